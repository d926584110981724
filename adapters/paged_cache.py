"""Extracting one request's KV from a paged cache (SPEC 4), moving each byte once.

Phase 1, :func:`plan_extraction`, reads shapes only: every layer is normalised to
``(key_blocks, value_blocks)`` views (:func:`normalize_layer_kv`), block ids outside
``[0, num_blocks)`` are dropped, and each tensor's output shape ``[tokens, *token_shape]``
(``[tokens, heads, head_dim]`` for the usual layouts) and dtype are known. Phase 2,
:meth:`ExtractionPlan.gather_into`, copies one tensor's tokens straight into a destination the
caller owns (e.g. a typed view into a shared-memory region laid out by the wire codec);
:meth:`ExtractionPlan.materialize` allocates fresh tensors instead. One copy per byte, no
temporaries (except the ``"staged"`` method, see :data:`GatherMethod`). The copies themselves
are :class:`~kvferry.adapters.paged_gather.TensorGather`'s (re-exported here).

Invariants (property-tested against ``torch.cat`` of per-block slices):

- a layer's valid ids are the request's ids ``b`` with ``0 <= b < min(K blocks, V blocks)``, in
  request order, duplicates kept;
- ``tokens = min(seq_len, len(valid ids) * block_tokens)``; the output is the selected blocks'
  tokens, concatenated and truncated to ``tokens``;
- a layer that cannot be normalised, has no valid id, or would hold zero tokens is absent
  (None); a request whose layers are all absent yields :class:`ExtractionSkipped`.

Same code on CPU and CUDA; on CUDA copies are queued on the current stream (synchronise
before another process reads the destination).
"""

from __future__ import annotations

import logging
import operator
from collections.abc import Iterable, Mapping, Sequence
from types import MappingProxyType
from typing import Any

import attrs
import torch

from kvferry.adapters.kv_layouts import kv_pair, split_named, split_unnamed
from kvferry.adapters.paged_gather import (
    CROSS_DEVICE_MAX_RUNS,
    DEVICE_MAX_RUNS,
    MAX_SPLIT,
    STRIDED_MAX_RUNS,
    BlockIds,
    BlockSite,
    Destination,
    GatherMethod,
    HostSpan,
    NativeCall,
    TensorGather,
    split_calls,
    split_stride,
    write_all,
)
from kvferry.core.errors import ConfigError, KVFerryError, RoutingError
from kvferry.core.head_slices import slice_bounds
from kvferry.core.layouts import KV_LATENT_KEY, LayoutSpec, layout_spec

__all__ = [
    "GatherMethod",
    "CROSS_DEVICE_MAX_RUNS",
    "DEVICE_MAX_RUNS",
    "STRIDED_MAX_RUNS",
    "LayerSkip",
    "ExtractionSkipped",
    "TensorGather",
    "BlockSite",
    "CacheGeometry",
    "LayerSites",
    "HostSpan",
    "Destination",
    "ExtractionPlan",
    "ExtractedKV",
    "normalize_layer_kv",
    "valid_block_ids",
    "block_runs",
    "token_split",
    "plan_extraction",
    "extract_request",
    "gather_slices",
]

logger = logging.getLogger(__name__)

_WHICH = ("key", "value")


@attrs.frozen
class LayerSkip:
    """A layer without tensors; ``reason``: unsupported_layout | no_valid_blocks | no_tokens."""

    layer: int
    reason: str
    detail: str


@attrs.frozen
class ExtractionSkipped:
    """No payload for the request. Falsy, so ``if not result:`` catches every skip.

    ``reason``: ``"no_block_ids"``, ``"no_layers"`` or ``"all_layers_empty"``.
    """

    request_id: str
    reason: str
    detail: str
    skipped_layers: tuple[LayerSkip, ...] = ()

    def __bool__(self) -> bool:
        return False


def valid_block_ids(block_ids: Sequence[int], num_blocks: int) -> tuple[int, ...]:
    """Ids ``b`` with ``0 <= b < num_blocks``, in the given order, duplicates kept."""
    if block_ids and min(block_ids) >= 0 and max(block_ids) < num_blocks:  # the usual case, ~5x faster
        return tuple(block_ids)
    return tuple(b for b in block_ids if 0 <= b < num_blocks)


