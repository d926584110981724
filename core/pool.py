"""Sender-side pool bookkeeping: a region allocator and a lease table (pure; time passed in).

A connector that keeps payloads in one fixed-size buffer (an in-process tensor, a shared-memory
segment, a registered RDMA region) uses three pieces:

- :class:`~kvferry.core.regions.RegionAllocator` (:mod:`kvferry.core.regions`) hands out
  aligned, non-overlapping byte ranges; ``too_large`` never fits, ``pool_full`` not now.
- :class:`~kvferry.core.leases.LeaseTable` (:mod:`kvferry.core.leases`) tracks what was
  published under which key, its ``readers``, tickets, leases and holds. A ticket held past
  ``hold_s`` is revoked only when its holder is unknown or gone; a live holder keeps it (it
  may be reading the bytes in place) and is reported ``overdue``.
- :class:`PoolLedger` (here) joins the two: regions are freed exactly when their entry is
  freed, never earlier.

Units: offsets and sizes in bytes, times in seconds (any monotonic origin, passed in by the
caller). Nothing here reads a clock, allocates memory for payloads, or logs. Every name of the
two modules above is importable from here too.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import attrs

from kvferry.core.errors import ConfigError
from kvferry.core.leases import (
    EntryState,
    Expiry,
    ExpiryKind,
    LeaseEntry,
    LeaseTable,
    Ticket,
    request_id_of_key,
)
from kvferry.core.regions import (
    DEFAULT_ALIGNMENT,
    POOL_FULL,
    TOO_LARGE,
    AllocationFailure,
    Region,
    RegionAllocator,
    aligned_span,
)

__all__ = [
    "DEFAULT_ALIGNMENT",
    "POOL_FULL",
    "TOO_LARGE",
    "EntryState",
    "ExpiryKind",
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


@attrs.define(eq=False)
class PoolLedger:
    """A :class:`RegionAllocator` plus a :class:`LeaseTable` whose handles are its Regions.

    The flow on the sender: ``reserve`` -> write bytes at ``region.offset`` -> ``publish`` (or
    ``abort``). Readers: ``take`` -> read ``[offset, offset + nbytes)`` -> ``release``. A region
    returns to the allocator exactly when its entry is freed, never earlier.
    """

    allocator: RegionAllocator
    leases: LeaseTable = attrs.Factory(LeaseTable)
    #: Called with each entry's snapshot right after its region went back to the allocator
    #: (every way an entry is freed: released, given back past its lease, expired, dropped,
    #: replaced), exactly once per entry; under whatever lock guards the ledger.
    on_free: Callable[[LeaseEntry], None] | None = None
    _reserved: set[int] = attrs.field(init=False, factory=set)

    @classmethod
    def create(cls, capacity: int, *, alignment: int = DEFAULT_ALIGNMENT, hold_s: float | None = None) -> PoolLedger:
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
            if self.on_free is not None:
                self.on_free(entry)
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
        size: int | None = None,
    ) -> LeaseEntry:
        """Publish a reserved region under ``key``; an older readable payload of ``key`` is
        dropped first (latest put wins). ``size``: the payload's bytes when the region holds
        only its first piece (the rest lies in memory the caller keeps), at least
        ``region.nbytes``; by default the region's. Raises ConfigError if ``region`` is not
        reserved or ``size`` is smaller."""
        if region.offset not in self._reserved:
            raise ConfigError(f"region {region} was not reserved (or was already published)")
        if size is not None and size < region.nbytes:
            raise ConfigError(f"size {size} is less than the region's {region.nbytes} bytes")
        self._free(self.leases.drop_key(key))
        entry = self.leases.publish(
            key,
            region,
            region.nbytes if size is None else size,
            readers=readers,
            now_s=now_s,
            lease_s=lease_s,
            request_id=request_id,
        )
        self._reserved.discard(region.offset)
        return entry

    def take(self, key: str, now_s: float, holder: Any = None) -> Ticket | None:
        """One read of ``key`` (see :meth:`LeaseTable.take`; ``holder`` names the reader)."""
        return self.leases.take(key, now_s, holder)

    def release(self, ticket_id: int) -> LeaseEntry | None:
        """Release a ticket (idempotent); the entry's snapshot when this freed its region."""
        entry = self.leases.release(ticket_id)
        if entry is not None:
            self._free([entry])
        return entry

    def give_back(self, ticket_id: int, now_s: float) -> LeaseEntry | None:
        """A failed read: :meth:`LeaseTable.give_back` (the reader slot returns while the lease
        lasts); the entry's snapshot when this freed its region."""
        entry = self.leases.give_back(ticket_id, now_s)
        if entry is not None:
            self._free([entry])
        return entry

    def expire(self, now_s: float, holder_alive: Callable[[Any], bool] | None = None) -> tuple[Expiry, ...]:
        """:meth:`LeaseTable.expire`; regions of freed entries go back to the allocator."""
        report = self.leases.expire(now_s, holder_alive)
        self._free(x.entry for x in report if x.freed)
        return report

    def drop_key(self, key: str) -> tuple[LeaseEntry, ...]:
        """Make ``key`` unreadable; returns the entries whose regions were freed now."""
        return self._free(self.leases.drop_key(key))

    def fail(self, key: str, failure: Any) -> tuple[tuple[LeaseEntry, ...], bool]:
        """Record that ``key`` will never be published (:meth:`LeaseTable.fail`, a failure
        record: no space), a payload readable under it dropped first (a reader holding one keeps
        its region until it releases). Returns the entries freed now and whether the record was
        made."""
        freed = self.drop_key(key)
        return freed, self.leases.fail(key, failure)

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
            "overdue": self.leases.overdue_count(),
        }
