"""What per-tensor crc32 checksums cost, against the encode they would be added to.

A 235 MB request (28 layers, 4 KV heads of 128, bfloat16, 4096 tokens: a 7B-class model's
KV for one long prompt) is encoded the way the sender does it (gather into one reserved
buffer + header), then the crc32 of every tensor is computed, and the receiver's verification
is timed too. Prints one JSON line; docs/reliability.md records the figures.

    python tests/reliability/checksum_cost.py [--repeat N]
"""

from __future__ import annotations

import argparse
import json
import time
import zlib

import torch

from kvferry.adapters.torch_frames import decode_payload, host_byte_view, plan_tensors, write_payload_into

LAYERS, HEADS, HEAD_DIM, TOKENS = 28, 4, 128, 4096


def _best(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    torch.manual_seed(0)
    keys = [torch.randn(TOKENS, HEADS, HEAD_DIM).to(torch.bfloat16) for _ in range(LAYERS)]
    values = [torch.randn(TOKENS, HEADS, HEAD_DIM).to(torch.bfloat16) for _ in range(LAYERS)]
    meta = {"seq_len": TOKENS, "block_size": 16, "num_layers": LAYERS, "dtype": "bfloat16"}
    plain, tensors = plan_tensors("r", keys, values, [0], meta)
    summed, _ = plan_tensors("r", keys, values, [0], meta, checksums="crc32")
    dest = torch.empty(max(plain.total_nbytes, summed.total_nbytes), dtype=torch.uint8)
    dest.fill_(0)  # fault the pages in once, as a warm pool would be
    nbytes = sum(t.numel() * t.element_size() for t in tensors)

    encode = _best(lambda: write_payload_into(dest[: plain.total_nbytes], plain, tensors), args.repeat)
    encode_crc = _best(lambda: write_payload_into(dest[: summed.total_nbytes], summed, tensors), args.repeat)
    views = [host_byte_view(t) for t in tensors]
    crc_only = _best(lambda: [zlib.crc32(v) for v in views], args.repeat)
    written = dest[: summed.total_nbytes]
    write_payload_into(written, summed, tensors)
    verify = _best(lambda: decode_payload(written, verify=True), args.repeat)
    no_verify = _best(lambda: decode_payload(written, verify=False), args.repeat)
    print(
        json.dumps(
            {
                "payload_mb": round(nbytes / 1e6, 1),
                "encode_s": round(encode, 4),
                "encode_with_crc32_s": round(encode_crc, 4),
                "crc32_alone_s": round(crc_only, 4),
                "crc32_gb_per_s": round(nbytes / crc_only / 1e9, 2),
                "encode_gb_per_s": round(nbytes / encode / 1e9, 2),
                "decode_verify_s": round(verify, 4),
                "decode_no_verify_s": round(no_verify, 4),
                "crc32_over_encode": round(crc_only / encode, 2),
                "torch_threads": torch.get_num_threads(),
                "repeats": args.repeat,
            }
        )
    )


if __name__ == "__main__":
    main()