def block_runs(ids: Sequence[int]) -> tuple[tuple[int, int, int], ...]:
    """Maximal runs of consecutive ids as ``(dst_block, src_block, count)``.

    Concatenating ``range(src, src + count)`` over the runs gives ``ids``; ``dst_block`` is the
    position in ``ids`` of the run's first id.
    """
    runs: list[tuple[int, int, int]] = []
    start = 0  # position of the current run's first id
    for pos in range(1, len(ids) + 1):
        if pos == len(ids) or ids[pos] != ids[pos - 1] + 1:
            runs.append((start, ids[start], pos - start))
            start = pos
    return tuple(runs)


def token_split(selected_blocks: int, block_tokens: int, seq_len: int) -> tuple[int, int, int]:
    """``(tokens, full_blocks, tail_tokens)``: ``tokens = min(seq_len, blocks * block_tokens)``
    (0 when ``block_tokens <= 0``) ``== full_blocks * block_tokens + tail_tokens``, with
    ``0 <= tail_tokens < block_tokens``."""
    if block_tokens <= 0:
        return 0, 0, 0
    tokens = max(0, min(seq_len, selected_blocks * block_tokens))
    return (tokens, *divmod(tokens, block_tokens))


def _split_layer(
    layer_kv: Any, block_size: int | None, layout: LayoutSpec | None = None, layer: int | None = None
) -> tuple[torch.Tensor, torch.Tensor | None] | str:
    """``(key_blocks, value_blocks)`` views (value None for ``mla``), or a human reason why the
    layer is unusable. A named layout whose shape does not fit, and an unnamed shape two known
    layouts could both mean, raise ConfigError (:mod:`kvferry.adapters.kv_layouts`)."""
    if layout is not None:
        if block_size is None:
            raise ConfigError(f"layout {layout.name!r} needs the block size")
        key, value = split_named(layer_kv, layout, block_size=block_size, layer=layer)
    else:
        split = split_unnamed(layer_kv, block_size=block_size, layer=layer)
        if isinstance(split, str):
            return split
        key, value = split
    if key.ndim < 2 or (value is not None and value.ndim < 2):
        shown = None if value is None else tuple(value.shape)
        return f"key/value blocks under 2-D: key={tuple(key.shape)} value={shown}"
    if key.requires_grad:
        key = key.detach()
    if value is not None and value.requires_grad:
        value = value.detach()
    return key, value


def _reference_split(layer_kv: Any, block_size: int | None) -> tuple[torch.Tensor, torch.Tensor] | str:
    """The reference's reading by shape (its ``normalize_layer_kv``): ``(key_blocks,
    value_blocks)`` views, or a human reason why the layer is unusable. It guesses: a vLLM CPU
    cache reads as packed, a two-block K/V-on-dim-1 cache as K/V on dim 0."""
    if isinstance(layer_kv, torch.Tensor):
        shape = tuple(layer_kv.shape)
        if (
            layer_kv.ndim == 4 and block_size is not None and shape[2] == block_size and shape[3] % 2 == 0
        ):  # packed [blocks, heads, block_size, 2*head_dim]
            half, blocks = shape[3] // 2, layer_kv.transpose(1, 2)
            key, value = blocks.narrow(-1, 0, half), blocks.narrow(-1, half, half)
        elif layer_kv.ndim >= 3 and shape[0] == 2:  # [2, blocks, ...]; wins when blocks == 2
            key, value = layer_kv[0], layer_kv[1]
        elif layer_kv.ndim >= 3 and shape[1] == 2:  # [blocks, 2, ...]
            key, value = layer_kv[:, 0], layer_kv[:, 1]
        else:
            return (
                f"unsupported KV tensor shape {shape}: expected [2, blocks, ...], "
                "[blocks, 2, ...] or packed [blocks, heads, block_size, 2*head_dim]"
            )
    elif isinstance(layer_kv, (tuple, list)):
        pair = kv_pair(layer_kv)
        if isinstance(pair, str):
            return pair
        key, value = pair
    else:
        return f"unsupported KV type {type(layer_kv).__name__}"
    if key.ndim < 2 or value.ndim < 2:
        return f"key/value blocks under 2-D: key={tuple(key.shape)} value={tuple(value.shape)}"
    return (key.detach() if key.requires_grad else key), (value.detach() if value.requires_grad else value)


