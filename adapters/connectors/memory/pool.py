"""The thread-safe pool store of pool-backed connectors (memory, and the shm sender).

:class:`LocalPool` keeps published payloads in one preallocated 1-D ``uint8`` tensor (or as
immutable ``bytes`` objects): a region ledger from :mod:`kvferry.core.pool`, a storage tensor
and a condition variable. Readers take tickets; each ticket names its *holder*, an object with
``alive() -> bool``. Readers of this process hold :data:`IN_PROCESS` (always alive: such a
reader cannot die while the pool lives, and its pool buffers are released when dropped), the
shm sender's readers hold their process (:mod:`kvferry.adapters.connectors.shm.server`).
A ticket held past ``hold_s`` is
revoked only when its holder is gone; a live holder is reported (``held_overdue`` in the
counters, a warning in the log) and keeps it.

Config keys shared by pool-backed connectors are read by :class:`PoolSettings`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NoReturn, cast

import attrs
import numpy as np
import torch

from kvferry.adapters.connectors.pool_buffer import PooledBuffer
from kvferry.core.errors import ConfigError, PoolFullError
from kvferry.core.pool import (
    DEFAULT_ALIGNMENT,
    AllocationFailure,
    ExpiryKind,
    PoolLedger,
    Region,
    Ticket,
)
from kvferry.core.ports import Clock, PutResult
from kvferry.core.validate import check_int, check_seconds

__all__ = [
    "DEFAULT_LEASE_S",
    "DEFAULT_READERS",
    "IN_PROCESS",
    "MonotonicClock",
    "PoolSettings",
    "payload_parts",
    "write_parts",
    "put_failure",
    "PoolReservation",
    "LocalPool",
]

logger = logging.getLogger(__name__)

DEFAULT_LEASE_S = 60.0
DEFAULT_READERS = 1


class _InProcess:
    """The holder of tickets taken by readers of the pool's own process."""

    def alive(self) -> bool:
        return True

    def __repr__(self) -> str:
        return "this process"


#: Holder of tickets read in the pool's own process: never presumed dead.
IN_PROCESS = _InProcess()


def _holder_alive(holder: Any) -> bool:
    return bool(holder.alive())


class MonotonicClock:
    """The real monotonic clock (seconds)."""

    def monotonic(self) -> float:
        return time.monotonic()


def _int_key(config: Mapping[str, Any], key: str, default: int, minimum: int) -> int:
    value = config.get(key, default)
    return check_int(f"connector config {key!r}", value, minimum)


def _seconds_key(config: Mapping[str, Any], key: str, default: float | None) -> float | None:
    value = config.get(key, default)
    if value is None:
        return None
    return check_seconds(f"connector config {key!r}", value)


@attrs.frozen
class PoolSettings:
    """Config keys shared by pool-backed connectors (bytes, seconds)."""

    pool_bytes: int
    readers: int = DEFAULT_READERS
    lease_s: float = DEFAULT_LEASE_S
    hold_s: float | None = None
    alignment: int = DEFAULT_ALIGNMENT
    clock: Any = attrs.field(factory=MonotonicClock)

    @classmethod
    def from_config(cls, config: Mapping[str, Any], *, default_pool_bytes: int) -> PoolSettings:
        """Read ``pool_bytes``, ``readers``, ``lease_s``, ``hold_s`` (default: ``lease_s``),
        ``alignment`` and ``clock``; a bad value is a ConfigError naming the key."""
        clock = config.get("clock") or MonotonicClock()
        if not isinstance(clock, Clock):
            raise ConfigError(f"connector config 'clock' must have monotonic(), got {clock!r}")
        alignment = _int_key(config, "alignment", DEFAULT_ALIGNMENT, 1)
        if alignment & (alignment - 1):
            raise ConfigError(f"connector config 'alignment' must be a power of two, got {alignment}")
        return cls(
            pool_bytes=_int_key(config, "pool_bytes", default_pool_bytes, alignment),
            readers=_int_key(config, "readers", DEFAULT_READERS, 1),
            # None only for an explicit "lease_s": None, which reaches the pool as given
            lease_s=cast(float, _seconds_key(config, "lease_s", DEFAULT_LEASE_S)),
            hold_s=_seconds_key(config, "hold_s", None),
            alignment=alignment,
            clock=clock,
        )


