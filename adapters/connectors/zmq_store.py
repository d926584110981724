"""What a zmq sender holds: payload frames in a lease table, bounded in bytes and count.

Thread-safe (one lock): the caller's thread publishes and reserves, the serving thread serves.
Bookkeeping (readers, leases, "expired" vs "not found") is :class:`kvferry.core.pool.LeaseTable`;
this adds the byte and count bounds and the reservations a sender writes into before publishing.
Times come from the injected ``clock`` (seconds, monotonic).

Bounds: ``held_bytes + reserved_bytes <= pool_bytes`` at all times; at most ``max_payloads``
published payloads. A payload's frames are dropped from the table when its last permitted
reader was served, when its lease passes, or on cleanup (zmq keeps its own references to
frames that are still being sent).
"""

from __future__ import annotations

import logging
import sys
import threading
from typing import Any, Callable

import attrs

from kvferry.adapters.connectors.zmq_protocol import MAX_PAYLOAD_FRAMES
from kvferry.core.errors import ConfigError
from kvferry.core.pool import EntryState, LeaseTable

__all__ = [
    "Held", "PublishFailure", "HeldPayloads", "STORE_COUNTERS", "ZmqReservation", "as_frames",
]

logger = logging.getLogger(__name__)

STORE_COUNTERS = ("puts", "put_failures", "bytes_put", "served", "bytes_served", "expired")


@attrs.frozen
class PublishFailure:
    """Why a put or reserve was refused: ``reason`` is ``pool_full``, ``too_large`` or
    ``closed``; ``detail`` is human text."""

    reason: str
    detail: str


@attrs.frozen
class Held:
    """A published payload: its frames (kept by reference) and their byte sizes."""

    frames: tuple[Any, ...]
    sizes: tuple[int, ...]


@attrs.define(eq=False)
class HeldPayloads:
    """The sender's payloads by key. Every method takes the lock; none blocks on I/O except
    the ``send`` callback given to :meth:`serve` (a non-blocking zmq send)."""

    pool_bytes: int
    max_payloads: int
    clock: Callable[[], float]
    _table: LeaseTable = attrs.field(init=False, factory=LeaseTable)
    _lock: threading.Lock = attrs.field(init=False, factory=threading.Lock)
    _held_bytes: int = attrs.field(init=False, default=0)
    _reserved_bytes: int = attrs.field(init=False, default=0)
    _next_check: float | None = attrs.field(init=False, default=None)
    _closed: bool = attrs.field(init=False, default=False)
    _counters: dict[str, int] = attrs.field(
        init=False, factory=lambda: dict.fromkeys(STORE_COUNTERS, 0)
    )

    def _room_locked(self, size: int, reclaim: int, new_entry: bool) -> PublishFailure | None:
        if self._closed:
            return PublishFailure("closed", "the connector is closed")
        if size > self.pool_bytes:
            return PublishFailure(
                "too_large", f"payload of {size} bytes exceeds pool_bytes={self.pool_bytes}"
            )
        used = self._held_bytes + self._reserved_bytes - reclaim
        if used + size > self.pool_bytes:
            return PublishFailure(
                "pool_full",
                f"pool full: {size} bytes requested, {used} of {self.pool_bytes} in use",
            )
        if new_entry and len(self._table) >= self.max_payloads:
            return PublishFailure(
                "pool_full", f"pool full: {len(self._table)} payloads held (max_payloads)"
            )
        return None

    def reserve(self, nbytes: int) -> PublishFailure | None:
        """Count ``nbytes`` against the pool until :meth:`publish` (with ``reserved``) or
        :meth:`unreserve`."""
        with self._lock:
            self._expire_locked(self.clock())
            failure = self._room_locked(nbytes, 0, False)
            if failure is None:
                self._reserved_bytes += nbytes
            return failure

    def unreserve(self, nbytes: int) -> None:
        with self._lock:
            self._reserved_bytes = max(0, self._reserved_bytes - nbytes)

    def publish(
        self, key: str, held: Held, *, readers: int, lease_s: float, reserved: int = 0
    ) -> PublishFailure | None:
        """Publish ``held`` under ``key`` (an older readable payload of the key is replaced).
        ``reserved``: bytes of a reservation this payload turns into (already counted)."""
        size = sum(held.sizes)
        with self._lock:
            now = self.clock()
            self._expire_locked(now)
            self._reserved_bytes = max(0, self._reserved_bytes - reserved)
            old = self._table.entry(key)
            failure = self._room_locked(size, old.size if old else 0, old is None)
            if failure is not None:
                self._counters["put_failures"] += 1
                return failure
            for gone in self._table.drop_key(key):
                self._held_bytes -= gone.size
            self._table.publish(key, held, size, readers=readers, now_s=now, lease_s=lease_s)
            self._held_bytes += size
            deadline = now + lease_s
            if self._next_check is None or deadline < self._next_check:
                self._next_check = deadline
            self._counters["puts"] += 1
            self._counters["bytes_put"] += size
            return None

    def serve(self, key: str, send: Callable[[Held], bool]) -> str:
        """Hand ``key``'s payload to ``send``; one reader is consumed only if it returns True.

        Returns ``"sent"``, ``"gone"`` (send failed: the peer is unreachable, nothing was
        consumed), ``"expired"`` or ``"not_found"``.
        """
        with self._lock:
            now = self.clock()
            entry = self._table.entry(key)
            if entry is not None and now >= entry.deadline_s:
                self._expire_locked(now)
                entry = None
            if entry is None:
                return "expired" if self._table.status(key) == EntryState.EXPIRED else "not_found"
            if not send(entry.handle):
                return "gone"
            ticket = self._table.take(key, now)
            if ticket is not None and self._table.release(ticket.ticket_id) is not None:
                self._held_bytes -= entry.size
            self._counters["served"] += 1
            self._counters["bytes_served"] += entry.size
            return "sent"

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
        for item in self._table.expire(now):
            if item.freed:
                self._held_bytes -= item.entry.size
            if item.kind == "unread":
                self._counters["expired"] += 1
                logger.warning("zmq payload %r expired unread after %.1fs (lease_s)",
                               item.entry.key, item.entry.lease_s)
        self._next_check = self._table.next_deadline()

    def drop_request(self, request_id: str) -> None:
        with self._lock:
            for gone in self._table.drop_request(request_id):
                self._held_bytes -= gone.size

    def close(self) -> None:
        """Drop everything; later publishes and reservations fail with ``closed``."""
        with self._lock:
            self._closed = True
            self._table = LeaseTable()
            self._held_bytes = 0
            self._reserved_bytes = 0
            self._next_check = None

    def stats(self) -> dict[str, int]:
        with self._lock:
            self._expire_locked(self.clock())
            out = dict(self._counters)
            out["held_bytes"] = self._held_bytes
            out["reserved_bytes"] = self._reserved_bytes
            out["held_payloads"] = len(self._table)
            out["pool_bytes"] = self.pool_bytes
        return out


