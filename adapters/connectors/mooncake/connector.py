"""The ``mooncake`` connector: payload bytes move through Mooncake's transfer engine (TCP/RDMA).

Both sides own ONE registered pool (``pool_bytes``), allocated once at start and reused. The
sender copies each put into its pool (or the caller gathers straight into it via
:meth:`MooncakeConnector.reserve`) and publishes it in a lease table (``readers`` reads within
``lease_s`` seconds). A receiver asks the sender over a small ZMQ control channel (msgpack,
see :mod:`.wire`) where the payload is and how large; it reserves that many bytes in
its own pool and the engine *reads* them from the sender's pool (receiver pull: the sender never
needs to know the receiver's pool, a put never waits on a peer, and each receiver spends only
its own pool space). The result is a :class:`MooncakePoolBuffer` (``.tensor`` 1-D ``uint8``
view, ``.release()`` idempotent) that the caller decodes zero-copy and then releases.

Failures are values: ``put`` returns ``(False, 0, {"reason", "detail"})``; ``get`` returns None
and :meth:`MooncakeConnector.last_failure` says why (``sender_unavailable``, ``timeout``,
``expired``, ``no_room``, ``size_mismatch``, ``transfer_failed``, ``failed``, ...).
``get_blocking`` raises at once where waiting cannot help: LeaseExpired when the sender dropped
the key unread, FailedAtSender when the sender recorded that the key will never come
(:meth:`MooncakeConnector.publish_failure`, a failure record: no pool space, never data).
``get_many`` (the GetMany ability) takes several keys of one sender in one exchange: the
lookups together, one engine request reading every claimed payload, the claim ends together. A
missing package or system library makes construction raise ConnectorUnavailable with what to
install.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs

from kvferry.adapters.connectors.mooncake import wire
from kvferry.adapters.connectors.mooncake.config import MooncakeConfig
from kvferry.adapters.connectors.mooncake.engine import EnginePool
from kvferry.adapters.connectors.mooncake.receive import (
    SENDER_GONE,
    AllocatorSpace,
    Endpoint,
    ReceiveSide,
    resolve_endpoint,
)
from kvferry.core.errors import ConfigError, LeaseExpired, PoolFullError, SenderUnavailable
from kvferry.core.policy import SENDER_DOWN_GRACE_S
from kvferry.core.pool import PoolLedger, Region, RegionAllocator, request_id_of_key
from kvferry.core.recent import Recent
from kvferry.core.tombstones import FAILED_REASON, SenderFailure, failed_error

__all__ = ["MooncakeConnector", "MooncakePoolBuffer", "MooncakeReservation"]

logger = logging.getLogger(__name__)
_FAILURE_MEMORY = 1024


@attrs.define(eq=False)
class MooncakePoolBuffer:
    """A received payload in the receiver's pool. ``tensor``: 1-D ``uint8`` view of ``size``
    bytes. ``release()`` (idempotent) gives the space back; call it after the decoded tensors
    were moved or cloned."""

    tensor: Any
    _free: Callable[[], None]
    released: bool = False

    def release(self) -> None:
        if not self.released:
            self.released = True
            self._free()

    def __enter__(self) -> MooncakePoolBuffer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


#: A blocking get's pauses between asks of a sender it cannot reach (seconds, doubling).
_RETRY_FIRST_S = 0.05
_RETRY_MAX_S = 0.5


@attrs.define(eq=False)
class MooncakeReservation:
    """A sender-pool region reserved for ``put_key``: write ``buffer`` then ``commit()`` (or
    ``abort()``). Exactly one of the two takes effect; both are idempotent."""

    buffer: Any
    _connector: MooncakeConnector
    _key: str
    _region: Region
    _result: Any = None
    _aborted: bool = False

    def commit(self) -> Any:
        if self._result is None:
            if self._aborted:
                self._result = (False, 0, {"reason": "error", "detail": "reservation was aborted"})
            else:
                self._result = self._connector._publish(self._key, self._region)
        return self._result

    def abort(self) -> None:
        if self._result is None and not self._aborted:
            self._aborted = True
            self._connector._abort(self._region)


def _payload_views(data: Any) -> list[Any]:
    """``data`` as a list of flat uint8 pieces (tensors or memoryviews), no copy."""
    import torch

    if isinstance(data, torch.Tensor):
        return [data.reshape(-1).view(torch.uint8)] if data.numel() else []
    if isinstance(data, (bytes, bytearray, memoryview)):
        return [memoryview(data).cast("B")]
    if hasattr(data, "tensor") and hasattr(data, "release"):  # a PoolBuffer from elsewhere
        return _payload_views(data.tensor)
    if isinstance(data, (list, tuple)):
        return [view for item in data for view in _payload_views(item)]
    raise TypeError(f"cannot send {type(data).__name__}: bytes-like, uint8 tensor or frames")


def _nbytes(view: Any) -> int:
    return int(view.numel()) if hasattr(view, "numel") else view.nbytes


def _as_clock(clock: Any) -> Callable[[], float]:
    """A monotonic-seconds callable from None (the real clock), a Clock or a callable."""
    if clock is None:
        return time.monotonic
    if hasattr(clock, "monotonic"):
        return clock.monotonic
    if callable(clock):
        return clock
    raise ConfigError(f"mooncake config 'clock' must be a Clock or a callable, got {clock!r}")


@attrs.define(eq=False)
class MooncakeConnector:
    """Connector over Mooncake's transfer engine. Build with :meth:`from_config`.

    Sender role: binds the control channel on ``host:port`` (``port`` 0: OS-chosen, see
    :attr:`port`) at construction; a bind failure raises BindError. Receiver role: binds
    nothing; it reads from the sender given by ``get`` metadata or ``update_sender_info``.
    """

    config: MooncakeConfig
    _pool: EnginePool
    _ctx: Any
    _sender: Any = None  # SenderState (sender role)
    _server: Any = None  # ControlServer (sender role)
    port: int = 0
    clock: Callable[[], float] = time.monotonic
    _receive: ReceiveSide = attrs.field(init=False)
    _lock: threading.Lock = attrs.field(init=False, factory=threading.Lock)
    _default_sender: tuple[str, int] | None = attrs.field(init=False, default=None)
    _failures: Recent[str, str] = attrs.field(init=False, factory=lambda: Recent(_FAILURE_MEMORY))
    _counters: dict[str, int] = attrs.field(init=False, factory=dict)
    _closed: bool = attrs.field(init=False, default=False)
    _closing: threading.Event = attrs.field(init=False, factory=threading.Event)

    def __attrs_post_init__(self) -> None:
        from kvferry.adapters.connectors.mooncake.server import SenderSpace

        space: Any = (
            SenderSpace(self._sender)
            if self._sender is not None
            else AllocatorSpace(RegionAllocator(self._pool.pool_bytes, self.config.alignment))
        )
        self._receive = ReceiveSide(
            self._ctx,
            self._pool,
            space,
            self.config.control_timeout_s,
            self.clock,
            MooncakePoolBuffer,
            self.config.WHAT,
        )

    @classmethod
    def from_config(
        cls,
        config: Mapping[str, Any] | MooncakeConfig,
        *,
        clock: Callable[[], float] | None = None,
        engine_factory: Callable[[], Any] | None = None,
    ) -> MooncakeConnector:
        """Create from a config dict (``{"type": "mooncake", "role": ..., ...}``).

        Raises ConfigError for bad values (naming the key), ConnectorUnavailable when the
        engine package or its system library is missing or the engine fails to start,
        BindError when the sender's control port cannot be bound.
        """
        import zmq

        from kvferry.adapters.connectors.mooncake.server import ControlServer, SenderState, bind_router

        cfg = config if isinstance(config, MooncakeConfig) else MooncakeConfig.from_mapping(config)
        if clock is None and not isinstance(config, MooncakeConfig):
            clock = config.get("clock")
        now = _as_clock(clock)
        pool = EnginePool.create(
            host=cfg.host,
            pool_bytes=cfg.pool_bytes,
            protocol=cfg.protocol,
            device_name=cfg.device_name,
            device=cfg.pool_device,
            chunk_bytes=cfg.chunk_bytes,
            transfer_timeout_s=cfg.transfer_timeout_s,
            shared=cfg.shared_engine,
            engine_factory=engine_factory,
        )
        ctx = zmq.Context()
        sender = server = None
        port = 0
        try:
            if cfg.role == "sender":
                router, port = bind_router(ctx, cfg.host, cfg.port)
                ledger = PoolLedger.create(pool.pool_bytes, alignment=cfg.alignment, hold_s=cfg.hold_s)
                sender = SenderState(ledger, pool.base, pool.rpc_port, cfg.hold_s, now)
                server = ControlServer(ctx, router, sender)
                server.start()
        except BaseException:
            pool.close()
            ctx.destroy(linger=0)
            raise
        conn = cls(cfg, pool, ctx, sender, server, port, now)
        logger.info(
            "mooncake %s up: control %s:%d, engine rpc port %d, pool %d bytes (%s)",
            cfg.role,
            cfg.host,
            port,
            pool.rpc_port,
            pool.pool_bytes,
            cfg.protocol,
        )
        return conn

    # -- sender ---------------------------------------------------------------------------

    def put(self, from_stage: Any, to_stage: Any, put_key: str, data: Any) -> tuple[bool, int, Any]:
        """Copy ``data`` into the sender pool and publish it under ``put_key``. Never raises for
        pool or state faults: ``(False, 0, {"reason", "detail"})``."""
        try:
            views = _payload_views(data)
        except TypeError as exc:
            return self._put_failed("error", str(exc))
        nbytes = sum(_nbytes(v) for v in views)
        region = self._reserve_region(put_key, nbytes)
        if not isinstance(region, Region):
            return region
        self._fill(region, views)
        return self._publish(put_key, region)

    def put_frames(self, from_stage: Any, to_stage: Any, put_key: str, frames: Any) -> tuple[bool, int, Any]:
        """:meth:`put` of the frames' concatenation, never joined first (the FramesPut ability)."""
        return self.put(from_stage, to_stage, put_key, frames)

    def reserve(self, from_stage: Any, to_stage: Any, put_key: str, nbytes: int) -> MooncakeReservation:
        """Reserve ``nbytes`` of the sender pool for ``put_key``; PoolFullError when no room."""
        region = self._reserve_region(put_key, nbytes)
        if not isinstance(region, Region):
            info = region[2]
            raise PoolFullError(f"{info['reason']}: {info['detail']}")
        view = self._pool.tensor[region.offset : region.offset + nbytes]
        return MooncakeReservation(view, self, put_key, region)

    def _reserve_region(self, key: str, nbytes: int) -> Region | tuple[bool, int, Any]:
        if self._closed:
            return self._put_failed("closed", "connector is closed")
        if self._sender is None:
            return self._put_failed("error", "put on a receiver-role mooncake connector")
        self._sender.sweep()
        with self._sender.lock:
            got = self._sender.ledger.reserve(nbytes)
        if isinstance(got, Region):
            return got
        return self._put_failed(got.reason, got.detail)

    def _fill(self, region: Region, views: list[Any]) -> None:
        """Copy the payload pieces back to back into the pool at ``region.offset`` (one copy)."""
        import numpy as np
        import torch

        offset = region.offset
        pool = self._pool.tensor
        host_pool = pool.numpy() if pool.device.type == "cpu" else None
        for view in views:
            size = _nbytes(view)
            if size and isinstance(view, torch.Tensor):
                if host_pool is not None and view.device.type == "cpu":
                    host_pool[offset : offset + size] = view.numpy()  # faster than copy_ here
                else:
                    pool[offset : offset + size].copy_(view)
            elif size and host_pool is not None:
                host_pool[offset : offset + size] = np.frombuffer(view, dtype=np.uint8)
            elif size:  # bytes into a device pool: stage through a writable host copy
                pool[offset : offset + size].copy_(torch.frombuffer(bytearray(view), dtype=torch.uint8))
            offset += size

    def _publish(
        self, key: str, region: Region, pieces: tuple[Sequence[tuple[int, int]], Callable[[], None]] | None = None
    ) -> tuple[bool, int, Any]:
        if self._closed:
            self._abort(region)
            return self._put_failed("closed", "connector is closed")
        size = region.nbytes + (0 if pieces is None else sum(n for _, n in pieces[0]))
        with self._sender.held() as ledger:
            if pieces is not None:
                self._sender.add_pieces(region, *pieces)
            ledger.publish(
                key,
                region,
                readers=self.config.readers,
                now_s=self.clock(),
                lease_s=self.config.lease_s,
                request_id=request_id_of_key(key),
                size=size,
            )
        self._server.notify(key)
        self._count("puts" if pieces is None else "puts_in_pieces")
        meta = {"source_host": self.config.host, "source_port": self.port, "size": size}
        return True, size, meta

    def _put_pieces(
        self, key: str, head: Any, spans: Sequence[tuple[int, int]], on_free: Callable[[], None]
    ) -> tuple[bool, int, Any]:
        """Copy ``head`` into the pool and publish it followed by ``spans`` (registered memory
        the caller keeps until ``on_free``), as one payload (the PiecesPut ability's put)."""
        try:
            views = _payload_views(head)
        except TypeError as exc:
            return self._put_failed("error", str(exc))
        nbytes = sum(_nbytes(v) for v in views)
        pieces = tuple((int(a), int(n)) for a, n in spans if n)
        if nbytes == 0 or any(a <= 0 or n < 0 for a, n in pieces) or len(pieces) + 1 > wire.MAX_SPANS:
            return self._put_failed(
                "error",
                f"a payload in pieces needs a head of at least 1 byte and at most {wire.MAX_SPANS - 1} "
                f"spans of registered memory; got {nbytes} bytes and {len(pieces)} spans",
            )
        region = self._reserve_region(key, nbytes)
        if not isinstance(region, Region):
            return region
        self._fill(region, views)
        return self._publish(key, region, (pieces, on_free))

    def publish_failure(self, from_stage: Any, to_stage: Any, put_key: str, failure: Any) -> bool:
        """Sender: record that ``put_key`` will never come (the FailureRecords ability): no
        pool space, a payload readable under it dropped; lookups for it, parked ones too, are
        answered ``failed`` with the record at once. False when closed or not a sender."""
        if self._closed or self._sender is None:
            return False
        recorded = bool(self._sender.fail(put_key, failure))
        if recorded:
            self._server.notify(put_key)
        return recorded

    def _abort(self, region: Region) -> None:
        with self._sender.lock:
            self._sender.ledger.abort(region)

    def _put_failed(self, reason: str, detail: str) -> tuple[bool, int, Any]:
        self._count("put_failed")
        logger.warning("%s put failed (%s): %s", self.config.WHAT, reason, detail)
        return False, 0, {"reason": reason, "detail": detail}

    # -- receiver ---------------------------------------------------------------------------

    def update_sender_info(self, host: str, port: int) -> None:
        """Default sender endpoint for gets whose metadata names none."""
        self._default_sender = (str(host), int(port))

    def get(self, from_stage: Any, to_stage: Any, get_key: str, metadata: Mapping[str, Any] | None = None) -> Any:
        """``(MooncakePoolBuffer, size)`` if the sender holds ``get_key`` now, else None."""
        return self._get(get_key, metadata, 0.0)

    def get_blocking(
        self,
        from_stage: Any,
        to_stage: Any,
        get_key: str,
        metadata: Mapping[str, Any] | None = None,
        *,
        timeout_s: float,
    ) -> Any:
        """Like :meth:`get`, but the sender answers on arrival, up to ``timeout_s`` seconds.
        Raises LeaseExpired or FailedAtSender at once when the sender says so (see the module
        doc), and SenderUnavailable when the sender is found gone: the connection dropped while
        this get was out, or the sender answered before and has been unreachable for
        :data:`~kvferry.core.policy.SENDER_DOWN_GRACE_S` (``sender_gone``). A sender it cannot
        reach otherwise (never reached yet, or within the grace) is asked again until the
        deadline, then None (``sender_unavailable``; see :meth:`last_failure`)."""
        return self._get(get_key, metadata, max(0.0, float(timeout_s)))

    def get_many(
        self, from_stage: Any, to_stage: Any, keys: list[str], metadata: Mapping[str, Any] | None = None
    ) -> list[tuple[Any, int] | None]:
        """Per key, in order, what :meth:`get` returns, from one sender in one exchange (the
        GetMany ability: the lookups together, one engine read of every claimed payload, the
        claim ends together). Never waits for a key; a key missing here may still come by
        :meth:`get_blocking`. ``metadata`` names the sender as for :meth:`get` (a ``size`` in it
        is not checked: it would be one key's)."""
        keys = [str(k) for k in keys]
        self._count("get_many")
        where = None if self._closed else resolve_endpoint(metadata, self._default_sender)
        if where is None:
            for k in keys:
                self._miss(k, "closed" if self._closed else "no_sender")
            return [None] * len(keys)
        outcomes = self._receive.fetch_many(keys, Endpoint(where.host, where.port))
        out: list[tuple[Any, int] | None] = []
        for key, outcome in zip(keys, outcomes):
            if isinstance(outcome, (SenderFailure, str)):
                self._miss(key, outcome if isinstance(outcome, str) else FAILED_REASON)
                out.append(None)
            else:
                self._hit(key)
                out.append(outcome)
        return out

    def last_failure(self, get_key: str) -> str | None:
        """Why the last get of ``get_key`` returned None (None after a success or never)."""
        with self._lock:
            return self._failures.get(get_key)

    def _get(self, key: str, metadata: Mapping[str, Any] | None, wait_s: float) -> Any:
        self._count("gets")
        if self._closed:
            return self._miss(key, "closed")
        where = resolve_endpoint(metadata, self._default_sender)
        if where is None:
            return self._miss(key, "no_sender")
        outcome = self._fetch_until(key, where, wait_s)
        if isinstance(outcome, SenderFailure):
            self._miss(key, FAILED_REASON)
            if wait_s > 0:
                raise failed_error(key, outcome, f"{where.host}:{where.port}")
            return None
        if isinstance(outcome, str):
            self._miss(key, outcome)
            where_s = f"{where.host}:{where.port}"
            if wait_s > 0 and outcome == "expired":
                raise LeaseExpired(f"the sender at {where_s} dropped {key!r} unread when its lease passed")
            if wait_s > 0 and outcome == SENDER_GONE:
                raise SenderUnavailable(
                    f"the sender at {where_s} is gone: its connection dropped while {key!r} was asked for, "
                    f"or it answered before and has been unreachable for {SENDER_DOWN_GRACE_S} s"
                )
            return None
        self._hit(key)
        return outcome

    def _fetch_until(self, key: str, where: Endpoint, wait_s: float) -> Any:
        """:meth:`ReceiveSide.fetch`; a blocking get (``wait_s`` > 0) whose sender cannot be
        reached (``sender_unavailable``: not started yet, restarting, or down within the grace)
        asks again, backing off from 50 ms to 0.5 s, until the sender answers, is given up on
        (``sender_gone``) or the wait ends: it returns at its deadline, not sooner, as a
        blocking get does (a caller reads an early None as the deadline passing). Its read of
        a payload claimed in time ends by the deadline plus ``control_timeout_s`` (the grace a
        control reply has): ``timeout`` (a read the engine could not end then goes on in the
        pool's late reads, which give its space back when it ends)."""
        if wait_s <= 0:
            return self._receive.fetch(key, where, 0.0)
        deadline, pause = time.monotonic() + wait_s, _RETRY_FIRST_S
        read_by = deadline + self.config.control_timeout_s
        while True:
            outcome = self._receive.fetch(key, where, max(0.0, deadline - time.monotonic()), read_by)
            left = deadline - time.monotonic()
            if outcome != "sender_unavailable" or left <= 0 or self._closing.wait(min(pause, left)):
                return outcome
            pause = min(pause * 2, _RETRY_MAX_S)

    def _miss(self, key: str, reason: str) -> None:
        # the loader's threads get at once: the table of failures is shared, as the counters are
        with self._lock:
            self._count_locked(f"miss_{reason}")
            self._failures.note(key, reason)
        return None

    def _hit(self, key: str) -> None:
        with self._lock:
            self._count_locked("hits")
            self._failures.pop(key, None)

    def _count(self, name: str, by: int = 1) -> None:
        with self._lock:
            self._count_locked(name, by)

    def _count_locked(self, name: str, by: int = 1) -> None:
        self._counters[name] = self._counters.get(name, 0) + by

    # -- both ------------------------------------------------------------------------------

    def cleanup(self, request_id: str) -> None:
        """Drop every payload of ``request_id`` this sender still holds. Idempotent."""
        if self._sender is not None and not self._closed:
            with self._sender.held() as ledger:
                ledger.drop_request(request_id)

    def health(self) -> dict[str, Any]:
        """JSON-able snapshot: role, endpoints, pool usage and counters."""
        with self._lock:
            counters = dict(self._counters)
        out: dict[str, Any] = {
            "ok": not self._closed,
            "type": "mooncake",
            "role": self.config.role,
            "host": self.config.host,
            "port": self.port,
            "rpc_port": self._pool.rpc_port,
            "protocol": self.config.protocol,
            "pool_bytes": self._pool.pool_bytes,
            "room": self._receive.space.room(),
            **self._pool.read_stats(),
            **counters,
        }
        if self._sender is not None:
            out["parked_lookups"] = self._server.parked
            with self._sender.lock:
                out.update(self._sender.ledger.stats())
                out.update(self._sender.counters)
        return out

    def close(self) -> None:
        """Stop the control thread, close channels, unregister the pool. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._closing.set()  # a blocking get waiting to ask a down sender again ends now
        if self._server is not None:
            self._server.close()
        self._receive.close()
        if self._server is not None and self._server.running:
            self._ctx.destroy(linger=0)  # the control thread is stuck: force its sockets shut
        else:
            self._ctx.term()  # waits for busy gets in other threads to see ETERM and close
        self._pool.close()

    def __enter__(self) -> MooncakeConnector:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
