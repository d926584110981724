"""A whole payload's native copies, prepared once per cache.

Gathering a request into a payload buffer the general way costs Python per tensor:
:func:`~kvferry.adapters.torch_frames.dest_spans` makes a span per tensor, then
:meth:`~kvferry.adapters.paged_cache.ExtractionPlan.gather_all` checks each destination,
chooses each tensor's method and prepares its native call. About 5 us a tensor when warm, twice
that after an idle wait, on a model of 28 layers 56 times over (docs/benchmarks.md, "Where the
shm path's time goes"). Most of it is the same for every request of a cache: where each
tensor's blocks are, how a block is walked, how a partial last block of so many tokens is.

A :class:`PayloadLane` keeps those for one cache's views (the block views of its
:class:`~kvferry.adapters.paged_cache.CacheGeometry`) and serves every later request that it
fits (:meth:`PayloadLane.fits`): the plan's gathers read the lane's views (by identity: a cache
that changed gets a new geometry and so new views), all with one selection of blocks; torch
still on one thread (where the general path picks the native copy) and the extension still the
one it was made with; a payload template (by identity) the general path's checks passed once
for that many tokens; a buffer that holds the payload, with the tensors' data start aligned for
the widest dtype; every block id inside every tensor's view. A request then costs that check
and the native calls, two a tensor at most (the whole blocks, the partial last one), each with
the destination read from the layout's spans. Anything it does not fit takes the general path
(:func:`gather_payload`), which stays the reference: the bytes written are the same either way
(tests/adapters/test_payload_lane.py).
"""

from __future__ import annotations

from collections.abc import Callable, MutableMapping, Sequence
from functools import partial
from typing import Any

import attrs
import torch

from kvferry.adapters import paged_gather
from kvferry.adapters.paged_cache import CacheGeometry, ExtractionPlan, gather_slices
from kvferry.adapters.paged_gather import BlockSite, HostSpan, TensorGather
from kvferry.adapters.torch_frames import dest_problem, dest_spans
from kvferry.core.header import PayloadLayout

__all__ = [
    "HeadSlices",
    "PayloadLane",
    "SliceLane",
    "Slot",
    "Slots",
    "gather_payload",
    "gather_slice_payloads",
    "TEMPLATES_KEPT",
]

#: Payload templates a lane remembers as checked (all forgotten when full).
TEMPLATES_KEPT = 64
#: The key of a caller's lane in the mapping :func:`gather_payload` keeps it in (one lane: the
#: views of the cache last sent from; a lane of another cache is replaced, not kept beside it,
#: so an old cache is not held alive by it).
LANE_KEY = "lane"
#: A head slice as ``(offset_in_shard, num_slices)``.
Slot = tuple[int, int]
#: Head slices, one per payload gathered.
Slots = tuple[Slot, ...]
#: The key of a caller's slice lane (:func:`gather_slice_payloads`), kept beside its lane.
SLICE_LANE_KEY = "slices"


