"""Decode ranks whose cache differs from the prefill's: pages re-blocked and re-laid per token.

A prefill worker saves a request from caches of one block size and page order (a CPU kernel's,
or the dense GPU backends' ``packed`` pages); a decode worker of another block size and order
loads it. Both caches are written from per-token truth through the page order of each side
(``tokens_to_vllm_pages``, itself checked against vLLM's own kernel in
tests/engines/vllm/test_page_decode.py), and the decode's pages are read back per token.
"""

from __future__ import annotations

import pytest
import torch
from page_kit import load, names, page_worker, publish
from test_vllm_pages import _params

from kvferry.adapters.kv_layouts import tokens_to_vllm_pages, vllm_pages_to_tokens
from kvferry.app.vllm.params import parse_decode_params
from kvferry.app.vllm.worker import LoadJob, PageWorker, SaveJob

HEADS, HEAD, LAYERS, TOKENS = 2, 32, 2, 150


def _truth(seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        (
            torch.randn(TOKENS, HEADS, HEAD, generator=g).bfloat16(),
            torch.randn(TOKENS, HEADS, HEAD, generator=g).bfloat16(),
        )
        for _ in range(LAYERS)
    ]


def _pages(k: torch.Tensor, v: torch.Tensor, layout: str, bs: int) -> tuple[torch.Tensor, torch.Tensor]:
    if layout.startswith("packed"):  # a (block, head) page is [bs, 2*D]: each token's K then V
        n = -(-k.shape[0] // bs)
        rows = torch.zeros(n * bs, HEADS, 2 * HEAD, dtype=k.dtype)
        rows[: k.shape[0], :, :HEAD], rows[: k.shape[0], :, HEAD:] = k, v
        page = rows.view(n, bs, HEADS, 2 * HEAD).transpose(1, 2).reshape(n, HEADS, 2, bs * HEAD)
        return page[:, :, 0], page[:, :, 1]
    return tokens_to_vllm_pages(k, v, block_size=bs, isa=layout.split(":")[1].split("/")[0])


def _cache(blocks: int, bs: int) -> torch.Tensor:
    return torch.zeros(blocks, HEADS, bs, 2 * HEAD, dtype=torch.bfloat16)


def _worker(name: str, producer: bool, layout: str, isa: str | None) -> PageWorker:
    w = page_worker(name, 0, 1, producer, HEADS)
    w.kernel_isa, w.cache_layout = isa, layout
    return w


def _hand_over(p_layout: str, p_bs: int, d_layout: str, d_bs: int, first_page: int = 0):
    """Save TOKENS tokens from a prefill cache, load them into a decode cache; returns the
    truth, the decode's caches, its blocks and the load's errors."""
    name = f"relay-{next(names)}"
    truth = _truth(4)
    p_isa = None if p_layout.startswith("packed") else p_layout.split(":")[1].split("/")[0]
    d_isa = None if d_layout.startswith("packed") else d_layout.split(":")[1].split("/")[0]
    p_blocks = tuple(range(-(-TOKENS // p_bs)))[::-1]  # reversed: block order matters
    src = {}
    for i, (k, v) in enumerate(truth):
        cache = _cache(len(p_blocks) + 1, p_bs)
        kp, vp = _pages(k, v, p_layout, p_bs)
        regions = cache.view(cache.shape[0], HEADS, 2, p_bs * HEAD)
        regions[list(p_blocks), :, 0], regions[list(p_blocks), :, 1] = kp, vp
        src[f"model.layers.{i}.attn"] = cache
    p = _worker(name, True, p_layout, p_isa)
    publish(p, src, SaveJob("r", "t", p_blocks, TOKENS, 1))
    d_count = -(-TOKENS // d_bs) - first_page
    d_blocks = tuple(range(3, 3 + d_count))
    dst = {n: _cache(3 + d_count + 2, d_bs) for n in src}
    d = _worker(name, False, d_layout, d_isa)
    d.register(dst)
    params = _params(transfer_id="t", remote_num_tokens=TOKENS, remote_block_size=p_bs, remote_num_layers=LAYERS)
    _, errors = load(d, LoadJob("r", parse_decode_params(params), d_blocks, first_page))
    d.close()
    p.close()
    return truth, dst, d_blocks, errors, d_isa


def _tokens_of(cache: torch.Tensor, blocks: tuple[int, ...], layout: str, isa: str | None, bs: int, n: int):
    pages = cache[list(blocks)]
    if layout.startswith("packed"):
        rows = pages.transpose(1, 2).reshape(-1, HEADS, 2 * HEAD)[:n]
        return rows[..., :HEAD], rows[..., HEAD:]
    regions = pages.view(len(blocks), HEADS, 2, bs * HEAD)
    return vllm_pages_to_tokens(regions[:, :, 0], regions[:, :, 1], block_size=bs, num_tokens=n, isa=isa)


@pytest.mark.parametrize(
    ("p_layout", "p_bs", "d_layout", "d_bs"),
    [
        ("vllm_cpu:vec/LBHNC", 32, "vllm_cpu:vec/LBHNC", 64),
        ("vllm_cpu:vec/LBHNC", 128, "vllm_cpu:vec/LBHNC", 32),
        ("vllm_cpu:amx/LBHNC", 32, "vllm_cpu:vec/LBHNC", 32),  # another kernel's order, same block size
        ("vllm_cpu:vec/LBHNC", 64, "vllm_cpu:amx/LBHNC", 32),
        ("packed/LBHNC", 16, "vllm_cpu:vec/LBHNC", 32),  # a GPU-layout producer, a CPU decode
        ("vllm_cpu:amx/LBHNC", 32, "packed/LBHNC", 16),  # and the reverse
    ],
)
def test_decode_pages_hold_the_prefills_tokens(p_layout: str, p_bs: int, d_layout: str, d_bs: int) -> None:
    truth, dst, d_blocks, errors, d_isa = _hand_over(p_layout, p_bs, d_layout, d_bs)
    assert errors == set()
    for i, (k, v) in enumerate(truth):
        got_k, got_v = _tokens_of(dst[f"model.layers.{i}.attn"], d_blocks, d_layout, d_isa, d_bs, TOKENS)
        assert torch.equal(got_k, k) and torch.equal(got_v, v), f"layer {i}"
        # control: the pages as they were sent (no re-lay) would read other K/V
        if p_bs == d_bs:
            raw_k, _ = _pages(k, v, p_layout, p_bs)
            mine_k, _ = _pages(k, v, d_layout, d_bs)
            assert not torch.equal(raw_k, mine_k)


def test_a_partial_load_after_a_local_prefix_reblocks_only_the_rest() -> None:
    truth, dst, d_blocks, errors, d_isa = _hand_over("vllm_cpu:vec/LBHNC", 32, "vllm_cpu:vec/LBHNC", 64, first_page=1)
    assert errors == set()
    for i, (k, v) in enumerate(truth):
        got_k, got_v = _tokens_of(dst[f"model.layers.{i}.attn"], d_blocks, "vllm_cpu:vec", d_isa, 64, TOKENS - 64)
        assert torch.equal(got_k, k[64:]) and torch.equal(got_v, v[64:])


def test_a_decode_whose_page_order_is_unknown_refuses_to_reblock() -> None:
    """vec16 pages move page for page between vec16 instances; re-blocking into them would
    need their order: the load fails (its blocks reported), the cache is never written."""
    _, dst, d_blocks, errors, _ = _hand_over("vllm_cpu:vec/LBHNC", 32, "vllm_cpu:vec16/LBHNC", 64)
    assert errors == set(d_blocks)
    assert all(not t.any() for t in dst.values())
