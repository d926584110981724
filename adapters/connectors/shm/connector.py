"""The shared-memory connector: one host, separate processes, zero-copy reads.

Sender role (``role: "sender"``, ``port``): at start it reaps leftovers of dead owners in its
namespace, creates ONE segment of ``pool_bytes`` (0600, pre-faulted) and serves it through a
control thread (:mod:`.server`) at ``ipc://{runtime dir}/ctl-{port}.sock``. ``put`` copies
the payload into a pool region (or the caller writes it there through ``reserve``) and
publishes it; nothing is sent until a receiver asks.

Receiver role (``role: "receiver"``): ``get`` asks the sender's control endpoint for a key
(immediately, or ``get_blocking`` parks the request at the sender until the key is published
or the deadline passes), naming its pid, receives ``(segment, offset, size, ticket)``, maps the
segment once and returns a tied :class:`~.pool_buffer.PooledBuffer` whose tensor is a view
into it. ``release()`` tells the sender and waits for its acknowledgement; ``release_soon()``
(and dropping the buffer with every view of it) sends the release without waiting. The sender
frees the region when every reader released it; a reader holding it past ``hold_s`` loses it
only once its process is gone (see :mod:`.server`). A get whose sender dies (its owner file
names a dead process and nothing listens on its socket,
:func:`~.segment.sender_gone`) ends within ``LIVENESS_S`` of that, not at its deadline:
``get_blocking`` raises SenderUnavailable, ``get`` and ``get_many`` miss (counted
``miss_sender_gone``).

Endpoints: ``put`` metadata carries ``endpoint``; partial metadata ``{"source_host",
"source_port"}``, ``update_sender_info(host, port)`` and config ``sender_port`` map to the
endpoint derived from (namespace, port) (the host is not used: shm is same-host by nature).
Configuration and the sender's parts: :mod:`.config`; names and cleanup rules:
:mod:`.segment` and docs/connectors.md.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import threading
import weakref
from collections.abc import Iterator, Mapping
from typing import Any

import attrs
import zmq

from kvferry.adapters.connectors.memory.pool import PoolReservation, put_failure
from kvferry.adapters.connectors.pool_buffer import PooledBuffer
from kvferry.adapters.connectors.shm.config import (
    SHM_DEFAULT_POOL_BYTES,
    SenderSide,
    ShmConfig,
    start_sender,
)
from kvferry.adapters.connectors.shm.control import MAX_MANY_KEYS, ControlClient, check_grant, granted_tickets
from kvferry.adapters.connectors.shm.segment import (
    Segment,
    control_endpoint,
    open_segment,
    reap_namespace,
    sender_gone,
)
from kvferry.core.addressing import resolve_get_source
from kvferry.core.errors import ConfigError, LeaseExpired, PayloadError, SenderUnavailable, UnreadableGrant
from kvferry.core.ports import PutResult
from kvferry.core.recent import Recent
from kvferry.core.tombstones import FAILED_REASON, FAILURE_FIELD, decode_failure, failed_error
from kvferry.core.validate import check_port

__all__ = ["SHM_DEFAULT_POOL_BYTES", "ShmConfig", "ShmConnector"]

logger = logging.getLogger(__name__)


#: Unreadable keys a receiver remembers for a later blocking get (the oldest are forgotten).
_UNREADABLE_KEPT = 4096


def _release_message(grant: dict[str, Any]) -> dict[str, Any]:
    """The release of a grant's ticket, naming its segment (a restarted sender ignores it)."""
    message: dict[str, Any] = {"op": "release", "ticket": grant["ticket"]}
    if isinstance(grant.get("seg"), str):
        message["seg"] = grant["seg"]
    return message