@attrs.define(eq=False)
class LaneChecks:
    """What a lane checks of a request and remembers for the next ones (both lanes: the one home
    of these checks). ``sites``: the block sites of the tensors, in wire order, whose partial
    block walks it knows; ``unit``: the widest dtype's size; ``min_blocks``: the fewest blocks a
    view holds."""

    sites: tuple[BlockSite, ...] = attrs.field(repr=False)
    unit: int
    min_blocks: int
    #: tail tokens -> per tensor the partial block's walk (``d0, s0, d1, s1, d2, s2, piece``)
    _tails: dict[int, tuple[tuple[int, ...], ...] | None] = attrs.field(init=False, factory=dict, repr=False)
    #: id(template descriptors) -> (descriptors, tokens, positions of the present tensors)
    _templates: dict[int, tuple[Any, int, tuple[int, ...]]] = attrs.field(init=False, factory=dict, repr=False)

    def payload_fits(
        self,
        plan: ExtractionPlan,
        buffer: torch.Tensor,
        layout: PayloadLayout,
        checked: Callable[[], ExtractionPlan] | None = None,
    ) -> bool:
        """A host buffer that holds the payload, the tensors' data start aligned for the widest
        dtype, and a template whose spans and shapes the general path's own checks passed for
        ``plan`` (checked the first time it is met with this many tokens, then remembered;
        the general path's ConfigError for one the plan does not fill). ``checked``: the plan
        the template is checked against when that is not ``plan`` (a head slice of it, with its
        token count), asked for only then."""
        if (
            dest_problem(buffer, layout) is not None
            or buffer.device.type != "cpu"
            or (buffer.storage_offset() + layout.data_start) % self.unit
        ):
            return False
        tokens = _first(plan).tokens
        entries = layout.header.tensors
        known = self._templates.get(id(entries))
        if known is None or known[0] is not entries or known[1] != tokens:
            present = _checked_template(plan if checked is None else checked(), buffer, layout)
            if present is None or len(present) != len(self.sites):
                return False
            if len(self._templates) >= TEMPLATES_KEPT:
                self._templates.clear()
            self._templates[id(entries)] = (entries, tokens, present)
        return True

    def selection_fits(self, first: TensorGather) -> bool:
        """The partial block's walk known for the selection's tail, every id inside every view."""
        if first.tail_tokens and self.tails(first.tail_tokens) is None:
            return False
        picked = first.block_ids[: first.full_blocks + (1 if first.tail_tokens else 0)]
        return not picked or (min(picked) >= 0 and max(picked) < self.min_blocks)

    def present(self, layout: PayloadLayout) -> tuple[int, ...]:
        """The positions of the present tensors in ``layout`` (a template :meth:`payload_fits`
        passed)."""
        return self._templates[id(layout.header.tensors)][2]

    def tails(self, tail_tokens: int) -> tuple[tuple[int, ...], ...] | None:
        """Per tensor the walk of a partial block of ``tail_tokens`` tokens; None where one has
        no native walk."""
        if tail_tokens not in self._tails:
            layouts = [site.layout(tail_tokens) for site in self.sites]
            self._tails[tail_tokens] = None if None in layouts else tuple(lay.tail for lay in layouts if lay)
        return self._tails[tail_tokens]


