"""The lease table: what a pool published under which key, its readers, tickets and leases.

Pure bookkeeping (times passed in, in seconds of any monotonic origin; sizes in bytes).

- ``readers`` gets may take a payload (default 1); each take hands out a :class:`Ticket` that
  the reader releases when it is done with the bytes. A payload is freed once no reader may
  take it any more *and* every ticket was released.
- An unread payload expires at ``created_s + lease_s``.
- A ticket not released within ``hold_s`` of its take is *overdue*. What happens then depends
  on who holds it. A ticket taken without a holder (``holder=None``), or any ticket when the
  caller of :meth:`LeaseTable.expire` gives no liveness test, is revoked: its reader is
  presumed dead. A ticket whose holder the caller's ``holder_alive`` reports alive is never
  revoked (the reader may still be reading the bytes in place: reusing them would corrupt its
  data silently); it is reported once as ``"overdue"`` and asked about again at every later
  :meth:`LeaseTable.expire`, and revoked once its holder is gone.
- A key its sender will never publish may carry a failure record (:meth:`LeaseTable.fail`, a
  tombstone): no entry, no space; :meth:`LeaseTable.status` says ``"failed"`` and
  :meth:`LeaseTable.failure` returns the record until the key is published or forgotten.
- A late or duplicate reader gets ``None`` ("not found"); tickets name entries by a serial
  number, never by key, so a late release can never touch a payload published later under the
  same key.

Every name here is also importable from :mod:`kvferry.core.pool`.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable
from typing import Any

import attrs

from kvferry.core.errors import ConfigError, RoutingError
from kvferry.core.ids import parse_connector_key, parse_legacy_key
from kvferry.core.recent import Recent
from kvferry.core.validate import check_int, check_seconds

__all__ = [
    "EntryState",
    "ExpiryKind",
    "request_id_of_key",
    "LeaseEntry",
    "Ticket",
    "Expiry",
    "LeaseTable",
]


class EntryState:
    """States of a lease-table entry (plain strings, JSON-able)."""

    PUBLISHED = "published"  #: readable: ``readers_left > 0`` and not past its lease
    DRAINED = "drained"  #: every reader took it; waiting for outstanding releases
    EXPIRED = "expired"  #: the lease passed with readers left; waiting for releases
    DROPPED = "dropped"  #: removed by drop_key / drop_request; waiting for releases
    FAILED = "failed"  #: never published: its sender recorded a failure (:meth:`LeaseTable.failure`)
    FREED = "freed"  #: gone; its region (if any) was returned to the allocator


class ExpiryKind:
    """What :meth:`LeaseTable.expire` reports (plain strings, JSON-able)."""

    UNREAD = "unread"  #: the lease passed with readers left
    UNRELEASED = "unreleased"  #: ticket(s) past ``hold_s`` were revoked (holder gone or unknown)
    OVERDUE = "overdue"  #: ticket(s) past ``hold_s`` whose holder lives: kept, reported once


def request_id_of_key(key: str) -> str:
    """The request id a connector key belongs to (legacy or rank-aware format), else the key."""
    try:
        return parse_legacy_key(key).request_id
    except RoutingError:
        pass
    try:
        return parse_connector_key(key).request_id
    except RoutingError:
        return key


@attrs.frozen
class LeaseEntry:
    """A snapshot of one published payload. ``handle`` is the caller's (a Region, an object)."""

    entry_id: int
    key: str
    request_id: str
    handle: Any
    size: int
    readers: int
    readers_left: int
    outstanding: int
    created_s: float
    lease_s: float
    state: str

    @property
    def deadline_s(self) -> float:
        """When unread readers are dropped (``created_s + lease_s``)."""
        return self.created_s + self.lease_s


@attrs.frozen
class Ticket:
    """One reader's hold on a payload; release it by ``ticket_id`` when done with the bytes.

    ``holder`` is whatever the caller passed to :meth:`LeaseTable.take` (None: unknown)."""

    ticket_id: int
    entry_id: int
    key: str
    handle: Any
    size: int
    taken_s: float
    holder: Any = None


@attrs.frozen
class Expiry:
    """What :meth:`LeaseTable.expire` did to one entry. ``kind``: an :class:`ExpiryKind` value.
    ``freed``: the entry is gone now and its handle may be reused (never for ``overdue``).
    ``holders``: the holders of the tickets this report is about (revoked or overdue)."""

    entry: LeaseEntry
    kind: str
    freed: bool
    holders: tuple[Any, ...] = ()


@attrs.define(eq=False)
class _Hold:
    taken_s: float
    holder: Any
    overdue: bool = False