@attrs.define(eq=False)
class ShmConnector:
    """Shared-memory connector; see the module docstring. Build with :meth:`from_config`."""

    config: ShmConfig
    _sender: SenderSide | None = attrs.field(default=None, alias="sender")
    _default_endpoint: str | None = attrs.field(init=False, default=None)
    _context: zmq.Context | None = attrs.field(init=False, default=None)
    _clients: dict[str, ControlClient] = attrs.field(init=False, factory=dict)
    _segments: dict[str, Segment] = attrs.field(init=False, factory=dict)
    _current: dict[str, str] = attrs.field(init=False, factory=dict)  # endpoint -> segment
    _endpoints: dict[int, str] = attrs.field(init=False, factory=dict)  # port -> endpoint
    _lock: threading.Lock = attrs.field(init=False, factory=threading.Lock)
    _batch: threading.local = attrs.field(init=False, factory=threading.local)
    _closed: bool = attrs.field(init=False, default=False)
    counters: dict[str, int] = attrs.field(init=False, factory=dict)
    #: Keys whose grant this receiver could not read, with why (oldest first, bounded): the
    #: grant drained the key, so a blocking get of it raises at once (once) instead of waiting.
    _unreadable: Recent[str, str] = attrs.field(init=False, factory=lambda: Recent(_UNREADABLE_KEPT))

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> ShmConnector:
        cfg = ShmConfig.from_config(config)
        reap_namespace(cfg.namespace, cfg.runtime_base, cfg.shm_dir)
        sender = start_sender(cfg) if cfg.role == "sender" else None
        connector = cls(cfg, sender=sender)
        if sender is not None:
            weakref.finalize(connector, sender.close)
        if cfg.sender_port is not None:
            connector.update_sender_info("127.0.0.1", cfg.sender_port)
        return connector

    # ------------------------------------------------------------------------- common
    @property
    def role(self) -> str:
        return self.config.role

    @property
    def port(self) -> int | None:
        return self.config.port

    @property
    def endpoint(self) -> str | None:
        """This sender's control endpoint (None for a receiver)."""
        return self._sender.server.endpoint if self._sender is not None else None

    def _count(self, name: str, n: int = 1) -> None:
        self.counters[name] = self.counters.get(name, 0) + n

    def update_sender_info(self, host: str, port: int) -> None:
        """Set the default sender: the one bound with ``port`` in this namespace."""
        check_port("sender port", port, expected="1..65535")
        self._default_endpoint = control_endpoint(self.config.namespace, port, self.config.runtime_base)

    # ------------------------------------------------------------------------- sender side
    def _metadata(self, key: str, size: int) -> dict[str, Any]:
        assert self._sender is not None  # a sender's put or commit
        return {
            "endpoint": self.endpoint,
            "namespace": self.config.namespace,
            "source_port": self.config.port,
            "segment": self._sender.segment.name,
            "key": key,
            "size": size,
        }

    def put(self, from_stage: Any, to_stage: Any, put_key: str, data: Any) -> PutResult:
        if self._closed:
            return put_failure("closed", "shm connector is closed")
        if self._sender is None:
            return put_failure("error", "a receiver-role shm connector cannot put")
        ok, size, meta = self._sender.pool.put(put_key, data)
        return (True, size, self._metadata(put_key, size)) if ok else (ok, size, meta)

    def put_frames(self, from_stage: Any, to_stage: Any, put_key: str, frames: Any) -> PutResult:
        """:meth:`put` of the frames' concatenation, never joined first (the FramesPut ability)."""
        return self.put(from_stage, to_stage, put_key, frames)

    def reserve(self, from_stage: Any, to_stage: Any, put_key: str, nbytes: int) -> PoolReservation:
        """A writable view of the segment for ``put_key``; raises PoolFullError when full."""
        if self._sender is None:
            raise ConfigError("a receiver-role shm connector cannot reserve")
        reservation = self._sender.pool.reserve(put_key, nbytes)
        inner = reservation.commit

        def commit() -> PutResult:
            ok, size, meta = inner()
            return (True, size, self._metadata(put_key, size)) if ok else (ok, size, meta)

        return PoolReservation(
            reservation.buffer, commit=commit, abort=reservation.abort, host_bytes=reservation.host_bytes
        )

    def publish_failure(self, from_stage: Any, to_stage: Any, put_key: str, failure: Any) -> bool:
        """Sender: record that ``put_key`` will never come (the FailureRecords ability): no
        segment space (a payload under it is dropped); a get waiting for the key is answered
        at once."""
        if self._closed or self._sender is None:
            return False
        return self._sender.pool.fail(put_key, failure)

    # ------------------------------------------------------------------------- receiver side
    def _resolve(self, metadata: Mapping[str, Any] | None) -> str | None:
        """The put's ``endpoint`` when the metadata carries one, else the sender
        :func:`~kvferry.core.addressing.resolve_get_source` names (its port in this namespace;
        the host is not used), else the default sender."""
        if metadata:
            endpoint = metadata.get("endpoint")
            if isinstance(endpoint, str) and endpoint.startswith("ipc://"):
                return endpoint
        source = resolve_get_source(metadata, None, needs_host=False)
        if source is None:
            return self._default_endpoint
        port = source.port
        endpoint = self._endpoints.get(port)
        if endpoint is None:  # derived once per port (path joins on every get add up)
            endpoint = control_endpoint(self.config.namespace, port, self.config.runtime_base)
            if len(self._endpoints) < 4096:
                self._endpoints[port] = endpoint
        return endpoint

    def _client(self, endpoint: str) -> ControlClient | None:
        with self._lock:
            if self._closed:
                return None
            client = self._clients.get(endpoint)
            if client is None:
                if self._context is None:
                    self._context = zmq.Context()
                path = endpoint[len("ipc://") :]
                client = ControlClient(
                    self._context, endpoint, self._on_stale(endpoint), gone=functools.partial(sender_gone, path)
                )
                self._clients[endpoint] = client
            return client

    def _on_stale(self, endpoint: str) -> Any:
        def release_stale(reply: dict[str, Any]) -> None:
            """A reply that came after its caller gave up (a get or a get_many past its
            deadline: a stopped or overloaded process): release every ticket it grants, or
            the sender keeps those regions for as long as this process lives."""
            tickets = granted_tickets(reply)
            client = self._clients.get(endpoint)
            if not tickets or client is None:
                return
            by_segment: dict[str | None, list[int]] = {}
            for ticket, segment in tickets:
                by_segment.setdefault(segment, []).append(ticket)
            for segment, some in by_segment.items():
                self._count("stale_grants_released", len(some))
                if not client.send_releases(some, segment, self.config.rpc_timeout_s):
                    self._count("release_unsent")
                    logger.warning(
                        "shm release of %d late-granted tickets could not be sent; the sender reclaims "
                        "them once this process is gone",
                        len(some),
                    )

        return release_stale

    def _segment(self, endpoint: str, name: str) -> Segment | None:
        """The mapping of segment ``name`` (mapped once). A sender serves one segment: when
        its endpoint names a new one (the sender restarted), the old mapping is dropped (its
        memory goes when the last view of it does)."""
        with self._lock:
            segment = self._segments.get(name)
            if segment is None and not self._closed:
                try:
                    segment = open_segment(name, self.config.shm_dir)
                except (OSError, ValueError) as exc:
                    logger.warning("shm segment %s cannot be mapped: %s", name, exc)
                    return None
                self._segments[name] = segment
                previous = self._current.get(endpoint)
                self._current[endpoint] = name
                old = self._segments.pop(previous, None) if previous is not None and previous != name else None
                if old is not None:
                    old.unmap()
            return segment

    def _fetch(self, metadata: Mapping[str, Any] | None, key: str, wait_s: float) -> tuple[Any, int] | None:
        if self._closed:
            return None
        if wait_s > 0 and self._unreadable:
            with self._lock:
                why = self._unreadable.pop(key, None)
            if why is not None:  # an earlier non-blocking get drained it: it cannot come
                raise UnreadableGrant(why)
        if self._sender is not None and metadata is None and self._default_endpoint is None:
            pool = self._sender.pool  # a sender reading its own pool: no round trip
            ticket = pool.take_blocking(key, wait_s) if wait_s > 0 else pool.take(key)
            if ticket is None and wait_s > 0 and pool.status(key) == "expired":
                raise LeaseExpired(f"{key!r} was dropped unread when its lease passed")
            failure = pool.failure(key) if ticket is None and wait_s > 0 else None
            if failure is not None:
                raise failed_error(key, failure)
            return None if ticket is None else pool.read(ticket)
        endpoint = self._resolve(metadata)
        if endpoint is None:
            self._count("miss_no_sender")
            return None
        if wait_s <= 0 and not os.path.exists(endpoint[len("ipc://") :]):
            self._count("miss_sender_absent")
            return None
        client = self._client(endpoint)
        if client is None:
            return None
        margin = self.config.rpc_timeout_s if wait_s <= 0 else min(self.config.rpc_timeout_s, 0.25)
        try:
            reply = client.request({"op": "get", "key": key, "wait_s": wait_s, "pid": os.getpid()}, wait_s + margin)
        except SenderUnavailable:  # the caller reports it (a typed outcome, logged there)
            self._count("miss_sender_gone")
            if wait_s > 0:
                raise
            return None
        if reply is None:
            self._count("miss_no_reply")
            return None
        if not reply.get("ok"):
            self._count(f"miss_{reply.get('reason', 'unknown')}")
            if wait_s > 0 and reply.get("reason") == "expired":
                raise LeaseExpired(f"the sender at {endpoint} dropped {key!r} unread when its lease passed")
            if wait_s > 0 and reply.get("reason") == FAILED_REASON:
                try:
                    failure = decode_failure(reply.get(FAILURE_FIELD))
                except PayloadError as exc:
                    self._count("bad_failure_records")
                    logger.warning("shm sender at %s: unreadable failure record for %r: %s", endpoint, key, exc)
                    return None
                raise failed_error(key, failure, endpoint)
            return None
        return self._view(endpoint, client, reply, key, blocking=wait_s > 0)

    def _view(
        self, endpoint: str, client: ControlClient, grant: dict[str, Any], key: str, blocking: bool = False
    ) -> tuple[Any, int] | None:
        """The granted region of ``key`` as a pool buffer. An unusable grant is counted
        (``bad_grants``), logged and given back; a blocking get then raises UnreadableGrant (the
        grant drained the key: waiting for it cannot help), a non-blocking one answers None and
        the next blocking get of the key raises it."""
        ticket = grant.get("ticket")
        problem = check_grant(grant)
        segment = self._segment(endpoint, grant["seg"]) if problem is None else None
        # the buffer's owner holds this tensor, so the mapping cannot close under the buffer
        # (an unmap that came first left an empty tensor: refused like a region outside it)
        mapped = segment.tensor if segment is not None else None
        if mapped is not None and grant["off"] + grant["size"] > mapped.numel():
            problem = "grant outside the mapped segment"
        if problem is not None or segment is None:
            problem = problem or f"segment {grant['seg']!r} not mappable"
            self._count("bad_grants")
            logger.warning("shm grant unusable (%s): %s", problem, grant)
            if isinstance(ticket, int):
                client.notify(_release_message(grant))
            why = (
                f"the sender at {endpoint} granted {key!r} in shared memory this receiver cannot read "
                f"({problem}); fix: run the receiver where "
                f"the sender's shm_dir ({self.config.shm_dir}) is the same directory (same host, same IPC "
                "namespace, same user), or use the zmq connector between hosts"
            )
            if blocking:
                raise UnreadableGrant(why)
            with self._lock:
                self._unreadable.note(key, why)
            return None
        self._count("gets_hit")
        client.prepare_releases()
        message = _release_message(grant)
        rpc = self.config.rpc_timeout_s

        def release() -> None:  # synchronous: once it returns, the sender may reuse the region
            try:
                acked = client.request(message, rpc)
            except SenderUnavailable:  # the region went with its sender: nothing to give back
                self._count("release_sender_gone")
                return
            if acked is None:
                self._count("release_unacknowledged")
                logger.warning(
                    "shm release of ticket %s not acknowledged; the sender reclaims it once this process is gone",
                    ticket,
                )

        def release_soon() -> None:  # fire-and-forget: the sender frees it when this arrives
            batch = getattr(self._batch, "items", None)
            if batch is not None:  # within batched_releases() of this thread: leaves at its end
                batch.append((client, grant["ticket"], grant["seg"]))
                return
            if not client.send_release(grant["ticket"], grant["seg"], rpc):
                self._count("release_unsent")
                if client.closed:  # dropped after close (at exit): counted, not a line per buffer
                    return
                logger.warning(
                    "shm release of ticket %s could not be sent; the sender reclaims it once this process is gone",
                    ticket,
                )

        buffer = PooledBuffer.tied_region(
            mapped, segment.address + grant["off"], grant["size"], on_release=release, on_release_soon=release_soon
        )
        return buffer, grant["size"]

    def flush_releases(self, timeout_s: float | None = None) -> bool:
        """Wait until every sender this receiver talks to processed the releases sent so far
        without waiting (``release_soon``, dropped buffers). True when all confirmed in time."""
        timeout = self.config.rpc_timeout_s if timeout_s is None else float(timeout_s)
        with self._lock:
            clients = list(self._clients.values())
        return all([client.flush_releases(timeout) for client in clients])

    def get(
        self, from_stage: Any, to_stage: Any, get_key: str, metadata: Mapping[str, Any] | None = None
    ) -> tuple[Any, int] | None:
        """Non-blocking: one round trip to the sender (None: not there, or no sender)."""
        return self._fetch(metadata, get_key, 0.0)

    def get_many(
        self, from_stage: Any, to_stage: Any, keys: list[str], metadata: Mapping[str, Any] | None = None
    ) -> list[tuple[Any, int] | None]:
        """Non-blocking gets of several keys from one sender in one round trip (a "get_many"
        message each ``MAX_MANY_KEYS``): per key ``(data, size)`` or None (not there). Without
        a remote sender to ask, each key as :meth:`get`."""
        local = self._closed or (self._sender is not None and metadata is None)
        endpoint = None if local else self._resolve(metadata)
        client = None if endpoint is None or not os.path.exists(endpoint[len("ipc://") :]) else self._client(endpoint)
        if endpoint is None or client is None:
            return [self._fetch(metadata, key, 0.0) for key in keys]
        out: list[tuple[Any, int] | None] = []
        for at in range(0, len(keys), MAX_MANY_KEYS):
            part = keys[at : at + MAX_MANY_KEYS]
            try:
                reply = client.request({"op": "get_many", "keys": part, "pid": os.getpid()}, self.config.rpc_timeout_s)
            except SenderUnavailable:
                self._count("miss_sender_gone")
                reply = None
            entries = reply.get("grants") if reply is not None and reply.get("ok") else None
            if not isinstance(entries, list) or len(entries) != len(part):
                self._count("miss_no_reply" if reply is None else "bad_grants")
                out.extend([None] * len(part))
                continue
            for key, entry in zip(part, entries):
                if not isinstance(entry, dict) or not entry.get("ok"):
                    reason = entry.get("reason", "unknown") if isinstance(entry, dict) else "unknown"
                    self._count(f"miss_{reason}")
                    out.append(None)
                else:
                    out.append(self._view(endpoint, client, entry, key))
        return out

    @contextlib.contextmanager
    def batched_releases(self) -> Iterator[None]:
        """Within this block, this thread's fire-and-forget releases (``release_soon``, a
        dropped buffer) wait, and leave at its end in one message per sender segment."""
        if getattr(self._batch, "items", None) is not None:  # nested: the outer block sends
            yield
            return
        self._batch.items = []
        try:
            yield
        finally:
            items, self._batch.items = self._batch.items, None
            groups: dict[tuple[int, str], tuple[ControlClient, list[int]]] = {}
            for client, ticket, segment in items:
                groups.setdefault((id(client), segment), (client, []))[1].append(ticket)
            for (_, segment), (client, tickets) in groups.items():
                if not client.send_releases(tickets, segment, self.config.rpc_timeout_s):
                    self._count("release_unsent")
                    logger.warning("shm releases of %d tickets could not be sent", len(tickets))

    def get_blocking(
        self,
        from_stage: Any,
        to_stage: Any,
        get_key: str,
        metadata: Mapping[str, Any] | None = None,
        *,
        timeout_s: float,
    ) -> tuple[Any, int] | None:
        """Wait up to ``timeout_s`` seconds; the sender answers when the key is published.
        Raises LeaseExpired at once when the sender says the key expired unread,
        FailedAtSender at once when it recorded a failure for the key (also while waiting),
        UnreadableGrant at once when its grant cannot be read here (the segment cannot be
        mapped: another shm directory, host or user), and SenderUnavailable when the sender's
        process is found dead (see the module doc)."""
        return self._fetch(metadata, get_key, max(0.0, float(timeout_s)))

    def mapped_range(self, segment_name: str) -> tuple[int, int] | None:
        """Addresses ``[start, end)`` of a segment this receiver mapped (for zero-copy checks)."""
        segment = self._segments.get(segment_name)
        return None if segment is None else segment.address_range

    # ------------------------------------------------------------------------- lifecycle
    def cleanup(self, request_id: str) -> None:
        """Sender: drop every readable key of ``request_id``. Receiver: nothing to drop (a
        receiver never drops payloads meant for other ranks)."""
        if self._sender is not None and not self._closed:
            self._sender.pool.cleanup(request_id)

    def health(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "ok": not self._closed,
            "type": "shm",
            "role": self.role,
            "namespace": self.config.namespace,
            **self.counters,
        }
        if self._sender is not None:
            out.update(
                endpoint=self.endpoint,
                segment=self._sender.segment.name,
                control_thread=self._sender.server.alive,
                parked=self._sender.server.parked(),
            )
            out["ok"] = out["ok"] and self._sender.server.alive
            if not self._closed:
                out.update(self._sender.pool.stats())
                out.update({k: v for k, v in self._sender.server.counters.items()})
        else:
            out.update(sender_endpoint=self._default_endpoint, mapped_segments=len(self._segments))
        foreign = sum(client.foreign_datagrams for client in list(self._clients.values()))
        if foreign:  # datagrams on a reply bell without this process's token: dropped
            out["foreign_datagrams"] = foreign
        return out

    def close(self) -> None:
        """Sender: remove segment and socket files, stop serving. Receiver: close sockets and
        mappings (views still held stay valid until dropped). Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            clients, self._clients = list(self._clients.values()), {}
            segments, self._segments = list(self._segments.values()), {}
        idle = all([client.close() for client in clients])
        if self._context is not None and idle:
            self._context.term()  # waits up to LINGER for queued releases to reach the sender
        for segment in segments:
            segment.unmap()
        if self._sender is not None:
            self._sender.close()

    def __enter__(self) -> ShmConnector:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