def normalize_layer_kv(
    layer_kv: Any,
    *,
    req_id: str = "",
    layer_idx: int = -1,
    block_size: int | None = None,
    layout: Any = None,
) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """One layer's cache as ``(key_blocks, value_blocks)`` views, ``[num_blocks, ...]`` each.

    Recognised in this order: packed ``[blocks, heads, block_size, 2*head_dim]`` (4-D, only when
    ``block_size`` is given and equals dim 2, last dim even; K is the first half); then, for rank
    >= 3, ``dim 0 == 2`` (K/V on dim 0), then ``dim 1 == 2`` (K/V on dim 1); or a ``(key, value)``
    tuple/list of tensors. So ``[2, 2, ...]`` reads as K/V on dim 0. Anything else, or key/value
    under 2-D, gives None and a warning naming request and layer.

    That is the reference's guess, kept for its API. With ``layout`` (a name of
    :mod:`kvferry.core.layouts`) the layer is read as that layout instead (ConfigError when it
    does not fit); the typed extraction (:func:`plan_extraction`) never guesses ambiguous shapes.
    """
    spec = layout_spec(layout, "layout")
    split = (
        _reference_split(layer_kv, block_size) if spec is None else _split_layer(layer_kv, block_size, spec, layer_idx)
    )
    if isinstance(split, str):
        logger.warning("request %s layer %s skipped: %s", req_id, layer_idx, split)
        return None
    return split


def _signature(layer_kv: Any) -> Any:
    """What must stay the same for a layer's block views to stay the layer's: each tensor's
    identity, address, shape and strides (a list or tuple layer: its tensors')."""
    if isinstance(layer_kv, torch.Tensor):
        return (id(layer_kv), layer_kv.data_ptr(), layer_kv.shape, layer_kv.stride())
    if isinstance(layer_kv, (tuple, list)):
        return (type(layer_kv), *map(_signature, layer_kv))
    return (type(layer_kv), id(layer_kv))


@attrs.frozen(eq=False)
class LayerSites:
    """One usable layer of a :class:`CacheGeometry`: its key and value block sites (value None
    for an MLA latent), the blocks both hold (``bound``) and whether their counts differ."""

    key: BlockSite
    value: BlockSite | None
    bound: int
    uneven: bool


@attrs.frozen(eq=False)
class CacheGeometry:
    """A paged cache's layers read once: each layer's :class:`LayerSites`, or the reason it is
    unusable. Every request of the cache plans from it (:func:`plan_extraction` with
    ``geometry=``) while :meth:`fits` the layers it is given: the same tensors at the same
    addresses, shapes and strides, the same block size and layout. It keeps the layers it read
    (so their identities stay theirs) and every head slice made of it (:meth:`head_slice`).
    Reading a cache of 28 layers costs about 0.27 ms; checking that it still fits, 0.016 ms."""

    block_size: int
    layout: LayoutSpec | None
    layers: tuple[Any, ...] = attrs.field(repr=False)
    signature: tuple[Any, ...] = attrs.field(repr=False)
    sites: tuple[LayerSites | str, ...] = attrs.field(repr=False)
    _slices: dict[tuple[int, int], tuple[tuple[BlockSite | KVFerryError, ...], ...]] = attrs.field(
        init=False, factory=dict, repr=False
    )
    #: The block count every layer's key and value hold when every layer is usable and their
    #: views share one block size and device: one selection of a request's blocks then serves
    #: every tensor (:func:`plan_extraction` makes it once); None otherwise.
    uniform: int | None = attrs.field(init=False, repr=False)

    @uniform.default
    def _uniform_default(self) -> int | None:
        views = [
            site.blocks
            for entry in self.sites
            if not isinstance(entry, str)
            for site in (entry.key, entry.value)
            if site is not None
        ]
        if not views or any(isinstance(entry, str) or entry.uneven for entry in self.sites):
            return None
        first = views[0]
        if any(v.shape[0] != first.shape[0] or v.shape[1] != first.shape[1] or v.device != first.device for v in views):
            return None
        return int(first.shape[0])

    @classmethod
    def of(cls, layers: Sequence[Any], block_size: int, layout: LayoutSpec | None) -> CacheGeometry:
        """Read ``layers``; ConfigError as :func:`plan_extraction` raises it (a layer that does
        not fit its named layout, an unnamed shape two layouts could mean)."""
        layers = tuple(layers)
        sites: list[LayerSites | str] = []
        for layer, layer_kv in enumerate(layers):
            split = _split_layer(layer_kv, block_size, layout, layer)
            if isinstance(split, str):
                sites.append(split)
                continue
            key, value = split
            bound = key.shape[0] if value is None else min(key.shape[0], value.shape[0])
            uneven = value is not None and key.shape[0] != value.shape[0]
            sites.append(LayerSites(BlockSite(key), None if value is None else BlockSite(value), bound, uneven))
        return cls(block_size, layout, layers, tuple(map(_signature, layers)), tuple(sites))

    def fits(self, layers: Sequence[Any], block_size: int, layout: LayoutSpec | None) -> bool:
        """True when ``layers`` are read as this geometry read its own."""
        return (
            block_size == self.block_size
            and layout == self.layout
            and len(layers) == len(self.layers)
            and tuple(map(_signature, layers)) == self.signature
        )

    def site(self, layer: int, which: str) -> BlockSite | None:
        """``which`` (``"key"``/``"value"``) site of ``layer``; None when the layer is unusable
        or has no such tensor."""
        entry = self.sites[layer]
        if isinstance(entry, str):
            return None
        return entry.key if which == "key" else entry.value

    def head_slice(self, offset_in_shard: int, num_slices: int) -> tuple[tuple[BlockSite | KVFerryError, ...], ...]:
        """Per layer, ``(key, value)`` sites narrowed on dim 2 (heads) to slice
        ``offset_in_shard`` of ``num_slices`` (:func:`kvferry.core.head_slices.slice_bounds`, the
        receiver's function too), made once and kept; where a tensor cannot be sliced, the
        RoutingError to raise when a request reads it (an empty tuple for an unusable layer)."""
        made = self._slices.get((offset_in_shard, num_slices))
        if made is None:
            made = tuple(
                () if isinstance(entry, str) else tuple(
                    _narrow_heads(site, offset_in_shard, num_slices) for site in (entry.key, entry.value)
                    if site is not None
                )
                for entry in self.sites
            )  # fmt: skip
            self._slices[offset_in_shard, num_slices] = made
        return made