@attrs.define(eq=False)
class PayloadLane:
    """The native copies of every tensor of one cache's payloads (see the module doc).

    ``blocks``: each present tensor's view in wire order (keys, then values; absent layers left
    out), compared by identity with a plan's gathers; ``full``: per tensor the whole-block
    copy's arguments after the destination, source address, ids and count (``nblocks,
    block_stride, d0, s0, d1, s1, d2, s2, piece``) and its block's bytes; ``checks``: what is
    checked of a request and remembered (:class:`LaneChecks`, over those tensors' sites)."""

    blocks: tuple[torch.Tensor, ...] = attrs.field(repr=False)
    native: Any = attrs.field(repr=False)
    full: tuple[tuple[int, tuple[int, ...], int], ...] = attrs.field(repr=False)
    checks: LaneChecks

    @classmethod
    def of(cls, plan: ExtractionPlan) -> PayloadLane | None:
        """The lane of the cache ``plan`` reads (its geometry's views); None when the general
        path would not copy every tensor natively to a host buffer, or the plan is not one
        selection of blocks over its geometry's views."""
        native = paged_gather._native
        geometry = plan.geometry
        gathers = _present(plan)
        if native is None or geometry is None or not gathers or not _one_thread():
            return None
        first = gathers[0]
        cpu = torch.device("cpu")
        sites: list[BlockSite] = []
        full: list[tuple[int, tuple[int, ...], int]] = []
        for gather in gathers:
            site = geometry.site(gather.layer, gather.which)
            if site is None or site.blocks is not gather.blocks or not _same_selection(gather, first):
                return None
            layout = site.layout(gather.tail_tokens)
            if layout is None or gather.choose_method(cpu) != "native":
                return None
            sites.append(site)
            walk = (int(gather.blocks.shape[0]), layout.block_stride, *layout.full)
            full.append((gather.blocks.data_ptr(), walk, layout.block_bytes))
        checks = LaneChecks(
            tuple(sites), max(g.dtype.itemsize for g in gathers), min(int(g.blocks.shape[0]) for g in gathers)
        )
        return cls(tuple(g.blocks for g in gathers), native, tuple(full), checks)

    def reads(self, plan: ExtractionPlan) -> bool:
        """Whether ``plan``'s gathers are this lane's views with one selection of blocks, and
        the native copy is still the general path's choice for them."""
        if paged_gather._native is not self.native or not _one_thread():
            return False
        gathers = _present(plan)
        if len(gathers) != len(self.blocks):
            return False
        first = gathers[0]
        return all(g.blocks is b and _same_selection(g, first) for g, b in zip(gathers, self.blocks))

    def fits(self, plan: ExtractionPlan, buffer: torch.Tensor, layout: PayloadLayout) -> bool:
        """Whether :meth:`run` writes what the general path would for this request (``plan``
        already :meth:`reads` this lane's views). A template seen for the first time with this
        many tokens is checked the general path's way (its spans, each tensor's destination)
        and remembered."""
        return self.checks.payload_fits(plan, buffer, layout) and self.checks.selection_fits(_first(plan))

    def run(self, plan: ExtractionPlan, buffer: torch.Tensor, layout: PayloadLayout) -> None:
        """Gather every tensor of ``plan`` into ``buffer`` at ``layout``'s spans (only after
        :meth:`reads` and :meth:`fits` said yes: nothing is checked again here)."""
        first = _first(plan)
        present = self.checks.present(layout)
        spans, base, gather = layout.spans, buffer.data_ptr(), self.native.gather
        n, tail, streaming = first.full_blocks, first.tail_tokens, paged_gather.STREAM_MIN_BYTES
        ids = first.index.address() if n else 0
        tails = self.checks.tails(tail) if tail else None
        last = first.block_ids[n] if tail else 0
        for k, (src, walk, block_bytes) in enumerate(self.full):
            start, nbytes = spans[present[k]]  # type: ignore[misc]  # present: never None
            stream = nbytes >= streaming  # as TensorGather's own copies decide
            if n:
                gather(base + start, src, ids, n, *walk, stream)
            if tails is not None:
                stride = walk[1]
                gather(base + start + n * block_bytes, src + last * stride, 0, 1, 1, stride, *tails[k], stream)


def gather_payload(
    plan: ExtractionPlan,
    buffer: torch.Tensor,
    layout: PayloadLayout,
    lanes: MutableMapping[str, PayloadLane | None] | None = None,
) -> None:
    """Gather every tensor of ``plan`` into ``buffer`` where ``layout`` puts it: through the
    caller's lane (kept in ``lanes``) when ``plan`` reads its cache and the request
    :meth:`~PayloadLane.fits` it, through a new lane of the plan's cache (replacing the one kept)
    when it reads another, else the general way (spans and
    :meth:`~kvferry.adapters.paged_cache.ExtractionPlan.gather_all`). ``lanes``: the caller's
    own mapping (one per sender); None keeps no lane. Raises what the general path raises
    (ConfigError for a destination that does not fit, IndexError for a block id outside the
    cache)."""
    lane = lanes.get(LANE_KEY) if lanes is not None else None
    if lane is None or not lane.reads(plan):
        lane = PayloadLane.of(plan)
        if lanes is not None and lane is not None:
            lanes[LANE_KEY] = lane
    if lane is not None and lane.fits(plan, buffer, layout):
        lane.run(plan, buffer, layout)
        return
    spans = dest_spans(buffer, layout)
    plan.gather_all((spans[: plan.num_layers], spans[plan.num_layers :]))


