"""What a zmq sender holds: payloads in one reused pool of host memory, by key, under leases.

The pool is one page-aligned ``uint8`` array of ``pool_bytes`` (:func:`.buffers.host_pool`),
allocated once; its pages are touched on first use (or all at construction with ``prefault``)
and stay mapped, so after warm-up neither a gather into a reservation nor a ``put``'s copy
page-faults. Regions, readers and leases are :class:`kvferry.core.pool.PoolLedger`'s (the same
bookkeeping the memory and shm pools use): ``reserve`` -> write -> ``publish`` (or ``abort``).

A region is reused only when no reader may take it any more AND libzmq no longer reads it:
serving a reader sends views of the region with ``copy=False`` and takes a ledger ticket that
stays out until every ``MessageTracker`` of that send is done (:meth:`reap`, run by the serving
loop on every pass and by any caller that needs room). Tickets are never revoked by time: a
peer that stalls keeps its region until libzmq drops the message (connection closed).

Thread-safe (one lock): callers reserve and publish, the serving thread serves and reaps; a
caller that finds the pool full while sends are in flight waits for their trackers (at most
``drain_wait_s``), outside the lock. Lease times come from the injected ``clock`` (seconds).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import attrs
import numpy as np
import zmq

from kvferry.adapters.connectors.zmq.buffers import host_pool
from kvferry.core.errors import TransferError
from kvferry.core.pool import (
    AllocationFailure,
    EntryState,
    LeaseTable,
    PoolLedger,
    Region,
    RegionAllocator,
)

__all__ = ["Held", "PublishFailure", "HeldPayloads", "STORE_COUNTERS", "ZmqReservation"]

logger = logging.getLogger(__name__)

STORE_COUNTERS = (
    "puts",
    "put_failures",
    "bytes_put",
    "served",
    "bytes_served",
    "expired",
    "drain_waits",
    "failures_recorded",
)
#: Region alignment in bytes (a cache line: every dtype's views stay aligned).
ALIGNMENT = 64
#: Tickets are released by libzmq's trackers, never revoked by time.
_NEVER_S = 1e9


@attrs.frozen
class PublishFailure:
    """Why a put or reserve was refused: ``reason`` is ``pool_full``, ``too_large`` or
    ``closed``; ``detail`` is human text."""

    reason: str
    detail: str


@attrs.frozen
class Held:
    """A payload as the send callback sees it: ``frames`` (the put's frame boundaries) and
    ``whole`` (their concatenation), both read-only views of its pool region."""

    frames: tuple[memoryview, ...]
    whole: memoryview

    @property
    def size(self) -> int:
        return self.whole.nbytes


@attrs.define(eq=False)
class HeldPayloads:
    """The sender's pool. Every method takes the lock; only ``send`` (given to :meth:`serve`,
    a non-blocking zmq send) and tracker waits in :meth:`reserve` touch I/O."""

    pool_bytes: int
    max_payloads: int
    clock: Callable[[], float]
    prefault: bool = False
    drain_wait_s: float = 1.0
    _storage: np.ndarray | None = attrs.field(init=False)
    _view: memoryview | None = attrs.field(init=False)
    _tensor: Any = attrs.field(init=False, default=None)
    _ledger: PoolLedger = attrs.field(init=False)
    _sizes: dict[int, tuple[int, ...]] = attrs.field(init=False, factory=dict)  # by entry id
    _reserved: dict[int, int] = attrs.field(init=False, factory=dict)
    _draining: list[tuple[list[Any], int]] = attrs.field(init=False, factory=list)
    _lock: threading.Lock = attrs.field(init=False, factory=threading.Lock)
    _next_check: float | None = attrs.field(init=False, default=None)
    _closed: bool = attrs.field(init=False, default=False)
    _counters: dict[str, int] = attrs.field(init=False, factory=lambda: dict.fromkeys(STORE_COUNTERS, 0))

    def __attrs_post_init__(self) -> None:
        self._storage = host_pool(self.pool_bytes, touch=self.prefault)
        self._view = self._storage.data.toreadonly()
        self._ledger = self._new_ledger()

    def _new_ledger(self) -> PoolLedger:
        return PoolLedger(RegionAllocator(self.pool_bytes, ALIGNMENT), LeaseTable(hold_s=_NEVER_S))

    # ------------------------------------------------------------------ writing

    def reserve(self, nbytes: int, *, count_failure: bool = False) -> Region | PublishFailure:
        """A region of ``nbytes`` (counted until published or aborted), or why not. When the
        pool is full but sends are in flight, waits up to ``drain_wait_s`` for them."""
        deadline = time.monotonic() + self.drain_wait_s
        waited = False
        while True:
            with self._lock:
                got = self._reserve_locked(nbytes)
                pending = self._draining[0][0] if self._draining else None
                if not isinstance(got, AllocationFailure):
                    return got
                remaining = deadline - time.monotonic()
                if got.reason != "pool_full" or not pending or remaining <= 0:
                    if count_failure:
                        self._counters["put_failures"] += 1
                    if got.reason == "closed":
                        return PublishFailure("closed", "the connector is closed")
                    return PublishFailure(got.reason, got.detail)
                if not waited:
                    self._counters["drain_waits"] += 1
                    waited = True
            try:  # libzmq is still sending a served payload: its region frees when it is done
                pending[0].wait(remaining)
            except zmq.NotDone:
                pass

    def _reserve_locked(self, nbytes: int) -> Region | AllocationFailure:
        if self._closed:
            return AllocationFailure("closed", nbytes, 0, 0, 0)
        self._expire_locked(self.clock())
        self._reap_locked()
        region = self._ledger.reserve(nbytes)
        if isinstance(region, Region):
            self._reserved[region.offset] = nbytes
        return region

    def write(self, region: Region, frames: tuple[memoryview, ...]) -> bool:
        """Copy ``frames`` back to back into ``region`` (the caller's reserved region); False
        when the pool was closed meanwhile (nothing written)."""
        storage = self._storage
        if storage is None:
            return False
        position = region.offset
        for frame in frames:
            count = frame.nbytes
            storage[position : position + count] = np.frombuffer(frame, dtype=np.uint8)
            position += count
        return True

    def buffer(self, region: Region) -> Any:
        """A writable 1-D ``uint8`` tensor view of ``region`` (for a reservation). Raises
        TransferError when the pool was closed meanwhile."""
        tensor, storage = self._tensor, self._storage
        if tensor is None:
            if storage is None:
                raise TransferError("closed: the zmq sender's pool is closed")
            import torch

            tensor = self._tensor = torch.from_numpy(storage)
        return tensor[region.offset : region.offset + region.nbytes]

    def abort(self, region: Region) -> None:
        """Give back a reserved region that will not be published. Idempotent."""
        with self._lock:
            if self._reserved.pop(region.offset, None) is not None:
                self._ledger.abort(region)

    def publish(
        self, key: str, region: Region, sizes: tuple[int, ...], *, readers: int, lease_s: float
    ) -> PublishFailure | None:
        """Publish the written ``region`` under ``key`` (latest put wins); on failure the
        region goes back to the pool."""
        with self._lock:
            if self._reserved.pop(region.offset, None) is None:
                return PublishFailure(
                    "closed" if self._closed else "aborted", "the reservation is gone (closed or aborted)"
                )
            if self._closed:
                return PublishFailure("closed", "the connector is closed")
            now = self.clock()
            self._expire_locked(now)
            leases = self._ledger.leases
            if leases.entry(key) is None and len(leases) >= self.max_payloads:
                self._ledger.abort(region)
                self._counters["put_failures"] += 1
                return PublishFailure("pool_full", f"pool full: {len(leases)} payloads held (max_payloads)")
            self._forget(self._ledger.drop_key(key))  # latest put wins
            entry = self._ledger.publish(key, region, readers=readers, now_s=now, lease_s=lease_s)
            self._sizes[entry.entry_id] = sizes
            deadline = now + lease_s
            if self._next_check is None or deadline < self._next_check:
                self._next_check = deadline
            self._counters["puts"] += 1
            self._counters["bytes_put"] += region.nbytes
            return None

    def _forget(self, freed: Any) -> None:
        for entry in freed:
            self._sizes.pop(entry.entry_id, None)

    # ------------------------------------------------------------------ serving

    def fail(self, key: str, failure: Any) -> bool:
        """Record that ``key`` will never be published (a tombstone, no pool space; a payload
        under it is dropped first). False once closed."""
        with self._lock:
            if self._closed:
                return False
            freed, recorded = self._ledger.fail(key, failure)
            self._forget(freed)
            if recorded:
                self._counters["failures_recorded"] += 1
            return recorded

    def failure(self, key: str) -> Any | None:
        """The failure record of ``key`` (:meth:`fail`), or None."""
        with self._lock:
            return self._ledger.leases.failure(key)

    def serve(self, key: str, send: Callable[[Held], list[Any] | None]) -> str:
        """Hand ``key``'s payload to ``send``; one reader is consumed only if it queued the
        reply (returns the trackers libzmq still holds; None: the peer is unreachable).

        Returns ``"sent"``, ``"gone"`` (nothing consumed), ``"expired"``, ``"failed"`` (its
        sender recorded a failure: :meth:`failure`) or ``"not_found"``.
        """
        with self._lock:
            now = self.clock()
            entry = self._ledger.leases.entry(key)
            if entry is not None and now >= entry.deadline_s:
                self._expire_locked(now)
                entry = None
            if entry is None:
                status = self._ledger.leases.status(key)
                return status if status in (EntryState.EXPIRED, EntryState.FAILED) else "not_found"
            region, view = entry.handle, self._view
            assert view is not None  # not closed: held
            whole = view[region.offset : region.offset + region.nbytes]
            frames, start = [], 0
            for size in self._sizes.get(entry.entry_id, (region.nbytes,)):
                frames.append(whole[start : start + size])
                start += size
            pending = send(Held(tuple(frames), whole))
            if pending is None:
                return "gone"
            ticket = self._ledger.take(key, now)
            if ticket is not None:
                if pending:
                    self._draining.append((pending, ticket.ticket_id))
                else:
                    self._release_locked(ticket.ticket_id)
            self._counters["served"] += 1
            self._counters["bytes_served"] += entry.size
            return "sent"

    def reap(self) -> int:
        """Release readers whose sends libzmq finished; returns how many sends are still in
        flight. Never blocks."""
        with self._lock:
            self._reap_locked()
            return len(self._draining)

    def _reap_locked(self) -> None:
        if not self._draining:
            return
        still = []
        for pending, ticket_id in self._draining:
            if all(t.done for t in pending):
                self._release_locked(ticket_id)
            else:
                still.append((pending, ticket_id))
        self._draining = still

    def _release_locked(self, ticket_id: int) -> None:
        freed = self._ledger.release(ticket_id)
        self._forget([freed] if freed is not None else [])

    # ------------------------------------------------------------------ leases

    def expire(self) -> None:
        with self._lock:
            self._expire_locked(self.clock())

    def seconds_to_next_expiry(self) -> float | None:
        """Clock seconds until a lease may pass (None: nothing held)."""
        with self._lock:
            return None if self._next_check is None else self._next_check - self.clock()

    def _expire_locked(self, now: float) -> None:
        if self._next_check is None or now < self._next_check:
            return
        for item in self._ledger.expire(now):
            if item.freed:
                self._forget([item.entry])
            if item.kind == "unread":
                self._counters["expired"] += 1
                logger.warning(
                    "zmq payload %r expired unread after %.1fs (lease_s)", item.entry.key, item.entry.lease_s
                )
        self._next_check = self._next_lease_locked()

    def _next_lease_locked(self) -> float | None:
        times = [e.deadline_s for e in self._ledger.leases.entries() if e.state == EntryState.PUBLISHED]
        return min(times, default=None)

    def drop_request(self, request_id: str) -> None:
        with self._lock:
            self._forget(self._ledger.drop_request(request_id))

    def close(self) -> None:
        """Drop everything; later reservations and publishes fail with ``closed``. The pool's
        memory is freed once nothing references it: messages libzmq still holds and
        reservation tensors keep what they view valid."""
        with self._lock:
            self._closed = True
            self._storage = self._view = self._tensor = None
            self._ledger = self._new_ledger()
            self._sizes.clear()
            self._reserved.clear()
            self._draining = []
            self._next_check = None

    def stats(self) -> dict[str, int]:
        with self._lock:
            if not self._closed:
                self._expire_locked(self.clock())
                self._reap_locked()
            entries = self._ledger.leases.entries()
            pool = self._ledger.stats()
            out = dict(self._counters)
            out["held_bytes"] = sum(e.size for e in entries)
            out["reserved_bytes"] = sum(self._reserved.values())
            out["held_payloads"] = len(entries)
            out["in_flight"] = len(self._draining)
            out["pool_bytes"] = self.pool_bytes
            out["pool_used_bytes"] = pool["used_bytes"]
            out["pool_largest_free"] = pool["largest_free"]
        return out


@attrs.define(eq=False)
class ZmqReservation:
    """A region of the sender's pool reserved before the payload exists (``Reservation`` port).

    ``buffer`` is a writable 1-D ``uint8`` CPU tensor viewing exactly the reserved bytes of the
    pool; the sender writes the payload into it, then ``commit()`` publishes the region itself
    (no copy) or ``abort()`` gives it back. Both are idempotent; the first one called wins.
    Do not write into ``buffer`` after either.
    """

    buffer: Any
    _publish: Callable[[], tuple[bool, int, Any]]
    _abort: Callable[[], None]
    _result: tuple[bool, int, Any] | None = None
    _lock: threading.Lock = attrs.Factory(threading.Lock)

    def commit(self) -> tuple[bool, int, Any]:
        with self._lock:
            if self._result is None:
                self._result = self._publish()
            return self._result

    def abort(self) -> None:
        with self._lock:
            if self._result is None:
                self._abort()
                self._result = (False, 0, {"reason": "aborted", "detail": "reservation aborted"})
