"""The in-process connector (threads of one process), and the pool machinery shm reuses.

``MemoryConnector`` keeps payloads in one preallocated 1-D ``uint8`` tensor (``storage:
"pool"``, the default; ``get`` returns zero-copy :class:`PooledBuffer` views) or as immutable
``bytes`` copies (``storage: "objects"``; ``get`` returns ``bytes``). Both are bounded by
``pool_bytes`` and follow the contract of :class:`kvferry.core.ports.Connector`: ``readers``
gets per put (default 1), a lease of ``lease_s`` seconds (default 60), ``put`` failures as
``(False, 0, {"reason", "detail"})``, blocking gets woken by a condition variable.

Two connectors built from configs with the same ``shared_name`` share one store (a sender and a
receiver stage in one process); the store closes with the last of them.

:class:`LocalPool` is the thread-safe store (region ledger from :mod:`kvferry.core.pool` + a
storage tensor + a condition variable). The shm connector's sender runs the same class over a
shared-memory segment.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable, Mapping, Sequence

import attrs
import numpy as np
import torch

from kvferry.core.errors import ConfigError, LeaseExpired, PoolFullError
from kvferry.core.pool import DEFAULT_ALIGNMENT, AllocationFailure, PoolLedger, Region, Ticket
from kvferry.core.ports import Clock, PutResult

__all__ = [
    "DEFAULT_LEASE_S",
    "DEFAULT_READERS",
    "MEMORY_DEFAULT_POOL_BYTES",
    "MonotonicClock",
    "PoolSettings",
    "payload_parts",
    "write_parts",
    "put_failure",
    "PooledBuffer",
    "PoolReservation",
    "LocalPool",
    "MemoryConnector",
]

logger = logging.getLogger(__name__)

DEFAULT_LEASE_S = 60.0
DEFAULT_READERS = 1
MEMORY_DEFAULT_POOL_BYTES = 256 << 20


class MonotonicClock:
    """The real monotonic clock (seconds)."""

    def monotonic(self) -> float:
        return time.monotonic()


def _int_key(config: Mapping[str, Any], key: str, default: int, minimum: int) -> int:
    value = config.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"connector config {key!r} must be an integer >= {minimum}, got {value!r}")
    return value


def _seconds_key(config: Mapping[str, Any], key: str, default: float | None) -> float | None:
    value = config.get(key, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
        raise ConfigError(f"connector config {key!r} must be a positive number of seconds, got {value!r}")
    return float(value)


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
    def from_config(cls, config: Mapping[str, Any], *, default_pool_bytes: int) -> "PoolSettings":
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
            lease_s=_seconds_key(config, "lease_s", DEFAULT_LEASE_S),
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
            dst[pos:pos + n].copy_(part)
        else:
            n = int(part.nbytes)
            dst_np[pos:pos + n] = part
        pos += n


def put_failure(reason: str, detail: str) -> PutResult:
    """The ``put`` result for a failure (``reason``: pool_full, too_large, closed, error)."""
    return False, 0, {"reason": reason, "detail": detail}


@attrs.define(eq=False)
class PooledBuffer:
    """Received data living in a pool: ``tensor`` is a 1-D uint8 view; ``release()`` is
    idempotent and lets the pool reuse the region. Also a context manager (releases on exit)."""

    tensor: Any
    _on_release: Callable[[], None] | None = attrs.field(alias="on_release")

    @property
    def nbytes(self) -> int:
        return int(self.tensor.numel())

    @property
    def released(self) -> bool:
        return self._on_release is None

    def release(self) -> None:
        callback, self._on_release = self._on_release, None
        if callback is not None:
            callback()

    def __enter__(self) -> "PooledBuffer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


@attrs.define(eq=False)
class PoolReservation:
    """A writable region reserved in a pool; exactly one of commit/abort takes effect."""

    buffer: Any
    _commit: Callable[[], PutResult] = attrs.field(alias="commit")
    _abort: Callable[[], None] = attrs.field(alias="abort")
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

    @classmethod
    def create(
        cls, settings: PoolSettings, *, storage: torch.Tensor | None = None,
        objects: bool = False, name: str = "memory",
    ) -> "LocalPool":
        """A pool over ``storage`` (a CPU 1-D uint8 tensor of at least ``pool_bytes``), a fresh
        tensor when None, or plain bytes objects when ``objects``."""
        if storage is None and not objects:
            storage = torch.empty(settings.pool_bytes, dtype=torch.uint8)
        if storage is not None and (storage.dtype != torch.uint8 or storage.dim() != 1
                                    or storage.numel() < settings.pool_bytes):
            raise ConfigError("pool storage must be a 1-D uint8 tensor of at least pool_bytes")
        ledger = PoolLedger.create(
            settings.pool_bytes, alignment=settings.alignment, hold_s=settings.hold_s
        )
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
        report = self.ledger.expire(self.settings.clock.monotonic())
        for item in report:
            self._count("expired_" + item.kind)
            logger.warning(
                "%s pool: %s %r (%d bytes) after %.3g s lease", self.name,
                "dropped unread" if item.kind == "unread" else "revoked unreleased",
                item.entry.key, item.entry.size, item.entry.lease_s,
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
                key, region, readers=self.settings.readers,
                now_s=self.settings.clock.monotonic(), lease_s=self.settings.lease_s,
            )
            self._count("puts_ok")
            self._count("bytes_in", region.nbytes)
            self._cond.notify_all()
        for callback in self.on_publish:
            callback(key)
        return True, region.nbytes, None

    def _failed(self, failure: AllocationFailure) -> PutResult:
        self._count("puts_" + failure.reason)
        if failure.reason == "closed":
            return put_failure("closed", f"{self.name} pool is closed")
        return put_failure(failure.reason, failure.detail)

    def _raise_full(self, failure: AllocationFailure) -> None:
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
                payload = b"".join(p.cpu().numpy().tobytes() if isinstance(p, torch.Tensor) else p.tobytes() for p in parts)
            else:
                write_parts(self.storage[region.offset:region.offset + total], parts)
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
        if self.storage is None:
            buffer = torch.empty(nbytes, dtype=torch.uint8)
        else:
            buffer = self.storage[region.offset:region.offset + nbytes]

        def commit() -> PutResult:
            payload = buffer.numpy().tobytes() if self.storage is None else None
            return self.publish(key, region, payload)

        return PoolReservation(buffer, commit=commit, abort=lambda: self.abort_region(region))

    def take(self, key: str) -> Ticket | None:
        """Take one read of ``key`` now (None: absent, consumed, expired or closed)."""
        with self._cond:
            return self._take_locked(key)

    def _take_locked(self, key: str) -> Ticket | None:
        if self._closed:
            return None
        self._expire_locked()
        ticket = self.ledger.take(key, self.settings.clock.monotonic())
        self._count("gets_hit" if ticket is not None else "gets_miss")
        return ticket

    def status(self, key: str) -> str:
        """``"published"``, why the key is gone (drained/expired/dropped) or ``"unknown"``."""
        with self._cond:
            return self.ledger.leases.status(key)

    def take_blocking(self, key: str, timeout_s: float) -> Ticket | None:
        """Wait (condition variable, no polling) until ``key`` can be taken or ``timeout_s``
        seconds of real time pass; None at once when ``key`` expired unread."""
        deadline = time.monotonic() + max(0.0, float(timeout_s))
        with self._cond:
            while True:
                ticket = self._take_locked(key)
                remaining = deadline - time.monotonic()
                if ticket is not None or self._closed or remaining <= 0:
                    return ticket
                if self.ledger.leases.status(key) == "expired":
                    return None  # dropped unread: it cannot come (see status())
                self._cond.wait(remaining)

    def view(self, ticket: Ticket) -> Any:
        """The taken bytes: a uint8 view into storage, or the stored bytes object."""
        region = ticket.handle
        if self.storage is None:
            return self._objects[region.offset]
        return self.storage[region.offset:region.offset + ticket.size]

    def release(self, ticket_id: int) -> bool:
        """Release a ticket (idempotent); True when this freed the region for reuse."""
        with self._cond:
            entry = self.ledger.release(ticket_id)
            self._forget([entry] if entry is not None else [])
            return entry is not None

    def read(self, ticket: Ticket) -> tuple[Any, int]:
        """``(data, size)`` for a ticket: a PooledBuffer in pool mode, bytes in objects mode."""
        if self.storage is None:
            data = self.view(ticket)
            self.release(ticket.ticket_id)
            return data, ticket.size
        buffer = PooledBuffer(self.view(ticket), on_release=lambda: self.release(ticket.ticket_id))
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


_SHARED_LOCK = threading.Lock()
_SHARED: dict[str, tuple[LocalPool, int]] = {}


def _acquire_shared(name: str, make: Callable[[], LocalPool]) -> LocalPool:
    with _SHARED_LOCK:
        pool, count = _SHARED.get(name, (None, 0))
        if pool is None or pool.closed:
            pool, count = make(), 0
        _SHARED[name] = (pool, count + 1)
        return pool


def _release_shared(name: str, pool: LocalPool) -> bool:
    """Drop one reference; True when the caller was the last user (and should close)."""
    with _SHARED_LOCK:
        current, count = _SHARED.get(name, (None, 0))
        if current is not pool:
            return True
        if count <= 1:
            del _SHARED[name]
            return True
        _SHARED[name] = (pool, count - 1)
        return False


@attrs.define(eq=False)
class MemoryConnector:
    """In-process connector. Config: ``pool_bytes`` (default 256 MiB), ``readers``,
    ``lease_s``, ``hold_s``, ``alignment``, ``clock``, ``storage`` (``"pool"`` | ``"objects"``),
    ``shared_name`` (share one store between connectors of one process)."""

    pool: LocalPool
    shared_name: str | None = None
    _closed: bool = attrs.field(init=False, default=False)

    @classmethod
    def from_config(cls, config: Mapping[str, Any] | None = None) -> "MemoryConnector":
        config = dict(config or {})
        settings = PoolSettings.from_config(config, default_pool_bytes=MEMORY_DEFAULT_POOL_BYTES)
        mode = config.get("storage", "pool")
        if mode not in ("pool", "objects"):
            raise ConfigError(f"connector config 'storage' must be 'pool' or 'objects', got {mode!r}")

        def make() -> LocalPool:
            return LocalPool.create(settings, objects=mode == "objects")

        shared = config.get("shared_name")
        if shared is not None and not isinstance(shared, str):
            raise ConfigError(f"connector config 'shared_name' must be a string, got {shared!r}")
        return cls(_acquire_shared(shared, make) if shared else make(), shared)

    def put(self, from_stage: Any, to_stage: Any, put_key: str, data: Any) -> PutResult:
        if self._closed:
            return put_failure("closed", "memory connector is closed")
        ok, size, meta = self.pool.put(put_key, data)
        return (ok, size, {"key": put_key, "size": size}) if ok else (ok, size, meta)

    def get(
        self, from_stage: Any, to_stage: Any, get_key: str,
        metadata: Mapping[str, Any] | None = None,
    ) -> tuple[Any, int] | None:
        if self._closed:
            return None
        ticket = self.pool.take(get_key)
        return None if ticket is None else self.pool.read(ticket)

    def get_blocking(
        self, from_stage: Any, to_stage: Any, get_key: str,
        metadata: Mapping[str, Any] | None = None, *, timeout_s: float,
    ) -> tuple[Any, int] | None:
        if self._closed:
            return None
        ticket = self.pool.take_blocking(get_key, timeout_s)
        if ticket is None and self.pool.status(get_key) == "expired":
            raise LeaseExpired(f"{get_key!r} was dropped unread when its lease passed")
        return None if ticket is None else self.pool.read(ticket)

    def reserve(self, from_stage: Any, to_stage: Any, put_key: str, nbytes: int) -> PoolReservation:
        if self._closed:
            raise PoolFullError("closed: memory connector is closed")
        reservation = self.pool.reserve(put_key, nbytes)
        inner = reservation.commit

        def commit() -> PutResult:
            ok, size, meta = inner()
            return (ok, size, {"key": put_key, "size": size}) if ok else (ok, size, meta)

        return PoolReservation(reservation.buffer, commit=commit, abort=reservation.abort)

    def cleanup(self, request_id: str) -> None:
        self.pool.cleanup(request_id)

    def health(self) -> dict[str, Any]:
        mode = "objects" if self.pool.storage is None else "pool"
        return {"ok": not self._closed and not self.pool.closed, "type": "memory", "storage": mode,
                **self.pool.stats()}

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.shared_name is None or _release_shared(self.shared_name, self.pool):
            self.pool.close()

    def __enter__(self) -> "MemoryConnector":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