@attrs.define(eq=False)
class HeadSlices:
    """One request's head slices: slice ``slots[j]`` of ``whole`` (a plan of its cache's
    geometry), each planned by ``slicer`` (:meth:`ExtractionPlan.head_slice`, or a sender's own
    function around it) only when it is asked for (:meth:`plan`) and then kept. A slice lane
    serves a request it knows from ``whole`` alone, so such a request is not sliced at all."""

    whole: ExtractionPlan
    slots: Slots
    slicer: Callable[[ExtractionPlan, int, int], ExtractionPlan] = ExtractionPlan.head_slice
    #: slot -> its sliced plan (shared by :meth:`only`'s subsets)
    _made: dict[Slot, ExtractionPlan] = attrs.field(factory=dict, repr=False)

    @property
    def geometry(self) -> CacheGeometry | None:
        return self.whole.geometry

    def plan(self, j: int) -> ExtractionPlan:
        """Slice ``j``'s plan (what ``slicer`` raises for it, e.g. RoutingError)."""
        slot = self.slots[j]
        made = self._made.get(slot)
        if made is None:
            made = self._made[slot] = self.slicer(self.whole, *slot)
        return made

    def plans(self) -> list[ExtractionPlan]:
        return [self.plan(j) for j in range(len(self.slots))]

    def only(self, picked: Sequence[int]) -> HeadSlices:
        """The slices ``picked`` (indices into :attr:`slots`), sharing the plans made."""
        return HeadSlices(self.whole, tuple(self.slots[j] for j in picked), self.slicer, self._made)