# --------------------------------------------------------------------------- put data -> frames


def _flat(buffer: Any, what: str) -> memoryview:
    try:
        view = memoryview(buffer)
    except TypeError:
        raise ConfigError(f"{what} is a {type(buffer).__name__}, not a bytes-like buffer") from None
    if not view.c_contiguous:
        raise ConfigError(f"{what} is not contiguous")
    if view.ndim == 1 and view.format == "B":
        return view
    return view.cast("B") if view.ndim else view.cast("B", (view.nbytes,))


def _tensor_frame(tensor: Any, what: str) -> memoryview:
    torch = sys.modules["torch"]
    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous().reshape(-1)
    if t.dtype != torch.uint8:
        t = t.view(torch.uint8)
    return _flat(t.numpy(), what)


def _is_tensor(obj: Any) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(obj, torch.Tensor)


def as_frames(data: Any) -> tuple[tuple[memoryview, ...], tuple[int, ...]]:
    """Payload data -> (frames, their byte sizes), without copying CPU data.

    Accepts a bytes-like object, a tensor (normally 1-D ``uint8``; device tensors are copied
    to the CPU), or a list/tuple of those (zero-copy frames whose concatenation is the
    payload). Anything else, a non-contiguous buffer, or more than 65536 frames: ConfigError.
    """
    if isinstance(data, (list, tuple)):
        if len(data) > MAX_PAYLOAD_FRAMES:
            raise ConfigError(f"payload has {len(data)} frames; at most {MAX_PAYLOAD_FRAMES}")
        items = list(data)
    else:
        items = [data]
    frames = []
    for index, item in enumerate(items):
        what = f"payload frame {index}"
        if _is_tensor(item):
            frames.append(_tensor_frame(item, what))
        elif isinstance(item, (str, dict, list, tuple)) or item is None:
            raise ConfigError(f"{what} is a {type(item).__name__}, not a bytes-like buffer")
        else:
            frames.append(_flat(item, what))
    return tuple(frames), tuple(f.nbytes for f in frames)


@attrs.define(eq=False)
class ZmqReservation:
    """Pool space reserved by a sender before the payload exists (``Reservation`` port).

    ``buffer`` is a fresh writable 1-D ``uint8`` CPU tensor of exactly the reserved size; the
    sender writes the payload into it, then ``commit()`` publishes it (zero further copies:
    the tensor itself becomes the frame zmq sends) or ``abort()`` gives the space back. Both
    are idempotent; the first one called wins.
    """

    buffer: Any
    _publish: Callable[[Held, int], tuple[bool, int, Any]]
    _unreserve: Callable[[int], None]
    _nbytes: int
    _result: tuple[bool, int, Any] | None = None
    _lock: threading.Lock = attrs.Factory(threading.Lock)

    def commit(self) -> tuple[bool, int, Any]:
        with self._lock:
            if self._result is None:
                frame = _tensor_frame(self.buffer, "reserved buffer")
                self._result = self._publish(Held((frame,), (frame.nbytes,)), self._nbytes)
            return self._result

    def abort(self) -> None:
        with self._lock:
            if self._result is None:
                self._unreserve(self._nbytes)
                self._result = (False, 0, {"reason": "aborted", "detail": "reservation aborted"})
