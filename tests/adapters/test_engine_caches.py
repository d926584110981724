"""vLLM 0.32 cache views (``[num_blocks, heads, block_size, content]`` in a stride order) read
per token by ``split_engine_cache``; CPU pages laid out again by ``tokens_to_vllm_pages``.

Each cache is written element by element at the byte offsets the backend's cache-write kernel
uses (``reshape_and_cache_flash``: token ``t`` of slot ``s`` into block ``s // B``, row ``s % B``,
K in the first ``D`` of the content and V in the second; MLA: the latent row of the slot), so
the reader is checked against the kernel's addressing, not against itself."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvferry.adapters.kv_layouts import split_engine_cache, tokens_to_vllm_pages, vllm_pages_to_tokens
from kvferry.core.errors import ConfigError
from kvferry.core.layouts import LayoutSpec

N, B, H, D, T = 6, 16, 2, 8, 70


def _kv(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    k = torch.randint(-30000, 30000, (T, H, D), generator=g, dtype=torch.int16).view(torch.bfloat16)
    v = torch.randint(-30000, 30000, (T, H, D), generator=g, dtype=torch.int16).view(torch.bfloat16)
    blocks = torch.randperm(N, generator=g)[: -(-T // B)]
    slots = torch.cat([b * B + torch.arange(B) for b in blocks.tolist()])[:T]
    return k, v, slots


def _flash_written(order: str, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """The logical [N, H, B, 2D] view of a cache in physical ``order`` (vLLM's KVCacheLayout:
    LBHNC = [N, H, B, 2D], LBNHC = [N, B, H, 2D] in memory) after reshape_and_cache_flash."""
    flat = torch.zeros(N * H * B * 2 * D, dtype=torch.bfloat16)
    for t, s in enumerate(slots.tolist()):
        blk, row = divmod(s, B)
        for h in range(H):
            cell = ((blk * H + h) * B + row) if order == "LBHNC" else ((blk * B + row) * H + h)
            flat[cell * 2 * D : cell * 2 * D + D] = k[t, h]
            flat[cell * 2 * D + D : (cell + 1) * 2 * D] = v[t, h]
    if order == "LBHNC":
        return flat.view(N, H, B, 2 * D)
    return flat.view(N, B, H, 2 * D).permute(0, 2, 1, 3)  # what vLLM hands the connector


def _tokens(blocks: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    return blocks.flatten(0, 1)[slots]


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit (random bits include NaNs, which torch.equal never finds equal)."""
    return a.shape == b.shape and torch.equal(a.contiguous().view(torch.int16), b.contiguous().view(torch.int16))


@pytest.mark.parametrize("order", ["LBHNC", "LBNHC"])
def test_dense_gpu_caches_read_per_token_in_either_stride_order(order: str) -> None:
    k, v, slots = _kv(1)
    cache = _flash_written(order, k, v, slots)
    kb, vb = split_engine_cache(cache, LayoutSpec("packed"), block_size=B)
    assert vb is not None
    assert _same(_tokens(kb, slots), k) and _same(_tokens(vb, slots), v)
    # control: the same bytes taken as the other stride order are other K/V
    physical = cache.permute(0, 2, 1, 3) if order == "LBNHC" else cache  # the memory, contiguous
    other = physical.view(N, H, B, 2 * D) if order == "LBNHC" else physical.view(N, B, H, 2 * D).transpose(1, 2)
    kb2, _ = split_engine_cache(other, LayoutSpec("packed"), block_size=B)
    assert not _same(_tokens(kb2, slots), k)


def test_mla_cache_reads_the_latent_of_each_slot() -> None:
    g = torch.Generator().manual_seed(3)
    latent = torch.randn(T, 40, generator=g).to(torch.bfloat16)
    slots = _kv(3)[2]
    flat = torch.zeros(N * B, 40, dtype=torch.bfloat16)
    flat[slots] = latent  # CPU_MLA's do_kv_cache_update: flat[slots] = cat(kv_c, k_pe)
    kb, vb = split_engine_cache(flat.view(N, 1, B, 40), LayoutSpec("mla"), block_size=B)
    assert vb is None and torch.equal(kb.flatten(0, 1)[slots], latent)
    with pytest.raises(ConfigError, match="one head slot"):
        split_engine_cache(flat.view(N, 2, B // 2, 40), LayoutSpec("mla"), block_size=B // 2)


@pytest.mark.parametrize("isa", ["vec", "amx"])
def test_cpu_cache_reads_through_the_kernel_page_order(isa: str) -> None:
    k = torch.randn(3 * 32, 2, 32).to(torch.bfloat16)
    v = torch.randn(3 * 32, 2, 32).to(torch.bfloat16)
    kp, vp = tokens_to_vllm_pages(k, v, block_size=32, isa=isa)
    cache = torch.stack((kp, vp), dim=2).view(3, 2, 32, 64)  # a (block, head) page: K region, V region
    kb, vb = split_engine_cache(cache, LayoutSpec("vllm_cpu", isa), block_size=32)
    assert vb is not None and torch.equal(kb.flatten(0, 1), k) and torch.equal(vb.flatten(0, 1), v)
    with pytest.raises(ConfigError, match="neon"):
        split_engine_cache(cache, LayoutSpec("vllm_cpu", "neon"), block_size=32)


@settings(max_examples=40, deadline=None)
@given(
    isa=st.sampled_from(["vec", "amx"]),
    bs=st.sampled_from([32, 64, 128]),
    d=st.sampled_from([32, 64]),
    tokens=st.integers(1, 300),
    seed=st.integers(0, 2**16),
)
def test_tokens_to_vllm_pages_inverts_the_page_decode(isa: str, bs: int, d: int, tokens: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    k = torch.randint(-30000, 30000, (tokens, 2, d), generator=g, dtype=torch.int16).view(torch.bfloat16)
    v = torch.randint(-30000, 30000, (tokens, 2, d), generator=g, dtype=torch.int16).view(torch.bfloat16)
    kp, vp = tokens_to_vllm_pages(k, v, block_size=bs, isa=isa)
    assert kp.shape == (-(-tokens // bs), 2, bs * d)
    k2, v2 = vllm_pages_to_tokens(kp, vp, block_size=bs, num_tokens=tokens, isa=isa)
    assert _same(k2, k) and _same(v2, v)
