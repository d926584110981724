"""Hexagonal ports: the small interfaces the manager needs from the outside world.

(Network port *numbers* live in :mod:`kvferry.core.addressing`; these are interfaces.)

Every Protocol here has an in-memory adapter that passes the same contract tests as the real
ones. Optional abilities are separate small Protocols, checked with ``isinstance`` once, where a
connector is wired, never with scattered ``hasattr`` calls.

Data vocabulary used below:

- *payload data* handed to ``put``: a bytes-like object, a 1-D ``uint8`` tensor, or a sequence
  of bytes-like buffers ("frames") whose concatenation is the payload. Connectors never look
  inside a payload.
- *received data* returned by ``get``: one of bytes / bytearray / memoryview, a 1-D ``uint8``
  tensor, a :class:`PoolBuffer`, or a sequence of buffers (frames, concatenated meaning).
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

__all__ = [
    "PutResult",
    "GetResult",
    "Connector",
    "FramesPut",
    "BlockingGet",
    "FailureRecords",
    "GetMany",
    "BatchedReleases",
    "SenderAware",
    "Reservable",
    "Reservation",
    "PiecesPut",
    "PoolBuffer",
    "CollectiveGroup",
    "Clock",
    "Implements",
]

#: ``(ok, size_in_bytes, metadata)``. On failure ``ok`` is False, size is 0 and metadata is a
#: dict with ``"reason"`` (a short machine word such as ``"pool_full"``, ``"too_large"``,
#: ``"closed"``, ``"error"``) and ``"detail"`` (human text).
PutResult = tuple[bool, int, "dict[str, Any] | None"]
#: ``(data, size_in_bytes)`` or None for "not there (yet)".
GetResult = "tuple[Any, int] | None"


@runtime_checkable
class Connector(Protocol):
    """Moves opaque payloads from a sender stage to a receiver stage under a string key.

    Called by the manager: ``put`` once per (request, target key) on the sender; ``get`` once
    or repeatedly (polling) per receive key on the receiver. Keyword names are fixed
    (``from_stage``, ``to_stage``, ``put_key`` / ``get_key``, ``data``, ``metadata``) so that a
    connector written for the reference plugs in unchanged.

    Consume semantics: a payload is readable by ``readers`` gets (default 1, set per put or in
    config); after that, or when its lease (``lease_s``) expires, it is freed and further gets
    return None ("not found"), never another request's data. Memory is bounded: when the pool
    is full, ``put`` returns ``(False, 0, {"reason": "pool_full", ...})`` promptly.
    """

    def put(self, from_stage: str, to_stage: str, put_key: str, data: Any) -> PutResult:
        """Store ``data`` under ``put_key``. Never raises for transfer faults: returns ok=False."""
        ...

    def get(
        self,
        from_stage: str,
        to_stage: str,
        get_key: str,
        metadata: Mapping[str, Any] | None = None,
    ) -> Any:
        """Return ``(data, size)`` if the payload is there now, else None. Non-blocking.

        ``metadata`` is what ``put`` returned (use directly), or a partial dict with only
        ``source_host`` / ``source_port`` (ask that sender), or None (use the default sender
        set by ``update_sender_info`` where the connector has one).
        """
        ...

    def cleanup(self, request_id: str) -> None:
        """Drop everything held for keys of ``request_id``. Idempotent."""
        ...

    def health(self) -> dict[str, Any]:
        """A JSON-able snapshot: at least ``{"ok": bool, "type": str}`` plus counters."""
        ...

    def close(self) -> None:
        """Release every resource. Idempotent; connectors are also context managers."""
        ...


@runtime_checkable
class FramesPut(Protocol):
    """Optional: a connector that takes a payload as zero-copy frames (kvferry's own do).

    ``frames`` is a sequence of bytes-like buffers (a header, then tensor memoryviews and zero
    padding) whose concatenation is the payload; the connector copies them into its store
    without joining them first. A connector without this ability gets exactly what the
    reference hands every connector: one bytes-like payload, or, when its class says
    ``supports_raw_data = True`` and the KV lives on a device, the payload as one device
    ``uint8`` tensor. (The reference's connectors serialize whatever ``put`` is given, so a
    list of frames would reach a reference receiver as a list, not as a payload.)
    """

    def put_frames(self, from_stage: str, to_stage: str, put_key: str, frames: Sequence[Any]) -> PutResult:
        """Store the concatenation of ``frames`` under ``put_key``; results as :meth:`Connector.put`."""
        ...


@runtime_checkable
class BlockingGet(Protocol):
    """Optional: wait for arrival (notification, not sleep-polling) until a deadline."""

    def get_blocking(
        self,
        from_stage: str,
        to_stage: str,
        get_key: str,
        metadata: Mapping[str, Any] | None = None,
        *,
        timeout_s: float,
    ) -> Any:
        """Like ``get`` but waits up to ``timeout_s`` seconds; None when the deadline passes.

        Raises :class:`~kvferry.core.errors.LeaseExpired` (at once, not at the deadline) when
        the sender reports that the key was dropped unread because its lease passed: waiting
        longer cannot help. ``get`` keeps answering None ("not found") for such a key. May
        raise :class:`~kvferry.core.errors.SenderUnavailable` (also at once) when the sender is
        known to have died: the key died with it.
        """
        ...


@runtime_checkable
class FailureRecords(Protocol):
    """Optional: a sender that can say a key will never come (a failure record, a tombstone).

    Called by the sender stage when a transfer it promised fails (its pool stayed full, its save
    ran out of time), once per key it did not publish. The record takes no pool space and is
    never data: ``get`` of the key keeps answering None, and a receiver's
    :meth:`BlockingGet.get_blocking` raises :class:`~kvferry.core.errors.FailedAtSender` (the
    record's kind and reason) at once, also when it was already waiting. Connectors without
    this ability leave the receiver to its deadline.
    """

    def publish_failure(self, from_stage: str, to_stage: str, put_key: str, failure: Any) -> bool:
        """Record ``failure`` (a :class:`~kvferry.core.tombstones.SenderFailure`) under
        ``put_key``, dropping a payload readable under it (the failed transfer's pages are of
        no use; a reader holding one keeps it until it releases); False when the connector is
        closed or cannot record it. Never raises for transfer faults."""
        ...


@runtime_checkable
class GetMany(Protocol):
    """Optional: several keys from one sender in one exchange (the shm connector). Never waits."""

    def get_many(
        self, from_stage: Any, to_stage: Any, keys: list[str], metadata: Mapping[str, Any] | None = None
    ) -> list[tuple[Any, int] | None]:
        """Per key, in order: ``(data, size)`` as :meth:`Connector.get` returns it, or None (not
        there now). A key missing here may still be fetched with ``get``/``get_blocking``."""
        ...


@runtime_checkable
class BatchedReleases(Protocol):
    """Optional: pool buffers released inside the block leave together at its end (one message
    per sender instead of one per buffer)."""

    def batched_releases(self) -> contextlib.AbstractContextManager[None]:
        """A context manager; nested blocks send at the outermost block's end."""
        ...


@runtime_checkable
class SenderAware(Protocol):
    """Optional: a receiver-side connector that can be told its default sender endpoint."""

    def update_sender_info(self, host: str, port: int) -> None: ...


@runtime_checkable
class Reservation(Protocol):
    """A writable region of a connector's pool, reserved by the sender before the data exists.

    ``buffer`` is a writable 1-D ``uint8`` tensor of exactly the reserved size; the sender
    writes the payload bytes into it (extraction gathers straight into it) and then calls
    ``commit()`` to publish it under the key, or ``abort()`` to give the space back. Exactly one
    of the two is called; both are idempotent.
    """

    buffer: Any

    def commit(self) -> PutResult: ...

    def abort(self) -> None: ...


@runtime_checkable
class Reservable(Protocol):
    """Optional: connectors whose pool the sender can write into directly (zero extra copy)."""

    def reserve(self, from_stage: str, to_stage: str, put_key: str, nbytes: int) -> Reservation:
        """Reserve ``nbytes``; raises :class:`~kvferry.core.errors.PoolFullError` when full."""
        ...


@runtime_checkable
class PiecesPut(Protocol):
    """Optional: connectors whose receivers read a payload in place from memory the sender
    registered with them (the engine's KV cache), so that only its header is copied.

    ``register_memory(tensor)`` makes a host tensor's bytes readable by receivers (before the
    first get of a payload in it). ``put_pieces`` publishes ``head`` (bytes copied into the
    pool) followed by ``spans``, absolute ``(address, length)`` ranges of registered memory,
    as one payload; the caller keeps those bytes unchanged until ``on_free`` is called (once:
    every reader read it, or its lease passed, or it was dropped). A result like ``put``'s;
    on failure ``on_free`` is never called. ``max_pieces``: the most spans one put takes."""

    max_pieces: int

    def register_memory(self, tensor: Any) -> None: ...

    def put_pieces(
        self,
        from_stage: str,
        to_stage: str,
        put_key: str,
        head: Any,
        spans: Sequence[tuple[int, int]],
        on_free: Any,
    ) -> PutResult: ...


@runtime_checkable
class PoolBuffer(Protocol):
    """Received data that lives in a connector's pool: decode zero-copy, then release.

    ``tensor`` is a 1-D ``uint8`` view. The caller releases only after every tensor decoded from
    it was moved or cloned. ``release()`` is idempotent.
    """

    tensor: Any

    def release(self) -> None: ...


@runtime_checkable
class CollectiveGroup(Protocol):
    """The group operations the manager needs (torch.distributed or in-process threads).

    Every call is collective: all ranks of the group make the same call in the same order;
    ``src``/``dst`` are ranks *within this group* (0..size-1). Each call takes ``timeout_s``
    and raises :class:`~kvferry.core.errors.TransferTimeout` when the peers do not arrive.
    """

    @property
    def rank(self) -> int: ...

    @property
    def size(self) -> int: ...

    def broadcast_object(self, obj: Any, src: int, *, timeout_s: float) -> Any: ...

    def broadcast_tensor(self, tensor: Any, src: int, *, timeout_s: float) -> Any: ...

    def send_object(self, obj: Any, dst: int, *, timeout_s: float) -> None: ...

    def recv_object(self, src: int, *, timeout_s: float) -> Any: ...

    def send_tensor(self, tensor: Any, dst: int, *, timeout_s: float) -> None: ...

    def recv_tensor(self, tensor: Any, src: int, *, timeout_s: float) -> Any: ...


@runtime_checkable
class Clock(Protocol):
    """Monotonic time in seconds. Injected so policies and tests never read the real clock."""

    def monotonic(self) -> float: ...


class Implements:
    """``isinstance(obj, protocol)`` remembered for the last object asked about. A runtime
    Protocol check costs tens of microseconds, and a send or receive path asks about the same
    connector on every request; a new object is checked again."""

    __slots__ = ("protocol", "_last", "_answer")

    def __init__(self, protocol: type) -> None:
        self.protocol = protocol
        self._last: Any = None
        self._answer = False

    def __call__(self, obj: Any) -> bool:
        if obj is not self._last or obj is None:
            self._answer = isinstance(obj, self.protocol)
            self._last = obj
        return self._answer
