"""Which sender rank sends which KV heads to which receiver rank, for real models' geometries.

One pure function, :func:`route_heads`, answers it for every pair of TP sizes where the larger
is a multiple of the smaller and every KV head count ``H`` that divides, or is divisible by,
each TP size. What a rank holds is what the engine gives it (:func:`rank_heads`):

- ``TP <= H``: rank ``r`` holds the contiguous heads ``r*H/TP .. (r+1)*H/TP``;
- ``TP > H``: rank ``r`` holds the single head ``r*H // TP``; each head is replicated on
  ``TP/H`` consecutive ranks (vLLM and SGLang do this for Qwen2.5-7B at TP 8, Llama-3.1-70B at
  TP 16, ...).

Routing rule. For each head ``h``, let ``P(h)`` be the sender ranks holding it and ``Q(h)`` the
receiver ranks needing it, both in increasing order. The ``i``-th receiver of ``Q(h)`` takes
``h`` from sender ``P(h)[i * |P(h)| // |Q(h)|]``. Without replication on either side this is the
reference's rank map exactly (fan-out: receiver ``t`` reads sender ``t // k``; fan-in: it reads
senders ``t*k .. t*k+k-1``), so keys and ports are unchanged where the reference worked. With
replicated receivers, the replicas of a sender share its receivers evenly (each serves
``|Q|/|P|``); with replicated senders and fewer receivers of a head than replicas, the first
replica of each block serves, the others send nothing for it (a receiver needs each head once).
One payload carries every head one ``(sender, receiver)`` pair exchanges; that range is
contiguous in both ranks' shards.

The same rule routes an MLA latent (:func:`route_latent`): every rank holds the whole latent,
which is one unsliceable "head" replicated on every rank, so each receiver gets it whole from
exactly one sender and receivers spread over the senders.

The reference's rank map (SPEC 2.1: no head count) is this rule at a virtual head count of
``max(source_tp, target_tp)`` (:func:`reference_routing`): one head per rank of the larger stage,
so nothing is replicated and every pair carries whole ranks' heads. :func:`routing_for` is the one
value every caller reads: the model's head count when it is known, else the reference's map.

Invariants (property-tested over ``H`` in 1..64 and TP sizes 1..16 on both sides): every
receiver gets exactly its heads, each from exactly one sender rank that holds them; no sender
replica idles while another replica of the same head serves more than ``ceil(|Q|/|P|)``
receivers; the pairs the senders send equal the pairs the receivers read; no pair repeats.
"""

from __future__ import annotations

import functools

import attrs

from kvferry.core.errors import RoutingError
from kvferry.core.validate import check_int

__all__ = [
    "HeadSlice",
    "Routing",
    "rank_heads",
    "check_head_count",
    "route_heads",
    "route_latent",
    "latent_source",
    "reference_routing",
    "routing_for",
    "validate_sizes",
]


def validate_sizes(source_tp: int, target_tp: int) -> int:
    """Check that ``source_tp`` and ``target_tp`` (>= 1) can be mapped; return the ratio.

    Raises RoutingError naming the field for a size below 1, and one that says "divisible" and
    names both sizes when the larger is not a multiple of the smaller.
    """
    check_int("source_tp", source_tp, 1, RoutingError)
    check_int("target_tp", target_tp, 1, RoutingError)
    larger, smaller = max(source_tp, target_tp), min(source_tp, target_tp)
    if larger % smaller:
        raise RoutingError(
            f"TP sizes are not divisible: source_tp={source_tp}, target_tp={target_tp} "
            f"(the larger size must be divisible by the smaller)"
        )
    return larger // smaller


@attrs.frozen
class HeadSlice:
    """The heads one payload carries from ``source_rank`` to ``target_rank``.

    ``head_start:head_stop`` index dim 1 of the sender's shard; ``abs_head_*`` index the full
    model's heads; ``recv_head_*`` index dim 1 of the receiver's merged shard. All counts are
    KV heads. ``(offset_in_shard, num_slices)``: the payload is slice ``offset_in_shard`` of
    ``num_slices`` equal slices of the sender's shard; ``(0, 1)`` when nothing is cut.
    """

    source_rank: int
    target_rank: int
    offset_in_shard: int
    num_slices: int
    head_start: int
    head_stop: int
    abs_head_start: int
    abs_head_stop: int
    recv_head_start: int
    recv_head_stop: int

    @property
    def num_heads(self) -> int:
        return self.head_stop - self.head_start

    @property
    def is_sliced(self) -> bool:
        """True when the payload is a part of the sender's shard."""
        return self.num_slices > 1