def _bytes_part(item: Any) -> Any:
    if isinstance(item, torch.Tensor):
        item = item.detach()
        if item.dtype != torch.uint8 or item.dim() != 1:
            item = item.contiguous().reshape(-1).view(torch.uint8)
        return item.contiguous()
    if isinstance(item, str):
        raise ConfigError("payload data must be bytes-like, a uint8 tensor or frames, not str")
    try:
        view = memoryview(item)
    except TypeError:
        raise ConfigError(f"payload data of type {type(item).__name__} is not bytes-like") from None
    if not view.c_contiguous:
        raise ConfigError("payload buffers must be C-contiguous")
    return np.frombuffer(view.cast("B") if view.format != "B" or view.ndim != 1 else view, np.uint8)


def payload_parts(data: Any) -> tuple[list[Any], int]:
    """Split ``put`` data into byte parts (uint8 tensors / numpy arrays) and their total size.

    Accepts a bytes-like object, a tensor (viewed as its bytes) or a list/tuple of those
    (frames). Raises ConfigError for anything else. Never copies.
    """
    items: Sequence[Any] = data if isinstance(data, (list, tuple)) else (data,)
    parts = [_bytes_part(item) for item in items]
    total = sum(int(p.numel()) if isinstance(p, torch.Tensor) else int(p.nbytes) for p in parts)
    return parts, total


def write_parts(dst: torch.Tensor, parts: Sequence[Any]) -> None:
    """Copy ``parts`` back to back into the CPU uint8 tensor ``dst`` (one copy per part)."""
    dst_np = dst.numpy()
    pos = 0
    for part in parts:
        if isinstance(part, torch.Tensor):
            n = int(part.numel())
            dst[pos : pos + n].copy_(part)
        else:
            n = int(part.nbytes)
            dst_np[pos : pos + n] = part
        pos += n


def put_failure(reason: str, detail: str) -> tuple[bool, int, dict[str, Any]]:
    """The ``put`` result for a failure (``reason``: pool_full, too_large, closed, error)."""
    return False, 0, {"reason": reason, "detail": detail}


@attrs.define(eq=False)
class PoolReservation:
    """A writable region reserved in a pool; exactly one of commit/abort takes effect.
    ``host_bytes``: the region's bytes as a memoryview when the pool is host memory (the
    payload's header is written through it, not through a numpy view of ``buffer``)."""

    buffer: Any
    _commit: Callable[[], PutResult] = attrs.field(alias="commit")
    _abort: Callable[[], None] = attrs.field(alias="abort")
    host_bytes: memoryview | None = attrs.field(default=None, repr=False)
    _result: PutResult | None = attrs.field(init=False, default=None)

    def commit(self) -> PutResult:
        if self._result is None:
            self._result = self._commit()
        return self._result

    def abort(self) -> None:
        if self._result is None:
            self._result = put_failure("error", "reservation aborted")
            self._abort()


