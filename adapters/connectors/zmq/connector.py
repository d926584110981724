"""The ``zmq`` connector: a sender serves the payloads it holds to pulling receivers.

Roles (config ``role``):

- ``"sender"`` binds a ROUTER on ``host`` (loopback by default; binds only where told) and
  ``port`` (0: the OS chooses; the bound port is in ``health()`` and put metadata), or on
  ``ipc://{ipc_dir}/kvferry-zmq-{port}.ipc`` with ``transport: "ipc"``. A bind failure raises
  BindError naming host and port (fatal; never retried on another port). Payloads live in one
  reused pool of ``pool_bytes`` (``reserve`` hands out a region of it to write into; ``put``
  copies its data in, so the caller's buffers are free at once) for ``readers`` gets or
  ``lease_s`` seconds, at most ``max_payloads`` of them.
- ``"receiver"`` only pulls. The sender it asks comes from ``get``'s metadata (what ``put``
  returned, or partial ``source_host``/``source_port``), else from ``update_sender_info`` or
  config ``sender_host``/``sender_port``. A sender connector's default sender is itself.

Every connector can ``get``. ``get`` asks once ("now") and waits at most ``request_timeout_s``
for the answer; ``get_blocking`` parks the request at the sender ("wait") until the key is
published or ``timeout_s`` passes. Both return ``(data, size)`` or None. ``data`` is a tuple
of memoryviews of the received zmq frames for a payload of at most ``chunk_bytes`` (kept
alive by the views; their concatenation is the payload), or, for a larger (streamed) payload,
a pool buffer of the receive pool: ``.tensor`` (1-D ``uint8``) and ``.release()`` (idempotent;
release once every tensor decoded from it was copied). Either way a decoder builds tensor
views without copying.

Wire protocol, ports and security: docs/zmq.md.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

import attrs
import zmq

from kvferry.adapters.connectors.zmq.buffers import as_frames
from kvferry.adapters.connectors.zmq.client import Outcome, ZmqClient
from kvferry.adapters.connectors.zmq.config import ZmqConfig
from kvferry.adapters.connectors.zmq.protocol import resolve_endpoint
from kvferry.adapters.connectors.zmq.server import ZmqServer
from kvferry.adapters.connectors.zmq.store import PublishFailure, ZmqReservation
from kvferry.core.errors import ConfigError, LeaseExpired, PoolFullError, SenderUnavailable, TransferError
from kvferry.core.tombstones import failed_error
from kvferry.core.validate import check_int, check_seconds

__all__ = ["ZmqConnector"]

logger = logging.getLogger(__name__)


def _as_clock(clock: Any) -> Callable[[], float]:
    """A Clock (``.monotonic()``), a zero-argument callable, or None (the real clock)."""
    if clock is None:
        return time.monotonic
    if callable(getattr(clock, "monotonic", None)):
        return clock.monotonic
    if callable(clock):
        return clock
    raise ConfigError(f"clock must have a monotonic() method or be callable, got {clock!r}")


@attrs.define(eq=False, init=False)
class ZmqConnector:
    """Connector, BlockingGet, SenderAware and Reservable over ZeroMQ (tcp across hosts, ipc
    on one host).

    Thread-safe: ``put``/``get``/``get_blocking`` may be called from several threads. Owns a
    private zmq context, one serving thread (sender role) and one receive thread (started on
    the first get). ``close()`` is idempotent.
    """

    config: ZmqConfig
    _clock: Callable[[], float]
    _context: zmq.Context
    _server: ZmqServer | None
    _client: ZmqClient
    _default_sender: tuple[str, int] | None
    _unresolved: int
    _closed: bool

    def __init__(
        self,
        config: Mapping[str, Any] | ZmqConfig | None = None,
        *,
        clock: Any = None,
        **overrides: Any,
    ) -> None:
        if isinstance(config, ZmqConfig):
            if overrides:
                raise ConfigError("pass overrides in the config mapping, not with a ZmqConfig")
            cfg = config
        else:
            raw = {**dict(config or {}), **overrides}
            clock = raw.pop("clock", None) if clock is None else clock
            cfg = ZmqConfig.from_mapping(raw)
        if cfg.ignored_keys:
            logger.warning("zmq connector ignores unknown config keys %s", list(cfg.ignored_keys))
        if cfg.curve is not None:
            (cfg.curve.require_server if cfg.role == "sender" else cfg.curve.require_client)()
        self.config = cfg
        self._clock = _as_clock(clock)
        self._closed = False
        self._unresolved = 0
        self._default_sender = None
        if cfg.sender_host is not None and cfg.sender_port is not None:
            self._default_sender = (cfg.sender_host, cfg.sender_port)
        self._context = zmq.Context()
        self._server = None
        self._client = ZmqClient(cfg, self._context)
        if cfg.role == "sender":
            server = ZmqServer(cfg, self._context, self._clock)
            try:
                server.start()
            except BaseException:
                self._closed = True
                if not server.thread_running:  # never term under a live socket: it would hang
                    self._context.term()
                raise
            self._server = server
            logger.info("zmq sender serving on %s", server.endpoint)

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> ZmqConnector:
        """Build from a registry config dict ``{"type": "zmq", ...}``."""
        return cls(config)

    # ---------------------------------------------------------------- identity

    @property
    def role(self) -> str:
        return self.config.role

    @property
    def endpoint(self) -> str | None:
        """The bound endpoint (``tcp://127.0.0.1:50151`` / ``ipc://...``); None for receivers."""
        return self._server.endpoint if self._server is not None else None

    @property
    def port(self) -> int | None:
        """The bound port number (the OS's choice when configured as 0); None for receivers."""
        return self._server.port if self._server is not None else None

    def sender_metadata(self) -> dict[str, Any]:
        """What a receiver needs to find this sender (also part of every put's metadata)."""
        if self._server is None:
            raise ConfigError("only a connector with role 'sender' has sender metadata")
        meta: dict[str, Any] = {
            "source_host": self.config.advertise_host,
            "source_port": self._server.port,
            "transport": self.config.transport,
        }
        if self._server.ipc_file is not None:
            meta["ipc_path"] = self._server.ipc_file
        return meta

    # ---------------------------------------------------------------- Connector

    def _check_put(self, put_key: Any, readers: Any, lease_s: Any) -> tuple[int, float]:
        if not isinstance(put_key, str) or not put_key:
            raise ConfigError(f"put_key must be a non-empty string, got {put_key!r}")
        readers = self.config.readers if readers is None else readers
        lease = self.config.lease_s if lease_s is None else lease_s
        return check_int("readers", readers, 1), check_seconds("lease_s", lease)

    def _refusal(self) -> dict[str, str] | None:
        if self._closed:
            return {"reason": "closed", "detail": "the zmq connector is closed"}
        if self._server is None:
            return {"reason": "not_sender", "detail": "needs a zmq connector with role 'sender'"}
        return None

    def publish_failure(self, from_stage: Any, to_stage: Any, put_key: str, failure: Any) -> bool:
        """Sender: record that ``put_key`` will never come (the FailureRecords ability): no
        pool space (a payload under it is dropped); a get parked on the key is answered at once."""
        if self._refusal() is not None:
            return False
        assert self._server is not None  # no refusal: a sender
        return self._server.publish_failure(put_key, failure)

    def put(
        self,
        from_stage: Any,
        to_stage: Any,
        put_key: str,
        data: Any,
        *,
        readers: int | None = None,
        lease_s: float | None = None,
    ) -> tuple[bool, int, dict[str, Any] | None]:
        """Copy ``data`` into the pool and hold it under ``put_key`` for pulling receivers
        (latest put of a key wins). The caller may reuse its buffers as soon as this returns.

        Returns ``(True, size, metadata)`` or ``(False, 0, {"reason", "detail"})`` with reason
        ``pool_full`` (after waiting up to ``drain_wait_s`` for sends in flight), ``too_large``,
        ``closed`` or ``not_sender``. Unsupported data types and invalid ``readers``/``lease_s``
        raise ConfigError (caller misuse).
        """
        readers, lease = self._check_put(put_key, readers, lease_s)
        refusal = self._refusal()
        if refusal is not None:
            return False, 0, refusal
        frames, sizes = as_frames(data)
        assert self._server is not None  # no refusal: a sender
        store = self._server.store
        region = store.reserve(sum(sizes), count_failure=True)
        if isinstance(region, PublishFailure):
            return self._refused(put_key, region)
        try:
            written = store.write(region, frames)
        except BaseException:
            store.abort(region)
            raise
        if not written:
            store.abort(region)
            return self._refused(put_key, PublishFailure("closed", "the zmq connector is closed"))
        return self._publish(put_key, region, sizes, readers, lease)

    def put_frames(
        self, from_stage: Any, to_stage: Any, put_key: str, frames: Any
    ) -> tuple[bool, int, dict[str, Any] | None]:
        """:meth:`put` of the frames' concatenation, never joined first (the FramesPut ability)."""
        return self.put(from_stage, to_stage, put_key, frames)

    def _refused(self, key: str, failure: PublishFailure) -> tuple[bool, int, dict[str, Any]]:
        logger.warning("zmq put of %r refused: %s", key, failure.detail)
        return False, 0, {"reason": failure.reason, "detail": failure.detail}

    def _publish(
        self, key: str, region: Any, sizes: tuple[int, ...], readers: int, lease: float
    ) -> tuple[bool, int, dict[str, Any] | None]:
        assert self._server is not None  # called for a sender's put or reservation
        failure = self._server.publish(key, region, sizes, readers=readers, lease_s=lease)
        if failure is not None:
            return self._refused(key, failure)
        size = region.nbytes
        return True, size, {**self.sender_metadata(), "key": key, "size": size}

    def reserve(
        self,
        from_stage: Any,
        to_stage: Any,
        put_key: str,
        nbytes: int,
        *,
        readers: int | None = None,
        lease_s: float | None = None,
    ) -> ZmqReservation:
        """Reserve ``nbytes`` of the pool for ``put_key``; write into ``.buffer`` (a view of the
        pool: no page faults once the pool is warm), then ``commit()`` (publishes the region
        itself, no copy). Raises PoolFullError (``pool_full`` / ``too_large`` in the message;
        ``pool_full`` after waiting up to ``drain_wait_s`` for sends in flight), TransferError
        when closed, ConfigError for a receiver or bad arguments."""
        readers, lease = self._check_put(put_key, readers, lease_s)
        check_int("nbytes", nbytes, 0)
        refusal = self._refusal()
        if refusal is not None:
            if refusal["reason"] == "closed":
                raise TransferError(f"closed: {refusal['detail']}")
            raise ConfigError(f"reserve {refusal['detail']}")
        assert self._server is not None  # no refusal: a sender
        store = self._server.store
        region = store.reserve(nbytes)
        if isinstance(region, PublishFailure):
            if region.reason == "closed":
                raise TransferError(f"closed: {region.detail}")
            raise PoolFullError(f"{region.reason}: {region.detail}")

        def publish() -> tuple[bool, int, Any]:
            return self._publish(put_key, region, (nbytes,), readers, lease)

        return ZmqReservation(store.buffer(region), publish, lambda: store.abort(region))

    def get(
        self,
        from_stage: Any,
        to_stage: Any,
        get_key: str,
        metadata: Mapping[str, Any] | None = None,
    ) -> tuple[Any, int] | None:
        """Ask the sender for ``get_key`` now; ``(data, size)`` (frames or a pool buffer, see
        the module docstring) or None (not there, sender unreachable within
        ``request_timeout_s``, or no sender known)."""
        return self._fetch(get_key, metadata, "now", 0.0, self.config.request_timeout_s)

    def get_blocking(
        self,
        from_stage: Any,
        to_stage: Any,
        get_key: str,
        metadata: Mapping[str, Any] | None = None,
        *,
        timeout_s: float,
    ) -> tuple[Any, int] | None:
        """Wait up to ``timeout_s`` seconds for ``get_key``; the sender answers on arrival.
        Raises LeaseExpired at once when the sender says the key expired unread,
        FailedAtSender at once when it recorded a failure for the key (also while waiting), and
        SenderUnavailable at once when the connection to the sender drops while the get waits
        (or stays down :data:`~.client.DOWN_GRACE_S` after it was up)."""
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or timeout_s < 0:
            raise ConfigError(f"timeout_s must be a number of seconds >= 0, got {timeout_s!r}")
        if timeout_s == 0:
            return None  # nothing can arrive in no time; asking would only strand a reply
        return self._fetch(get_key, metadata, "wait", float(timeout_s), float(timeout_s))

    def _fetch(
        self, key: str, metadata: Mapping[str, Any] | None, mode: str, wait: float, timeout: float
    ) -> tuple[Any, int] | None:
        if self._closed:
            return None
        curve = self.config.curve
        if curve is not None and not (curve.client_public and curve.client_secret):
            self._unresolved += 1
            logger.warning("zmq get needs curve.client_public/client_secret to reach a sender")
            return None
        endpoint = self._endpoint_for(metadata)
        if endpoint is None:
            return None
        outcome: Outcome = self._client.request(endpoint, key, mode, wait, timeout)
        if outcome.kind == "miss" and outcome.reason == "expired" and mode == "wait":
            raise LeaseExpired(f"the sender at {endpoint} dropped {key!r} unread when its lease passed")
        if outcome.kind == "miss" and outcome.failure is not None and mode == "wait":
            raise failed_error(key, outcome.failure, endpoint)
        if outcome.kind == "error" and outcome.reason == "disconnected" and mode == "wait":
            raise SenderUnavailable(
                f"the connection to the sender at {endpoint} dropped while {key!r} was asked for "
                "(the sender ended, or the network broke)"
            )
        if outcome.kind != "data":
            return None
        return outcome.frames, outcome.size

    def _endpoint_for(self, metadata: Mapping[str, Any] | None) -> str | None:
        default = self._default_sender
        if default is None and self._server is not None:
            default = (self.config.advertise_host or self.config.host, self._server.port)
        try:
            endpoint = resolve_endpoint(metadata, default, transport=self.config.transport, ipc_dir=self.config.ipc_dir)
        except ConfigError as exc:
            self._unresolved += 1
            logger.warning("zmq get cannot resolve the sender: %s", exc)
            return None
        if endpoint is None:
            self._unresolved += 1
            logger.warning("zmq get has no sender: pass metadata or call update_sender_info")
        return endpoint

    # ---------------------------------------------------------------- SenderAware

    def update_sender_info(self, host: str, port: int) -> None:
        """Set the default sender for gets without metadata. Raises ConfigError if invalid."""
        resolve_endpoint(
            {"source_host": host, "source_port": port},
            None,
            transport=self.config.transport,
            ipc_dir=self.config.ipc_dir,
        )
        self._default_sender = (host, int(port))

    # ---------------------------------------------------------------- housekeeping

    def cleanup(self, request_id: str) -> None:
        """Drop held payloads (sender) and stashed late payloads (receiver) of the request."""
        if self._server is not None:
            self._server.store.drop_request(request_id)
        self._client.drop_request(request_id)

    def health(self) -> dict[str, Any]:
        """``ok``, identity, a summary and the full ``sender`` / ``receiver`` counters.

        Summary, sender side: ``puts``, ``gets_served``, ``misses`` (not found + waits that
        timed out), ``expired``, ``bytes_served``, ``held_bytes``, ``held_payloads``; receiver
        side: ``gets``, ``hits``, ``recv_misses`` (the sender said no), ``timeouts`` (no answer
        in time), ``bytes_received``, ``unresolved`` (no sender known for a get).
        """
        sender = self._server.stats() if self._server is not None else {}
        receiver = self._client.stats()
        ok = not self._closed and (self._server is None or self._server.alive)
        return {
            "ok": ok,
            "type": "zmq",
            "role": self.config.role,
            "transport": self.config.transport,
            "endpoint": self.endpoint,
            "host": self.config.host,
            "port": self.port,
            "closed": self._closed,
            "puts": sender.get("puts", 0),
            "gets_served": sender.get("served", 0),
            "misses": sender.get("misses_not_found", 0) + sender.get("wait_timeouts", 0),
            "expired": sender.get("expired", 0),
            "bytes_served": sender.get("bytes_served", 0),
            "held_bytes": sender.get("held_bytes", 0),
            "held_payloads": sender.get("held_payloads", 0),
            "gets": receiver["requests"],
            "hits": receiver["hits"],
            "recv_misses": sum(v for k, v in receiver.items() if k.startswith("misses_")),
            "bytes_received": receiver["bytes_received"],
            "timeouts": receiver["timeouts"],
            "unresolved": self._unresolved,
            "sender": sender,
            "receiver": receiver,
        }

    def close(self) -> None:
        """Stop both threads, close sockets (linger 0), remove the ipc file. Idempotent."""
        if self._closed:
            return
        self._closed = True
        stopped = self._client.close()
        if self._server is not None:
            stopped = self._server.close() and stopped
        if stopped:
            self._context.term()
        else:
            logger.error("zmq connector closed with a thread still running; context left open")

    def __enter__(self) -> ZmqConnector:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()
