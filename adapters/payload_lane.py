"""A whole payload's native copies, prepared once per cache and payload template.

Gathering a request into a payload buffer the general way costs Python per tensor:
:func:`~kvferry.adapters.torch_frames.dest_spans` makes a span per tensor, then
:meth:`~kvferry.adapters.paged_cache.ExtractionPlan.gather_all` checks each destination,
chooses each tensor's method and prepares its native call. About 5 us a tensor when warm, twice
that after an idle wait, on a model of 28 layers 56 times over (docs/benchmarks.md, "Where the
shm path's time goes"). Almost all of it is the same for every request of a cache: the blocks'
addresses, the walk over a block, where each tensor lies from the payload's data start.

A :class:`PayloadLane` keeps those, made once by the general path's own checks and calls, and
serves every later request that it fits (:meth:`PayloadLane.fits`): the same payload template
(its descriptors, by identity: the same dtypes, shapes and offsets), the same cache views (the
plan's gathers read the lane's blocks, by identity: a cache that changed gets a new geometry and
so new views), one shared selection of blocks, the same split into whole blocks and a tail,
torch still single-threaded (the general path's choice of the native copy) and the native
extension still the one it was made with. A request then costs its block ids' address, one
range check of the ids against every tensor's block count, and the native calls themselves.
Anything it does not fit takes the general path (:func:`gather_payload`), which stays the
reference: the bytes written are the same either way (tests/adapters/test_payload_lane.py).
"""

from __future__ import annotations

from collections.abc import MutableMapping
from typing import Any

import attrs
import torch

from kvferry.adapters import paged_gather
from kvferry.adapters.paged_cache import ExtractionPlan
from kvferry.adapters.paged_gather import HostSpan, TensorGather
from kvferry.adapters.torch_frames import dest_spans
from kvferry.core.header import PayloadLayout

__all__ = ["PayloadLane", "gather_payload", "LANES_KEPT"]

#: Lanes a caller keeps (one per payload template; all dropped when full).
LANES_KEPT = 64


