"""The zmq connector's sender side: one serving thread around a ROUTER socket.

Threads: ``publish``/``stats`` and the ``store`` may be used from any thread (the store has its
own lock); publishing pokes the loop. The ROUTER socket is created, bound, used
and closed by the serving thread alone. Parked "wait" requests are answered when their key is
published (the publisher pokes the loop) or when their deadline passes (the poll timeout is the
next deadline): no sleep-polling anywhere.

What a payload costs: it lives in the sender's pool (:mod:`.store`) and is sent from there
with ``copy=False``: one message (``[header, *frames]``) when small or when the receiver did not
ask for a stream, else the header then chunks of ``chunk_bytes`` (:mod:`.stream`). A served
payload's region is reused once libzmq's trackers say it is done with the bytes; the loop
reaps finished sends on every pass without ever waiting for one.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import attrs
import zmq

from kvferry.adapters.connectors.wake import Doorbell
from kvferry.adapters.connectors.zmq.config import CurveConfig, ZmqConfig, start_authenticator
from kvferry.adapters.connectors.zmq.protocol import (
    MAX_CONTROL_BYTES,
    Rejection,
    Reply,
    Request,
    decode_request,
    encode_reply,
    ipc_path,
    refuse_live_ipc,
    tcp_endpoint,
)
from kvferry.adapters.connectors.zmq.store import Held, HeldPayloads, PublishFailure
from kvferry.adapters.connectors.zmq.stream import send_message, send_payload
from kvferry.core.errors import BindError
from kvferry.core.parked import MissReason, Parked, ParkedTable

__all__ = ["ZmqServer"]

logger = logging.getLogger(__name__)
_BATCH = 256  # most requests handled per loop pass before timers and publications run
#: Every counter exists from the start (the dict never resizes while another thread reads
#: it); all of them change only in the serving thread.
COUNTERS = (
    "requests",
    "misses_not_found",
    "misses_expired",
    "misses_failed",
    "wait_timeouts",
    "parked_total",
    "parked_refused",
    "bad_messages",
    "undeliverable",
    "loop_failures",
    "streams",
    "chunks_sent",
    "streams_cut",
)
#: Longest poll wait in seconds (a backstop; every real event wakes the loop sooner).
_MAX_POLL_S = 3600.0


@attrs.frozen
class _Waiter:
    """Where a parked get's answer goes."""

    identity: bytes
    corr_id: int
    stream: bool = False