@attrs.define(eq=False)
class _Record:
    entry_id: int
    key: str
    request_id: str
    handle: Any
    size: int
    readers: int
    readers_left: int
    created_s: float
    lease_s: float
    state: str = EntryState.PUBLISHED
    tickets: dict[int, _Hold] = attrs.Factory(dict)

    def snapshot(self) -> LeaseEntry:
        return LeaseEntry(
            self.entry_id,
            self.key,
            self.request_id,
            self.handle,
            self.size,
            self.readers,
            self.readers_left,
            len(self.tickets),
            self.created_s,
            self.lease_s,
            self.state,
        )


def _hold_validator(instance: Any, attribute: attrs.Attribute[float | None], value: Any) -> None:
    if value is not None:
        check_seconds("hold_s", value)


@attrs.define(eq=False)
class LeaseTable:
    """Published payloads by key, their readers, tickets and leases (see the module doc).

    ``hold_s`` bounds how long a reader may keep a ticket before it is overdue (None: the
    entry's ``lease_s``). ``history`` bounds how many gone keys are remembered for
    :meth:`status` (oldest forgotten).
    """

    hold_s: float | None = attrs.field(
        default=None, validator=_hold_validator, on_setattr=attrs.setters.frozen
    )  # fixed: the deadlines of tickets already taken were computed with it
    history: int = attrs.field(default=4096, validator=lambda _, a, v: check_int(a.name, v, 1))
    _by_key: dict[str, _Record] = attrs.field(init=False, factory=dict)
    #: request id -> its readable keys, in publication order (what ``drop_request`` drops)
    _by_request: dict[str, dict[str, None]] = attrs.field(init=False, factory=dict)
    _held: dict[int, _Record] = attrs.field(init=False, factory=dict)  # entry_id -> not freed
    _tickets: dict[int, _Record] = attrs.field(init=False, factory=dict)
    #: why each of the last ``history`` gone keys left (what :meth:`status` answers for them)
    _gone: Recent[str, str] = attrs.field(
        init=False, default=attrs.Factory(lambda table: Recent(table.history), takes_self=True)
    )
    _failures: dict[str, Any] = attrs.field(init=False, factory=dict)
    _next_id: int = attrs.field(init=False, default=1)
    #: ``(time, entry_id, ticket_id)``: when an unread lease (ticket 0) or a ticket's hold runs
    #: out. Stale items (released, drained, already handled) stay until they reach the top or
    #: the heap is rebuilt; :meth:`_deadline_live` tells them apart.
    _deadlines: list[tuple[float, int, int]] = attrs.field(init=False, factory=list)
    #: Entries holding a ticket reported overdue (asked about again at every :meth:`expire`).
    _overdue: dict[int, None] = attrs.field(init=False, factory=dict)

    def __len__(self) -> int:
        """Entries not yet freed (readable or waiting for releases)."""
        return len(self._held)

    def _serial(self) -> int:
        value = self._next_id
        self._next_id += 1
        return value

    def _forget_later(self, key: str, why: str) -> None:
        self._failures.pop(key, None)
        for oldest in self._gone.note(key, why):
            self._failures.pop(oldest, None)

    def _unlist(self, record: _Record, state: str) -> None:
        """Stop new takes of ``record`` (it leaves the key map); remember why."""
        if self._by_key.get(record.key) is record:
            del self._by_key[record.key]
            self._unindex(record)
            self._forget_later(record.key, state)
        record.state = state

    def _index(self, record: _Record) -> None:
        self._by_key[record.key] = record
        self._by_request.setdefault(record.request_id, {})[record.key] = None

    def _unindex(self, record: _Record) -> None:
        keys = self._by_request.get(record.request_id)
        if keys is not None:
            keys.pop(record.key, None)
            if not keys:
                del self._by_request[record.request_id]

    def _free_if_done(self, record: _Record) -> bool:
        if record.tickets or record.state == EntryState.PUBLISHED:
            return False
        record.state = EntryState.FREED
        self._held.pop(record.entry_id, None)
        return True

    def _hold_of(self, record: _Record) -> float:
        return self.hold_s if self.hold_s is not None else record.lease_s

    # Deadlines: expiry visits only the entries something is due on (a heap of lease and hold
    # ends) and those with overdue tickets, so a reserve costs the same with 10 payloads
    # waiting for their readers as with 10 000.
    def _add_deadline(self, at_s: float, entry_id: int, ticket_id: int = 0) -> None:
        heap = self._deadlines
        heapq.heappush(heap, (at_s, entry_id, ticket_id))
        if len(heap) > 64 + 2 * (len(self._held) + len(self._tickets)):  # mostly stale: rebuild
            self._deadlines = [d for d in heap if self._deadline_live(d)]
            heapq.heapify(self._deadlines)

    def _deadline_live(self, deadline: tuple[float, int, int]) -> bool:
        """Whether ``deadline`` still stands: its entry is held, and it is the entry's unread
        lease while the entry is readable, or a ticket not yet released nor reported overdue."""
        at_s, entry_id, ticket_id = deadline
        record = self._held.get(entry_id)
        if record is None:
            return False
        if not ticket_id:
            return record.state == EntryState.PUBLISHED and record.created_s + record.lease_s == at_s
        held = record.tickets.get(ticket_id)
        return held is not None and not held.overdue and held.taken_s + self._hold_of(record) == at_s

    def _due(self, now_s: float) -> list[_Record]:
        """The entries :meth:`expire` must look at: a deadline passed, or an overdue ticket;
        in publication order (the order a scan of every entry gives)."""
        heap, due = self._deadlines, dict.fromkeys(self._overdue)
        while heap and heap[0][0] <= now_s:
            deadline = heapq.heappop(heap)
            if self._deadline_live(deadline):
                due[deadline[1]] = None
        return [self._held[i] for i in sorted(due) if i in self._held]

    def publish(
        self,
        key: str,
        handle: Any,
        size: int,
        *,
        readers: int = 1,
        now_s: float,
        lease_s: float,
        request_id: str | None = None,
    ) -> LeaseEntry:
        """Publish ``handle`` under ``key`` for ``readers`` takes until ``now_s + lease_s``.

        Raises ConfigError when ``key`` is already readable (drop it first to replace it), or
        for a non-string key, ``readers < 1``, ``size < 0`` or a non-positive lease.
        """
        if not isinstance(key, str):
            raise ConfigError(f"key must be a string, got {type(key).__name__}")
        check_int("readers", readers, 1)
        check_int("size", size, 0)
        lease = check_seconds("lease_s", lease_s)
        if key in self._by_key:
            raise ConfigError(f"key {key!r} is already published")
        rid = request_id if request_id is not None else request_id_of_key(key)
        record = _Record(self._serial(), key, rid, handle, size, readers, readers, float(now_s), lease)
        self._index(record)
        self._held[record.entry_id] = record
        self._add_deadline(record.created_s + lease, record.entry_id)
        self._gone.pop(key, None)
        self._failures.pop(key, None)
        return record.snapshot()

    def take(self, key: str, now_s: float, holder: Any = None) -> Ticket | None:
        """One reader takes ``key``: a Ticket, or None when absent, consumed or past its lease.

        ``holder`` names the reader for :meth:`expire`'s liveness test (None: unknown, so an
        overdue ticket is revoked). The last permitted reader removes the key from lookup
        (later readers get None); the payload stays held until every ticket is released.
        """
        record = self._by_key.get(key)
        if record is None or now_s >= record.created_s + record.lease_s:
            return None
        record.readers_left -= 1
        ticket = Ticket(self._serial(), record.entry_id, key, record.handle, record.size, now_s, holder)
        record.tickets[ticket.ticket_id] = _Hold(float(now_s), holder)
        self._tickets[ticket.ticket_id] = record
        self._add_deadline(float(now_s) + self._hold_of(record), record.entry_id, ticket.ticket_id)
        if record.readers_left == 0:
            self._unlist(record, EntryState.DRAINED)
        return ticket

    def release(self, ticket_id: int) -> LeaseEntry | None:
        """Release a ticket (idempotent). Returns the entry's snapshot when this freed it."""
        record = self._tickets.pop(ticket_id, None)
        if record is None:
            return None
        record.tickets.pop(ticket_id, None)
        if self._free_if_done(record):
            return record.snapshot()
        return None

    def give_back(self, ticket_id: int, now_s: float) -> LeaseEntry | None:
        """Release a ticket whose read failed, and give its reader slot back (idempotent): the
        key is readable again (relisted if that read had drained it) while its lease lasts and
        no newer payload took the key; otherwise the same as :meth:`release`. Returns the
        entry's snapshot when this freed it."""
        record = self._tickets.pop(ticket_id, None)
        if record is None:
            return None
        record.tickets.pop(ticket_id, None)
        readable = now_s < record.created_s + record.lease_s
        if readable and record.state == EntryState.PUBLISHED:
            record.readers_left += 1
        elif readable and record.state == EntryState.DRAINED and record.key not in self._by_key:
            record.readers_left += 1
            record.state = EntryState.PUBLISHED
            self._index(record)
            self._gone.pop(record.key, None)
            self._add_deadline(record.created_s + record.lease_s, record.entry_id)
        if self._free_if_done(record):
            return record.snapshot()
        return None

    def expire(self, now_s: float, holder_alive: Callable[[Any], bool] | None = None) -> tuple[Expiry, ...]:
        """Drop unread readers past their lease; deal with tickets held past ``hold_s``.

        An overdue ticket is revoked unless it has a holder and ``holder_alive(holder)`` is
        true; then it is kept and reported once (``overdue``), and its holder is asked again
        at every later call (once per holder and call, however many tickets it holds). Each
        transition is reported once; only ``freed`` entries may have their handle reused.
        """
        out: list[Expiry] = []
        asked: dict[int, bool] = {}  # holder id -> alive, asked once per call

        def lives(holder: Any) -> bool:
            key = id(holder)
            if key not in asked:
                asked[key] = bool(holder_alive(holder))  # type: ignore[misc]
            return asked[key]

        for record in self._due(now_s):
            kind = ""
            if record.state == EntryState.PUBLISHED and now_s >= record.created_s + record.lease_s:
                self._unlist(record, EntryState.EXPIRED)
                kind = ExpiryKind.UNREAD
            hold = self._hold_of(record)
            revoked: list[int] = []
            overdue: list[Any] = []
            for ticket_id, held in record.tickets.items():
                if now_s < held.taken_s + hold:
                    continue
                if held.holder is not None and holder_alive is not None and lives(held.holder):
                    if not held.overdue:
                        held.overdue = True
                        overdue.append(held.holder)
                    continue
                revoked.append(ticket_id)
            gone = tuple(record.tickets[t].holder for t in revoked)
            for ticket_id in revoked:
                del record.tickets[ticket_id]
                del self._tickets[ticket_id]
            if revoked and not kind:
                kind = ExpiryKind.UNRELEASED
            if kind:
                freed = self._free_if_done(record)
                out.append(Expiry(record.snapshot(), kind, freed, gone))
            if overdue:
                out.append(Expiry(record.snapshot(), ExpiryKind.OVERDUE, False, tuple(overdue)))
            if record.state != EntryState.FREED and any(h.overdue for h in record.tickets.values()):
                self._overdue[record.entry_id] = None
            else:
                self._overdue.pop(record.entry_id, None)
        return tuple(out)

    def overdue_count(self) -> int:
        """Tickets kept past ``hold_s`` because their holder lives (reported ``overdue``)."""
        held = (self._held.get(i) for i in self._overdue)
        return sum(h.overdue for r in held if r is not None for h in r.tickets.values())

    def _drop(self, records: Iterable[_Record]) -> tuple[LeaseEntry, ...]:
        freed = []
        for record in records:
            if record.state == EntryState.PUBLISHED:
                self._unlist(record, EntryState.DROPPED)
            if self._free_if_done(record):
                freed.append(record.snapshot())
        return tuple(freed)

    def drop_key(self, key: str) -> tuple[LeaseEntry, ...]:
        """Make ``key`` unreadable now. Returns entries freed by this (outstanding tickets stay
        valid until released)."""
        record = self._by_key.get(key)
        return self._drop([record] if record is not None else [])

    def drop_request(self, request_id: str) -> tuple[LeaseEntry, ...]:
        """Make every readable key of ``request_id`` unreadable; returns entries freed now."""
        return self._drop([self._by_key[k] for k in self._by_request.get(request_id, ())])

    def fail(self, key: str, failure: Any) -> bool:
        """Record that ``key`` will never be published (``failure``: the sender's record, a
        :class:`~kvferry.core.tombstones.SenderFailure`). A readable payload under ``key`` wins
        (False, nothing recorded); otherwise True: ``status(key)`` is ``"failed"`` and
        :meth:`failure` returns the record until the key is published or forgotten (the same
        ``history`` bound as every gone key). Takes no entry and no space."""
        if not isinstance(key, str):
            raise ConfigError(f"key must be a string, got {type(key).__name__}")
        if key in self._by_key:
            return False
        self._forget_later(key, EntryState.FAILED)
        self._failures[key] = failure
        return True

    def failure(self, key: str) -> Any | None:
        """The failure record of ``key`` (:meth:`fail`), or None."""
        return self._failures.get(key)

    def status(self, key: str) -> str:
        """``"published"``, or why it is gone (``"drained"``, ``"expired"``, ``"dropped"``,
        ``"failed"``), or ``"unknown"`` (never published, or forgotten beyond ``history``)."""
        if key in self._by_key:
            return EntryState.PUBLISHED
        return self._gone.get(key) or "unknown"

    def entry(self, key: str) -> LeaseEntry | None:
        """Snapshot of the readable entry under ``key``, if any."""
        record = self._by_key.get(key)
        return record.snapshot() if record is not None else None

    def entries(self) -> tuple[LeaseEntry, ...]:
        """Snapshots of every entry not yet freed, in publication order."""
        return tuple(r.snapshot() for r in self._held.values())

    def readable_keys(self) -> tuple[str, ...]:
        return tuple(self._by_key)

    def next_deadline(self) -> float | None:
        """Earliest time at which :meth:`expire` would do something (None: nothing pending).

        Tickets already reported ``overdue`` add no deadline: whoever holds them is asked
        about again at every :meth:`expire`, on the caller's own schedule."""
        heap = self._deadlines
        while heap and not self._deadline_live(heap[0]):
            heapq.heappop(heap)
        return heap[0][0] if heap else None