@attrs.frozen(eq=False)
class PayloadLane:
    """The native copies of one payload template over one cache's views (see the module doc).

    ``entries``: the template's descriptors (``layout.header.tensors``, compared by identity);
    ``blocks``: each present tensor's cache view in wire order (by identity); ``full``: per
    tensor ``(offset from the data start, source address, the rest of its whole-block call
    after the block count)``, empty without whole blocks; ``tail``: per tensor ``(offset from
    the data start, cache view address, block stride, the rest of its tail call)``, empty
    without a tail; ``unit``: the widest dtype's size (the data start must be a multiple of it,
    as :func:`~kvferry.adapters.torch_frames.dest_spans` requires for its spans);
    ``min_blocks``: the fewest blocks any tensor's view holds (every id must be below it)."""

    entries: Any = attrs.field(repr=False)
    blocks: tuple[torch.Tensor, ...] = attrs.field(repr=False)
    native: Any = attrs.field(repr=False)
    full_blocks: int
    tail_tokens: int
    full: tuple[tuple[int, int, tuple[Any, ...]], ...] = attrs.field(repr=False)
    tail: tuple[tuple[int, int, int, tuple[Any, ...]], ...] = attrs.field(repr=False)
    unit: int
    min_blocks: int

    @classmethod
    def of(cls, plan: ExtractionPlan, buffer: torch.Tensor, layout: PayloadLayout) -> PayloadLane | None:
        """The lane of ``plan``'s template over its cache, made from the general path's own
        spans, checks and native calls for ``buffer``; None when some tensor would not be
        gathered natively into it, or the plan's tensors do not share one selection of blocks."""
        native = paged_gather._native
        if native is None or torch.get_num_threads() > paged_gather.NATIVE_MAX_THREADS:
            return None  # torch's copies: the general path
        gathers = _present(plan)
        unit = max((g.dtype.itemsize for g in gathers), default=1)
        if not gathers or buffer.device.type != "cpu" or (buffer.storage_offset() + layout.data_start) % unit:
            return None
        first = gathers[0]
        if any(not _same_selection(g, first) for g in gathers):
            return None
        places = dest_spans(buffer, layout)
        tensors = plan.tensors()
        if len(places) != len(tensors) or any((g is None) != (s is None) for g, s in zip(tensors, places)):
            return None  # the general path names what does not match
        spans = [s for s in places if s is not None]
        if any(type(s) is not HostSpan for s in spans):
            return None
        base = buffer.data_ptr() + layout.data_start
        full: list[tuple[int, int, tuple[Any, ...]]] = []
        tail: list[tuple[int, int, int, tuple[Any, ...]]] = []
        for gather, span in zip(gathers, spans):
            gather.check_out(span)
            if gather.choose_method(span.device) != "native":
                return None
            calls = gather.native_calls(span)
            if gather.full_blocks:
                fn, args = calls[0]
                if fn is not native.gather:
                    return None
                full.append((args[0] - base, args[1], args[4:]))
            if gather.tail_tokens:
                fn, args = calls[-1]
                if fn is not native.gather:
                    return None
                stride = args[5]
                tail.append((args[0] - base, gather.blocks.data_ptr(), stride, args[6:]))
        return cls(
            layout.header.tensors,
            tuple(g.blocks for g in gathers),
            native,
            first.full_blocks,
            first.tail_tokens,
            tuple(full),
            tuple(tail),
            unit,
            min(int(g.blocks.shape[0]) for g in gathers),
        )

    def fits(self, plan: ExtractionPlan, buffer: torch.Tensor, layout: PayloadLayout) -> bool:
        """Whether :meth:`run` writes what the general path would for this request."""
        if (
            layout.header.tensors is not self.entries
            or paged_gather._native is not self.native
            or torch.get_num_threads() > paged_gather.NATIVE_MAX_THREADS
            or buffer.device.type != "cpu"
            or buffer.dtype != torch.uint8
            or buffer.dim() != 1
            or (buffer.numel() > 1 and buffer.stride(0) != 1)
            or buffer.numel() < layout.total_nbytes
            or (buffer.storage_offset() + layout.data_start) % self.unit
        ):
            return False
        gathers = _present(plan)
        if len(gathers) != len(self.blocks):
            return False
        first = gathers[0]
        if first.full_blocks != self.full_blocks or first.tail_tokens != self.tail_tokens:
            return False
        for gather, blocks in zip(gathers, self.blocks):
            if gather.blocks is not blocks or not _same_selection(gather, first):
                return False
        picked = first.block_ids[: self.full_blocks + (1 if self.tail_tokens else 0)]
        return not picked or (min(picked) >= 0 and max(picked) < self.min_blocks)

    def run(self, plan: ExtractionPlan, buffer: torch.Tensor, layout: PayloadLayout) -> None:
        """Gather every tensor of ``plan`` into ``buffer`` at ``layout``'s spans (only after
        :meth:`fits` said yes: nothing is checked again here)."""
        first = _present(plan)[0]
        base = buffer.data_ptr() + layout.data_start
        gather = self.native.gather
        if self.full:
            ids, n = first.index.address(), self.full_blocks
            for offset, src, rest in self.full:
                gather(base + offset, src, ids, n, *rest)
        if self.tail:
            last = first.block_ids[self.full_blocks]
            for offset, src, stride, rest in self.tail:
                gather(base + offset, src + last * stride, 0, 1, 1, stride, *rest)


def gather_payload(
    plan: ExtractionPlan,
    buffer: torch.Tensor,
    layout: PayloadLayout,
    lanes: MutableMapping[int, PayloadLane | None] | None = None,
) -> None:
    """Gather every tensor of ``plan`` into ``buffer`` where ``layout`` puts it: through the
    lane kept in ``lanes`` for this template when it :meth:`~PayloadLane.fits`, else through a
    new lane (kept there), else the general way (spans and
    :meth:`~kvferry.adapters.paged_cache.ExtractionPlan.gather_all`). ``lanes``: the caller's
    own (one per sender: a lane holds its cache's views); None keeps none. Raises what the
    general path raises (ConfigError for a destination that does not fit, IndexError for a
    block id outside the cache)."""
    key = id(layout.header.tensors)
    lane = lanes.get(key) if lanes is not None else None
    if torch.get_num_threads() > paged_gather.NATIVE_MAX_THREADS:
        lane = None  # torch's parallel copies: the general path chooses them
    elif lane is None or not lane.fits(plan, buffer, layout):
        lane = PayloadLane.of(plan, buffer, layout)
        if lane is not None and not lane.fits(plan, buffer, layout):
            lane = None  # e.g. an id outside some tensor's blocks: the general path says which
        if lanes is not None and lane is not None:
            if len(lanes) >= LANES_KEPT:
                lanes.clear()
            lanes[key] = lane
    if lane is None:
        spans = dest_spans(buffer, layout)
        plan.gather_all((spans[: plan.num_layers], spans[plan.num_layers :]))
        return
    lane.run(plan, buffer, layout)


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
