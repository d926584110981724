"""One paged-cache layer in a named layout -> ``(key_blocks, value_blocks)`` views.

The names and their shapes are :mod:`kvferry.core.layouts`'; this module builds the views,
``[num_blocks, block_size, *token_shape]`` each (``token_shape`` is ``(heads, head_dim)``, or
``(latent_dim,)`` for ``mla``, whose value is None). No data moves: every view reads the cache
through its strides, so the gathers copy each byte once, as for any other layout.

``vllm_cpu`` with the ``vec`` (AVX2) kernel: each ``(block, head)`` page of ``2*B*D`` elements
holds K as ``[D][B]`` (dimension-major) then V as ``[B][D]``; the key view is
``kc.view(N, H, D, B).permute(0, 3, 1, 2)`` and the value view ``vc.transpose(1, 2)`` where
``kc, vc`` are the first and second ``B*D`` elements of each page. Another ISA's order is not
known here, so its per-token extraction is refused (whole pages still move between engines of
the same ISA by other means).

``vllm_cpu_pages_hnd`` (what kvferry's vLLM connector publishes: a layer's K regions and V regions,
each ``[N, H, B*D]``) is read through :func:`kvferry.core.layouts.vllm_page_order` for the ``vec``
and ``amx`` kernels; :func:`vllm_pages_to_tokens` turns one payload into per-token
``[num_tokens, H, D]`` K and V.
"""

from __future__ import annotations

from typing import Any

import torch

from kvferry.core.errors import ConfigError
from kvferry.core.layouts import (
    REFERENCE_LAYOUTS,
    VLLM_CPU_ISAS,
    VLLM_PAGES,
    LayoutSpec,
    RegionOrder,
    check_layer_shape,
    layout_spec,
    shape_candidates,
    vllm_page_order,
)

__all__ = [
    "split_named",
    "split_unnamed",
    "split_engine_cache",
    "kv_pair",
    "vllm_pages_to_tokens",
    "tokens_to_vllm_pages",
    "AmbiguousLayout",
]


