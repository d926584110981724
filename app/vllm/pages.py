"""vLLM's paged KV cache as pages: which pages move, under which keys, and the copies.

vLLM's CPU attention backend stores each layer as one tensor ``[num_blocks, heads, block_size,
2 * head_size]`` (HND). Inside a (block, head) page the first ``block_size * head_size`` elements
are the K region and the rest the V region; how each region is ordered inside depends on the
CPU kernel (docs/vllm.md). kvferry moves the pages exactly as stored: a layer's payload is the
K regions ``[blocks, heads, block_size * head_size]`` as its key tensor and the V regions as its
value tensor (SPEC 3.1 codec, one layer per payload), never decoded into tokens. Two instances
of one vLLM build and CPU kind therefore exchange bytes that mean the same thing.

Keys: one payload per (layer, prefill rank, decode rank), the rank-aware key of SPEC 2.2 with
``chunk_id = layer + 1`` (0 would be a whole-request payload). Heads: dim 1 of the page
tensor; with different TP sizes each decode rank gets its heads from the core's head plan
(:func:`kvferry.core.routing.route_heads`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs
import torch

from kvferry.adapters.kv_layouts import tokens_to_vllm_pages, vllm_pages_to_tokens
from kvferry.adapters.torch_decode import dtype_name
from kvferry.adapters.torch_frames import dest_views, finish_payload_in
from kvferry.core.errors import ConfigError, PayloadError
from kvferry.core.head_slices import HeadSlice
from kvferry.core.header import LayoutTemplate, kv_layout_template
from kvferry.core.ids import connector_key
from kvferry.core.layouts import VLLM_CPU_PAGE_ISAS, reblock_span
from kvferry.core.routing import rank_heads, route_heads

__all__ = [
    "PAGE_LAYOUT",
    "PageGeometry",
    "layer_key",
    "send_slices",
    "recv_slices",
    "rank_head_count",
    "PageWriter",
    "write_pages",
    "block_runs",
    "check_payload",
    "layout_family",
    "needs_relay",
    "pages_to_tokens",
    "write_relaid",
]

#: The layout name recorded in every payload's metadata.
PAGE_LAYOUT = "vllm_cpu_pages_hnd"


@attrs.frozen
class PageGeometry:
    """One rank's cache geometry: ``num_layers`` tensors of ``[num_blocks, heads, block_size,
    2 * head_size]`` of one dtype. ``heads`` are this rank's KV heads."""

    num_layers: int
    num_blocks: int
    heads: int
    block_size: int
    head_size: int
    dtype: str

    @property
    def region(self) -> int:
        """Elements in one K (or V) region of a page."""
        return self.block_size * self.head_size

    @classmethod
    def of(cls, layers: Sequence[torch.Tensor]) -> PageGeometry:
        """The geometry of vLLM's per-layer tensors; ConfigError for anything else."""
        if not layers:
            raise ConfigError("kv_caches: no attention layers registered")
        first = layers[0]
        for i, t in enumerate(layers):
            if not isinstance(t, torch.Tensor) or t.dim() != 4 or t.shape[3] % 2:
                shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                raise ConfigError(
                    f"kv_caches[{i}]: kvferry's vLLM connector moves the CPU backend's pages "
                    f"[num_blocks, heads, block_size, 2*head_size]; got {shape}"
                )
            if t.shape != first.shape or t.dtype != first.dtype:
                raise ConfigError(
                    f"kv_caches[{i}]: shape {tuple(t.shape)} / {t.dtype} differs from layer 0's "
                    f"{tuple(first.shape)} / {first.dtype}"
                )
            if not t.is_contiguous():
                raise ConfigError(f"kv_caches[{i}]: expected a contiguous tensor")
        nb, heads, bs, two_d = first.shape
        return cls(len(layers), nb, heads, bs, two_d // 2, dtype_name(first.dtype))

    def regions(self, layer: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Views ``[num_blocks, heads, region]`` of a layer's K and V regions (no copy)."""
        v = layer.view(self.num_blocks, self.heads, 2, self.region)
        return v[:, :, 0], v[:, :, 1]


def layer_key(transfer_id: str, from_stage: int, layer: int, from_rank: int, to_rank: int) -> str:
    """The key of one layer's pages from ``from_rank`` to ``to_rank`` (chunk ``layer + 1``)."""
    return connector_key(transfer_id, from_stage, layer + 1, from_rank, to_rank)


def send_slices(prefill_tp: int, decode_tp: int, total_heads: int, prefill_rank: int) -> tuple[HeadSlice, ...]:
    """What prefill rank ``prefill_rank`` sends: one head slice per decode rank it feeds
    (:func:`kvferry.core.routing.route_heads`; replicated KV heads included: a replica that
    serves nobody sends nothing). RoutingError (naming the sizes and the head count) when the
    heads cannot be mapped."""
    return route_heads(prefill_tp, decode_tp, total_heads).sends(prefill_rank)


def recv_slices(prefill_tp: int, decode_tp: int, total_heads: int, decode_rank: int) -> tuple[HeadSlice, ...]:
    """What decode rank ``decode_rank`` reads, in merge order (``recv_head_*`` index its heads),
    each slice from exactly one prefill rank that holds it."""
    return route_heads(prefill_tp, decode_tp, total_heads).reads(decode_rank)


def rank_head_count(tp_size: int, total_heads: int) -> int:
    """How many KV heads each rank of a TP ``tp_size`` instance holds (1 when heads replicate)."""
    start, stop = rank_heads(tp_size, total_heads, 0)
    return stop - start


@attrs.define(eq=False)
class PageWriter:
    """Writes one layer's pages for one head slice into a connector reservation."""

    geometry: PageGeometry
    align: int = 64
    checksums: str | None = None
    _templates: dict[tuple[int, int], LayoutTemplate] = attrs.field(init=False, factory=dict)

    def template(self, num_blocks: int, heads: int) -> LayoutTemplate:
        key = (num_blocks, heads)
        tpl = self._templates.get(key)
        if tpl is None:
            spec = (self.geometry.dtype, (num_blocks, heads, self.geometry.region))
            tpl = kv_layout_template([spec], [spec], align=self.align, checksums=self.checksums)
            if len(self._templates) > 256:
                self._templates.clear()
            self._templates[key] = tpl
        return tpl

    def layout(self, transfer_id: str, block_ids: Sequence[int], heads: int, metadata: dict[str, Any]) -> Any:
        return self.template(len(block_ids), heads).layout(transfer_id, list(block_ids), metadata)

    def gather(
        self, layer: torch.Tensor, index: torch.Tensor, head_start: int, head_stop: int, dest: torch.Tensor, layout: Any
    ) -> None:
        """Copy the pages ``layer[index, head_start:head_stop]`` (K then V regions) into ``dest``
        (a 1-D uint8 buffer of ``layout.total_nbytes``) and write the header in front."""
        k, v = self.geometry.regions(layer)
        k_dest, v_dest = dest_views(dest, layout)
        torch.index_select(k[:, head_start:head_stop], 0, index, out=k_dest)
        torch.index_select(v[:, head_start:head_stop], 0, index, out=v_dest)
        finish_payload_in(dest, layout)


def check_payload(decoded: Any, geometry: PageGeometry, layer: int, heads: int, min_blocks: int) -> None:
    """PayloadError unless ``decoded`` is ``layer``'s pages for ``heads`` heads in our layout."""
    meta = decoded.metadata or {}
    if meta.get("layout") != PAGE_LAYOUT:
        raise PayloadError(f"layer {layer}: payload layout {meta.get('layout')!r}, expected {PAGE_LAYOUT!r}")
    if meta.get("layer") != layer:
        raise PayloadError(f"layer {layer}: payload is for layer {meta.get('layer')!r}")
    if decoded.num_layers != 1 or decoded.key_cache[0] is None or decoded.value_cache[0] is None:
        raise PayloadError(f"layer {layer}: expected one layer of K and V pages")
    k, v = decoded.key_cache[0], decoded.value_cache[0]
    region = geometry.region
    src_bs = meta.get("block_size", geometry.block_size)
    if src_bs != geometry.block_size:  # re-blocked on write: the sender's pages hold its block size
        if isinstance(src_bs, bool) or not isinstance(src_bs, int) or src_bs < 1:
            raise PayloadError(f"layer {layer}: payload block_size {src_bs!r}")
        region = src_bs * geometry.head_size
    want = (heads, region)
    for name, t in (("K", k), ("V", v)):
        if t.dim() != 3 or tuple(t.shape[1:]) != want or t.shape[0] < min_blocks:
            raise PayloadError(
                f"layer {layer}: {name} pages {tuple(t.shape)}, expected "
                f"[>= {min_blocks}, {heads}, {region}] (block_size {src_bs}, "
                f"head_size {geometry.head_size})"
            )
        if dtype_name(t.dtype) != geometry.dtype:
            raise PayloadError(f"layer {layer}: {name} pages are {dtype_name(t.dtype)}, this cache is {geometry.dtype}")


def block_runs(block_ids: Sequence[int]) -> tuple[tuple[int, int, int], ...]:
    """``(first block, first position, length)`` of each maximal run of consecutive ids in
    ``block_ids``, in order: position ``p`` of a run is block ``first block + p - first
    position``. A fresh request's blocks are mostly one or a few runs."""
    runs: list[tuple[int, int, int]] = []
    for pos, block in enumerate(block_ids):
        if runs and runs[-1][0] + runs[-1][2] == block:
            first, at, length = runs[-1]
            runs[-1] = (first, at, length + 1)
        else:
            runs.append((int(block), pos, 1))
    return tuple(runs)


def write_pages(
    layer: torch.Tensor,
    geometry: PageGeometry,
    decoded: Any,
    index: torch.Tensor,
    first_page: int,
    recv_start: int,
    recv_stop: int,
    runs: Sequence[tuple[int, int, int]] | None = None,
) -> int:
    """Copy received pages ``first_page:first_page+len(index)`` into ``layer[index,
    recv_start:recv_stop]`` (K and V regions); returns the bytes written. With ``runs``
    (:func:`block_runs` of ``index``) few enough, each run is one slice copy (several times
    faster than an indexed copy), else one indexed copy per region."""
    k_dst, v_dst = geometry.regions(layer)
    n = index.numel()
    k_src = decoded.key_cache[0].narrow(0, first_page, n)
    v_src = decoded.value_cache[0].narrow(0, first_page, n)
    if runs is not None and len(runs) <= max(1, n // 4):
        for block, at, length in runs:
            k_dst[block : block + length, recv_start:recv_stop].copy_(k_src[at : at + length])
            v_dst[block : block + length, recv_start:recv_stop].copy_(v_src[at : at + length])
    else:
        k_dst[:, recv_start:recv_stop].index_copy_(0, index, k_src)
        v_dst[:, recv_start:recv_stop].index_copy_(0, index, v_src)
    return 2 * k_src.numel() * k_src.element_size()


def layout_family(label: Any) -> str:
    """``packed`` or ``vllm_cpu`` of a payload's ``cache_layout`` label (``core.backends.
    BackendLayout.label``: ``packed/LBHNC``, ``vllm_cpu:amx/LBHNC``, ...); a payload without
    one is the CPU backend's (what this connector sent before it said)."""
    if not isinstance(label, str) or not label:
        return "vllm_cpu"
    return label.split("/", 1)[0].split(":", 1)[0]


def _kernel(isa: Any) -> str | None:
    return VLLM_CPU_PAGE_ISAS.get(isa.strip().lower()) if isinstance(isa, str) else None


def needs_relay(metadata: Any, geometry: PageGeometry, cache_layout: str | None, isa: str | None) -> bool:
    """True when a payload's pages are not this cache's page for page: another block size,
    another layout family (``packed`` pages into a CPU cache or back), or another CPU kernel's
    order (all stated by the sender: ``block_size``, ``cache_layout``, ``isa``)."""
    meta = metadata or {}
    if meta.get("block_size", geometry.block_size) != geometry.block_size:
        return True
    family = layout_family(cache_layout)
    if layout_family(meta.get("cache_layout")) != family:
        return True
    theirs = meta.get("isa")
    return family == "vllm_cpu" and theirs is not None and isa is not None and _kernel(theirs) != _kernel(isa)


def pages_to_tokens(
    k_regions: torch.Tensor, v_regions: torch.Tensor, family: str, isa: Any, block_size: int, num_tokens: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pages (K regions, V regions ``[n, H, B*D]``) of layout ``family`` (:func:`layout_family`;
    ``vllm_cpu`` in kernel ``isa``'s order) -> per-token ``[num_tokens, H, D]``, contiguous.
    ConfigError for an unknown ISA, a shape that does not fit, or more tokens than the pages hold."""
    if family == "packed":  # a (block, head) page is [B, 2*D]: each token's K then V
        n, h, region = k_regions.shape
        if region % block_size or not 0 <= num_tokens <= n * block_size:
            raise ConfigError(f"packed pages [{n}, {h}, {region}] do not hold {num_tokens} tokens of {block_size}")
        page = torch.cat((k_regions, v_regions), dim=2).view(n, h, block_size, 2 * region // block_size)
        d = page.shape[3] // 2
        tokens = page.transpose(1, 2).reshape(n * block_size, h, 2 * d)[:num_tokens]
        return tokens[..., :d].contiguous(), tokens[..., d:].contiguous()
    if family != "vllm_cpu":
        raise ConfigError(f"pages of layout {family!r}: kvferry reads packed and vllm_cpu pages")
    return vllm_pages_to_tokens(k_regions, v_regions, block_size=block_size, num_tokens=num_tokens, isa=isa)


def _tokens_to_pages(
    k: torch.Tensor, v: torch.Tensor, family: str, isa: Any, block_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token ``[T, H, D]`` -> this cache's pages (K regions, V regions), zero-padded."""
    if family == "packed":
        t, h, d = k.shape
        n = -(-t // block_size)
        page = torch.zeros((n * block_size, h, 2 * d), dtype=k.dtype)
        page[:t, :, :d], page[:t, :, d:] = k, v
        regions = page.view(n, block_size, h, 2 * d).transpose(1, 2).reshape(n, h, 2, block_size * d)
        return regions[:, :, 0], regions[:, :, 1]
    return tokens_to_vllm_pages(k, v, block_size=block_size, isa=isa)


def write_relaid(
    layer: torch.Tensor,
    geometry: PageGeometry,
    cache_layout: str | None,
    isa: str | None,
    decoded: Any,
    index: torch.Tensor,
    first_page: int,
    recv_start: int,
    recv_stop: int,
) -> int:
    """Write a payload whose pages differ from this cache's (:func:`needs_relay`): decode the
    sender's pages that hold local pages ``first_page .. first_page + len(index)`` into tokens
    (its block size, layout and kernel ISA, from the payload), lay them out as this cache's
    pages (``geometry.block_size``, ``cache_layout``, kernel ``isa``) and copy those into
    ``layer[index, recv_start:recv_stop]``. Bit-exact per token; the tail of a partial last
    page is zero. Returns the bytes written. PayloadError when the sender's pages cannot be
    decoded or re-laid (naming both sides)."""
    meta: dict[str, Any] = dict(decoded.metadata or {})
    src_bs: Any = meta.get("block_size")
    num_tokens: Any = meta.get("num_tokens")
    src_isa = meta.get("isa")
    src_family, family = layout_family(meta.get("cache_layout")), layout_family(cache_layout)
    n = index.numel()
    try:
        start, stop, src_first, src_stop = reblock_span(first_page, n, geometry.block_size, src_bs, num_tokens)
        k_src = decoded.key_cache[0].narrow(0, src_first, src_stop - src_first)
        v_src = decoded.value_cache[0].narrow(0, src_first, src_stop - src_first)
        k, v = pages_to_tokens(k_src, v_src, src_family, src_isa, src_bs, (src_stop - src_first) * src_bs)
        offset = start - src_first * src_bs
        k, v = k[offset : offset + stop - start], v[offset : offset + stop - start]
        k_pages, v_pages = _tokens_to_pages(k, v, family, isa, geometry.block_size)
    except ConfigError as exc:
        raise PayloadError(
            f"pages of block_size {src_bs} in layout {meta.get('cache_layout') or 'vllm_cpu'} (kernel {src_isa!r}) "
            f"cannot be re-laid as this cache's (block_size {geometry.block_size}, {cache_layout}, "
            f"kernel {isa!r}): {exc}"
        ) from exc
    k_dst, v_dst = geometry.regions(layer)
    index = index[: k_pages.shape[0]]  # local pages past the prompt's end hold nothing of it
    k_dst[:, recv_start:recv_stop].index_copy_(0, index, k_pages[: index.numel()])
    v_dst[:, recv_start:recv_stop].index_copy_(0, index, v_pages[: index.numel()])
    return 2 * k_pages.numel() * k_pages.element_size()
