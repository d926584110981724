"""A whole transfer plan: every rank of both stages, its keys, ports and head ranges.

The plan only composes the single-source functions (:mod:`~kvferry.core.topology`,
:mod:`~kvferry.core.ids`, :mod:`~kvferry.core.addressing`, :mod:`~kvferry.core.routing`),
so what it prints is what senders and receivers compute. It is what ``kvferry plan`` shows and
what an operator compares when the two stages disagree.

Invariants (property-tested): the keys all senders put equal the keys all receivers get, and
every receive route pulls from the port the sender rank that puts that key binds.
"""

from __future__ import annotations

from typing import Any

import attrs

from kvferry.core.addressing import kv_port, pull_port
from kvferry.core.ids import Stage, recv_keys, send_keys
from kvferry.core.routing import HeadSlice, rank_heads, routing_for
from kvferry.core.topology import TPTopology, validate_sizes

__all__ = ["SENDER", "RECEIVER", "KeyRoute", "RankPlan", "stage_plan", "to_json_records"]

SENDER = "sender"
RECEIVER = "receiver"


@attrs.frozen
class KeyRoute:
    """One payload seen from one rank.

    ``peer_rank`` is the receiver rank (on a sender) or the sender rank (on a receiver; None
    when the key does not name it, as legacy keys do). ``port`` is the sender port that serves
    the key (host-independent). ``heads`` describes the KV heads the payload carries (None when
    the plan was made without a head count).
    """

    key: str
    peer_rank: int | None
    port: int
    heads: HeadSlice | None = None

    def to_json(self, role: str) -> dict[str, Any]:
        peer = "to_rank" if role == SENDER else "from_rank"
        record: dict[str, Any] = {"key": self.key, peer: self.peer_rank, "port": self.port}
        if self.heads is not None:
            h = self.heads
            record.update(
                heads=[h.abs_head_start, h.abs_head_stop],
                shard_heads=[h.head_start, h.head_stop],
                offset_in_shard=h.offset_in_shard,
                num_slices=h.num_slices,
            )
        return record


@attrs.frozen
class RankPlan:
    """Everything one rank of one stage does for a request.

    Senders: ``port`` is the port the rank binds; ``routes`` one per key it puts (receiver
    order). Receivers: ``port`` is None; ``routes`` one per key it gets, in merge order.
    ``head_start:head_stop`` are the rank's absolute KV heads (its shard), None without a head
    count.
    """

    role: str
    stage: str
    tp_rank: int
    tp_size: int
    replica: int
    dp_rank: int
    port: int | None
    routes: tuple[KeyRoute, ...]
    head_start: int | None = None
    head_stop: int | None = None

    @property
    def keys(self) -> tuple[str, ...]:
        return tuple(r.key for r in self.routes)

    @property
    def merge_order(self) -> tuple[int | None, ...]:
        """Peer ranks in route order (for a receiver: the order payloads are concatenated)."""
        return tuple(r.peer_rank for r in self.routes)

    def to_json(self) -> dict[str, Any]:
        """A JSON-able dict (lists, ints, strings, None)."""
        record: dict[str, Any] = {
            "role": self.role,
            "stage": self.stage,
            "tp_rank": self.tp_rank,
            "tp_size": self.tp_size,
            "replica": self.replica,
            "dp_rank": self.dp_rank,
            "port": self.port,
            "heads": None if self.head_start is None else [self.head_start, self.head_stop],
            "keys": [r.to_json(self.role) for r in self.routes],
        }
        if self.role == RECEIVER:
            record["merge_order"] = list(self.merge_order)
        return record


def stage_plan(
    from_stage: Stage,
    to_stage: Stage,
    from_tp: int,
    to_tp: int,
    *,
    num_heads: int | None = None,
    base_port: int,
    replica: int = 0,
    dp_rank: int = 0,
    request_id: str,
) -> tuple[RankPlan, ...]:
    """Plans for every sender rank (``0..from_tp-1``) then every receiver rank (``0..to_tp-1``).

    Sender rank ``r`` binds ``kv_port(base_port, from_stage, r, replica, dp_rank, from_tp)``;
    receivers pull each key from the advertised rank-0 port plus ``source_rank * 16``. With
    ``num_heads``, pairs and head ranges are :func:`~kvferry.core.routing.route_heads`' (a head
    count below a TP size is replicated; a sender replica may put no key). Raises RoutingError
    for unmappable sizes, a head count that does not fit a TP size, or any port out of bounds
    (the message names the field).
    """
    validate_sizes(from_tp, to_tp)
    stage = str(from_stage)
    sender_ports = tuple(kv_port(base_port, from_stage, r, replica, dp_rank, from_tp) for r in range(from_tp))
    advertised = sender_ports[0]
    # one routing value; head slices are shown only when the model's head count is known
    routing = routing_for(from_tp, to_tp, num_heads)
    plans: list[RankPlan] = []
    for rank in range(from_tp):
        topo = TPTopology(from_tp, to_tp, rank)
        keys = send_keys(request_id, from_stage, to_stage, topo, num_heads=num_heads)
        targets = routing.targets(rank)
        slices: tuple[HeadSlice | None, ...] = routing.sends(rank) if num_heads is not None else (None,) * len(targets)
        routes = tuple(
            KeyRoute(key, target, sender_ports[rank], head)
            for key, target, head in zip(keys, targets, slices, strict=True)
        )
        shard = rank_heads(from_tp, num_heads, rank) if num_heads is not None else (None, None)
        plans.append(RankPlan(SENDER, stage, rank, from_tp, replica, dp_rank, sender_ports[rank], routes, *shard))
    to_stage_str = str(to_stage)
    for rank in range(to_tp):
        topo = TPTopology(from_tp, to_tp, rank)
        pairs = recv_keys(request_id, from_stage, to_stage, topo, num_heads=num_heads)
        heads: tuple[HeadSlice | None, ...] = routing.reads(rank) if num_heads is not None else (None,) * len(pairs)
        pulls = tuple(
            KeyRoute(key, src, pull_port(advertised, src, rank), head)
            for (key, src), head in zip(pairs, heads, strict=True)
        )
        own = rank_heads(to_tp, num_heads, rank) if num_heads is not None else (None, None)
        plans.append(RankPlan(RECEIVER, to_stage_str, rank, to_tp, replica, dp_rank, None, pulls, *own))
    return tuple(plans)


def to_json_records(plans: tuple[RankPlan, ...] | list[RankPlan]) -> list[dict[str, Any]]:
    """The plans as a JSON-able list of per-rank dicts (senders first, as planned)."""
    return [p.to_json() for p in plans]
