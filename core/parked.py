"""The parked-get table: gets that wait at a sender for a key not published yet.

Pure bookkeeping shared by every serving connector (zmq, shm, mooncake): times are passed in (seconds
of any monotonic origin); the table holds the caller's waiter objects (a reply address, a request
id) and never does I/O. One thread owns a table (a connector's serving thread); it is not locked.

- :meth:`ParkedTable.park` files a waiter under its key with ``deadline = now + wait_s``; with
  ``max_parked`` set, a full table refuses (``None``) and the caller answers "busy".
- :meth:`ParkedTable.serve` walks a key's waiters oldest first after that key was published: a
  waiter past its deadline is taken out and returned as timed out; the others are offered to the
  caller's ``offer(waiter) -> bool`` until one is refused (nothing more to hand out for that key).
- :meth:`ParkedTable.expire` takes out every waiter whose deadline has passed;
  :meth:`ParkedTable.drain` takes out all of them (the server is closing).
- :meth:`ParkedTable.next_deadline` is the earliest deadline of a waiter still parked: the only
  timer a serving loop needs (its poll timeout).

Invariants (property-tested): every parked waiter leaves the table exactly once, through exactly
one of serve (served or timed out), expire or drain; a key's waiters are served in the order they
parked; ``expire(now)`` returns exactly the parked waiters whose deadline is ``<= now``;
``len(table)`` is the number parked; ``next_deadline()`` is the least deadline parked, or None.

A get that finds nothing says why with one of :data:`MISS_REASONS` (:class:`MissReason`).
"""

from __future__ import annotations

import collections
import heapq
from collections.abc import Callable
from typing import Generic, TypeVar

import attrs

from kvferry.core.errors import ConfigError
from kvferry.core.validate import check_int, check_seconds

__all__ = ["MISS_REASONS", "MissReason", "Parked", "ParkedTable"]

W = TypeVar("W")


class MissReason:
    """Why a get at a sender found nothing (plain strings, JSON-able, on every connector's wire)."""

    NOT_FOUND = "not_found"  #: never published here, or every permitted reader took it already
    EXPIRED = "expired"  #: published, but its lease passed before anybody read it
    TIMEOUT = "timeout"  #: the get waited its whole ``wait_s`` and the key did not come
    CLOSING = "closing"  #: the sender is shutting down; parked gets are answered with this


#: The closed set of miss reasons, in the order above.
MISS_REASONS: tuple[str, ...] = (MissReason.NOT_FOUND, MissReason.EXPIRED, MissReason.TIMEOUT, MissReason.CLOSING)


@attrs.define(eq=False)
class Parked(Generic[W]):
    """One waiting get: the caller's ``waiter``, its ``key`` and ``deadline`` (seconds)."""

    key: str
    deadline: float
    waiter: W
    done: bool = False


@attrs.define(eq=False)
class ParkedTable(Generic[W]):
    """Waiting gets by key (oldest first) with their deadlines; see the module docstring.

    ``max_parked``: most waiters at once (None: no bound).
    """

    max_parked: int | None = None
    _by_key: dict[str, collections.deque[Parked[W]]] = attrs.field(init=False, factory=dict)
    _heap: list[tuple[float, int, Parked[W]]] = attrs.field(init=False, factory=list)
    _seq: int = attrs.field(init=False, default=0)
    _count: int = attrs.field(init=False, default=0)

    def __attrs_post_init__(self) -> None:
        if self.max_parked is not None:
            check_int("max_parked", self.max_parked, 1, ConfigError)

    def __len__(self) -> int:
        return self._count

    def keys(self) -> tuple[str, ...]:
        """Keys with at least one waiter."""
        return tuple(self._by_key)

    def park(self, key: str, waiter: W, now: float, wait_s: float) -> Parked[W] | None:
        """File ``waiter`` under ``key`` until ``now + wait_s``; None when the table is full."""
        check_seconds("wait_s", wait_s, ConfigError)
        if self.max_parked is not None and self._count >= self.max_parked:
            return None
        parked = Parked(key, now + wait_s, waiter)
        self._by_key.setdefault(key, collections.deque()).append(parked)
        self._seq += 1
        heapq.heappush(self._heap, (parked.deadline, self._seq, parked))
        self._count += 1
        return parked

    def serve(self, key: str, now: float, offer: Callable[[W], bool]) -> list[Parked[W]]:
        """``key`` was published: offer it to its waiters, oldest first, until ``offer`` returns
        False. Served waiters leave the table; those past their deadline leave it too and are
        returned (the caller answers them "timeout"); the rest keep waiting."""
        queue = self._by_key.get(key)
        timed_out: list[Parked[W]] = []
        while queue:
            parked = queue[0]
            if parked.deadline <= now:
                timed_out.append(parked)
            elif not offer(parked.waiter):
                break
            queue.popleft()
            self._leave(parked)
        if queue is not None and not queue:
            del self._by_key[key]
        return timed_out

    def expire(self, now: float) -> list[Parked[W]]:
        """Take out and return every waiter whose deadline is ``<= now``, earliest first."""
        out: list[Parked[W]] = []
        while self._heap and self._heap[0][0] <= now:
            parked = heapq.heappop(self._heap)[2]
            if parked.done:
                continue
            self._remove(parked)
            out.append(parked)
        return out

    def drain(self) -> list[Parked[W]]:
        """Take out and return every waiter (the server is closing), oldest deadline first."""
        out = [p for _, _, p in sorted(self._heap, key=lambda item: (item[0], item[1])) if not p.done]
        for parked in out:
            parked.done = True
        self._by_key.clear()
        self._heap.clear()
        self._count = 0
        return out

    def next_deadline(self) -> float | None:
        """The earliest deadline of a waiter still parked, or None."""
        while self._heap and self._heap[0][2].done:
            heapq.heappop(self._heap)
        return self._heap[0][0] if self._heap else None

    def seconds_to_next(self, now: float) -> float | None:
        """Seconds from ``now`` to :meth:`next_deadline` (>= 0), or None."""
        deadline = self.next_deadline()
        return None if deadline is None else max(0.0, deadline - now)

    def _leave(self, parked: Parked[W]) -> None:
        parked.done = True
        self._count -= 1

    def _remove(self, parked: Parked[W]) -> None:
        queue = self._by_key.get(parked.key)
        if queue is not None:
            queue.remove(parked)
            if not queue:
                del self._by_key[parked.key]
        self._leave(parked)
