"""Sender-side pool bookkeeping: a region allocator and a lease table (pure; time passed in).

A connector that keeps payloads in one fixed-size buffer (an in-process tensor, a shared-memory
segment, a registered RDMA region) uses three pieces from here:

- :class:`RegionAllocator` hands out aligned, non-overlapping byte ranges of a pool of
  ``capacity`` bytes (best fit over a coalescing free list). A request that can never fit is
  ``too_large``; one that does not fit *now* is ``pool_full`` (back-pressure, retry after a
  release).
- :class:`LeaseTable` tracks what was published under which key: ``readers`` gets may take a
  payload (default 1); each take hands out a :class:`Ticket` that the reader releases when it is
  done with the bytes. A payload is freed once no reader may take it any more *and* every ticket
  was released. An unread payload expires at ``created_s + lease_s``; a ticket not released
  within ``hold_s`` of its take is revoked (the reader is presumed dead). A late or duplicate
  reader gets ``None`` ("not found"); tickets name entries by a serial number, never by key, so
  a late release can never touch another payload published later under the same key.
- :class:`PoolLedger` joins the two: regions are freed exactly when their entry is freed.

Units: offsets and sizes in bytes, times in seconds (any monotonic origin, passed in by the
caller). Nothing here reads a clock, allocates memory for payloads, or logs.
"""

from __future__ import annotations

import bisect
from typing import Any, Iterable

import attrs

from kvferry.core.errors import ConfigError, RoutingError
from kvferry.core.ids import parse_connector_key, parse_legacy_key

__all__ = [
    "DEFAULT_ALIGNMENT",
    "POOL_FULL",
    "TOO_LARGE",
    "EntryState",
    "Region",
    "AllocationFailure",
    "RegionAllocator",
    "aligned_span",
    "request_id_of_key",
    "LeaseEntry",
    "Ticket",
    "Expiry",
    "LeaseTable",
    "PoolLedger",
]

#: Default alignment of region offsets and spans, in bytes (a cache line; fine for every dtype).
DEFAULT_ALIGNMENT = 64
#: Failure reason: the pool has no hole large enough right now (retry after a release).
POOL_FULL = "pool_full"
#: Failure reason: the request is larger than the whole usable pool (never fits).
TOO_LARGE = "too_large"


class EntryState:
    """States of a lease-table entry (plain strings, JSON-able)."""

    PUBLISHED = "published"  #: readable: ``readers_left > 0`` and not past its lease
    DRAINED = "drained"  #: every reader took it; waiting for outstanding releases
    EXPIRED = "expired"  #: the lease passed with readers left; waiting for releases
    DROPPED = "dropped"  #: removed by drop_key / drop_request; waiting for releases
    FREED = "freed"  #: gone; its region (if any) was returned to the allocator