def _narrow_heads(site: BlockSite, offset_in_shard: int, num_slices: int) -> BlockSite | KVFerryError:
    """``site`` narrowed to one head slice, or the error that slicing it is."""
    blocks = site.blocks
    if blocks.dim() < 3:
        return RoutingError("cannot slice heads of a tensor without a head dimension")
    try:
        start, stop = slice_bounds(blocks.shape[2], offset_in_shard, num_slices)
    except KVFerryError as exc:
        return exc
    return BlockSite(blocks.narrow(2, start, stop - start))


@attrs.frozen(eq=False)
class ExtractionPlan:
    """One request's payload before any byte moves. Truthy (:class:`ExtractionSkipped` is not).

    ``keys[i]``/``values[i]`` describe layer ``i`` (None when absent, both or neither);
    ``num_layers`` counts every layer of the cache; ``block_ids`` are the request's, as given;
    ``geometry``: the cache's :class:`CacheGeometry` the gathers' blocks come from (None when
    the plan was put together by hand), what the next request of the cache plans with.
    """

    request_id: str
    block_ids: tuple[int, ...]
    seq_len: int
    keys: tuple[TensorGather | None, ...]
    values: tuple[TensorGather | None, ...]
    _metadata: Mapping[str, Any] = attrs.field(converter=lambda m: MappingProxyType(dict(m)))
    skipped_layers: tuple[LayerSkip, ...] = ()
    geometry: CacheGeometry | None = attrs.field(default=None, repr=False)

    @property
    def num_layers(self) -> int:
        return len(self.keys)

    @property
    def shard_heads(self) -> int | None:
        """KV heads the cache holds (dim 2 of the first present key blocks ``[N, B, H, D]``);
        None for an MLA latent or blocks without a head dimension."""
        if self._metadata.get(KV_LATENT_KEY):
            return None
        for gather in self.keys:
            if gather is not None:
                return int(gather.blocks.shape[2]) if gather.blocks.dim() >= 4 else None
        return None

    @property
    def metadata(self) -> dict[str, Any]:
        """A fresh dict: ``block_size``, ``num_layers``, ``dtype``, ``seq_len``, custom keys."""
        return dict(self._metadata)

    @property
    def nbytes(self) -> int:
        """Total bytes of all output tensors."""
        return sum(g.nbytes for g in self.tensors() if g is not None)

    def tensors(self) -> tuple[TensorGather | None, ...]:
        """Wire order: every layer's key, then every layer's value (None where absent)."""
        return self.keys + self.values

    def dtype_shapes(self) -> tuple[list[tuple[str, tuple[int, ...]] | None], ...]:
        """``(keys, values)``: per layer ``(dtype name, shape)`` or None, the input of the wire
        codec's ``kv_tensor_specs``."""
        return tuple(
            [None if g is None else (g.dtype_name, g.shape) for g in gathers] for gathers in (self.keys, self.values)
        )

    def tensor(self, layer: int, which: str) -> TensorGather | None:
        """``which`` (``"key"``/``"value"``) of ``layer`` (shape, dtype, ...); None if absent."""
        if which not in _WHICH:
            raise ConfigError(f"which must be 'key' or 'value', got {which!r}")
        if not 0 <= layer < self.num_layers:
            raise ConfigError(f"layer must be in [0, {self.num_layers}), got {layer}")
        return (self.keys if which == "key" else self.values)[layer]

    def gather_into(self, layer: int, which: str, out: torch.Tensor, *, method: GatherMethod = "auto") -> torch.Tensor:
        """Write one tensor into the preallocated ``out`` in place (ConfigError if absent)."""
        gather = self.tensor(layer, which)
        if gather is None:
            raise ConfigError(f"request {self.request_id}: layer {layer} has no {which} tensor")
        return gather.gather_into(out, method=method)

    def gather_all(self, dest_views: Sequence[Sequence[Destination | None]], *, method: GatherMethod = "auto") -> None:
        """Fill ``(key_views, value_views)``: one view (or :class:`HostSpan`) per layer, None
        exactly where absent.

        Every view is checked before the first byte moves.
        """
        if len(dest_views) != 2:
            raise ConfigError("dest_views must be (key_views, value_views)")
        pairs = []
        for which, gathers, views in zip(_WHICH, (self.keys, self.values), dest_views):
            if len(views) != self.num_layers:
                raise ConfigError(f"{which} views: need {self.num_layers}, got {len(views)}")
            for layer, (gather, view) in enumerate(zip(gathers, views)):
                if (gather is None) != (view is None):
                    raise ConfigError(f"{which} layer {layer}: view must be None exactly when the layer is absent")
                if gather is not None and view is not None:
                    gather.check_out(view)
                    pairs.append((gather, view, gather.choose_method(view.device, method)))
        write_all(pairs)

    def head_slice(self, offset_in_shard: int, num_slices: int) -> ExtractionPlan:
        """The same extraction restricted to head slice ``offset_in_shard`` of ``num_slices``
        (dim 2 of each block view; :func:`kvferry.core.head_slices.slice_bounds`). No data
        moves: the gathers read strided views of the cache. The narrowed views come from the
        plan's geometry, made once per cache and slice; a gather not over its geometry's
        blocks is narrowed on its own. RoutingError for a tensor without a head dimension or
        a head count the slices do not divide."""
        geometry = self.geometry
        sliced = geometry.head_slice(offset_in_shard, num_slices) if geometry is not None else None

        def narrow(g: TensorGather | None, nth: int) -> TensorGather | None:
            if g is None:
                return None
            original = geometry.site(g.layer, g.which) if geometry is not None else None
            if original is not None and original.blocks is g.blocks:
                assert sliced is not None  # made from the same geometry
                site = sliced[g.layer][nth]
                if isinstance(site, KVFerryError):
                    raise type(site)(f"{g.name}: {site}")
                fields = (g.block_ids, g.tokens, g.full_blocks, g.tail_tokens, g.index, g.runs)
                return TensorGather.on_site(site, g.layer, g.which, *fields)
            own = _narrow_heads(BlockSite(g.blocks), offset_in_shard, num_slices)
            if isinstance(own, KVFerryError):
                raise type(own)(f"{g.name}: {own}")
            return attrs.evolve(g, blocks=own.blocks)

        keys = tuple(narrow(g, 0) for g in self.keys)
        values = tuple(narrow(g, 1) for g in self.values)
        return attrs.evolve(self, keys=keys, values=values, metadata=self._metadata, geometry=None)

    def materialize(
        self, *, method: GatherMethod = "auto"
    ) -> tuple[list[torch.Tensor | None], list[torch.Tensor | None]]:
        """Fresh contiguous tensors on the cache's device (one copy): ``(keys, values)``."""

        def fresh(g: TensorGather | None) -> torch.Tensor | None:
            if g is None:
                return None
            out = torch.empty(g.shape, dtype=g.dtype, device=g.device)
            return g.gather_into(out, method=method)

        return [fresh(g) for g in self.keys], [fresh(g) for g in self.values]


