"""The GPU script's non-CUDA parts on CPU tensors (runs everywhere): the cache writers lay
tokens out as each backend's cache-write kernel does, and kvferry's own saver and loader move
them between caches of each layout (NHD into HND and back, other block sizes, MLA, FP8),
in one process and, over shm and zmq, in two (decode_peer.py, the GPU script's decode process)."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from cache_writers import new_cache, read_tokens, slots_of, write_tokens
from page_moves import load, save, tokens_equal

from kvferry.adapters.platform import free_base_port

HERE = Path(__file__).resolve().parent
_names = itertools.count()


@pytest.mark.parametrize("layout", ["flash_hnd", "flash_nhd", "flashinfer"])
def test_dense_writers_put_each_token_where_reshape_and_cache_flash_does(layout: str) -> None:
    n, h, bs, d2 = 4, 2, 8, 6
    cache = new_cache(layout, n, h, bs, d2, torch.float32, "cpu")
    assert cache.shape == (n, h, bs, d2)
    tokens = torch.arange(10 * h * d2, dtype=torch.float32).view(10, h, d2) + 1
    slots = slots_of([3, 1], bs, 10)
    write_tokens(cache, tokens, slots)
    # the memory: HND [N, H, B, 2D] or NHD [N, B, H, 2D], slot s at block s // B, row s % B
    memory = cache if layout != "flash_nhd" else cache.transpose(1, 2)
    assert memory.is_contiguous()
    for t, s in enumerate(slots.tolist()):
        b, r = divmod(s, bs)
        got = memory[b, :, r] if layout != "flash_nhd" else memory[b, r]
        assert torch.equal(got, tokens[t])
    assert torch.equal(read_tokens(cache, slots), tokens)
    # control: the other stride order holds the same tokens in other bytes
    other = new_cache("flash_hnd" if layout == "flash_nhd" else "flash_nhd", n, h, bs, d2, torch.float32, "cpu")
    write_tokens(other, tokens, slots)
    assert torch.equal(read_tokens(other, slots), tokens)
    flat = [t.as_strided((t.numel(),), (1,)) for t in (other, cache)]  # the bytes in memory order
    assert not torch.equal(*flat)


def test_mla_writer_puts_each_latent_at_its_slot() -> None:
    cache = new_cache("mla", 4, 1, 16, 10, torch.float32, "cpu")
    latents = torch.arange(20 * 10, dtype=torch.float32).view(20, 10)
    slots = slots_of([2, 0], 16, 20)
    write_tokens(cache, latents, slots)
    assert torch.equal(cache.view(-1, 10)[slots], latents)
    assert torch.equal(read_tokens(cache, slots, latent=True), latents)


MOVES = [
    # (source layout, block size, decode layout, block size, dtype, fp8)
    ("flash_nhd", 16, "flash_nhd", 16, torch.bfloat16, None),
    ("flash_nhd", 16, "flash_hnd", 16, torch.bfloat16, None),
    ("flash_hnd", 16, "flash_nhd", 16, torch.bfloat16, None),
    ("flashinfer", 16, "flash_nhd", 16, torch.bfloat16, None),
    ("flash_nhd", 16, "flash_hnd", 32, torch.bfloat16, None),  # re-blocked
    ("flash_hnd", 32, "flash_nhd", 16, torch.bfloat16, None),
    ("flash_nhd", 16, "flash_nhd", 16, torch.uint8, "fp8_e4m3"),  # vLLM's FP8 cache: uint8 bytes
    ("mla", 16, "mla", 16, torch.bfloat16, None),
    ("mla", 16, "mla", 64, torch.bfloat16, None),  # re-blocked latents
]


@pytest.mark.parametrize(("src", "src_bs", "dst", "dst_bs", "dtype", "fp8"), MOVES)
def test_the_workers_move_each_layout_token_for_token(src, src_bs, dst, dst_bs, dtype, fp8) -> None:
    tokens, seed = 100, 7
    p_blocks = [9, 2, 5, 0, 7, 4, 1][: -(-tokens // src_bs)]
    d_blocks = [3, 8, 1, 6, 0, 2, 5][: -(-tokens // dst_bs)]
    conn = {"type": "memory", "shared_name": f"gpu-writers-{next(_names)}"}
    kw = {"num_blocks": 10, "dtype": dtype, "device": "cpu", "fp8": fp8}
    p, _, params, _ = save(conn, 50051, src, p_blocks, tokens, seed=seed, block_size=src_bs, **kw)
    d = None
    try:
        d, dst_caches, _, errors = load(conn, 50051, dst, params, d_blocks, block_size=dst_bs, **kw)
        assert errors == set()
        assert tokens_equal(dst, dst_caches, d_blocks, tokens, seed, dtype) == [True] * 4
        # control: the decode's tokens are not another seed's, nor the blocks read in another order
        assert tokens_equal(dst, dst_caches, d_blocks, tokens, seed + 1, dtype) == [False] * 4
        assert tokens_equal(dst, dst_caches, d_blocks[::-1], tokens, seed, dtype) == [False] * 4
    finally:
        if d is not None:
            d.close()
        p.close()


@pytest.mark.parametrize(("layout", "kind"), [("flash_nhd", "shm"), ("mla", "shm"), ("flash_hnd", "zmq")])
def test_two_processes_move_a_layout_token_for_token(layout: str, kind: str, tmp_path: Path) -> None:
    tokens, seed, bs = 100, 11, 16
    p_blocks, d_blocks = [4, 1, 6, 2, 8, 0, 3], [2, 5, 0, 7, 1, 9, 3]
    if kind == "shm":
        conn = {"type": "shm", "namespace": f"gw{os.getpid()}n{next(_names)}", "runtime_dir": str(tmp_path)}
    else:
        conn = {"type": "zmq"}
    conn["pool_bytes"] = 16 << 20
    base = free_base_port(2)
    kw = {"block_size": bs, "num_blocks": 10, "dtype": torch.bfloat16, "device": "cpu"}
    p, _, params, _ = save(conn, base, layout, p_blocks, tokens, seed=seed, **kw)
    try:
        cfg = {
            "connector": conn,
            "base_port": base,
            "layout": layout,
            "params": params,
            "block_ids": d_blocks,
            "num_tokens": tokens,
            "seed": seed,
            "dtype": "bfloat16",
            **{k: v for k, v in kw.items() if k != "dtype"},
        }
        proc = subprocess.run(
            [sys.executable, str(HERE / "decode_peer.py"), json.dumps(cfg)],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=HERE,
            check=False,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        out = json.loads(proc.stdout.strip().splitlines()[-1])
        assert out["errors"] == [] and out["equal"] == [True] * 4
        assert out["nbytes"] > 0
    finally:
        p.close()
