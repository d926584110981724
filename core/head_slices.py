"""Head-slice plans for heterogeneous TP (SPEC 2.4), in plain integers.

KV tensors are ``[tokens, heads, head_dim]``; heads are dim 1. With ``H`` KV heads in the full
model, sender rank ``s`` of a stage with TP ``S`` holds heads ``s*H/S .. (s+1)*H/S`` and
receiver rank ``t`` of a stage with TP ``T`` needs heads ``t*H/T .. (t+1)*H/T``.

- Fan-out (``S < T``, ``k = T // S``): receiver ``t`` takes slice ``t % k`` of ``k`` equal
  slices of its sender's shard (:func:`fan_out_slice`, :func:`slice_bounds`).
- Fan-in (``S > T``, ``k = S // T``): receiver ``t`` concatenates the shards of senders
  ``t*k .. t*k+k-1`` along dim 1 in increasing rank order (:func:`merge_order`).
- Equal sizes: shard ``r`` goes unchanged to rank ``r``.

Invariant (property-tested): for every valid topology and head count, slicing then merging
gives every receiver exactly its own contiguous head range, and every head of the model is
delivered to exactly one receiver rank. The tensor adapters apply these integer plans; the
plans themselves never touch tensors.

Which sender sends which heads to which receiver, replicated heads (TP > H) included, is
:func:`kvferry.core.routing.route_heads`; :func:`plan_heads` and :func:`sender_slices` read it.
:func:`fan_out_slice` and :func:`merge_order` are the reference's rank-map view (no head count):
:func:`kvferry.core.routing.reference_routing`, the same rule at a virtual head count of max(S, T).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from kvferry.core.errors import RoutingError
from kvferry.core.routing import HeadSlice, rank_heads, reference_routing, route_heads
from kvferry.core.validate import check_int

__all__ = [
    "TP_HEAD_SLICE_KEY",
    "HeadSlice",
    "TargetHeadPlan",
    "slice_bounds",
    "fan_out_slice",
    "merge_order",
    "sender_slices",
    "plan_heads",
    "tp_head_slice_record",
    "applied_head_slice",
]

#: Metadata key of the tag a sliced payload carries.
TP_HEAD_SLICE_KEY = "tp_head_slice"
_SIDES = ("sender", "receiver")


def slice_bounds(shard_heads: int, offset_in_shard: int, num_slices: int) -> tuple[int, int]:
    """``(start, stop)`` on dim 1 of slice ``offset_in_shard`` of ``num_slices`` equal slices.

    Raises RoutingError for ``num_slices < 1``, an offset outside ``[0, num_slices)`` or a head
    count not divisible by ``num_slices``.
    """
    heads = check_int("shard_heads", shard_heads, 0, RoutingError)
    slices = check_int("num_slices", num_slices, 1, RoutingError)
    offset = check_int("offset_in_shard", offset_in_shard, 0, RoutingError)
    if offset >= slices:
        raise RoutingError(f"offset_in_shard {offset} is outside [0, {slices})")
    if heads % slices:
        raise RoutingError(f"head count {heads} is not divisible by num_slices {slices}")
    width = heads // slices
    return offset * width, (offset + 1) * width


def fan_out_slice(source_tp: int, target_tp: int, target_rank: int) -> tuple[int, int]:
    """``(offset_in_shard, num_slices)`` receiver ``target_rank`` takes from its sender's shard.

    Fan-out: ``(target_rank % k, k)``; equal sizes or fan-in: ``(0, 1)`` (the whole shard). Read
    from :func:`kvferry.core.routing.reference_routing`.
    """
    (first, *_) = reference_routing(source_tp, target_tp).reads(target_rank)
    return first.offset_in_shard, first.num_slices


def merge_order(source_tp: int, target_tp: int, target_rank: int) -> tuple[int, ...]:
    """Sender ranks whose payloads receiver ``target_rank`` concatenates on dim 1, increasing."""
    return reference_routing(source_tp, target_tp).sources(target_rank)


@attrs.frozen
class TargetHeadPlan:
    """What receiver ``target_rank`` ends up with: its head range and the slices, merge order."""

    target_rank: int
    abs_head_start: int
    abs_head_stop: int
    slices: tuple[HeadSlice, ...]

    @property
    def merge_order(self) -> tuple[int, ...]:
        return tuple(s.source_rank for s in self.slices)


def sender_slices(source_tp: int, target_tp: int, num_heads: int, source_rank: int) -> tuple[HeadSlice, ...]:
    """The payloads sender ``source_rank`` produces, one per receiver it feeds, increasing
    (:func:`kvferry.core.routing.route_heads`; none for a replica that serves nobody)."""
    rank = check_int("source_rank", source_rank, 0, RoutingError)
    routing = route_heads(source_tp, target_tp, num_heads)
    if rank >= source_tp:
        raise RoutingError(f"source_rank {rank} is not a sender rank (source_tp={source_tp})")
    return routing.sends(rank)


def plan_heads(source_tp: int, target_tp: int, num_heads: int) -> tuple[TargetHeadPlan, ...]:
    """One :class:`TargetHeadPlan` per receiver rank (index = rank) for ``num_heads`` KV heads
    (:func:`kvferry.core.routing.route_heads`: replicated heads included).

    Raises RoutingError for unmappable sizes or a head count that neither divides nor is
    divisible by a TP size.
    """
    routing = route_heads(source_tp, target_tp, num_heads)
    plans = []
    for target in range(target_tp):
        start, stop = rank_heads(target_tp, num_heads, target)
        plans.append(TargetHeadPlan(target, start, stop, routing.reads(target)))
    return tuple(plans)


def tp_head_slice_record(
    side: str,
    source_rank: int,
    target_rank: int,
    from_tp: int,
    to_tp: int,
    offset_in_shard: int,
    num_slices: int,
) -> dict[str, Any]:
    """The ``tp_head_slice`` metadata tag of a sliced payload (SPEC 2.4); JSON-able.

    ``side`` is ``"sender"`` (sliced before sending) or ``"receiver"`` (sliced on arrival).
    """
    if side not in _SIDES:
        raise RoutingError(f"side must be one of {_SIDES}, got {side!r}")
    slices = check_int("num_slices", num_slices, 1, RoutingError)
    offset = check_int("offset_in_shard", offset_in_shard, 0, RoutingError)
    if offset >= slices:
        raise RoutingError(f"offset_in_shard {offset} is outside [0, {slices})")
    return {
        "applied": True,
        "side": side,
        "target_rank": check_int("target_rank", target_rank, 0, RoutingError),
        "source_rank": check_int("source_rank", source_rank, 0, RoutingError),
        "from_tp": check_int("from_tp", from_tp, 1, RoutingError),
        "to_tp": check_int("to_tp", to_tp, 1, RoutingError),
        "offset_in_shard": offset,
        "num_slices": slices,
    }


def applied_head_slice(metadata: Any) -> Mapping[str, Any] | None:
    """The payload's ``tp_head_slice`` tag when its ``applied`` is truthy, else None.

    A payload with such a tag is never sliced again. Tolerates any metadata shape (remote data).
    """
    if not isinstance(metadata, Mapping):
        return None
    tag = metadata.get(TP_HEAD_SLICE_KEY)
    if isinstance(tag, Mapping) and bool(tag.get("applied")):
        return tag
    return None
