"""The GPU script: kvferry's vLLM page saver and loader on CUDA caches (never needed to pass;
skipped without CUDA).

For each layout a vLLM GPU backend writes (FlashAttention in HND and NHD stride order,
FlashInfer, MLA; FlashAttention with an FP8 cache), a prefill worker in this process saves one
request's pages from a CUDA cache (gathered on the device, out through pinned host staging,
into the connector's pool) and a decode worker in another process (decode_peer.py) loads them
over shm or zmq into a CUDA cache of the same layout (in through pinned staging), then checks
every layer's tokens against the seeded source, byte for byte. It prints the save's and the
load's GB/s beside a plain device-to-host copy of the same bytes (into pinned and pageable
memory). The same code runs on CPU tensors in test_gpu_cache_writers.py.

Run: ``python -m pytest -q -s -m gpu tests/gpu/test_gpu_pages.py``.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from cache_writers import LAYOUTS
from page_moves import LAYERS, save

from kvferry.adapters.platform import free_base_port

HERE = Path(__file__).resolve().parent
_names = itertools.count()

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.timeout(600),
    pytest.mark.skipif(
        not torch.cuda.is_available(),
        reason="needs CUDA: torch.cuda.is_available() is False on this machine (the GPU script runs where a GPU is)",
    ),
]

TOKENS, BS = 8192, 16
CASES = [
    ("flash_hnd", torch.bfloat16, None),
    ("flash_nhd", torch.bfloat16, None),
    ("flashinfer", torch.bfloat16, None),
    ("mla", torch.bfloat16, None),
    ("flash_hnd", torch.uint8, "fp8_e4m3"),  # vLLM's FP8 cache: uint8 bytes, scales beside
]


def _d2h_gbps(src: dict[str, torch.Tensor], blocks: list[int], pinned: bool) -> float:
    """GB/s of one device-to-host copy of the request's pages (the same bytes the save moves)."""
    index = torch.tensor(blocks, device="cuda")
    pages = [t.index_select(0, index).contiguous() for t in src.values()]
    nbytes = sum(p.numel() * p.element_size() for p in pages)
    host = [torch.empty(p.shape, dtype=p.dtype, pin_memory=pinned) for p in pages]
    for _ in range(2):  # the second is timed (the first maps the pages)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for h, p in zip(host, pages):
            h.copy_(p)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
    return nbytes / seconds / 1e9


@pytest.mark.parametrize("kind", ["shm", "zmq"])
@pytest.mark.parametrize(("layout", "dtype", "fp8"), CASES)
def test_cuda_pages_move_between_two_processes_byte_for_byte(layout, dtype, fp8, kind, tmp_path: Path) -> None:
    num_blocks = TOKENS // BS + 64
    p_blocks = list(range(num_blocks - 1, num_blocks - 1 - TOKENS // BS, -1))  # not in order: a real gather
    d_blocks = list(range(0, 2 * (TOKENS // BS), 2))[: TOKENS // BS]
    if kind == "shm":
        conn = {"type": "shm", "namespace": f"gg{os.getpid()}n{next(_names)}", "runtime_dir": str(tmp_path)}
    else:
        conn = {"type": "zmq"}
    conn["pool_bytes"] = 1 << 30
    base = free_base_port(2)
    kw = {"block_size": BS, "num_blocks": num_blocks, "dtype": dtype, "device": "cuda", "fp8": fp8}
    p, src, params, save_s = save(conn, base, layout, p_blocks, TOKENS, seed=5, **kw)
    try:
        staging = p._saver.writer._staging
        assert staging is not None and staging.nbytes > 0  # the pages went out through pinned memory
        nbytes = sum(t[p_blocks].numel() * t.element_size() for t in src.values())
        cfg = {
            "connector": conn,
            "base_port": base,
            "layout": layout,
            "params": params,
            "block_ids": d_blocks,
            "num_tokens": TOKENS,
            "seed": 5,
            "dtype": str(dtype).replace("torch.", ""),
            **{k: v for k, v in kw.items() if k != "dtype"},
        }
        proc = subprocess.run(
            [sys.executable, str(HERE / "decode_peer.py"), json.dumps(cfg)],
            capture_output=True,
            text=True,
            timeout=300,
            cwd=HERE,
            check=False,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        out = json.loads(proc.stdout.strip().splitlines()[-1])
        assert out["errors"] == [] and out["equal"] == [True] * LAYERS, out
        assert out["nbytes"] == nbytes
        pinned, pageable = _d2h_gbps(src, p_blocks, True), _d2h_gbps(src, p_blocks, False)
        print(
            f"\n{layout}{'/' + fp8 if fp8 else ''} over {kind}: {nbytes / 2**20:.0f} MiB in {LAYERS} layers, "
            f"save {nbytes / save_s / 1e9:.2f} GB/s ({save_s * 1e3:.1f} ms), "
            f"load {nbytes / out['seconds'] / 1e9:.2f} GB/s ({out['seconds'] * 1e3:.1f} ms, another process); "
            f"device-to-host copy of the same bytes: pinned {pinned:.2f} GB/s, pageable {pageable:.2f} GB/s "
            f"(first move of a process: includes pinned allocation; {LAYOUTS[layout]})"
        )
    finally:
        p.close()
