"""vLLM 0.32 caches as its backends' cache-write kernels leave them, on any device.

Each layer is the logical ``[num_blocks, heads, block_size, content]`` view vLLM hands a
connector, in the physical stride order of its ``KVCacheLayout``:

- ``flash_hnd`` (FlashAttention, ``LBHNC``) and ``flashinfer`` (FlashInfer's default, HND):
  memory ``[N, H, B, 2D]``; ``flash_nhd`` (FlashAttention, ``LBNHC``): memory ``[N, B, H, 2D]``,
  the view its transpose. ``reshape_and_cache_flash`` puts token ``t`` at slot ``s``: block
  ``s // B``, row ``s % B``, each head's K then V (``content = 2D``);
- ``mla`` (FlashMLA, Triton MLA, CPU MLA): ``[N, 1, B, L]`` (vLLM's own ``[N, B, L]``),
  ``concat_and_cache_mla`` puts ``kv_c`` then ``k_pe`` at slot ``s`` (``content = L``).

Used by the GPU script (test_gpu_pages.py) on CUDA caches and by test_gpu_cache_writers.py
on CPU tensors; plain torch indexing, no CUDA op (those do not run without a GPU).
"""

from __future__ import annotations

import torch

__all__ = ["LAYOUTS", "new_cache", "write_tokens", "read_tokens", "slots_of", "cache_layout_label"]

#: Layout -> (physical stride order, latent).
LAYOUTS = {
    "flash_hnd": ("LBHNC", False),
    "flash_nhd": ("LBNHC", False),
    "flashinfer": ("LBHNC", False),
    "mla": (None, True),
}


def cache_layout_label(layout: str, fp8: str | None = None) -> str:
    """The connector's ``cache_layout`` label of a cache of ``layout`` (core.backends.BackendLayout.label)."""
    order, latent = LAYOUTS[layout]
    label = "mla/LBHNC" if latent else f"packed/{order}"
    return f"{label}/{fp8}" if fp8 else label


def new_cache(
    layout: str,
    num_blocks: int,
    heads: int,
    block_size: int,
    width: int,
    dtype: torch.dtype,
    device: str | torch.device,
) -> torch.Tensor:
    """A zero cache: the logical view ``[N, heads, B, width]`` (``width`` = ``2D``, or ``L`` for
    ``mla`` with ``heads`` 1) over memory in ``layout``'s order."""
    order, latent = LAYOUTS[layout]
    if latent:
        return torch.zeros(num_blocks, 1, block_size, width, dtype=dtype, device=device)
    if order == "LBNHC":
        return torch.zeros(num_blocks, block_size, heads, width, dtype=dtype, device=device).transpose(1, 2)
    return torch.zeros(num_blocks, heads, block_size, width, dtype=dtype, device=device)


def slots_of(
    block_ids: list[int], block_size: int, num_tokens: int, device: str | torch.device = "cpu"
) -> torch.Tensor:
    """vLLM's slot mapping of a request's first ``num_tokens`` tokens in ``block_ids``."""
    blocks = torch.tensor(block_ids, dtype=torch.long, device=device)
    rows = torch.arange(block_size, dtype=torch.long, device=device)
    return (blocks[:, None] * block_size + rows[None, :]).reshape(-1)[:num_tokens]


def write_tokens(cache: torch.Tensor, tokens: torch.Tensor, slots: torch.Tensor) -> None:
    """Write per-token rows ``tokens`` (``[T, heads, width]``: each head's K then V, or
    ``[T, L]`` latents) at ``slots``, as the backend's cache-write kernel does."""
    bs = cache.shape[2]
    block, row = slots // bs, slots % bs
    if tokens.dim() == 2:  # a latent per token
        cache[block, 0, row] = tokens
    else:
        cache[block, :, row] = tokens


def read_tokens(cache: torch.Tensor, slots: torch.Tensor, *, latent: bool = False) -> torch.Tensor:
    """The per-token rows at ``slots`` (the inverse of :func:`write_tokens`), as the attention
    kernel reads them: ``[T, heads, width]``, or ``[T, L]`` for a ``latent`` cache."""
    bs = cache.shape[2]
    block, row = slots // bs, slots % bs
    return cache[block, 0, row] if latent else cache[block, :, row]