@attrs.define(eq=False)
class ZmqServer:
    """Serves published payloads to pulling receivers. ``start()`` binds or raises BindError.

    ``lease_clock`` times leases (injectable); parked-request deadlines use the real
    monotonic clock because they bound real waits on the socket.
    """

    config: ZmqConfig
    context: zmq.Context
    lease_clock: Callable[[], float] = time.monotonic
    endpoint: str = ""
    port: int = 0
    ipc_file: str | None = None
    store: HeldPayloads = attrs.field(init=False)
    _bell: Doorbell = attrs.field(init=False, factory=Doorbell)
    _table: ParkedTable[_Waiter] = attrs.field(init=False)
    _counters: dict[str, int] = attrs.field(init=False, factory=lambda: dict.fromkeys(COUNTERS, 0))
    _thread: threading.Thread | None = attrs.field(init=False, default=None)
    _ready: threading.Event = attrs.field(init=False, factory=threading.Event)
    _bind_error: BaseException | None = attrs.field(init=False, default=None)
    _stopping: bool = attrs.field(init=False, default=False)
    _ipc_inode: tuple[int, int] | None = attrs.field(init=False, default=None)
    _auth: Any = attrs.field(init=False, default=None)

    def __attrs_post_init__(self) -> None:
        cfg = self.config
        self._table = ParkedTable(max_parked=cfg.max_parked)
        self.store = HeldPayloads(
            cfg.pool_bytes, cfg.max_payloads, self.lease_clock, prefault=cfg.prefault, drain_wait_s=cfg.drain_wait_s
        )

    # ---------------------------------------------------------------- lifecycle

    def start(self) -> None:
        """Start the serving thread and wait until it has bound. Raises BindError."""
        if self.config.curve is not None:
            self._start_authenticator(self.config.curve)
        self._thread = threading.Thread(target=self._run, name="kvferry-zmq-serve", daemon=True)
        self._thread.start()
        if not self._ready.wait(self.config.start_timeout_s):
            self.close(self.config.start_timeout_s)
            raise BindError(f"zmq sender did not bind {self._wanted()} within the start timeout")
        if self._bind_error is not None:
            self._thread.join(self.config.start_timeout_s)
            self._stop_authenticator()
            self._bell.close()
            raise self._bind_error

    def close(self, timeout_s: float = 5.0) -> bool:
        """Stop serving (parked requests get a "closing" miss), drop every payload, join the
        thread, remove the ipc file. Idempotent; False when the thread did not stop in time."""
        self._stopping = True
        self.store.close()
        self._bell.ring()
        stopped = True
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout_s)
            stopped = not self._thread.is_alive()
            if not stopped:
                logger.error("zmq serving thread for %s did not stop in %.1fs", self.endpoint, timeout_s)
        if stopped:
            self._bell.close()
        self._stop_authenticator()
        return stopped

    def _start_authenticator(self, curve: CurveConfig) -> None:
        self._auth = start_authenticator(self.context, curve, logging.getLogger(__name__ + ".auth"))

    def _stop_authenticator(self) -> None:
        auth, self._auth = self._auth, None
        if auth is not None:
            auth.stop()

    def _wanted(self) -> str:
        cfg = self.config
        if cfg.transport == "ipc":
            return f"ipc://{ipc_path(cfg.ipc_dir, cfg.port)} (host {cfg.host}, port {cfg.port})"
        return tcp_endpoint(cfg.host, cfg.port if cfg.port else "*")

    # ---------------------------------------------------------------- any thread

    def publish(
        self, key: str, region: Any, sizes: tuple[int, ...], *, readers: int, lease_s: float
    ) -> PublishFailure | None:
        """Publish the written pool ``region`` under ``key`` (latest put wins) and wake
        requests parked on it."""
        failure = self.store.publish(key, region, sizes, readers=readers, lease_s=lease_s)
        if failure is None:
            self._bell.ring(key)
        return failure

    def publish_failure(self, key: str, failure: Any) -> bool:
        """Record that ``key`` will never come (a tombstone) and answer the requests parked on
        it at once."""
        recorded = self.store.fail(key, failure)
        if recorded:
            self._bell.ring(key)
        return recorded

    def stats(self) -> dict[str, int]:
        out = self.store.stats()
        out.update(self._counters)
        out["parked"] = len(self._table)
        return out

    @property
    def thread_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stopping

    # ---------------------------------------------------------------- serving thread

    def _bind(self, sock: zmq.Socket) -> None:
        cfg = self.config
        if cfg.transport == "ipc":
            path, port = ipc_path(cfg.ipc_dir, cfg.port), cfg.port
            assert port is not None  # ipc_path took it: a port in 1..65535
            refuse_live_ipc(path, cfg.host, port)
            sock.bind(f"ipc://{path}")
            info = os.stat(path)
            self._ipc_inode = (info.st_dev, info.st_ino)
            self.ipc_file, self.port, self.endpoint = path, port, f"ipc://{path}"
            return
        if ":" in cfg.host.strip("[]"):
            sock.ipv6 = True
        if cfg.bind_device is not None:
            sock.setsockopt(zmq.BINDTODEVICE, cfg.bind_device.encode())
        sock.bind(tcp_endpoint(cfg.host, cfg.port if cfg.port else "*"))
        self.endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.port = int(self.endpoint.rsplit(":", 1)[1])

    def _open(self) -> zmq.Socket | None:
        cfg = self.config
        sock = self.context.socket(zmq.ROUTER)
        sock.linger = 0
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_CONTROL_BYTES)
        if cfg.curve is not None:
            public, secret = cfg.curve.require_server()
            sock.curve_secretkey = secret.encode("ascii")
            sock.curve_publickey = public.encode("ascii")
            sock.curve_server = True
        try:
            self._bind(sock)
        except (zmq.ZMQError, OSError) as exc:
            sock.close(linger=0)
            if isinstance(exc, BindError):
                self._bind_error = exc
            else:
                self._bind_error = BindError(
                    f"zmq sender cannot bind {self._wanted()} (host {cfg.host!r}, port {cfg.port}): {exc}"
                )
            return None
        return sock

    def _run(self) -> None:
        sock = self._open()
        self._ready.set()
        if sock is None:
            return
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(self._bell.fileno, zmq.POLLIN)
        try:
            while not self._stopping:
                events = dict(poller.poll(self._poll_timeout_ms()))
                published = self._bell.take() if self._bell.fileno in events else []
                if self._stopping:
                    break
                if sock in events:
                    self._read_requests(sock)
                self._serve_published(sock, published)
                self._fire_timers(sock)
                self.store.reap()
        except Exception:  # a bug or a zmq fault: visible in health (ok False) and the log
            logger.exception("zmq serving loop for %s failed; the sender stops serving", self.endpoint)
            self._counters["loop_failures"] += 1
        finally:
            self._answer_all_parked(sock)
            sock.close(linger=0)
            self._remove_ipc_file()

    def _poll_timeout_ms(self) -> int | None:
        parked_wait = self._table.seconds_to_next(time.monotonic())
        waits = [] if parked_wait is None else [parked_wait]
        lease_wait = self.store.seconds_to_next_expiry()
        if lease_wait is not None:
            waits.append(lease_wait)
        if not waits:
            return None
        return max(0, int(min(min(waits), _MAX_POLL_S) * 1000) + 1)

    def _reply(self, sock: zmq.Socket, identity: bytes, reply: Reply) -> None:
        if send_message(sock, [identity, encode_reply(reply)]) is None:
            self._counters["undeliverable"] += 1

    def _read_requests(self, sock: zmq.Socket) -> None:
        for _ in range(_BATCH):
            try:
                message = sock.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            identity = message[0]
            if len(message) != 2:
                self._counters["bad_messages"] += 1
                bad = Reply(
                    "error", None, reason="bad_frames", detail=f"expected 1 request frame, got {len(message) - 1}"
                )
                self._reply(sock, identity, bad)
                continue
            request = decode_request(message[1])
            if isinstance(request, Rejection):
                self._counters["bad_messages"] += 1
                self._reply(
                    sock, identity, Reply("error", request.corr_id, reason=request.reason, detail=request.detail)
                )
                continue
            self._serve_request(sock, identity, request)

    def _try_send(self, sock: zmq.Socket, identity: bytes, corr_id: int, key: str, stream: bool) -> str:
        """``"sent"``, ``"gone"`` (peer unreachable; nothing consumed) or a miss reason."""
        chunk = self.config.chunk_bytes if stream else 0

        def send(held: Held) -> list[Any] | None:
            streamed = chunk if 0 < chunk < held.size else 0
            queued = send_payload(sock, identity, corr_id, key, held.frames, held.whole, streamed)
            if queued is None:
                self._counters["undeliverable"] += 1
                return None
            pending, chunks = queued
            if streamed:
                self._counters["streams"] += 1
                self._counters["chunks_sent"] += chunks
                if chunks * streamed < held.size:
                    self._counters["streams_cut"] += 1
                    logger.warning("zmq receiver of %r vanished mid-stream", key)
            return pending

        return self.store.serve(key, send)

    def _serve_request(self, sock: zmq.Socket, identity: bytes, request: Request) -> None:
        self._counters["requests"] += 1
        outcome = self._try_send(sock, identity, request.corr_id, request.key, request.stream)
        if outcome in ("sent", "gone"):
            return
        if outcome == "failed":
            self._answer_failed(sock, identity, request.corr_id, request.key)
            return
        if request.mode == "now" or request.wait_s <= 0 or outcome == "expired":
            self._counters["misses_" + outcome] += 1
            self._reply(sock, identity, Reply("miss", request.corr_id, request.key, reason=outcome))
            return
        wait = min(request.wait_s, self.config.max_wait_s)
        waiter = _Waiter(identity, request.corr_id, request.stream)
        if self._table.park(request.key, waiter, time.monotonic(), wait) is None:
            self._counters["parked_refused"] += 1
            detail = f"{len(self._table)} requests already wait (max_parked)"
            self._reply(sock, identity, Reply("error", request.corr_id, reason="busy", detail=detail))
            return
        self._counters["parked_total"] += 1

    def _serve_published(self, sock: zmq.Socket, keys: list[str]) -> None:
        now = time.monotonic()
        for key in keys:

            def offer(waiter: _Waiter) -> bool:
                # False once every permitted reader was served: the rest keep waiting
                outcome = self._try_send(sock, waiter.identity, waiter.corr_id, key, waiter.stream)
                if outcome == "failed":  # its sender failed it: every waiter hears so now
                    self._answer_failed(sock, waiter.identity, waiter.corr_id, key)
                    return True
                return outcome in ("sent", "gone")

            self._time_out(sock, self._table.serve(key, now, offer))

    def _answer_failed(self, sock: zmq.Socket, identity: bytes, corr_id: int, key: str) -> None:
        self._counters["misses_failed"] += 1
        failure = self.store.failure(key)
        reason = MissReason.NOT_FOUND if failure is None else "failed"  # forgotten meanwhile: not found
        self._reply(sock, identity, Reply("miss", corr_id, key, reason=reason, failure=failure))

    def _fire_timers(self, sock: zmq.Socket) -> None:
        self._time_out(sock, self._table.expire(time.monotonic()))
        self.store.expire()

    def _time_out(self, sock: zmq.Socket, parked: list[Parked[_Waiter]]) -> None:
        for p in parked:
            self._counters["wait_timeouts"] += 1
            self._reply(sock, p.waiter.identity, Reply("miss", p.waiter.corr_id, p.key, reason=MissReason.TIMEOUT))

    def _answer_all_parked(self, sock: zmq.Socket) -> None:
        for p in self._table.drain():
            self._reply(sock, p.waiter.identity, Reply("miss", p.waiter.corr_id, p.key, reason=MissReason.CLOSING))

    def _remove_ipc_file(self) -> None:
        path = self.ipc_file
        if path is None or self._ipc_inode is None:
            return
        try:
            info = os.stat(path)
            if (info.st_dev, info.st_ino) == self._ipc_inode:
                os.unlink(path)
        except FileNotFoundError:
            pass  # libzmq already removed it
        self._ipc_inode = None
