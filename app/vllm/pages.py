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

MLA (vLLM's ``CPU_MLA``, ``TRITON_MLA``, ``FLASHMLA``: kvferry's layout ``mla``): a layer is
``[num_blocks, 1, block_size, latent]``, one latent per token and no heads to split. A block
is one page of ``block_size * latent`` elements, moved as it is: the payload's key tensor is
the pages ``[blocks, 1, block_size * latent]``, its value absent, its metadata ``layout``
:data:`MLA_PAGE_LAYOUT` and ``kv_latent: true``. Every rank holds the whole latent; each decode
rank reads it whole from one prefill rank (:func:`kvferry.core.routing.latent_source`, the
head plan of one head held by every rank), so a latent geometry routes as one head. A decode
of another block size re-blocks the latent rows on write (:func:`write_relaid`).

Dense caches in NHD order (vLLM's ``LBNHC``) are read through strided views of their pages
(``PageGeometry.nhd``); their payloads hold the bytes an HND cache's would. FP8 caches
(vLLM's ``uint8``, or torch's float8 dtypes) are copied as their bytes (:func:`raw_bytes`);
their scales travel in the metadata (the saver and loader). A device cache's pages go
through pinned host staging (:class:`kvferry.adapters.device_staging.PinnedStaging`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs
import torch

from kvferry.adapters.checked_scatter import scatter_checked
from kvferry.adapters.checksums import compute_checksum
from kvferry.adapters.device_staging import PinnedStaging
from kvferry.adapters.kv_layouts import tokens_to_vllm_pages, vllm_pages_to_tokens
from kvferry.adapters.torch_decode import dtype_name, verify_deferred
from kvferry.adapters.torch_frames import dest_views, finish_payload_in
from kvferry.core.errors import ConfigError, PayloadError
from kvferry.core.head_slices import HeadSlice
from kvferry.core.header import LayoutTemplate, kv_layout_template
from kvferry.core.ids import connector_key
from kvferry.core.layouts import KV_LATENT_KEY, VLLM_CPU_PAGE_ISAS, reblock_span
from kvferry.core.routing import rank_heads, route_heads, route_latent

__all__ = [
    "PAGE_LAYOUT",
    "MLA_PAGE_LAYOUT",
    "PageGeometry",
    "layer_key",
    "send_slices",
    "recv_slices",
    "rank_head_count",
    "PageWriter",
    "page_spans",
    "payload_pieces",
    "write_pages",
    "block_runs",
    "check_payload",
    "layout_family",
    "needs_relay",
    "pages_to_tokens",
    "write_relaid",
    "FP8_DTYPES",
    "FP8_FORMAT_KEY",
    "raw_bytes",
    "as_pages_of",
]

#: The layout name recorded in every dense payload's metadata.
PAGE_LAYOUT = "vllm_cpu_pages_hnd"
#: The layout name of an MLA payload (one latent region per block, no value tensor).
MLA_PAGE_LAYOUT = "vllm_mla_pages"
#: Metadata key of an FP8 payload's format (``fp8_e4m3``, ``fp8_e5m2``; absent: not FP8).
FP8_FORMAT_KEY = "kv_cache_dtype"


@attrs.frozen
class PageGeometry:
    """One rank's cache geometry: ``num_layers`` tensors of ``[num_blocks, heads, block_size,
    2 * head_size]`` of one dtype. ``heads`` are this rank's KV heads.

    ``latent``: an MLA cache ``[num_blocks, 1, block_size, head_size]``, ``head_size`` the
    latent width (``kv_lora_rank + qk_rope_head_dim``), one region per block (no V).

    ``nhd``: a dense cache in vLLM's ``LBNHC`` stride order (the logical view of a contiguous
    ``[num_blocks, block_size, heads, 2 * head_size]``), whose (block, head) pages are not
    contiguous: its K and V regions are the strided views ``[num_blocks, heads, block_size / 2,
    2 * head_size]`` of each page's first and second half, and the payload holds the same
    bytes an HND cache's would (each page's rows in order), so either order reads the other's."""

    num_layers: int
    num_blocks: int
    heads: int
    block_size: int
    head_size: int
    dtype: str
    latent: bool = False
    nhd: bool = False

    @property
    def region(self) -> int:
        """Elements in one K (or V) region of a page (an MLA block's latents)."""
        return self.block_size * self.head_size

    @property
    def payload_layout(self) -> str:
        """The ``layout`` a payload of these pages states (:data:`PAGE_LAYOUT`, :data:`MLA_PAGE_LAYOUT`)."""
        return MLA_PAGE_LAYOUT if self.latent else PAGE_LAYOUT

    @property
    def tensors(self) -> int:
        """Tensors in one layer's payload: K and V regions (2), or the latent (1)."""
        return 1 if self.latent else 2

    @classmethod
    def of(cls, layers: Sequence[torch.Tensor], *, latent: bool = False) -> PageGeometry:
        """The geometry of vLLM's per-layer tensors (``latent``: an MLA cache, as vLLM hands it
        to a connector: ``[num_blocks, 1, block_size, latent]``, or the backend's own
        ``[num_blocks, block_size, latent]``); ConfigError for anything else."""
        if not layers:
            raise ConfigError("kv_caches: no attention layers registered")
        if latent:  # vLLM's own MLA cache shape [num_blocks, block_size, latent]: the same bytes
            layers = [t.unsqueeze(1) if isinstance(t, torch.Tensor) and t.dim() == 3 else t for t in layers]
        first = layers[0]
        for i, t in enumerate(layers):
            if latent:
                if not isinstance(t, torch.Tensor) or t.dim() != 4 or t.shape[1] != 1:
                    shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                    raise ConfigError(
                        f"kv_caches[{i}]: kvferry's vLLM connector moves an MLA cache as "
                        f"[num_blocks, 1, block_size, latent] (one latent per token); got {shape}"
                    )
            elif not isinstance(t, torch.Tensor) or t.dim() != 4 or t.shape[3] % 2:
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
            nhd = not latent and not t.is_contiguous() and t.transpose(1, 2).is_contiguous()
            if nhd != (not latent and not first.is_contiguous()) or not (t.is_contiguous() or nhd):
                raise ConfigError(
                    f"kv_caches[{i}]: expected a contiguous tensor, or for a dense cache the HND view of a "
                    f"contiguous [num_blocks, block_size, heads, 2*head_size] (vLLM's LBNHC), as layer 0 is"
                )
            if nhd and t.shape[2] % 2:
                raise ConfigError(f"kv_caches[{i}]: an NHD cache's block size must be even, got {t.shape[2]}")
        nb, heads, bs, content = first.shape
        if latent:
            return cls(len(layers), nb, 1, bs, content, dtype_name(first.dtype), latent=True)
        nhd = not first.is_contiguous()
        return cls(len(layers), nb, heads, bs, content // 2, dtype_name(first.dtype), nhd=nhd)

    def regions(self, layer: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Views ``[num_blocks, heads, region]`` of a layer's K and V regions (no copy); of an
        NHD cache, ``[num_blocks, heads, block_size / 2, 2 * head_size]`` (strided: reshape a
        payload's pages to them with :func:`as_pages_of`)."""
        if self.latent:
            raise ConfigError("an MLA cache has one latent region per block, no K and V regions")
        if self.nhd:
            half = self.block_size // 2
            return layer[:, :, :half], layer[:, :, half:]
        v = layer.view(self.num_blocks, self.heads, 2, self.region)
        return v[:, :, 0], v[:, :, 1]

    def page_places(self, itemsize: int) -> tuple[tuple[int, int, int], ...]:
        """Where :meth:`page_tensors` put each page of a contiguous layer, in bytes: per page
        tensor ``(base, block stride, head stride)``, head ``h`` of block ``b`` at ``base + b *
        block stride + h * head stride`` (elements of ``itemsize`` bytes)."""
        region = self.region * itemsize
        if self.latent:
            return ((0, region, region),)
        head = 2 * region
        return ((0, self.heads * head, head), (region, self.heads * head, head))

    def page_tensors(self, layer: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The layer's page views in payload order, each ``[num_blocks, heads, region]`` (no
        copy): the K and V regions, or an MLA cache's one latent region per block."""
        if self.latent:
            return (layer.view(self.num_blocks, 1, self.region),)
        return self.regions(layer)


#: Torch dtypes of an FP8 cache: moved as their bytes (uint8 views), never converted.
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def raw_bytes(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself, or for an FP8 tensor its bytes (a uint8 view of one shape and strides):
    pages are copied as bytes, so an FP8 cache moves bit for bit through copies torch may not
    have for its float8 dtypes."""
    return t.view(torch.uint8) if t.dtype in FP8_DTYPES else t


def as_pages_of(pages: torch.Tensor, region_view: torch.Tensor) -> torch.Tensor:
    """Payload pages ``[n, heads, region]`` in the shape of a cache's region view (itself, or an
    NHD cache's ``[n, heads, block_size / 2, 2 * head_size]``): a view where the pages are
    contiguous."""
    if region_view.dim() == pages.dim():
        return pages
    return pages.reshape(pages.shape[0], pages.shape[1], *region_view.shape[2:])


#: Pinned host staging of the loads into a device cache (one copy at a time; see PinnedStaging).
_LOAD_STAGING = PinnedStaging()


def layer_key(transfer_id: str, from_stage: int, layer: int, from_rank: int, to_rank: int) -> str:
    """The key of one layer's pages from ``from_rank`` to ``to_rank`` (chunk ``layer + 1``)."""
    return connector_key(transfer_id, from_stage, layer + 1, from_rank, to_rank)


def send_slices(
    prefill_tp: int, decode_tp: int, total_heads: int, prefill_rank: int, *, latent: bool = False
) -> tuple[HeadSlice, ...]:
    """What prefill rank ``prefill_rank`` sends: one head slice per decode rank it feeds
    (:func:`kvferry.core.routing.route_heads`; replicated KV heads included: a replica that
    serves nobody sends nothing). RoutingError (naming the sizes and the head count) when the
    heads cannot be mapped. ``latent``: an MLA cache, whose whole latent goes to each decode
    rank that :func:`kvferry.core.routing.latent_source` gives this rank (``total_heads``
    is then not used)."""
    if latent:
        return route_latent(prefill_tp, decode_tp).sends(prefill_rank)
    return route_heads(prefill_tp, decode_tp, total_heads).sends(prefill_rank)


def recv_slices(
    prefill_tp: int, decode_tp: int, total_heads: int, decode_rank: int, *, latent: bool = False
) -> tuple[HeadSlice, ...]:
    """What decode rank ``decode_rank`` reads, in merge order (``recv_head_*`` index its heads),
    each slice from exactly one prefill rank that holds it. ``latent``: an MLA cache, one
    slice (the whole latent) from :func:`kvferry.core.routing.latent_source`."""
    if latent:
        return route_latent(prefill_tp, decode_tp).reads(decode_rank)
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
    #: Pinned host staging for a device cache's pages (created on the first device gather).
    _staging: PinnedStaging | None = attrs.field(init=False, default=None)
    #: :meth:`pieces`' ranges in the layer (offsets, the same for every layer of a request and
    #: head slice), by what decides them; cleared when it grows past 64 entries.
    _ranges: dict[tuple[Any, ...], tuple[list[list[tuple[int, int]]], list[tuple[int, int]] | None]] = attrs.field(
        init=False, factory=dict
    )

    def template(self, num_blocks: int, heads: int) -> LayoutTemplate:
        key = (num_blocks, heads)
        tpl = self._templates.get(key)
        if tpl is None:
            spec = (self.geometry.dtype, (num_blocks, heads, self.geometry.region))
            values = [None] if self.geometry.latent else [spec]  # an MLA latent has no value tensor
            tpl = kv_layout_template([spec], values, align=self.align, checksums=self.checksums)
            if len(self._templates) > 256:
                self._templates.clear()
            self._templates[key] = tpl
        return tpl

    def layout(self, transfer_id: str, block_ids: Sequence[int], heads: int, metadata: dict[str, Any]) -> Any:
        """The payload layout of ``block_ids``' pages of ``heads`` heads; ``metadata``'s
        ``layout`` is the geometry's (:attr:`PageGeometry.payload_layout`), an MLA payload's
        also says ``kv_latent: true``."""
        meta = {**metadata, "layout": self.geometry.payload_layout}
        if self.geometry.latent:
            meta[KV_LATENT_KEY] = True
        return self.template(len(block_ids), heads).layout(transfer_id, list(block_ids), meta)

    def gather(
        self, layer: torch.Tensor, index: torch.Tensor, head_start: int, head_stop: int, dest: torch.Tensor, layout: Any
    ) -> None:
        """Copy the pages ``layer[index, head_start:head_stop]`` (K then V regions, or an MLA
        block's latents) into ``dest`` (a 1-D uint8 buffer of ``layout.total_nbytes``) and
        write the header in front."""
        dests = dest_views(dest, layout)
        for src, out in zip(self.geometry.page_tensors(layer), dests):
            assert out is not None
            src, out = raw_bytes(src)[:, head_start:head_stop], as_pages_of(raw_bytes(out), src)
            if src.device == out.device:
                torch.index_select(src, 0, index, out=out)
            else:  # a device cache into a host payload: gathered on the device, out through pinned memory
                if self._staging is None:
                    self._staging = PinnedStaging()
                self._staging.to_host(torch.index_select(src, 0, index.to(src.device)), out)
        finish_payload_in(dest, layout)

    def pieces(
        self,
        layer: torch.Tensor,
        block_ids: Sequence[int],
        head_start: int,
        head_stop: int,
        layout: Any,
        zeros: tuple[int, int],
    ) -> tuple[bytes, list[tuple[int, int]]] | None:
        """What :meth:`gather` would write into a payload, as its header and the address
        ranges of ``layer`` (and of ``zeros``, ``(address, length)`` of a zero-filled buffer,
        for padding) whose concatenation is the rest, in place: no page is copied. Checksums
        are computed over those ranges in order. None where the pages cannot be read in place
        (a device cache, or one that is not vLLM's contiguous CPU layout)."""
        g = self.geometry
        if g.nhd or layer.device.type != "cpu" or not layer.is_contiguous():
            return None
        itemsize = layer.element_size()
        present = tuple(sp for sp in layout.spans if sp is not None and sp[1])
        key: tuple[Any, ...] = (tuple(block_ids), head_start, head_stop, itemsize, zeros[1])
        key += (layout.data_start, layout.total_nbytes, present)
        known = self._ranges.get(key)
        if known is None:  # the first layer of this request and slice: the rest reuse them
            spans = page_spans(g.page_places(itemsize), g.region * itemsize, block_ids, head_start, head_stop)
            pieces = None
            if len(present) == len(spans):
                pieces = payload_pieces(layout.data_start, layout.total_nbytes, present, spans, zeros[1])
            known = spans, pieces
            if len(self._ranges) >= 64:
                self._ranges.clear()
            self._ranges[key] = known
        spans, pieces = known
        if pieces is None:
            return None
        if layout.checksums_pending:
            algorithm = layout.header.checksum_algorithm
            assert algorithm is not None  # pending checksums were planned with an algorithm
            flat = layer.view(torch.uint8).reshape(-1).numpy()
            layout = layout.with_checksums(
                [compute_checksum(algorithm, [flat[off : off + n] for off, n in part]) for part in spans]
            )
        base = layer.data_ptr()
        return layout.header_bytes, [(zeros[0], n) if off < 0 else (base + off, n) for off, n in pieces]


def page_spans(
    places: Sequence[tuple[int, int, int]], region_bytes: int, block_ids: Sequence[int], head_start: int, head_stop: int
) -> list[list[tuple[int, int]]]:
    """Per page tensor (:meth:`PageGeometry.page_places`), the byte ranges ``(offset in the
    layer, length)`` that hold the pages of ``block_ids``' heads ``head_start:head_stop``, in
    the order a gather writes them (block by block, head by head), adjacent ranges merged:
    their concatenation is that tensor's bytes in the payload."""
    out: list[list[tuple[int, int]]] = []
    for base, block_stride, head_stride in places:
        spans: list[tuple[int, int]] = []
        for b in block_ids:
            for h in range(head_start, head_stop):
                at = base + int(b) * block_stride + h * head_stride
                if spans and spans[-1][0] + spans[-1][1] == at:
                    spans[-1] = (spans[-1][0], spans[-1][1] + region_bytes)
                else:
                    spans.append((at, region_bytes))
        out.append(spans)
    return out


def payload_pieces(
    data_start: int,
    total_nbytes: int,
    tensor_places: Sequence[tuple[int, int]],
    tensor_spans: Sequence[Sequence[tuple[int, int]]],
    zeros: int,
) -> list[tuple[int, int]] | None:
    """The pieces after the header (``data_start`` bytes) of a payload of ``total_nbytes``
    whose tensors lie at ``tensor_places`` (``(offset, nbytes)`` in the payload, in order) and
    are read from ``tensor_spans`` (layer offsets, :func:`page_spans`): those ranges, with the
    padding before, between and after the tensors as ranges ``(-1, n)`` of zeros, ``n`` at
    most ``zeros`` (>= 1) each. None when a tensor's ranges do not add up to its size."""
    if zeros < 1:
        raise ConfigError(f"zeros must be at least 1 byte, got {zeros}")
    out: list[tuple[int, int]] = []
    pos = data_start

    def pad(n: int) -> None:
        while n > 0:
            out.append((-1, min(n, zeros)))
            n -= min(n, zeros)

    for (offset, nbytes), spans in zip(tensor_places, tensor_spans):
        if offset < pos or sum(n for _, n in spans) != nbytes:
            return None
        pad(offset - pos)
        out.extend(spans)
        pos = offset + nbytes
    pad(total_nbytes - pos)
    return out


def check_payload(decoded: Any, geometry: PageGeometry, layer: int, heads: int, min_blocks: int) -> None:
    """PayloadError unless ``decoded`` is ``layer``'s pages for ``heads`` heads in our layout."""
    meta = decoded.metadata or {}
    want_layout = geometry.payload_layout
    if meta.get("layout") != want_layout:
        raise PayloadError(f"layer {layer}: payload layout {meta.get('layout')!r}, expected {want_layout!r}")
    if meta.get("layer") != layer:
        raise PayloadError(f"layer {layer}: payload is for layer {meta.get('layer')!r}")
    if geometry.latent:
        _check_latent(decoded, geometry, layer, min_blocks)
        return
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


def _check_latent(decoded: Any, geometry: PageGeometry, layer: int, min_blocks: int) -> None:
    """The MLA half of :func:`check_payload`: one layer, the latent pages as its key tensor
    ``[>= min_blocks, 1, block_size * latent]`` of this cache's block size and dtype, no value."""
    meta = decoded.metadata or {}
    if meta.get(KV_LATENT_KEY) is not True:
        raise PayloadError(f"layer {layer}: an MLA payload must say {KV_LATENT_KEY}: true")
    if decoded.num_layers != 1 or decoded.key_cache[0] is None or decoded.value_cache[0] is not None:
        raise PayloadError(f"layer {layer}: expected one layer of MLA latent pages and no value tensor")
    src_bs = meta.get("block_size", geometry.block_size)
    if isinstance(src_bs, bool) or not isinstance(src_bs, int) or src_bs < 1:
        raise PayloadError(f"layer {layer}: payload block_size {src_bs!r}")
    region = src_bs * geometry.head_size  # re-blocked on write when the sender's block size is another
    t = decoded.key_cache[0]
    if t.dim() != 3 or tuple(t.shape[1:]) != (1, region) or t.shape[0] < min_blocks:
        raise PayloadError(
            f"layer {layer}: latent pages {tuple(t.shape)}, expected [>= {min_blocks}, 1, {region}] "
            f"(block_size {src_bs}, latent {geometry.head_size})"
        )
    if dtype_name(t.dtype) != geometry.dtype:
        raise PayloadError(f"layer {layer}: latent pages are {dtype_name(t.dtype)}, this cache is {geometry.dtype}")


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
    layer_bytes: memoryview | None = None,
) -> int:
    """Copy received pages ``first_page:first_page+len(index)`` into ``layer[index,
    recv_start:recv_stop]`` (K and V regions); returns the bytes written. With ``runs``
    (:func:`block_runs` of ``index``) few enough, each run is one slice copy (several times
    faster than an indexed copy), else one indexed copy per region. An MLA geometry writes
    the latent pages (the payload's key tensor) alone.

    Checksums :func:`decode_payload` deferred (``defer_verify=True``) are checked here: in the
    copy's own read where :func:`scatter_checked` can (``layer_bytes``: the layer's own bytes,
    :func:`writable_bytes`; the pages are then written before a mismatch is known, and the
    caller fails the load), else before the copy. None is left unchecked: PayloadError naming
    the tensor on a mismatch."""
    n = index.numel()
    payload = (decoded.key_cache[0],) if geometry.latent else (decoded.key_cache[0], decoded.value_cache[0])
    pending = getattr(decoded, "unverified", None) or {}  # what decoding left to check
    fused: set[int] = set()  # page tensors written and checked in one read
    nbytes = 0
    if pending and layer_bytes is not None and not geometry.nhd:  # byte places of contiguous pages
        spans = runs if runs is not None else block_runs(index.tolist())
        algorithm = str(decoded.checksum_algorithm)
        for i, (whole, (base, block, head)) in enumerate(zip(payload, geometry.page_places(layer.element_size()))):
            entry = pending.get((i == 0, 0))
            if (
                entry is None
                or whole.dtype != layer.dtype
                or whole.shape[1:] != (recv_stop - recv_start, geometry.region)
            ):
                continue
            if scatter_checked(
                layer_bytes, whole, first_page, spans, (base + recv_start * head, block, head), (algorithm, *entry)
            ):
                del pending[(i == 0, 0)]
                fused.add(i)
                nbytes += n * whole.stride(0) * whole.element_size()
    for i, (dst, whole) in enumerate(zip(geometry.page_tensors(layer) if len(fused) < len(payload) else (), payload)):
        if i in fused:
            continue
        dst = raw_bytes(dst)
        src = as_pages_of(raw_bytes(whole).narrow(0, first_page, n), dst)
        if (i == 0, 0) in pending:  # a deferred check not fused: before the copy
            verify_deferred(decoded, (i == 0, 0))
        if src.device != dst.device:  # host pages into a device cache: in through pinned memory
            src, index = _LOAD_STAGING.to_device(src, dst.device), index.to(dst.device)
        if runs is not None and len(runs) <= max(1, n // 4):
            for block, at, length in runs:
                dst[block : block + length, recv_start:recv_stop].copy_(src[at : at + length])
        else:
            dst[:, recv_start:recv_stop].index_copy_(0, index, src)
        nbytes += src.numel() * src.element_size()
    if pending:  # a tensor this geometry does not write: checked all the same
        verify_deferred(decoded)
    return nbytes


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
    order (all stated by the sender: ``block_size``, ``cache_layout``, ``isa``). MLA latent
    pages differ only in their block size."""
    meta = metadata or {}
    if meta.get("block_size", geometry.block_size) != geometry.block_size:
        return True
    if geometry.latent:  # one latent per token in every MLA backend: only the block size can differ
        return False
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
    src_offset: int = 0,
) -> int:
    """Write a payload whose pages differ from this cache's (:func:`needs_relay`): decode the
    sender's pages that hold local pages ``first_page .. first_page + len(index)`` (the
    payload's row ``r`` is the sender's page ``src_offset + r``: a hybrid group's window) into tokens
    (its block size, layout and kernel ISA, from the payload), lay them out as this cache's
    pages (``geometry.block_size``, ``cache_layout``, kernel ``isa``) and copy those into
    ``layer[index, recv_start:recv_stop]``. Bit-exact per token; the tail of a partial last
    page is zero. Returns the bytes written. PayloadError when the sender's pages cannot be
    decoded or re-laid (naming both sides)."""
    if geometry.latent:
        return _write_latent_reblocked(layer, geometry, decoded, index, first_page, src_offset)
    meta: dict[str, Any] = dict(decoded.metadata or {})
    src_bs: Any = meta.get("block_size")
    num_tokens: Any = meta.get("num_tokens")
    src_isa = meta.get("isa")
    src_family, family = layout_family(meta.get("cache_layout")), layout_family(cache_layout)
    n = index.numel()
    try:
        start, stop, src_first, src_stop = reblock_span(first_page, n, geometry.block_size, src_bs, num_tokens)
        if src_first < src_offset or src_stop - src_offset > decoded.key_cache[0].shape[0]:
            raise ConfigError(
                f"the sender's pages {src_first}..{src_stop - 1} are needed, the payload holds pages "
                f"{src_offset}..{src_offset + decoded.key_cache[0].shape[0] - 1}"
            )
        k_src = raw_bytes(decoded.key_cache[0]).narrow(0, src_first - src_offset, src_stop - src_first)
        v_src = raw_bytes(decoded.value_cache[0]).narrow(0, src_first - src_offset, src_stop - src_first)
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
    k_dst, v_dst = (raw_bytes(t) for t in geometry.regions(layer))
    index = index[: k_pages.shape[0]].to(k_dst.device)  # local pages past the prompt's end hold nothing of it
    for dst, pages in ((k_dst, k_pages), (v_dst, v_pages)):
        dst[:, recv_start:recv_stop].index_copy_(0, index, as_pages_of(pages[: index.numel()], dst).to(dst.device))
    return 2 * k_pages.numel() * k_pages.element_size()


def _write_latent_reblocked(
    layer: torch.Tensor, geometry: PageGeometry, decoded: Any, index: torch.Tensor, first_page: int, src_offset: int = 0
) -> int:
    """:func:`write_relaid` for MLA latent pages of another block size: the sender's pages
    ``[n, 1, src_block_size * latent]`` are its tokens' latents in order (one row per token,
    ``latent`` wide), so the tokens of local pages ``first_page ..`` are a row range of them,
    laid out again ``geometry.block_size`` rows to a page (zero past the prompt's end) and
    copied into ``layer[index]``. Byte for byte per token (FP8 latents as their bytes)."""
    meta = decoded.metadata or {}
    src_bs: Any = meta.get("block_size")
    num_tokens: Any = meta.get("num_tokens")
    bs, width = geometry.block_size, geometry.head_size
    try:
        start, stop, src_first, src_stop = reblock_span(first_page, index.numel(), bs, src_bs, num_tokens)
    except ConfigError as exc:
        raise PayloadError(
            f"MLA pages of block_size {src_bs!r} cannot be re-blocked into this cache's ({bs}): {exc}"
        ) from exc
    if src_first < src_offset or src_stop - src_offset > decoded.key_cache[0].shape[0]:
        raise PayloadError(
            f"MLA pages {src_first}..{src_stop - 1} are needed, the payload holds pages from {src_offset} "
            f"({decoded.key_cache[0].shape[0]})"
        )
    src = raw_bytes(decoded.key_cache[0]).narrow(0, src_first - src_offset, src_stop - src_first).reshape(-1, width)
    offset = start - src_first * src_bs
    pages = -(-(stop - start) // bs)
    out = torch.zeros((pages * bs, width), dtype=src.dtype, device=src.device)
    out[: stop - start] = src[offset : offset + stop - start]
    (dst,) = geometry.page_tensors(layer)
    dst = raw_bytes(dst)
    target = index[:pages].to(dst.device)
    dst.index_copy_(0, target, out.view(pages, 1, bs * width).to(dst.device))
    return out.numel() * out.element_size()
