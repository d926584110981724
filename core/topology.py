"""Tensor-parallel topology between a sender stage and a receiver stage (SPEC 2.1).

A topology pairs the sender stage's TP size (``source_tp``) with the receiver stage's TP size
(``target_tp``) and names one local rank. Each TP rank holds a contiguous ``1/TP`` share of the
KV heads, so the two stages can exchange KV only when the larger size is a multiple of the
smaller. Rank maps:

- equal sizes: sender rank ``r`` <-> receiver rank ``r``;
- fan-in (``source_tp > target_tp``, ``k = source_tp // target_tp``): sender ``r`` feeds
  receiver ``r // k``; receiver ``r`` reads senders ``r*k .. r*k+k-1`` in increasing order;
- fan-out (``source_tp < target_tp``, ``k = target_tp // source_tp``): sender ``r`` feeds
  receivers ``r*k .. r*k+k-1``; receiver ``r`` reads sender ``r // k``.

The maps are :func:`kvferry.core.routing.reference_routing` (the head routing at a virtual head
count of ``max(source_tp, target_tp)``), so there is one routing function.

Invariants (property-tested): the send maps of all sender ranks cover every receiver rank,
send and receive maps are exact inverses, and every (sender, receiver) pair appears once.
"""

from __future__ import annotations

from typing import Any

import attrs

from kvferry.core.errors import RoutingError
from kvferry.core.routing import reference_routing, validate_sizes
from kvferry.core.validate import check_int

__all__ = [
    "TPTopology",
    "validate_topology",
    "validate_sizes",
    "target_ranks",
    "source_ranks",
    "send_rank_map",
    "recv_rank_map",
    "rank_pairs",
]


def _size_validator(instance: Any, attribute: attrs.Attribute[int], value: Any) -> None:
    check_int(attribute.name, value, 1, RoutingError)


def _rank_validator(instance: Any, attribute: attrs.Attribute[int], value: Any) -> None:
    check_int(attribute.name, value, 0, RoutingError)


@attrs.frozen
class TPTopology:
    """``(source_tp, target_tp, local_rank)``: TP sizes (>= 1) of both stages and one rank (>= 0).

    ``local_rank`` is a sender rank when asking :func:`target_ranks` and a receiver rank when
    asking :func:`source_ranks`. Building a topology checks only sizes and rank; divisibility is
    checked by :func:`validate_topology` (and by every rank-map function).
    """

    source_tp: int = attrs.field(validator=_size_validator)
    target_tp: int = attrs.field(validator=_size_validator)
    local_rank: int = attrs.field(default=0, validator=_rank_validator)

    @property
    def is_heterogeneous(self) -> bool:
        """True when the two stages run different TP sizes."""
        return self.source_tp != self.target_tp

    @property
    def ratio(self) -> int:
        """``larger // smaller`` (>= 1): how many ranks of the larger side meet one of the other."""
        return max(self.source_tp, self.target_tp) // min(self.source_tp, self.target_tp)

    @property
    def is_fan_in(self) -> bool:
        """More sender ranks than receiver ranks: a receiver merges ``ratio`` payloads."""
        return self.source_tp > self.target_tp

    @property
    def is_fan_out(self) -> bool:
        """Fewer sender ranks than receiver ranks: each receiver gets a slice of a sender shard."""
        return self.source_tp < self.target_tp

    @property
    def is_legacy(self) -> bool:
        """Both sizes <= 1: the single-rank case whose keys carry no ranks (SPEC 2.2)."""
        return self.source_tp <= 1 and self.target_tp <= 1


def validate_topology(topo: TPTopology) -> None:
    """Raise RoutingError (message contains "divisible" and both sizes) for an unmappable topology."""
    validate_sizes(topo.source_tp, topo.target_tp)


def _feeds(source_tp: int, target_tp: int, sender: int) -> tuple[int, ...]:
    return reference_routing(source_tp, target_tp).targets(sender)


def _reads(source_tp: int, target_tp: int, receiver: int) -> tuple[int, ...]:
    return reference_routing(source_tp, target_tp).sources(receiver)


def target_ranks(topo: TPTopology) -> tuple[int, ...]:
    """Receiver ranks fed by sender rank ``topo.local_rank``, increasing.

    Raises RoutingError for an unmappable topology or a sender rank >= ``source_tp``.
    """
    validate_topology(topo)
    if topo.local_rank >= topo.source_tp:
        raise RoutingError(f"local_rank {topo.local_rank} is not a sender rank (source_tp={topo.source_tp})")
    return _feeds(topo.source_tp, topo.target_tp, topo.local_rank)


def source_ranks(topo: TPTopology) -> tuple[int, ...]:
    """Sender ranks read by receiver rank ``topo.local_rank``, increasing (the merge order).

    Raises RoutingError for an unmappable topology or a receiver rank >= ``target_tp``.
    """
    validate_topology(topo)
    if topo.local_rank >= topo.target_tp:
        raise RoutingError(f"local_rank {topo.local_rank} is not a receiver rank (target_tp={topo.target_tp})")
    return _reads(topo.source_tp, topo.target_tp, topo.local_rank)


def send_rank_map(source_tp: int, target_tp: int) -> dict[int, tuple[int, ...]]:
    """``{sender rank: receiver ranks it feeds}`` for every sender rank."""
    validate_sizes(source_tp, target_tp)
    return {r: _feeds(source_tp, target_tp, r) for r in range(source_tp)}


def recv_rank_map(source_tp: int, target_tp: int) -> dict[int, tuple[int, ...]]:
    """``{receiver rank: sender ranks it reads}`` for every receiver rank."""
    validate_sizes(source_tp, target_tp)
    return {r: _reads(source_tp, target_tp, r) for r in range(target_tp)}


def rank_pairs(source_tp: int, target_tp: int) -> tuple[tuple[int, int], ...]:
    """Every ``(sender rank, receiver rank)`` pair that exchanges a payload, sorted."""
    return tuple((s, t) for s, targets in send_rank_map(source_tp, target_tp).items() for t in targets)