def check_head_count(source_tp: int, target_tp: int, num_heads: int) -> int:
    """``num_heads`` when the sizes can be mapped and ``num_heads`` divides, or is divisible by,
    each TP size; else RoutingError naming the sizes and the head count."""
    validate_sizes(source_tp, target_tp)
    heads = check_int("num_heads", num_heads, 1, RoutingError)
    for name, tp in (("source_tp", source_tp), ("target_tp", target_tp)):
        if heads % tp and tp % heads:
            raise RoutingError(
                f"num_heads {heads} neither divides nor is divisible by {name} {tp} "
                f"(source_tp={source_tp}, target_tp={target_tp}): a TP rank must hold whole heads "
                f"or one replicated head"
            )
    return heads


def rank_heads(tp_size: int, num_heads: int, rank: int) -> tuple[int, int]:
    """``(start, stop)``: the absolute KV heads rank ``rank`` of a stage with TP ``tp_size`` holds.

    ``tp_size <= num_heads``: ``num_heads / tp_size`` contiguous heads; ``tp_size > num_heads``:
    the one head ``rank * num_heads // tp_size``. RoutingError when ``num_heads`` and ``tp_size``
    do not divide one another or the rank is outside the stage.
    """
    size = check_int("tp_size", tp_size, 1, RoutingError)
    heads = check_int("num_heads", num_heads, 1, RoutingError)
    r = check_int("rank", rank, 0, RoutingError)
    if r >= size:
        raise RoutingError(f"rank {r} is outside the stage (tp_size={size})")
    if heads % size and size % heads:
        raise RoutingError(f"num_heads {heads} neither divides nor is divisible by tp_size {size}")
    if size <= heads:
        width = heads // size
        return r * width, (r + 1) * width
    head = r * heads // size
    return head, head + 1


def _holders(tp_size: int, num_heads: int, head: int) -> range:
    """Ranks of a stage holding ``head`` (increasing)."""
    if tp_size <= num_heads:
        rank = head // (num_heads // tp_size)
        return range(rank, rank + 1)
    replicas = tp_size // num_heads
    return range(head * replicas, (head + 1) * replicas)


@attrs.frozen
class Routing:
    """Every payload of one transfer: ``slices`` sorted by ``(target_rank, abs_head_start)``."""

    source_tp: int
    target_tp: int
    num_heads: int
    slices: tuple[HeadSlice, ...]

    def sends(self, source_rank: int) -> tuple[HeadSlice, ...]:
        """The payloads sender ``source_rank`` puts, in increasing receiver order (maybe none)."""
        rank = check_int("source_rank", source_rank, 0, RoutingError)
        if rank >= self.source_tp:
            raise RoutingError(f"source_rank {rank} is not a sender rank (source_tp={self.source_tp})")
        return tuple(s for s in self.slices if s.source_rank == rank)

    def reads(self, target_rank: int) -> tuple[HeadSlice, ...]:
        """The payloads receiver ``target_rank`` gets, in merge (head) order."""
        rank = check_int("target_rank", target_rank, 0, RoutingError)
        if rank >= self.target_tp:
            raise RoutingError(f"target_rank {rank} is not a receiver rank (target_tp={self.target_tp})")
        return tuple(s for s in self.slices if s.target_rank == rank)

    def targets(self, source_rank: int) -> tuple[int, ...]:
        """Receiver ranks sender ``source_rank`` feeds, increasing."""
        return tuple(s.target_rank for s in self.sends(source_rank))

    def sources(self, target_rank: int) -> tuple[int, ...]:
        """Sender ranks receiver ``target_rank`` reads, in merge order."""
        return tuple(s.source_rank for s in self.reads(target_rank))

    def pairs(self) -> tuple[tuple[int, int], ...]:
        """Every ``(sender, receiver)`` pair that exchanges a payload, sorted."""
        return tuple(sorted((s.source_rank, s.target_rank) for s in self.slices))


