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

from kvferry.adapters.torch_decode import dtype_name
from kvferry.adapters.torch_frames import dest_views, finish_payload_in
from kvferry.core.errors import ConfigError, PayloadError
from kvferry.core.head_slices import HeadSlice
from kvferry.core.header import LayoutTemplate, kv_layout_template
from kvferry.core.ids import connector_key
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
    want = (heads, geometry.region)
    for name, t in (("K", k), ("V", v)):
        if t.dim() != 3 or tuple(t.shape[1:]) != want or t.shape[0] < min_blocks:
            raise PayloadError(
                f"layer {layer}: {name} pages {tuple(t.shape)}, expected "
                f"[>= {min_blocks}, {heads}, {geometry.region}] (block_size {geometry.block_size}, "
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