@attrs.define(eq=False)
class LocalPool:
    """Published payloads of one process, thread-safe. ``storage`` None means objects mode.

    Every state change happens under ``_cond``'s lock; payload bytes are copied outside it
    (the region is reserved, no one else touches it). ``on_publish`` callbacks run after each
    publication, outside the lock (shm uses one to wake its control thread).
    """

    settings: PoolSettings
    storage: torch.Tensor | None
    ledger: PoolLedger
    name: str = "memory"
    on_publish: list[Callable[[str], None]] = attrs.Factory(list)
    _cond: threading.Condition = attrs.field(init=False, factory=threading.Condition)
    _objects: dict[int, bytes] = attrs.field(init=False, factory=dict)
    _closed: bool = attrs.field(init=False, default=False)
    counters: dict[str, int] = attrs.field(init=False, factory=dict)
    _host: memoryview | None = attrs.field(init=False, default=None, repr=False)  # storage's bytes

    @classmethod
    def create(
        cls,
        settings: PoolSettings,
        *,
        storage: torch.Tensor | None = None,
        objects: bool = False,
        name: str = "memory",
    ) -> LocalPool:
        """A pool over ``storage`` (a CPU 1-D uint8 tensor of at least ``pool_bytes``), a fresh
        tensor when None, or plain bytes objects when ``objects``."""
        if storage is None and not objects:
            storage = torch.empty(settings.pool_bytes, dtype=torch.uint8)
        if storage is not None and (
            storage.dtype != torch.uint8 or storage.dim() != 1 or storage.numel() < settings.pool_bytes
        ):
            raise ConfigError("pool storage must be a 1-D uint8 tensor of at least pool_bytes")
        ledger = PoolLedger.create(settings.pool_bytes, alignment=settings.alignment, hold_s=settings.hold_s)
        return cls(settings, storage, ledger, name)

    @property
    def closed(self) -> bool:
        return self._closed

    def _count(self, name: str, amount: int = 1) -> None:
        self.counters[name] = self.counters.get(name, 0) + amount

    def _forget(self, entries: Sequence[Any]) -> None:
        for entry in entries:
            self._objects.pop(entry.handle.offset, None)

    def _expire_locked(self) -> None:
        report = self.ledger.expire(self.settings.clock.monotonic(), _holder_alive)
        for item in report:
            entry = item.entry
            if item.kind == ExpiryKind.OVERDUE:
                self._count("held_overdue", len(item.holders))
                logger.warning(
                    "%s pool: %r (%d bytes) held past its hold by %s; kept while the reader lives",
                    self.name,
                    entry.key,
                    entry.size,
                    ", ".join(map(str, item.holders)),
                )
                continue
            self._count("expired_" + item.kind)
            logger.warning(
                "%s pool: %s %r (%d bytes) after %.3g s lease",
                self.name,
                "dropped unread" if item.kind == ExpiryKind.UNREAD else "revoked the hold of a gone reader on",
                entry.key,
                entry.size,
                entry.lease_s,
            )
        self._forget([x.entry for x in report if x.freed])

    def _reserve_locked(self, nbytes: int) -> Region | AllocationFailure:
        if self._closed:
            return AllocationFailure("closed", nbytes, 0, 0, 0)
        self._expire_locked()
        return self.ledger.reserve(nbytes)

    def reserve_region(self, nbytes: int) -> Region | AllocationFailure:
        with self._cond:
            return self._reserve_locked(nbytes)

    def abort_region(self, region: Region) -> None:
        with self._cond:
            self.ledger.abort(region)

    def publish(self, key: str, region: Region, payload: bytes | None = None) -> PutResult:
        """Publish a reserved, written region under ``key`` (latest put of a key wins)."""
        with self._cond:
            if self._closed:
                self.ledger.abort(region)
                return put_failure("closed", f"{self.name} pool is closed")
            self._forget(self.ledger.drop_key(key))
            if payload is not None:
                self._objects[region.offset] = payload
            self.ledger.publish(
                key,
                region,
                readers=self.settings.readers,
                now_s=self.settings.clock.monotonic(),
                lease_s=self.settings.lease_s,
            )
            self._count("puts_ok")
            self._count("bytes_in", region.nbytes)
            self._cond.notify_all()
        for callback in self.on_publish:
            callback(key)
        return True, region.nbytes, None

    def _failed(self, failure: AllocationFailure) -> tuple[bool, int, dict[str, Any]]:
        self._count("puts_" + failure.reason)
        if failure.reason == "closed":
            return put_failure("closed", f"{self.name} pool is closed")
        return put_failure(failure.reason, failure.detail)

    def _raise_full(self, failure: AllocationFailure) -> NoReturn:
        reason, detail = self._failed(failure)[2].values()
        raise PoolFullError(f"{reason}: {detail}")

    def put(self, key: str, data: Any) -> PutResult:
        """Copy ``data`` into the pool and publish it. Never raises for payload/pool faults."""
        try:
            parts, total = payload_parts(data)
        except ConfigError as exc:
            return put_failure("error", str(exc))
        with self._cond:
            region = self._reserve_locked(total)
            if isinstance(region, AllocationFailure):
                return self._failed(region)
        payload = None
        try:
            if self.storage is None:
                payload = b"".join(
                    p.cpu().numpy().tobytes() if isinstance(p, torch.Tensor) else p.tobytes() for p in parts
                )
            else:
                write_parts(self.storage[region.offset : region.offset + total], parts)
        except (RuntimeError, ValueError, TypeError) as exc:
            self.abort_region(region)
            return put_failure("error", f"copy into the pool failed: {exc}")
        return self.publish(key, region, payload)

    def reserve(self, key: str, nbytes: int) -> PoolReservation:
        """A writable region for ``key``; raises PoolFullError (``pool_full``/``too_large``/
        ``closed`` in the message) when there is none."""
        with self._cond:
            region = self._reserve_locked(nbytes)
            if isinstance(region, AllocationFailure):
                self._raise_full(region)
        host = None
        if self.storage is None:
            buffer = torch.empty(nbytes, dtype=torch.uint8)
        else:
            buffer = self.storage[region.offset : region.offset + nbytes]
            if self._host is None and self.storage.is_contiguous():
                self._host = self.storage.numpy().data  # once: every region is a slice of it
            if self._host is not None:
                host = self._host[region.offset : region.offset + nbytes]

        def commit() -> PutResult:
            payload = buffer.numpy().tobytes() if self.storage is None else None
            return self.publish(key, region, payload)

        return PoolReservation(buffer, commit=commit, abort=lambda: self.abort_region(region), host_bytes=host)

    def take(self, key: str, holder: Any = IN_PROCESS) -> Ticket | None:
        """Take one read of ``key`` now (None: absent, consumed, expired or closed).
        ``holder`` (an object with ``alive()``) is the reader; see the module doc."""
        with self._cond:
            return self._take_locked(key, holder)

    def _take_locked(self, key: str, holder: Any = IN_PROCESS) -> Ticket | None:
        if self._closed:
            return None
        self._expire_locked()
        ticket = self.ledger.take(key, self.settings.clock.monotonic(), holder)
        self._count("gets_hit" if ticket is not None else "gets_miss")
        return ticket

    def status(self, key: str) -> str:
        """``"published"``, why the key is gone (drained/expired/dropped/failed) or ``"unknown"``."""
        with self._cond:
            return self.ledger.leases.status(key)

    def fail(self, key: str, failure: Any) -> bool:
        """Record that ``key`` will never be published (a tombstone, no space; see
        :meth:`kvferry.core.leases.LeaseTable.fail`): a payload readable under it is dropped
        first (a failed transfer's pages are of no use; a reader holding one keeps it until it
        releases), blocking takes of it return at once and ``on_publish`` callbacks run, so
        waiting gets hear of it. False when the pool is closed."""
        with self._cond:
            if self._closed:
                return False
            freed, recorded = self.ledger.fail(key, failure)
            self._forget(freed)
            if not recorded:
                return False
            self._count("failures_recorded")
            self._cond.notify_all()
        for callback in self.on_publish:
            callback(key)
        return True

    def failure(self, key: str) -> Any | None:
        """The failure record of ``key`` (:meth:`fail`), or None."""
        with self._cond:
            return self.ledger.leases.failure(key)

    def take_blocking(self, key: str, timeout_s: float, holder: Any = IN_PROCESS) -> Ticket | None:
        """Wait (condition variable, no polling) until ``key`` can be taken or ``timeout_s``
        seconds of real time pass; None at once when ``key`` expired unread or its sender
        recorded a failure (:meth:`fail`)."""
        deadline = time.monotonic() + max(0.0, float(timeout_s))
        with self._cond:
            while True:
                ticket = self._take_locked(key, holder)
                remaining = deadline - time.monotonic()
                if ticket is not None or self._closed or remaining <= 0:
                    return ticket
                if self.ledger.leases.status(key) in ("expired", "failed"):
                    return None  # dropped unread, or its sender failed: it cannot come (see status())
                self._cond.wait(remaining)

    def view(self, ticket: Ticket) -> Any:
        """The taken bytes: a uint8 view into storage, or the stored bytes object."""
        region = ticket.handle
        if self.storage is None:
            return self._objects[region.offset]
        return self.storage[region.offset : region.offset + ticket.size]

    def release(self, ticket_id: int) -> bool:
        """Release a ticket (idempotent); True when this freed the region for reuse."""
        with self._cond:
            entry = self.ledger.release(ticket_id)
            if entry is None:
                return False
            self._count("released")  # the last reader's release freed it
            self._forget([entry])
            return True

    def read(self, ticket: Ticket) -> tuple[Any, int]:
        """``(data, size)`` for a ticket: a tied PooledBuffer in pool mode (dropping it and every
        view of its tensor releases it), bytes in objects mode (released at once)."""
        if self.storage is None:
            data = self.view(ticket)
            self.release(ticket.ticket_id)
            return data, ticket.size
        ticket_id = ticket.ticket_id

        def release() -> None:
            self.release(ticket_id)

        buffer = PooledBuffer.tied(self.view(ticket), on_release=release)
        return buffer, ticket.size

    def cleanup(self, request_id: str) -> int:
        """Drop every readable key of ``request_id``; returns how many regions were freed."""
        with self._cond:
            freed = self.ledger.drop_request(request_id)
            self._forget(freed)
            return len(freed)

    def expire(self) -> float | None:
        """Run lease expiry now; returns the next deadline (pool clock) or None."""
        with self._cond:
            self._expire_locked()
            return self.ledger.leases.next_deadline()

    def stats(self) -> dict[str, Any]:
        with self._cond:
            if not self._closed:
                self._expire_locked()
            return {**self.ledger.stats(), **self.counters}

    def close(self) -> None:
        """Refuse new puts/gets and wake every waiter. Idempotent. Outstanding PooledBuffer
        views stay valid (they keep the storage alive)."""
        with self._cond:
            self._closed = True
            self._objects.clear()
            self._cond.notify_all()