@attrs.define(eq=False)
class SliceLane:
    """The one-pass fan-out gather (:func:`~kvferry.adapters.paged_cache.gather_slices`) of one
    cache's head slices, prepared once per cache and set of slices, as :class:`PayloadLane` is
    for a whole payload.

    ``geometry`` and ``slots`` (the ``(offset_in_shard, num_slices)`` of each slice gathered, in
    order) name what it serves, ``copies`` how many destinations each slice is written to from its
    one read; ``blocks``: the whole tensors' views in wire order (absent layers left out: the
    geometry's sites), compared by identity with a request's whole plan, so a request it serves
    is never sliced (the slices of those views are the geometry's narrowed sites, made once per
    cache and slice); ``calls``: per tensor the split copy's source (slice 0's view), the bytes
    from one slice's view to the next (0 for a single slice), the walk after the destination,
    source, ids and count (``nblocks, block_stride, d0, s0, d1, s1, d2, s2, piece``) and a block's
    bytes; ``checks``: over slice 0's sites (:class:`LaneChecks`)."""

    geometry: CacheGeometry = attrs.field(repr=False)
    slots: Slots
    copies: int
    blocks: tuple[torch.Tensor, ...] = attrs.field(repr=False)
    native: Any = attrs.field(repr=False)
    calls: tuple[tuple[int, int, tuple[int, ...], int], ...] = attrs.field(repr=False)
    checks: LaneChecks

    @classmethod
    def of(cls, slices: HeadSlices, copies: int) -> SliceLane | None:
        """The lane of ``slices`` (their plans are made here, each by
        :meth:`~kvferry.adapters.paged_cache.ExtractionPlan.head_slice` of a plan of the
        geometry's views); None where the general path would not write every tensor with one
        native split copy to host buffers (the slices not equal views of one tensor at a fixed
        distance, more destinations than the native copy takes, torch on more threads), or the
        whole plan is not one selection of blocks over its geometry's views."""
        native = paged_gather._native
        geometry, slots = slices.geometry, slices.slots
        if (
            native is None
            or geometry is None
            or not slots
            or copies < 1
            or len(slots) * copies > paged_gather.MAX_SPLIT
            or (len(slots) == 1 and copies == 1)
            or not _one_thread()
        ):
            return None
        whole = _present(slices.whole)
        per_slot = [_present(p) for p in slices.plans()]
        count = len(whole)
        if not count or any(len(g) != count for g in per_slot):
            return None
        first = whole[0]
        for gather in whole:
            own = geometry.site(gather.layer, gather.which)
            if own is None or own.blocks is not gather.blocks or not _same_selection(gather, first):
                return None
        cpu = torch.device("cpu")
        narrowed = [geometry.head_slice(*slot) for slot in slots]
        calls: list[tuple[int, int, tuple[int, ...], int]] = []
        sites: list[BlockSite] = []
        for k in range(count):
            gathers = [g[k] for g in per_slot]
            views: list[BlockSite] = []
            for sliced, gather in zip(narrowed, gathers):
                pair = sliced[gather.layer] if gather.layer < len(sliced) else ()
                site = pair[0 if gather.which == "key" else 1] if len(pair) == 2 else None
                if (
                    not isinstance(site, BlockSite)
                    or site.blocks is not gather.blocks
                    or gather.layer != whole[k].layer
                    or gather.which != whole[k].which
                    or not _same_selection(gather, first)
                ):
                    return None
                views.append(site)
            layout = views[0].layout(first.tail_tokens)
            if layout is None or gathers[0].choose_method(cpu) != "native":
                return None
            base = views[0].blocks
            stride = views[1].blocks.data_ptr() - base.data_ptr() if len(views) > 1 else 0
            if len(views) > 1 and stride <= 0:
                return None
            for j, view in enumerate(views[1:], 1):  # equal views at a fixed distance (split_stride's test)
                b = view.blocks
                if (
                    b.data_ptr() != base.data_ptr() + j * stride
                    or b.shape != base.shape
                    or b.stride() != base.stride()
                    or b.dtype != base.dtype
                    or view.layout(first.tail_tokens) != layout
                ):
                    return None
            sites.append(views[0])
            walk = (int(base.shape[0]), layout.block_stride, *layout.full)
            calls.append((base.data_ptr(), stride, walk, layout.block_bytes))
        return cls(
            geometry,
            slots,
            copies,
            tuple(g.blocks for g in whole),
            native,
            tuple(calls),
            LaneChecks(
                tuple(sites),
                max(g.dtype.itemsize for g in per_slot[0]),
                min(int(g.blocks.shape[0]) for g in per_slot[0]),
            ),
        )

    def serves(self, slices: HeadSlices, copies: int) -> bool:
        """Whether ``slices`` are this lane's slices of a plan that reads its views with one
        selection of blocks, and the native copy is still the general path's choice for them
        (nothing is sliced to tell)."""
        if (
            slices.geometry is not self.geometry
            or slices.slots != self.slots
            or copies != self.copies
            or paged_gather._native is not self.native
            or not _one_thread()
        ):
            return False
        gathers = _present(slices.whole)
        if len(gathers) != len(self.blocks):
            return False
        first = gathers[0]
        return all(g.blocks is b and _same_selection(g, first) for g, b in zip(gathers, self.blocks))

    def fits(self, slices: HeadSlices, buffers: list[torch.Tensor], layouts: list[PayloadLayout]) -> bool:
        """Whether :meth:`run` writes what the general path would (``slices`` already
        :meth:`serves` this lane): every buffer holds its payload, on the host, its data start
        aligned; every template was checked the general path's way once for this many tokens
        (against its slice's plan, made then); every block id inside every view.
        ``buffers[d]``/``layouts[d]``: destination ``d`` = copy ``d % copies`` of slice
        ``d // copies``."""
        fit, whole, copies = self.checks.payload_fits, slices.whole, self.copies
        for d, (buffer, layout) in enumerate(zip(buffers, layouts)):
            if not fit(whole, buffer, layout, partial(slices.plan, d // copies)):
                return False
        return self.checks.selection_fits(_first(whole))

    def run(self, slices: HeadSlices, buffers: list[torch.Tensor], layouts: list[PayloadLayout]) -> None:
        """Gather every slice into its destinations (only after :meth:`serves` and :meth:`fits`
        said yes): per tensor one split copy of the whole blocks, then each destination's
        partial last block."""
        first = _first(slices.whole)
        positions = self.checks.present
        places = [(buffer.data_ptr(), layout.spans, positions(layout)) for buffer, layout in zip(buffers, layouts)]
        split, gather, copies = self.native.gather_split, self.native.gather, self.copies
        n, tail, streaming = first.full_blocks, first.tail_tokens, paged_gather.STREAM_MIN_BYTES
        ids = first.index.address() if n else 0
        tails = self.checks.tails(tail) if tail else None
        last = first.block_ids[n] if tail else 0
        for k, (src, stride, walk, block_bytes) in enumerate(self.calls):
            dsts = []
            for base, spans, present in places:
                start, nbytes = spans[present[k]]  # type: ignore[misc]  # present: never None
                dsts.append(base + start)
            stream = nbytes >= streaming  # every slice is as large: as TensorGather decides
            if n:
                split(tuple(dsts), stride, src, ids, n, *walk, stream, copies)
            if tails is not None:
                step = walk[1]
                for d, dst in enumerate(dsts):
                    at = src + (d // copies) * stride + last * step
                    gather(dst + n * block_bytes, at, 0, 1, 1, step, *tails[k], stream)


def gather_slice_payloads(
    slices: HeadSlices,
    buffers: list[torch.Tensor],
    layouts: list[PayloadLayout],
    copies: int = 1,
    lanes: MutableMapping[str, Any] | None = None,
) -> None:
    """:func:`~kvferry.adapters.paged_cache.gather_slices` of ``slices`` into payload buffers:
    destination ``d`` (``buffers[d]`` at ``layouts[d]``) gets slice ``d // copies``. Through the
    caller's :class:`SliceLane` (kept in ``lanes``) when the request fits it, a new one when the
    slices or the cache are others, else the general way (every slice planned), which raises
    what it raises."""
    lane = lanes.get(SLICE_LANE_KEY) if lanes is not None else None
    if not isinstance(lane, SliceLane) or not lane.serves(slices, copies):
        lane = SliceLane.of(slices, copies)
        if lanes is not None and lane is not None:
            lanes[SLICE_LANE_KEY] = lane
    if lane is not None and lane.fits(slices, buffers, layouts):
        lane.run(slices, buffers, layouts)
        return
    plans = slices.plans()
    views = [dest_spans(buffer, layout) for buffer, layout in zip(buffers, layouts)]
    dests = [(v[: plans[d // copies].num_layers], v[plans[d // copies].num_layers :]) for d, v in enumerate(views)]
    gather_slices(plans, dests, copies)


def _checked_template(plan: ExtractionPlan, buffer: torch.Tensor, layout: PayloadLayout) -> tuple[int, ...] | None:
    """The positions of the present tensors in ``layout`` when the general path would write
    every tensor of ``plan`` natively where ``layout`` puts it; None otherwise (or the general
    path's ConfigError for a destination that does not fit)."""
    places = dest_spans(buffer, layout)
    tensors = plan.tensors()
    if len(places) != len(tensors) or any((g is None) != (s is None) for g, s in zip(tensors, places)):
        return None  # the general path names what does not match
    present = tuple(i for i, s in enumerate(places) if s is not None)
    for i in present:
        gather, span = tensors[i], places[i]
        assert gather is not None  # present exactly where the spans are
        if type(span) is not HostSpan:
            return None
        gather.check_out(span)  # (the native copy was chosen for each view when the lane was made)
    return present


def _one_thread() -> bool:
    """Torch on as few threads as the general path picks the native copy for."""
    return torch.get_num_threads() <= paged_gather.NATIVE_MAX_THREADS


def _first(plan: ExtractionPlan) -> TensorGather:
    """The plan's first present tensor (a plan has one): it carries the selection all share."""
    return next(g for g in plan.tensors() if g is not None)


def _present(plan: ExtractionPlan) -> list[TensorGather]:
    """The plan's tensors in wire order (keys, then values), absent layers left out."""
    return [g for g in plan.tensors() if g is not None]


def _same_selection(gather: TensorGather, first: TensorGather) -> bool:
    return (
        gather.index is first.index
        and gather.block_ids is first.block_ids
        and gather.full_blocks == first.full_blocks
        and gather.tail_tokens == first.tail_tokens
    )