def _check_int(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{name} must be an integer, got {value!r}")
    if value < minimum:
        raise ConfigError(f"{name} must be >= {minimum}, got {value}")
    return value


def _check_seconds(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ConfigError(f"{name} must be a positive number of seconds, got {value!r}")
    if value != value or value == float("inf"):
        raise ConfigError(f"{name} must be finite, got {value!r}")
    return float(value)


def aligned_span(nbytes: int, alignment: int = DEFAULT_ALIGNMENT) -> int:
    """Bytes a region of ``nbytes`` occupies: rounded up to ``alignment``, at least one unit.

    Zero-byte payloads still take one unit so that every live region has a distinct offset.
    """
    _check_int("nbytes", nbytes, 0)
    _check_int("alignment", alignment, 1)
    units = max(1, -(-nbytes // alignment))
    return units * alignment


@attrs.frozen
class Region:
    """A byte range of the pool: ``[offset, offset + span)``; the payload uses ``nbytes`` of it.

    ``offset`` and ``span`` are multiples of the allocator's alignment; ``nbytes <= span``.
    """

    offset: int
    nbytes: int
    span: int

    @property
    def end(self) -> int:
        """One past the last byte of the reserved span."""
        return self.offset + self.span


@attrs.frozen
class AllocationFailure:
    """Why an allocation failed: ``reason`` is :data:`POOL_FULL` or :data:`TOO_LARGE`."""

    reason: str
    requested: int
    free_bytes: int
    largest_free: int
    capacity: int

    @property
    def detail(self) -> str:
        """Human text for logs and ``put`` metadata."""
        if self.reason == TOO_LARGE:
            return f"payload of {self.requested} bytes exceeds the pool ({self.capacity} bytes)"
        return (
            f"pool full: {self.requested} bytes requested, {self.free_bytes} free "
            f"(largest hole {self.largest_free}) of {self.capacity}"
        )


def _alignment_validator(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    _check_int("alignment", value, 1)
    if value & (value - 1):
        raise ConfigError(f"alignment must be a power of two, got {value}")


def _capacity_validator(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    _check_int("capacity", value, 1)


@attrs.define(eq=False)
class RegionAllocator:
    """Best-fit allocator over ``[0, usable_bytes)`` with a sorted, coalescing free list.

    Invariants (property-tested): live regions never overlap and lie inside the pool; offsets
    and spans are multiples of ``alignment``; ``free_bytes + used_bytes == usable_bytes``;
    adjacent holes are always merged, so freeing everything leaves exactly one hole.
    ``usable_bytes`` is ``capacity`` rounded down to the alignment.
    """

    capacity: int = attrs.field(validator=_capacity_validator)
    alignment: int = attrs.field(default=DEFAULT_ALIGNMENT, validator=_alignment_validator)
    _hole_offsets: list[int] = attrs.field(init=False, factory=list)
    _hole_sizes: list[int] = attrs.field(init=False, factory=list)
    _live: dict[int, Region] = attrs.field(init=False, factory=dict)
    _used: int = attrs.field(init=False, default=0)

    def __attrs_post_init__(self) -> None:
        if self.usable_bytes > 0:
            self._hole_offsets.append(0)
            self._hole_sizes.append(self.usable_bytes)

    @property
    def usable_bytes(self) -> int:
        return self.capacity - self.capacity % self.alignment

    @property
    def used_bytes(self) -> int:
        """Sum of the spans of live regions."""
        return self._used

    @property
    def free_bytes(self) -> int:
        return self.usable_bytes - self._used

    @property
    def largest_free(self) -> int:
        return max(self._hole_sizes, default=0)

    @property
    def live_count(self) -> int:
        return len(self._live)

    def live_regions(self) -> tuple[Region, ...]:
        """Live regions in offset order."""
        return tuple(self._live[o] for o in sorted(self._live))

    def holes(self) -> tuple[tuple[int, int], ...]:
        """Free holes as ``(offset, size)`` in offset order."""
        return tuple(zip(self._hole_offsets, self._hole_sizes))

    def too_large(self, nbytes: int) -> bool:
        """True when ``nbytes`` could never fit, even in an empty pool."""
        return aligned_span(nbytes, self.alignment) > self.usable_bytes

    def failure(self, nbytes: int) -> AllocationFailure:
        """Describe why ``nbytes`` cannot be allocated now (call after ``allocate`` gave None)."""
        reason = TOO_LARGE if self.too_large(nbytes) else POOL_FULL
        return AllocationFailure(
            reason, nbytes, self.free_bytes, self.largest_free, self.usable_bytes
        )

    def allocate(self, nbytes: int) -> Region | None:
        """Reserve ``nbytes``; None when no hole fits (see :meth:`too_large` / :meth:`failure`).

        Best fit: the smallest hole that fits, lowest offset on ties. Raises ConfigError for a
        negative or non-integer size.
        """
        span = aligned_span(nbytes, self.alignment)
        best = -1
        for index, size in enumerate(self._hole_sizes):
            if size >= span and (best < 0 or size < self._hole_sizes[best]):
                best = index
                if size == span:
                    break
        if best < 0:
            return None
        offset = self._hole_offsets[best]
        remaining = self._hole_sizes[best] - span
        if remaining:
            self._hole_offsets[best] = offset + span
            self._hole_sizes[best] = remaining
        else:
            del self._hole_offsets[best]
            del self._hole_sizes[best]
        region = Region(offset, nbytes, span)
        self._live[offset] = region
        self._used += span
        return region

    def free(self, region: Region) -> None:
        """Return a live region. Freeing an unknown or already freed region is a ConfigError."""
        if self._live.get(region.offset) != region:
            raise ConfigError(f"region {region} is not live in this pool (double free?)")
        del self._live[region.offset]
        self._used -= region.span
        index = bisect.bisect_left(self._hole_offsets, region.offset)
        offset, size = region.offset, region.span
        if index < len(self._hole_offsets) and self._hole_offsets[index] == region.end:
            size += self._hole_sizes[index]
            del self._hole_offsets[index]
            del self._hole_sizes[index]
        if index > 0 and self._hole_offsets[index - 1] + self._hole_sizes[index - 1] == offset:
            self._hole_sizes[index - 1] += size
        else:
            self._hole_offsets.insert(index, offset)
            self._hole_sizes.insert(index, size)


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
    """One reader's hold on a payload; release it by ``ticket_id`` when done with the bytes."""

    ticket_id: int
    entry_id: int
    key: str
    handle: Any
    size: int
    taken_s: float


@attrs.frozen
class Expiry:
    """What :meth:`LeaseTable.expire` did. ``kind``: ``"unread"`` (lease passed with readers
    left) or ``"unreleased"`` (a ticket was revoked after ``hold_s``). ``freed``: the entry is
    gone now and its handle may be reused."""

    entry: LeaseEntry
    kind: str
    freed: bool


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
    tickets: dict[int, float] = attrs.Factory(dict)

    def snapshot(self) -> LeaseEntry:
        return LeaseEntry(
            self.entry_id, self.key, self.request_id, self.handle, self.size, self.readers,
            self.readers_left, len(self.tickets), self.created_s, self.lease_s, self.state,
        )


def _hold_validator(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if value is not None:
        _check_seconds("hold_s", value)


@attrs.define(eq=False)
class LeaseTable:
    """Published payloads by key, their readers, tickets and leases.

    ``hold_s`` bounds how long a reader may keep a ticket (None: the entry's ``lease_s``).
    ``history`` bounds how many gone keys are remembered for :meth:`status` (oldest forgotten).
    """

    hold_s: float | None = attrs.field(default=None, validator=_hold_validator)
    history: int = attrs.field(default=4096)
    _by_key: dict[str, _Record] = attrs.field(init=False, factory=dict)
    _held: dict[int, _Record] = attrs.field(init=False, factory=dict)  # entry_id -> not freed
    _tickets: dict[int, _Record] = attrs.field(init=False, factory=dict)
    _gone: dict[str, str] = attrs.field(init=False, factory=dict)
    _next_id: int = attrs.field(init=False, default=1)

    def __len__(self) -> int:
        """Entries not yet freed (readable or waiting for releases)."""
        return len(self._held)

    def _serial(self) -> int:
        value = self._next_id
        self._next_id += 1
        return value

    def _forget_later(self, key: str, why: str) -> None:
        self._gone.pop(key, None)
        self._gone[key] = why
        while len(self._gone) > self.history:
            del self._gone[next(iter(self._gone))]

    def _unlist(self, record: _Record, state: str) -> None:
        """Stop new takes of ``record`` (it leaves the key map); remember why."""
        if self._by_key.get(record.key) is record:
            del self._by_key[record.key]
            self._forget_later(record.key, state)
        record.state = state

    def _free_if_done(self, record: _Record) -> bool:
        if record.tickets or record.state == EntryState.PUBLISHED:
            return False
        record.state = EntryState.FREED
        self._held.pop(record.entry_id, None)
        return True

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
        _check_int("readers", readers, 1)
        _check_int("size", size, 0)
        lease = _check_seconds("lease_s", lease_s)
        if key in self._by_key:
            raise ConfigError(f"key {key!r} is already published")
        rid = request_id if request_id is not None else request_id_of_key(key)
        record = _Record(
            self._serial(), key, rid, handle, size, readers, readers, float(now_s), lease
        )
        self._by_key[key] = record
        self._held[record.entry_id] = record
        self._gone.pop(key, None)
        return record.snapshot()

    def take(self, key: str, now_s: float) -> Ticket | None:
        """One reader takes ``key``: a Ticket, or None when absent, consumed or past its lease.

        The last permitted reader removes the key from lookup (later readers get None); the
        payload stays held until every ticket is released.
        """
        record = self._by_key.get(key)
        if record is None or now_s >= record.created_s + record.lease_s:
            return None
        record.readers_left -= 1
        ticket = Ticket(self._serial(), record.entry_id, key, record.handle, record.size, now_s)
        record.tickets[ticket.ticket_id] = float(now_s)
        self._tickets[ticket.ticket_id] = record
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

    def expire(self, now_s: float) -> tuple[Expiry, ...]:
        """Drop unread readers past their lease and revoke tickets held past ``hold_s``.

        Each transition is reported once; ``freed`` entries may have their handle reused.
        """
        out: list[Expiry] = []
        for record in list(self._held.values()):
            kind = ""
            if record.state == EntryState.PUBLISHED and now_s >= record.created_s + record.lease_s:
                self._unlist(record, EntryState.EXPIRED)
                kind = "unread"
            hold = self.hold_s if self.hold_s is not None else record.lease_s
            late = [t for t, taken in record.tickets.items() if now_s >= taken + hold]
            for ticket_id in late:
                del record.tickets[ticket_id]
                del self._tickets[ticket_id]
            if late and not kind:
                kind = "unreleased"
            if kind:
                freed = self._free_if_done(record)
                out.append(Expiry(record.snapshot(), kind, freed))
        return tuple(out)

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
        return self._drop([r for r in self._by_key.values() if r.request_id == request_id])

    def status(self, key: str) -> str:
        """``"published"``, or why it is gone (``"drained"``, ``"expired"``, ``"dropped"``),
        or ``"unknown"`` (never published, or forgotten beyond ``history``)."""
        if key in self._by_key:
            return EntryState.PUBLISHED
        return self._gone.get(key, "unknown")

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
        """Earliest time at which :meth:`expire` would do something (None: nothing pending)."""
        times = []
        for record in self._held.values():
            if record.state == EntryState.PUBLISHED:
                times.append(record.created_s + record.lease_s)
            hold = self.hold_s if self.hold_s is not None else record.lease_s
            times.extend(taken + hold for taken in record.tickets.values())
        return min(times, default=None)


@attrs.define(eq=False)
class PoolLedger:
    """A :class:`RegionAllocator` plus a :class:`LeaseTable` whose handles are its Regions.

    The flow on the sender: ``reserve`` -> write bytes at ``region.offset`` -> ``publish`` (or
    ``abort``). Readers: ``take`` -> read ``[offset, offset + nbytes)`` -> ``release``. A region
    returns to the allocator exactly when its entry is freed, never earlier.
    """

    allocator: RegionAllocator
    leases: LeaseTable = attrs.Factory(LeaseTable)
    _reserved: set[int] = attrs.field(init=False, factory=set)

    @classmethod
    def create(
        cls, capacity: int, *, alignment: int = DEFAULT_ALIGNMENT, hold_s: float | None = None
    ) -> "PoolLedger":
        return cls(RegionAllocator(capacity, alignment), LeaseTable(hold_s=hold_s))

    def reserve(self, nbytes: int) -> Region | AllocationFailure:
        """A region for ``nbytes`` not yet published, or why there is none."""
        region = self.allocator.allocate(nbytes)
        if region is None:
            return self.allocator.failure(nbytes)
        self._reserved.add(region.offset)
        return region

    def abort(self, region: Region) -> None:
        """Give back a reserved, unpublished region. Idempotent."""
        if region.offset in self._reserved:
            self._reserved.discard(region.offset)
            self.allocator.free(region)

    def _free(self, entries: Iterable[LeaseEntry]) -> tuple[LeaseEntry, ...]:
        done = tuple(entries)
        for entry in done:
            self.allocator.free(entry.handle)
        return done

    def publish(
        self,
        key: str,
        region: Region,
        *,
        readers: int = 1,
        now_s: float,
        lease_s: float,
        request_id: str | None = None,
    ) -> LeaseEntry:
        """Publish a reserved region under ``key``; an older readable payload of ``key`` is
        dropped first (latest put wins). Raises ConfigError if ``region`` is not reserved."""
        if region.offset not in self._reserved:
            raise ConfigError(f"region {region} was not reserved (or was already published)")
        self._free(self.leases.drop_key(key))
        entry = self.leases.publish(
            key, region, region.nbytes, readers=readers, now_s=now_s, lease_s=lease_s,
            request_id=request_id,
        )
        self._reserved.discard(region.offset)
        return entry

    def take(self, key: str, now_s: float) -> Ticket | None:
        return self.leases.take(key, now_s)

    def release(self, ticket_id: int) -> LeaseEntry | None:
        """Release a ticket (idempotent); the entry's snapshot when this freed its region."""
        entry = self.leases.release(ticket_id)
        if entry is not None:
            self._free([entry])
        return entry

    def expire(self, now_s: float) -> tuple[Expiry, ...]:
        report = self.leases.expire(now_s)
        self._free(x.entry for x in report if x.freed)
        return report

    def drop_key(self, key: str) -> tuple[LeaseEntry, ...]:
        """Make ``key`` unreadable; returns the entries whose regions were freed now."""
        return self._free(self.leases.drop_key(key))

    def drop_request(self, request_id: str) -> tuple[LeaseEntry, ...]:
        """Drop every readable key of ``request_id``; returns the entries freed now."""
        return self._free(self.leases.drop_request(request_id))

    def stats(self) -> dict[str, int]:
        """JSON-able counters: bytes (capacity, used, free, largest hole) and entry counts."""
        alloc = self.allocator
        return {
            "pool_bytes": alloc.usable_bytes,
            "used_bytes": alloc.used_bytes,
            "free_bytes": alloc.free_bytes,
            "largest_free": alloc.largest_free,
            "live_regions": alloc.live_count,
            "reserved": len(self._reserved),
            "entries": len(self.leases),
            "readable": len(self.leases.readable_keys()),
        }
