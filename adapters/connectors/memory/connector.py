"""The in-process connector (threads of one process).

``MemoryConnector`` keeps payloads in one preallocated 1-D ``uint8`` tensor (``storage:
"pool"``, the default; ``get`` returns zero-copy :class:`~.pool_buffer.PooledBuffer` views
tied to their release: dropping the buffer and every view of it gives the region back) or as
immutable ``bytes`` copies (``storage: "objects"``; ``get`` returns ``bytes``). Both are
bounded by ``pool_bytes`` and follow the contract of :class:`kvferry.core.ports.Connector`:
``readers`` gets per put (default 1), a lease of ``lease_s`` seconds (default 60), ``put``
failures as ``(False, 0, {"reason", "detail"})``, blocking gets woken by a condition variable.
A reader of this process is never presumed dead: a buffer held past ``hold_s`` is reported,
never revoked (revoking would let the next put overwrite bytes the reader still reads).

Two connectors built from configs with the same ``shared_name`` share one store (a sender and a
receiver stage in one process); the store closes with the last of them.

The pool machinery lives in :mod:`.pool` (re-exported here); the shm connector's sender
runs the same :class:`LocalPool` over a shared-memory segment.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from typing import Any

import attrs

from kvferry.adapters.connectors.memory.pool import (
    DEFAULT_LEASE_S,
    DEFAULT_READERS,
    IN_PROCESS,
    LocalPool,
    MonotonicClock,
    PoolReservation,
    PoolSettings,
    payload_parts,
    put_failure,
    write_parts,
)
from kvferry.adapters.connectors.pool_buffer import PooledBuffer
from kvferry.core.errors import ConfigError, LeaseExpired, PoolFullError
from kvferry.core.ports import PutResult
from kvferry.core.tombstones import failed_error

__all__ = [
    "DEFAULT_LEASE_S",
    "DEFAULT_READERS",
    "IN_PROCESS",
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

MEMORY_DEFAULT_POOL_BYTES = 256 << 20


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
    def from_config(cls, config: Mapping[str, Any] | None = None) -> MemoryConnector:
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

    def put_frames(self, from_stage: Any, to_stage: Any, put_key: str, frames: Any) -> PutResult:
        """:meth:`put` of the frames' concatenation, never joined first (the FramesPut ability)."""
        return self.put(from_stage, to_stage, put_key, frames)

    def get(
        self,
        from_stage: Any,
        to_stage: Any,
        get_key: str,
        metadata: Mapping[str, Any] | None = None,
    ) -> tuple[Any, int] | None:
        if self._closed:
            return None
        ticket = self.pool.take(get_key)
        return None if ticket is None else self.pool.read(ticket)

    def get_blocking(
        self,
        from_stage: Any,
        to_stage: Any,
        get_key: str,
        metadata: Mapping[str, Any] | None = None,
        *,
        timeout_s: float,
    ) -> tuple[Any, int] | None:
        if self._closed:
            return None
        ticket = self.pool.take_blocking(get_key, timeout_s)
        if ticket is None:
            status = self.pool.status(get_key)
            if status == "expired":
                raise LeaseExpired(f"{get_key!r} was dropped unread when its lease passed")
            failure = self.pool.failure(get_key) if status == "failed" else None
            if failure is not None:
                raise failed_error(get_key, failure)
        return None if ticket is None else self.pool.read(ticket)

    def publish_failure(self, from_stage: Any, to_stage: Any, put_key: str, failure: Any) -> bool:
        """Record that ``put_key`` will never come (the FailureRecords ability): no space (a
        payload under it is dropped)."""
        return not self._closed and self.pool.fail(put_key, failure)

    def reserve(self, from_stage: Any, to_stage: Any, put_key: str, nbytes: int) -> PoolReservation:
        if self._closed:
            raise PoolFullError("closed: memory connector is closed")
        reservation = self.pool.reserve(put_key, nbytes)
        inner = reservation.commit

        def commit() -> PutResult:
            ok, size, meta = inner()
            return (ok, size, {"key": put_key, "size": size}) if ok else (ok, size, meta)

        return PoolReservation(
            reservation.buffer, commit=commit, abort=reservation.abort, host_bytes=reservation.host_bytes
        )

    def cleanup(self, request_id: str) -> None:
        self.pool.cleanup(request_id)

    def health(self) -> dict[str, Any]:
        mode = "objects" if self.pool.storage is None else "pool"
        return {"ok": not self._closed and not self.pool.closed, "type": "memory", "storage": mode, **self.pool.stats()}

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.shared_name is None or _release_shared(self.shared_name, self.pool):
            self.pool.close()

    def __enter__(self) -> MemoryConnector:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