def gather_slices(
    plans: Sequence[ExtractionPlan], dests: Sequence[Sequence[Sequence[Destination | None]]], copies: int = 1
) -> None:
    """:meth:`ExtractionPlan.gather_all` of every plan into its ``(key_views, value_views)``,
    where the plans are slices of one request (e.g. the head slices of several receivers): a
    tensor whose slices are equal, consecutive views of the cache (``split_stride``) is read
    once for all of them by the native split gather; any other is gathered slice by slice.
    With ``copies`` > 1, ``dests`` holds that many destinations per plan, plan-major
    (``dests[j * copies + r]``: copy ``r`` of plan ``j``, e.g. every receiver of a replicated
    head): the native gather writes every copy from its one read of the slice; otherwise each
    copy is gathered again. Every view is checked before the first byte moves."""
    if copies < 1 or len(plans) * copies != len(dests):
        raise ConfigError(f"{len(plans)} plans of {copies} copies each, {len(dests)} destinations")
    jobs: list[tuple[list[TensorGather], list[Destination]]] = []
    num_layers = plans[0].num_layers
    for plan in plans:
        if plan.num_layers != num_layers:
            raise ConfigError("the plans must have the same layers")
    for dest in dests:
        if len(dest) != 2 or any(len(v) != num_layers for v in dest):
            raise ConfigError(
                "each destination must be (key_views, value_views), one view per layer of plans with the same layers"
            )
    for which in (0, 1):
        sides = [(plan.keys, plan.values)[which] for plan in plans]
        views = [dest[which] for dest in dests]
        for layer in range(num_layers):
            gathers: list[TensorGather] = []
            outs: list[Destination] = []
            for j, side in enumerate(sides):
                gather = side[layer]
                present = [view for r in range(copies) if (view := views[j * copies + r][layer]) is not None]
                if (gather is None) != (not present) or len(present) not in (0, copies):
                    raise ConfigError(
                        f"{_WHICH[which]} layer {layer}: view must be None exactly when the layer is absent"
                    )
                if gather is not None:
                    for view in present:
                        gather.check_out(view)
                    gathers.append(gather)
                    outs.extend(present)
            if gathers:
                jobs.append((gathers, outs))
    splits: list[NativeCall] = []  # a split read once for all its slices
    each: list[tuple[TensorGather, Destination, str]] = []  # every other destination on its own
    for gathers, outs in jobs:
        method = gathers[0].choose_method(outs[0].device)
        stride = None
        if (
            method == "native"
            and len(gathers) == len(plans)
            and len(outs) <= MAX_SPLIT
            and all(type(out) is HostSpan or out.device.type == "cpu" for out in outs)
        ):  # equal slices (split_stride: one layout, one device) on host destinations: all native
            stride = split_stride(gathers) if len(gathers) > 1 else (0 if copies > 1 else None)
        if stride is not None:
            splits.extend(split_calls(gathers, outs, stride, copies))
            continue
        methods = [method] + [g.choose_method(outs[k * copies].device) for k, g in enumerate(gathers) if k]
        each.extend((gathers[d // copies], out, methods[d // copies]) for d, out in enumerate(outs))
    write_all(each, splits)


@attrs.frozen(eq=False)
class ExtractedKV:
    """A materialised payload body; ``metadata`` is a fresh dict the caller owns."""

    request_id: str
    key_cache: tuple[torch.Tensor | None, ...] = attrs.field(repr=False)
    value_cache: tuple[torch.Tensor | None, ...] = attrs.field(repr=False)
    metadata: dict[str, Any]
    block_ids: tuple[int, ...]

    def layer_blocks(self) -> dict[str, list[torch.Tensor | None]]:
        """The reference's ``{"key_cache": [...], "value_cache": [...]}`` (fresh lists)."""
        return {"key_cache": list(self.key_cache), "value_cache": list(self.value_cache)}


def _check_args(
    block_ids: Any, seq_len: Any, block_size: Any, custom_metadata: Any
) -> tuple[tuple[int, ...], int, int]:
    try:
        seq_len, block_size = operator.index(seq_len), operator.index(block_size)
        if isinstance(block_ids, torch.Tensor):
            if block_ids.ndim != 1 or block_ids.is_floating_point() or block_ids.is_complex():
                raise TypeError(f"block_ids tensor is {block_ids.dtype}{list(block_ids.shape)}")
            block_ids = block_ids.tolist()
        ids = tuple(map(operator.index, block_ids if block_ids is not None else ()))
    except TypeError as exc:
        raise ConfigError(f"block_ids, seq_len and block_size must be integers: {exc}") from None
    if seq_len < 0 or block_size < 1:
        raise ConfigError(f"need seq_len >= 0 and block_size >= 1, got {seq_len}, {block_size}")
    if custom_metadata is not None and not isinstance(custom_metadata, Mapping):
        raise ConfigError(f"custom_metadata must be a mapping, not {type(custom_metadata).__name__}")
    return ids, seq_len, block_size


def _uniform_key(geometry: CacheGeometry) -> BlockSite:
    """The first layer's key site of a uniform geometry (every site selects as it does)."""
    entry = geometry.sites[0]
    assert not isinstance(entry, str)  # uniform: every layer usable
    return entry.key


def plan_extraction(
    kv_caches: Iterable[Any],
    block_ids: Any,
    seq_len: int,
    block_size: int,
    *,
    cache_dtype: Any,
    custom_metadata: Mapping[str, Any] | None = None,
    request_id: str = "",
    layout: Any = None,
    geometry: CacheGeometry | None = None,
) -> ExtractionPlan | ExtractionSkipped:
    """Plan one request's extraction: shapes only, no data moves (see the module docstring).

    ``block_ids``: a sequence of ints or a 1-D integer tensor (read once with ``tolist``).
    ``layout``: the cache's layout name (:mod:`kvferry.core.layouts`; an ``mla`` plan has keys
    only and metadata ``kv_latent: true``); None: recognised by shape, ambiguous shapes refused.
    ``geometry``: an earlier plan's :attr:`ExtractionPlan.geometry`, used when it still
    :meth:`~CacheGeometry.fits` the layers (else they are read again): the plan then costs
    the request's blocks only. Returns :class:`ExtractionSkipped` (falsy, with the reason) when
    there is nothing to send. Raises ConfigError for non-integer ids/sizes, ``seq_len < 0``,
    ``block_size < 1``, a non-mapping ``custom_metadata``, an unknown layout name, a cache that
    does not fit its named layout (naming the dimension) or an unnamed shape two layouts could
    mean (naming them).
    """
    ids, seq_len, block_size = _check_args(block_ids, seq_len, block_size, custom_metadata)
    spec = layout_spec(layout, "layout")
    layers = kv_caches if isinstance(kv_caches, (list, tuple)) else list(kv_caches)
    if not ids:
        logger.warning("request %s skipped: no block ids", request_id)
        return ExtractionSkipped(request_id, "no_block_ids", "the request has no block ids")
    if not layers:
        logger.warning("request %s skipped: the KV cache has no layers", request_id)
        return ExtractionSkipped(request_id, "no_layers", "the KV cache has no layers")
    if geometry is None or not geometry.fits(layers, block_size, spec):
        geometry = CacheGeometry.of(layers, block_size, spec)
    valid_by_bound: dict[int, tuple[int, ...]] = {}
    indexes: dict[tuple[torch.device, int, int], BlockIds] = {}  # (device, bound, full)
    runs: dict[tuple[int, int], tuple[tuple[int, int, int], ...]] = {}  # (bound, full)
    #: (bound, block tokens, device) -> the request's gather fields, None for zero tokens
    selections: dict[tuple[int, int, torch.device], tuple[Any, ...] | None] = {}

    def select(site: BlockSite, bound: int) -> tuple[Any, ...] | None:
        blocks = site.blocks
        key = (bound, blocks.shape[1], blocks.device)
        if key in selections:
            return selections[key]
        valid = valid_by_bound[bound]
        tokens, full, tail = token_split(len(valid), blocks.shape[1], seq_len)
        fields = None
        if tokens:
            if (blocks.device, bound, full) not in indexes:
                indexes[blocks.device, bound, full] = BlockIds(valid[:full], blocks.device)
            if (bound, full) not in runs:
                runs[bound, full] = block_runs(valid[:full])
            picked = valid[: full + (1 if tail else 0)]
            fields = (picked, tokens, full, tail, indexes[blocks.device, bound, full], runs[bound, full])
        selections[key] = fields
        return fields

    keys: list[TensorGather | None] = [None] * len(layers)
    values: list[TensorGather | None] = [None] * len(layers)
    skipped: list[LayerSkip] = []

    def valid_for(bound: int) -> tuple[int, ...]:
        """The request's ids below ``bound`` (once per bound; a drop is logged)."""
        if bound not in valid_by_bound:
            valid_by_bound[bound] = valid = valid_block_ids(ids, bound)
            if len(valid) != len(ids):
                logger.warning(
                    "request %s: dropped %s of %s block ids outside [0, %s)",
                    request_id,
                    len(ids) - len(valid),
                    len(ids),
                    bound,
                )
        return valid_by_bound[bound]

    uniform = geometry.uniform
    fields = None
    if uniform is not None and valid_for(uniform):  # one selection for every layer (CacheGeometry.uniform)
        fields = select(_uniform_key(geometry), uniform)
    if fields is not None:
        on_site = TensorGather.on_site
        for layer, entry in enumerate(geometry.sites):
            assert not isinstance(entry, str)  # uniform: every layer usable
            keys[layer] = on_site(entry.key, layer, "key", *fields)
            if entry.value is not None:
                values[layer] = on_site(entry.value, layer, "value", *fields)
    else:
        for layer, entry in enumerate(geometry.sites):
            if isinstance(entry, str):
                logger.warning("request %s layer %s skipped: %s", request_id, layer, entry)
                skipped.append(LayerSkip(layer, "unsupported_layout", entry))
                continue
            bound = entry.bound
            if entry.uneven:
                assert entry.value is not None  # uneven: a value tensor with another block count
                logger.warning(
                    "request %s layer %s: key has %s blocks, value %s; using the first %s",
                    request_id,
                    layer,
                    entry.key.blocks.shape[0],
                    entry.value.blocks.shape[0],
                    bound,
                )
            if not valid_for(bound):
                skipped.append(LayerSkip(layer, "no_valid_blocks", f"no block id in [0, {bound})"))
                continue
            k_fields = select(entry.key, bound)
            v_fields = None if entry.value is None else select(entry.value, bound)
            if k_fields is None or (v_fields is None and entry.value is not None):
                skipped.append(LayerSkip(layer, "no_tokens", "the layer would hold zero tokens"))
                continue
            keys[layer] = TensorGather.on_site(entry.key, layer, "key", *k_fields)
            if entry.value is not None and v_fields is not None:
                values[layer] = TensorGather.on_site(entry.value, layer, "value", *v_fields)
    if all(k is None for k in keys):
        logger.warning("request %s skipped: every layer is empty", request_id)
        return ExtractionSkipped(request_id, "all_layers_empty", "no layer yielded a token", tuple(skipped))
    metadata = {
        "block_size": block_size,
        "num_layers": len(layers),
        "dtype": str(cache_dtype),
        "seq_len": seq_len,
        **(custom_metadata or {}),
    }
    if spec is not None and not spec.has_value:
        metadata[KV_LATENT_KEY] = True
    return ExtractionPlan(
        request_id, ids, seq_len, tuple(keys), tuple(values), metadata, tuple(skipped), geometry=geometry
    )


def extract_request(
    kv_caches: Iterable[Any],
    block_ids: Any,
    seq_len: int,
    block_size: int,
    *,
    cache_dtype: Any,
    custom_metadata: Mapping[str, Any] | None = None,
    request_id: str = "",
    method: GatherMethod = "auto",
    layout: Any = None,
) -> ExtractedKV | ExtractionSkipped:
    """:func:`plan_extraction` then :meth:`ExtractionPlan.materialize` (fresh tensors)."""
    plan = plan_extraction(
        kv_caches,
        block_ids,
        seq_len,
        block_size,
        cache_dtype=cache_dtype,
        custom_metadata=custom_metadata,
        request_id=request_id,
        layout=layout,
    )
    if isinstance(plan, ExtractionSkipped):
        return plan
    keys, values = plan.materialize(method=method)
    return ExtractedKV(request_id, tuple(keys), tuple(values), plan.metadata, plan.block_ids)