class AmbiguousLayout(ConfigError):
    """A cache shape two known layouts could both mean; ``candidates`` names them (the message too)."""

    def __init__(self, message: str, candidates: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.candidates: tuple[str, ...] = candidates


def _tensor(layer_kv: Any, name: str, layer: int | None) -> torch.Tensor:
    if not isinstance(layer_kv, torch.Tensor):
        where = f"layer {layer}: " if layer is not None else ""
        raise ConfigError(f"{where}layout {name!r} needs one tensor per layer, got {type(layer_kv).__name__}")
    return layer_kv


def split_named(
    layer_kv: Any,
    layout: LayoutSpec | str,
    *,
    block_size: int,
    heads: int | None = None,
    head_dim: int | None = None,
    layer: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(key_blocks, value_blocks)`` of one layer in the named layout (value None for ``mla``).

    ConfigError saying which dimension differs when the shape does not fit the layout, and for a
    ``vllm_cpu`` cache written by a kernel whose element order is unknown (no ISA, or not one of
    :data:`~kvferry.core.layouts.VLLM_CPU_ISAS`).
    """
    spec = layout_spec(layout)
    assert spec is not None
    name = spec.name
    where = f"layer {layer}: " if layer is not None else ""
    if name == VLLM_PAGES:
        return _pages_named(layer_kv, spec, block_size=block_size, heads=heads, head_dim=head_dim, layer=layer)
    if name == "tuple":
        return _named_pair(
            layer_kv, name, "(key, value)", block_size=block_size, heads=heads, head_dim=head_dim, layer=layer
        )
    t = _tensor(layer_kv, name, layer)
    shape = tuple(t.shape)
    if name == "mla":
        check_layer_shape(name, shape, block_size=block_size, latent_dim=head_dim, layer=layer)
        return t, None
    check_layer_shape(name, shape, block_size=block_size, heads=heads, head_dim=head_dim, layer=layer)
    if name == "flash":
        return t[0], t[1]
    if name == "flashinfer":
        return t[:, 0], t[:, 1]
    if name == "flash_hnd":
        return t[0].transpose(1, 2), t[1].transpose(1, 2)
    if name == "flashinfer_hnd":
        return t[:, 0].transpose(1, 2), t[:, 1].transpose(1, 2)
    n, h, b, two_d = shape
    d = two_d // 2
    if name == "packed":
        blocks = t.transpose(1, 2)
        return blocks.narrow(-1, 0, d), blocks.narrow(-1, d, d)
    # vllm_cpu
    if spec.isa is None or spec.isa not in VLLM_CPU_ISAS:
        known = ", ".join(sorted(VLLM_CPU_ISAS))
        said = "no ISA was given" if spec.isa is None else f"ISA {spec.isa!r} is not one of them"
        raise ConfigError(
            f"{where}layout 'vllm_cpu': per-token K/V depend on the element order of the CPU kernel "
            f"that wrote the cache; kvferry knows the order of {known} and {said} "
            f"(name it as 'vllm_cpu:avx2'); refusing rather than reading it as 'packed'"
        )
    if t.stride(-1) != 1 or t.stride(2) != two_d or t.stride(1) != b * two_d:
        raise ConfigError(
            f"{where}layout 'vllm_cpu' needs each (block, head) page contiguous, got strides {list(t.stride())}"
        )
    pages = (
        t.view(n, h, 2 * b, d)
        if t.is_contiguous()
        else t.as_strided((n, h, 2 * b, d), (t.stride(0), t.stride(1), d, 1))
    )
    kc, vc = pages.narrow(2, 0, b), pages.narrow(2, b, b)
    key = kc.as_strided((n, h, d, b), (kc.stride(0), kc.stride(1), b, 1), kc.storage_offset()).permute(0, 3, 1, 2)
    return key, vc.transpose(1, 2)


def _named_pair(
    layer_kv: Any,
    name: str,
    what: str,
    *,
    block_size: int,
    heads: int | None,
    head_dim: int | None,
    layer: int | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The two tensors of a layout given as a pair (``tuple``, ``vllm_cpu_pages_hnd``), each
    checked against the layout's shape and equal in shape; ConfigError naming what differs."""
    where = f"layer {layer}: " if layer is not None else ""
    if (
        not isinstance(layer_kv, (tuple, list))
        or len(layer_kv) != 2
        or not all(isinstance(t, torch.Tensor) for t in layer_kv)
    ):
        raise ConfigError(f"{where}layout {name!r} needs a {what} pair of tensors, got {type(layer_kv).__name__}")
    key, value = layer_kv
    for tensor in (key, value):
        check_layer_shape(name, tuple(tensor.shape), block_size=block_size, heads=heads, head_dim=head_dim, layer=layer)
    if key.shape != value.shape:
        raise ConfigError(f"{where}layout {name!r}: key {list(key.shape)} and value {list(value.shape)} differ")
    return key, value


def _pages_named(
    layer_kv: Any, spec: LayoutSpec, *, block_size: int, heads: int | None, head_dim: int | None, layer: int | None
) -> tuple[torch.Tensor, torch.Tensor]:
    where = f"layer {layer}: " if layer is not None else ""
    key, value = _named_pair(
        layer_kv,
        VLLM_PAGES,
        "(key pages, value pages)",
        block_size=block_size,
        heads=heads,
        head_dim=head_dim,
        layer=layer,
    )
    d = key.shape[2] // block_size
    try:
        order = vllm_page_order(spec.isa, block_size, d)
    except ConfigError as exc:
        raise ConfigError(f"{where}{exc}") from exc
    return _region_blocks(key, order.key, block_size, d), _region_blocks(value, order.value, block_size, d)


def _region_blocks(regions: torch.Tensor, order: RegionOrder, block_size: int, head_dim: int) -> torch.Tensor:
    """``[N, H, B*D]`` regions in ``order`` -> ``[N, B, H, D]`` (a view where the order allows)."""
    n, h, _ = regions.shape
    axes = [2 + p for p in order.perm]
    tokens = regions.reshape(n, h, *order.shape).permute(0, 1, *axes).reshape(n, h, block_size, head_dim)
    return tokens.transpose(1, 2)


def _tokens_to_regions(tokens: torch.Tensor, order: RegionOrder) -> torch.Tensor:
    """``[N, B, H, D]`` blocks of tokens -> ``[N, H, B*D]`` regions in ``order`` (the inverse of
    :func:`_region_blocks`; a copy)."""
    n, b, h, d = tokens.shape
    out = torch.empty((n, h, b * d), dtype=tokens.dtype)
    axes = [2 + p for p in order.perm]
    view = out.view(n, h, *order.shape).permute(0, 1, *axes)
    view.copy_(tokens.transpose(1, 2).reshape(view.shape))
    return out


def tokens_to_vllm_pages(
    key: torch.Tensor, value: torch.Tensor, *, block_size: int, isa: str | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token ``(K, V)``, each ``[num_tokens, H, D]``, -> the K regions and V regions
    ``[ceil(num_tokens / block_size), H, block_size*D]`` vLLM's CPU kernel ``isa`` would hold
    for them (the inverse of :func:`vllm_pages_to_tokens`; the tail of a partial last block is
    zero). ConfigError for an unknown ISA or sizes that kernel does not write."""
    if key.shape != value.shape or key.dim() != 3:
        raise ConfigError(f"key {list(key.shape)} and value {list(value.shape)} must both be [tokens, heads, head_dim]")
    t, h, d = key.shape
    order = vllm_page_order(isa, block_size, d)
    n = -(-t // block_size)
    pages = []
    for src, region in ((key, order.key), (value, order.value)):
        padded = torch.zeros((n * block_size, h, d), dtype=src.dtype)
        padded[:t] = src
        pages.append(_tokens_to_regions(padded.view(n, block_size, h, d), region))
    return pages[0], pages[1]


def split_engine_cache(
    cache: torch.Tensor, layout: LayoutSpec, *, block_size: int, layer: int | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(key_blocks, value_blocks)`` ``[N, B, H, D]`` (MLA: ``[N, B, L]`` and None) of one
    vLLM 0.32 layer view: logical ``[N, heads, B, content]`` in any stride order
    (``kvferry.core.backends`` says which layout a backend's content is).

    ``packed`` (FlashAttention, FlashInfer, Triton): strided views; ``vllm_cpu`` with ISA
    ``vec``: strided views, ``amx``: copies (its order is no strided view); ``mla``: the
    latent of the one head slot. ConfigError when the shape does not fit."""
    where = f"layer {layer}: " if layer is not None else ""
    if not isinstance(cache, torch.Tensor) or cache.dim() != 4:
        got = list(cache.shape) if isinstance(cache, torch.Tensor) else type(cache).__name__
        raise ConfigError(f"{where}a vLLM cache view is [num_blocks, heads, block_size, content], got {got}")
    if layout.name == "mla":
        if cache.shape[1] != 1:
            raise ConfigError(
                f"{where}an MLA cache has one head slot, got {cache.shape[1]} (shape {list(cache.shape)})"
            )
        return split_named(cache.squeeze(1), "mla", block_size=block_size, layer=layer)
    if layout.name == "vllm_cpu" and layout.isa not in VLLM_CPU_ISAS:
        n, h, b, two_d = cache.shape
        check_layer_shape("vllm_cpu", tuple(cache.shape), block_size=block_size, layer=layer)
        if not cache.is_contiguous():
            raise ConfigError(f"{where}layout 'vllm_cpu' needs a contiguous cache, got strides {list(cache.stride())}")
        regions = cache.view(n, h, 2, b * two_d // 2)
        pair = (regions[:, :, 0], regions[:, :, 1])
        key, value = split_named(pair, LayoutSpec(VLLM_PAGES, layout.isa), block_size=block_size, layer=layer)
        return key, value
    if layout.name not in ("packed", "vllm_cpu"):
        raise ConfigError(f"{where}layout {layout.name!r} is not a vLLM cache view's (packed, vllm_cpu, mla)")
    return split_named(cache, layout, block_size=block_size, layer=layer)


def vllm_pages_to_tokens(
    key_pages: torch.Tensor,
    value_pages: torch.Tensor,
    *,
    block_size: int,
    num_tokens: int,
    isa: str | None,
    heads: int | None = None,
    head_dim: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One ``vllm_cpu_pages_hnd`` payload layer -> per-token ``(K, V)``, each
    ``[num_tokens, heads, head_dim]``, contiguous (copies, except where the pages' own bytes
    already are in that order: then views of them).

    ``key_pages``/``value_pages``: ``[N, H, block_size*head_dim]``, the request's pages in
    order; the tokens of a partial last block are cut at ``num_tokens``. ``isa``: the CPU kernel
    that wrote them (:data:`kvferry.core.layouts.VLLM_CPU_PAGE_ISAS`). ConfigError for a shape
    that does not fit, an unknown ISA, or more tokens than the pages hold.
    """
    spec = LayoutSpec(VLLM_PAGES, None if isa is None else isa.strip().lower())
    kb, vb = _pages_named(
        (key_pages, value_pages), spec, block_size=block_size, heads=heads, head_dim=head_dim, layer=None
    )
    capacity = kb.shape[0] * block_size
    if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or not 0 <= num_tokens <= capacity:
        raise ConfigError(
            f"num_tokens: {num_tokens!r} does not fit {kb.shape[0]} pages of {block_size} tokens ({capacity})"
        )
    k = kb.flatten(0, 1)[:num_tokens].contiguous()
    v = vb.flatten(0, 1)[:num_tokens].contiguous()
    return k, v


def kv_pair(layer_kv: tuple[Any, ...] | list[Any]) -> tuple[torch.Tensor, torch.Tensor] | str:
    """A ``(key, value)`` tuple or list of tensors as the pair, or why it is not one."""
    if len(layer_kv) != 2:
        return f"KV pair has {len(layer_kv)} entries (expected 2)"
    key, value = layer_kv
    if not isinstance(key, torch.Tensor) or not isinstance(value, torch.Tensor):
        return f"KV pair holds {type(key).__name__}, {type(value).__name__}, not tensors"
    return key, value


def split_unnamed(
    layer_kv: Any, *, block_size: int | None, layer: int | None = None
) -> tuple[torch.Tensor, torch.Tensor] | str:
    """A layer without a layout name: the reference's layouts by the reference's shape rules.

    A shape that two known layouts could both mean raises :class:`AmbiguousLayout` naming the
    candidates; a shape only a non-reference layout fits, or none, gives a human reason (the
    layer is skipped, as the reference skipped it).
    """
    if isinstance(layer_kv, (tuple, list)):
        return kv_pair(layer_kv)
    if not isinstance(layer_kv, torch.Tensor):
        return f"unsupported KV type {type(layer_kv).__name__}"
    shape = tuple(layer_kv.shape)
    candidates = shape_candidates(shape, block_size)
    where = f"layer {layer}: " if layer is not None else ""
    if len(candidates) > 1:
        raise AmbiguousLayout(
            f"{where}KV cache shape {list(shape)} (block_size={block_size}) fits layouts "
            f"{', '.join(repr(c) for c in candidates)}; name the layout (kv_layout) instead of "
            f"having it guessed",
            tuple(candidates),
        )
    if not candidates or candidates[0] not in REFERENCE_LAYOUTS:
        hint = f" (it fits {candidates[0]!r}, which is never guessed: name it)" if candidates else ""
        return (
            f"unsupported KV tensor shape {shape}: expected [2, blocks, ...], "
            f"[blocks, 2, ...] or packed [blocks, heads, block_size, 2*head_dim]{hint}"
        )
    key, value = (
        split_named(layer_kv, candidates[0], block_size=block_size or 0, layer=layer)
        if candidates[0] == "packed"
        else _stacked(layer_kv, candidates[0])
    )
    assert value is not None
    return key, value


def _stacked(t: torch.Tensor, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    return (t[0], t[1]) if name == "flash" else (t[:, 0], t[:, 1])