@functools.lru_cache(maxsize=256)
def route_heads(source_tp: int, target_tp: int, num_heads: int) -> Routing:
    """The routing of ``num_heads`` KV heads from a TP ``source_tp`` stage to a TP ``target_tp``
    stage (see the module docstring for the rule). RoutingError (naming the sizes and the head
    count) when the sizes cannot be mapped or a head count does not fit a TP size."""
    heads = check_head_count(source_tp, target_tp, num_heads)
    # (source, target) -> absolute heads of that pair, in increasing order
    carried: dict[tuple[int, int], list[int]] = {}
    for head in range(heads):
        senders = _holders(source_tp, heads, head)
        receivers = _holders(target_tp, heads, head)
        for i, target in enumerate(receivers):
            source = senders[i * len(senders) // len(receivers)]
            carried.setdefault((source, target), []).append(head)
    slices = []
    for (source, target), abs_heads in carried.items():
        start, stop = abs_heads[0], abs_heads[-1] + 1
        if stop - start != len(abs_heads):  # the rule always gives contiguous ranges
            raise AssertionError(f"non-contiguous heads {abs_heads} for pair {(source, target)}")
        send_start, send_stop = rank_heads(source_tp, heads, source)
        recv_start, _ = rank_heads(target_tp, heads, target)
        width = stop - start
        slices.append(
            HeadSlice(
                source_rank=source,
                target_rank=target,
                offset_in_shard=(start - send_start) // width,
                num_slices=(send_stop - send_start) // width,
                head_start=start - send_start,
                head_stop=stop - send_start,
                abs_head_start=start,
                abs_head_stop=stop,
                recv_head_start=start - recv_start,
                recv_head_stop=stop - recv_start,
            )
        )
    slices.sort(key=lambda s: (s.target_rank, s.abs_head_start))
    return Routing(source_tp, target_tp, heads, tuple(slices))


def route_latent(source_tp: int, target_tp: int) -> Routing:
    """The routing of an MLA latent: the whole latent, held by every rank, travels to every
    receiver from exactly one sender, receivers spread evenly over the senders (the head rule
    with one head replicated on every rank; no payload is ever a slice)."""
    return route_heads(source_tp, target_tp, 1)


def latent_source(source_tp: int, target_tp: int, target_rank: int) -> int:
    """The one sender rank receiver ``target_rank`` reads the whole MLA latent from (every rank
    holds all of it): ``target_rank // (T / S)`` when ``T >= S`` (each sender serves ``T / S``
    consecutive receivers), ``target_rank * (S / T)`` when ``T < S`` (senders ``0, S/T, 2S/T,
    ...``; the others send nothing). The rule of :func:`route_latent`, in one expression.
    RoutingError for sizes that cannot be mapped or a rank outside the receiving stage."""
    ratio = validate_sizes(source_tp, target_tp)
    check_int("target_rank", target_rank, 0, RoutingError)
    if target_rank >= target_tp:
        raise RoutingError(f"target_rank {target_rank} is not a receiver rank of a TP {target_tp} stage")
    return target_rank // ratio if target_tp >= source_tp else target_rank * ratio


def reference_routing(source_tp: int, target_tp: int) -> Routing:
    """The reference's rank map (SPEC 2.1) and fan-out slices (SPEC 2.4) as a routing:
    :func:`route_heads` at a virtual head count of ``max(source_tp, target_tp)`` (property-tested
    against the SPEC's formulas). RoutingError for sizes that cannot be mapped."""
    validate_sizes(source_tp, target_tp)
    return route_heads(source_tp, target_tp, max(source_tp, target_tp))


def routing_for(source_tp: int, target_tp: int, num_heads: int | None = None) -> Routing:
    """The routing a transfer uses: :func:`route_heads` for the model's ``num_heads`` KV heads,
    or :func:`reference_routing` when the head count is not known."""
    if num_heads is None:
        return reference_routing(source_tp, target_tp)
    return route_heads(source_tp, target_tp, num_heads)
