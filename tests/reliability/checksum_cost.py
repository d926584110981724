"""What per-tensor checksums cost: against an encode, and against a vLLM connector load.

``--vllm`` (default): the vLLM connector's load path driven in-process on a 4 MiB load (8 layers
of 512 KiB: 64 blocks of 2 KV heads x 16 tokens x 64 dims, bfloat16, K and V pages). Each layer's
payload is written the way the prefill writes it (``PageWriter.gather``: pages into a buffer,
header, checksums), then loaded the way the decode side loads it (``decode_payload`` leaving
the checksums to the page write, ``check_payload``, ``write_pages`` into the decode cache, which
checks crc32c in its copy and crc32 before it). ``crc32c-first`` is the load before that fusion:
crc32c verified by the decode, then the copy. The loads without a checksum, with crc32, crc32c
and crc32c-first alternate round by round (in an order drawn anew each round), so each round's figures are
taken together; the checksum's cost is its load minus the plain load
of the same round, and the share is that over the plain load (median over rounds).

``--sets N``: each variant's payloads and the decode caches in N copies, a load taking the
next copy in turn. With 1 (the worst case) every load reads a payload and writes pages that
the previous rounds left in the last-level cache, so the copy runs at cache speed and the
checksum's share is largest; with enough copies to exceed the last-level cache (the default,
16: 64 MiB of payloads per variant) each load reads memory it has not touched lately, as a
decode does (its payload was written by another process, its pages are a new request's
blocks).

``--encode``: the older figure, a 235 MB request (28 layers, 4 KV heads of 128, bfloat16, 4096
tokens) encoded into one buffer, then each algorithm alone and the receiver's verification.

Prints one JSON line; docs/reliability.md records the figures.

    python tests/reliability/checksum_cost.py [--encode] [--rounds N]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections.abc import Callable

import torch

from kvferry.adapters.checked_scatter import writable_bytes
from kvferry.adapters.checksums import CHECKSUMS, checksum_engine
from kvferry.adapters.torch_frames import decode_payload, host_byte_view, plan_tensors, write_payload_into
from kvferry.app.vllm.pages import PageGeometry, PageWriter, block_runs, check_payload, write_pages

ALGORITHMS = (None, "crc32", "crc32c")
#: Load paths: the connector's (checksums deferred to the page copy: fused for crc32c) and,
#: for the figure before the fusion, crc32c verified by the decode before the copy.
VARIANTS = (*ALGORITHMS, "crc32c-first")


def _algorithm(variant: str | None) -> str | None:
    return None if variant is None else variant.split("-")[0]


def _timed(fn: Callable[[], object]) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def vllm_load(rounds: int, sets: int = 1) -> dict[str, object]:
    layers, blocks, heads, block_size, head_size = 8, 64, 2, 16, 64
    torch.manual_seed(0)
    shape = (blocks * 2, heads, block_size, 2 * head_size)
    prefill = [torch.randn(shape).to(torch.bfloat16) for _ in range(layers)]
    decodes = [[torch.zeros(shape, dtype=torch.bfloat16) for _ in range(layers)] for _ in range(sets)]
    # as the connector's loader takes them once
    decodes_bytes = [[writable_bytes(t) for t in decode] for decode in decodes]
    geometry = PageGeometry.of(prefill)
    index = torch.arange(blocks, dtype=torch.int64)
    runs = block_runs(index.tolist())
    payloads: dict[str | None, list[list[torch.Tensor]]] = {}  # by variant: sets of layer buffers
    save_s: dict[str | None, list[float]] = {a: [] for a in ALGORITHMS}
    for algorithm in ALGORITHMS:
        writer = PageWriter(geometry, checksums=algorithm)
        layout = writer.layout("t", index.tolist(), heads, {"layout": "vllm_cpu_pages_hnd", "layer": 0})
        bufs = [torch.empty(layout.total_nbytes, dtype=torch.uint8) for _ in range(layers)]
        for i, buf in enumerate(bufs):
            lay = writer.layout("t", index.tolist(), heads, {"layout": "vllm_cpu_pages_hnd", "layer": i})
            writer.gather(prefill[i], index, 0, heads, buf, lay)
        payloads[algorithm] = [bufs] + [[b.clone() for b in bufs] for _ in range(sets - 1)]
    # buffers of its own: a load that reads another variant's buffers would find them in cache
    payloads["crc32c-first"] = [[b.clone() for b in bufs] for bufs in payloads["crc32c"]]
    turn = {v: 0 for v in VARIANTS}  # the next copy each variant loads

    def save(algorithm: str | None) -> None:
        writer = PageWriter(geometry, checksums=algorithm)
        for i, buf in enumerate(payloads[algorithm][0]):
            lay = writer.layout("t", index.tolist(), heads, {"layout": "vllm_cpu_pages_hnd", "layer": i})
            writer.gather(prefill[i], index, 0, heads, buf, lay)

    def load(variant: str | None) -> None:
        k = turn[variant] = (turn[variant] + 1) % sets
        # the decode caches in turn too, offset per variant so no two variants share a copy in a round
        d = (k + VARIANTS.index(variant)) % sets
        for i, buf in enumerate(payloads[variant][k]):
            decoded = decode_payload(buf, defer_verify=variant is not None and not variant.endswith("-first"))
            check_payload(decoded, geometry, i, heads, blocks)
            write_pages(decodes[d][i], geometry, decoded, index, 0, 0, heads, runs, decodes_bytes[d][i])

    load_s: dict[str | None, list[float]] = {a: [] for a in VARIANTS}
    alone_s: dict[str | None, list[float]] = {a: [] for a in VARIANTS}
    regions = [host_byte_view(t[:blocks].contiguous()) for layer in prefill for t in geometry.regions(layer)]

    def alone(variant: str | None) -> None:  # the routine alone over the load's bytes
        algorithm = _algorithm(variant)
        if algorithm is not None:
            fn = CHECKSUMS[algorithm]
            for view in regions:
                fn(view, 0)

    for variant in VARIANTS:  # warm up every path once
        load(variant)
        save(_algorithm(variant))
    shuffle = random.Random(0).shuffle
    for _round in range(rounds):
        order = list(VARIANTS)
        shuffle(order)  # a new order each round: no variant always follows the same one
        for variant in order:  # the loads of a round back to back, so that they share its weather
            load_s[variant].append(_timed(lambda: load(variant)))
        for variant in order:
            if variant in save_s:
                save_s[variant].append(_timed(lambda: save(variant)))
            alone_s[variant].append(_timed(lambda: alone(variant)))
    for copy in decodes:  # every copy was loaded into: the loads moved the pages
        assert torch.equal(copy[3][:blocks], prefill[3][:blocks])
    nbytes = sum(b.numel() for b in payloads[None][0])
    out: dict[str, object] = {
        "load_mib": round(nbytes / 2**20, 2),
        "rounds": rounds,
        "sets": sets,
        "torch_threads": torch.get_num_threads(),
        "engines": {a: checksum_engine(a) for a in ALGORITHMS if a},
        "load_ms_none": round(statistics.median(load_s[None]) * 1e3, 3),
        "load_best_ms_none": round(min(load_s[None]) * 1e3, 3),
        "save_ms_none": round(statistics.median(save_s[None]) * 1e3, 3),
    }
    for algorithm in VARIANTS[1:]:
        extra = [a - b for a, b in zip(load_s[algorithm], load_s[None])]
        share = [(a - b) / b for a, b in zip(load_s[algorithm], load_s[None])]
        out[f"load_ms_{algorithm}"] = round(statistics.median(load_s[algorithm]) * 1e3, 3)
        out[f"load_best_ms_{algorithm}"] = round(min(load_s[algorithm]) * 1e3, 3)
        if save_s.get(algorithm):
            out[f"save_ms_{algorithm}"] = round(statistics.median(save_s[algorithm]) * 1e3, 3)
        out[f"alone_ms_{algorithm}"] = round(statistics.median(alone_s[algorithm]) * 1e3, 3)
        out[f"alone_best_ms_{algorithm}"] = round(min(alone_s[algorithm]) * 1e3, 3)
        out[f"alone_best_over_load_best_{algorithm}"] = round(min(alone_s[algorithm]) / min(load_s[None]), 3)
        out[f"alone_over_load_{algorithm}"] = round(
            statistics.median([a / b for a, b in zip(alone_s[algorithm], load_s[None])]), 3
        )
        out[f"load_cost_ms_{algorithm}"] = round(statistics.median(extra) * 1e3, 3)
        out[f"load_cost_share_{algorithm}"] = round(statistics.median(share), 3)
        out[f"load_cost_share_{algorithm}_quartiles"] = [round(q, 3) for q in statistics.quantiles(share, n=4)]
    return out


def encode_cost(repeat: int) -> dict[str, object]:
    layers, heads, head_dim, tokens = 28, 4, 128, 4096
    torch.manual_seed(0)
    keys = [torch.randn(tokens, heads, head_dim).to(torch.bfloat16) for _ in range(layers)]
    values = [torch.randn(tokens, heads, head_dim).to(torch.bfloat16) for _ in range(layers)]
    meta = {"seq_len": tokens, "block_size": 16, "num_layers": layers, "dtype": "bfloat16"}
    plain, tensors = plan_tensors("r", keys, values, [0], meta)
    dest = torch.empty(plain.total_nbytes + 4096, dtype=torch.uint8)
    dest.fill_(0)  # fault the pages in once, as a warm pool would be
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    out: dict[str, object] = {"payload_mb": round(nbytes / 1e6, 1), "repeats": repeat}
    out["encode_s"] = round(
        min(_timed(lambda: write_payload_into(dest[: plain.total_nbytes], plain, tensors)) for _ in range(repeat)), 4
    )
    views = [host_byte_view(t) for t in tensors]
    for algorithm in ALGORITHMS[1:]:
        fn = CHECKSUMS[algorithm]
        alone = min(_timed(lambda: [fn(v, 0) for v in views]) for _ in range(repeat))
        summed, _ = plan_tensors("r", keys, values, [0], meta, checksums=algorithm)
        written = dest[: summed.total_nbytes]
        write_payload_into(written, summed, tensors)
        out[f"{algorithm}_alone_s"] = round(alone, 4)
        out[f"{algorithm}_gb_per_s"] = round(nbytes / alone / 1e9, 2)
        out[f"decode_verify_{algorithm}_s"] = round(
            min(_timed(lambda: decode_payload(written, verify=True)) for _ in range(repeat)), 4
        )
    out["torch_threads"] = torch.get_num_threads()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--encode", action="store_true", help="the 235 MB encode figure instead")
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument(
        "--sets", type=int, default=16, help="copies of every payload and decode cache taken in turn (1: cache-hot)"
    )
    parser.add_argument("--threads", type=int, default=1, help="torch threads (a decode rank's copies)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(json.dumps(encode_cost(max(3, args.rounds // 20)) if args.encode else vllm_load(args.rounds, args.sets)))


if __name__ == "__main__":
    main()
