"""Typed results of the receiving stage's calls on :class:`~kvferry.app.manager.KVTransferManager`.

- :class:`Distribution`: what one rank ended with after receive-and-distribute (SPEC 6): KV,
  no KV, KV dropped because a TP peer missed (SPEC 9.1), or nothing done at all (a dummy
  request, a stage that does not receive). Every rank of the stage gets one per request.
- :class:`Prefetched`: what consuming a prefetch gave (SPEC 7): a payload to apply, a miss (the
  caller receives synchronously), or a payload that was taken but cannot be used (no retry).
- :class:`PrefetchStart`: whether a prefetch was started, and why not.
"""

from __future__ import annotations

import enum

import attrs

from kvferry.app.receive import ReceiveResult
from kvferry.core.outcomes import ReceiveOutcome
from kvferry.core.roles import ReceiveRole

__all__ = ["Distribution", "DistributionStatus", "Prefetched", "PrefetchStatus", "PrefetchStart"]


class DistributionStatus(enum.Enum):
    """How one rank's receive-and-distribute of one request ended."""

    #: This rank holds the request's KV (its own pull, or the leader's, handed over).
    HAS_KV = "has_kv"
    #: No KV on this rank: its receive (or its leader's) missed; every rank of the group agrees.
    NO_KV = "no_kv"
    #: This rank received, but a TP peer did not: every rank dropped its KV (SPEC 9.1).
    DROPPED_BY_CONSENSUS = "dropped_by_consensus"
    #: Nothing was done on any rank: a dummy or empty request id, or a stage that does not
    #: receive KV (the same decision on every rank, so no collective is entered).
    SKIPPED = "skipped"


@attrs.frozen
class Distribution:
    """One rank's result of :meth:`~kvferry.app.manager.KVTransferManager.distribute` or
    :meth:`~kvferry.app.manager.KVTransferManager.receive_and_distribute`.

    ``role``: this rank's receive role in its stage. ``received``: this rank's own receive when
    the manager made it (LOCAL and LEADER ranks of ``receive_and_distribute``; None on followers
    and for ``distribute``); a zero-copy result that ends without KV on this rank has been
    released already, one that ends with KV is the caller's to release (:meth:`release`).
    ``drop``: the counted ``dropped_by_consensus`` outcome, when that is the status.
    """

    request_id: str
    role: ReceiveRole
    status: DistributionStatus
    received: ReceiveResult | None = None
    drop: ReceiveOutcome | None = None

    @property
    def ok(self) -> bool:
        """True when this rank ends with the request's KV applied to the request."""
        return self.status is DistributionStatus.HAS_KV

    def release(self) -> None:
        """Give back the pool buffers this rank's zero-copy receive holds (idempotent)."""
        if self.received is not None:
            self.received.release()


class PrefetchStatus(enum.Enum):
    """What consuming a prefetch gave."""

    #: The prefetch received the payload: apply it.
    HIT = "hit"
    #: Nothing usable was prefetched for this id (none started, another id, a miss, a refusal):
    #: receive synchronously. A refusal the prefetch took is answered by that receive at once.
    MISS = "miss"
    #: The payload was taken from the connector but cannot be used (undecodable, consumed but
    #: failed): it is gone, so there is no synchronous retry; the request runs without KV.
    CONSUMED = "consumed"


@attrs.frozen
class Prefetched:
    """:meth:`~kvferry.app.manager.KVTransferManager.consume_prefetched`'s answer. ``result``:
    the prefetch's receive (None when nothing was prefetched for ``request_id``)."""

    request_id: str
    status: PrefetchStatus
    result: ReceiveResult | None = None

    @property
    def hit(self) -> bool:
        return self.status is PrefetchStatus.HIT


@attrs.frozen
class PrefetchStart:
    """:meth:`~kvferry.app.manager.KVTransferManager.start_prefetch`'s answer. ``reason``:
    ``"ok"`` when started, else why not: ``"shut_down"``, ``"no_request_id"`` or one of
    :func:`kvferry.core.policy.prefetch_allowed`'s reasons (``"disabled"``, ``"follower"``,
    ``"no_sender_info"``, ``"in_flight"``, ``"low_memory"``)."""

    request_id: str
    started: bool
    reason: str
