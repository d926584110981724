"""The shm sender's control thread: answers receivers' gets from its pool, frees on release.

One thread serves one ROUTER socket bound at the sender's ``ipc://`` endpoint. It sleeps in
``poll`` on the socket's file descriptor and on a wake pipe, and the only timer is the earliest
deadline of a parked get. The socket, the parked gets and the counters are used under one lock,
never across a wait: a ``put`` (any thread) answers the gets parked on its key itself, right
after publishing, so a waiting receiver's grant leaves before the put returns, without waiting
for this thread to be scheduled and to get the GIL from a busy caller (``grants_direct`` counts
them). Grants carry a ticket; the receiver's ``release`` returns it and the pool frees the
region when the last ticket of an entry is back. A get that names a reply bell is answered by
one datagram to it (the receiver's thread wakes on it directly, without libzmq's I/O threads in
between: ``replies_bell``), and on the socket when that datagram cannot leave
(``bell_undeliverable``).

The socket is shared the way libzmq allows: one thread at a time, under the lock (a full memory
barrier). The thread waits on ``zmq.FD`` outside the lock, which says only that the socket's
state may have changed, so every pass reads ``zmq.EVENTS`` until nothing is left to receive;
and any send from another thread may consume that signal, so such a sender checks ``zmq.EVENTS``
after it and wakes the thread when a request is waiting.

A receiver reads granted bytes in place (it may keep tensors viewing them as long as it
likes), so a ticket held past ``hold_s`` is revoked only when the reader's process is gone:
each get names its pid, and :class:`ReaderRegistry` watches that process through a pidfd
(``os.pidfd_open``; else ``kill(pid, 0)`` plus the zombie check). A live reader keeps its
tickets; the pool reports them (``overdue``, ``held_overdue``). A get without a pid (an older
receiver) gets a ticket revoked at ``hold_s``, as before.
"""

from __future__ import annotations

import collections
import logging
import os
import select
import socket
import threading
import time
from typing import Any

import attrs
import zmq

from kvferry.adapters.connectors.memory.pool import LocalPool
from kvferry.adapters.connectors.shm.control import (
    GetManyRequest,
    PingRequest,
    ReleaseRequest,
    decode_request,
    encode,
)
from kvferry.adapters.connectors.shm.segment import pid_alive
from kvferry.adapters.connectors.wake import Doorbell
from kvferry.core.control import Rejection
from kvferry.core.errors import BindError
from kvferry.core.parked import MissReason, Parked, ParkedTable
from kvferry.core.pool import Ticket
from kvferry.core.tombstones import FAILED_REASON, FAILURE_FIELD, encode_failure

__all__ = ["ControlServer", "Reader", "ReaderRegistry"]

logger = logging.getLogger(__name__)

_MISS = {"unknown": MissReason.NOT_FOUND, "published": MissReason.NOT_FOUND}
#: Statuses after which a key cannot come: a get is answered at once, never parked.
_FINAL = (MissReason.EXPIRED, FAILED_REASON)


@attrs.define(eq=False)
class Reader:
    """A reader process, the holder of the tickets it was granted. ``alive()`` is thread-safe;
    once it reports the process gone it stays False (and the pidfd is closed)."""

    pid: int
    _fd: int | None = attrs.field(default=None, alias="fd")
    _gone: bool = attrs.field(default=False, alias="gone")
    _lock: threading.Lock = attrs.field(init=False, factory=threading.Lock)

    @classmethod
    def watch(cls, pid: int) -> Reader:
        """Watch ``pid`` through a pidfd when the system has them (immune to pid reuse)."""
        try:
            return cls(pid, fd=os.pidfd_open(pid))
        except ProcessLookupError:
            return cls(pid, gone=True)
        except (AttributeError, OSError):  # no pidfd here: probe the pid instead
            return cls(pid)

    def alive(self) -> bool:
        with self._lock:
            if self._gone:
                return False
            if self._fd is not None:
                poller = select.poll()
                poller.register(self._fd, select.POLLIN)
                gone = bool(poller.poll(0))  # a pidfd turns readable when its process exits
            else:
                gone = not pid_alive(self.pid)
            if gone:
                self._gone = True
                self.close_locked()
            return not gone

    def close_locked(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def close(self) -> None:
        with self._lock:
            self.close_locked()

    def __str__(self) -> str:
        return f"reader pid {self.pid}"


@attrs.define(eq=False)
class ReaderRegistry:
    """Readers by pid. A pid whose process is gone gets a new :class:`Reader` when it asks
    again (a reused pid is a new process). Gone readers are swept when more than ``sweep_at``
    are known; every pidfd is closed by :meth:`close`."""

    sweep_at: int = 32
    _by_pid: dict[int, Reader] = attrs.field(init=False, factory=dict)

    def __len__(self) -> int:
        return len(self._by_pid)

    def holder(self, pid: Any) -> Reader | None:
        """The holder for a get naming ``pid`` (None when it names none: no liveness test)."""
        if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
            return None
        reader = self._by_pid.get(pid)
        if reader is not None and reader.alive():
            return reader
        if len(self._by_pid) >= self.sweep_at:
            self._by_pid = {p: r for p, r in self._by_pid.items() if r.alive()}
        reader = Reader.watch(pid)
        self._by_pid[pid] = reader
        return reader

    def close(self) -> None:
        readers, self._by_pid = list(self._by_pid.values()), {}
        for reader in readers:
            reader.close()


def _poll_ms(wait_s: float | None) -> int | None:
    """A poll timeout in milliseconds for ``wait_s`` seconds (None: no timer): 0 for none left,
    else rounded up, so a deadline is never polled for before it has passed."""
    if wait_s is None:
        return None
    return 0 if wait_s <= 0 else int(wait_s * 1000) + 1


@attrs.frozen
class _Waiter:
    """Where a get's answer goes (the socket identity, and the reply bell with its token when
    the get named one), and which reader process will hold the grant."""

    identity: bytes
    request_id: int
    holder: Reader | None = None
    bell: bytes | None = None
    token: bytes | None = None


@attrs.define(eq=False)
class ControlServer:
    """Serve ``pool`` (living in segment ``segment_name`` of ``segment_bytes``) at ``endpoint``."""

    pool: LocalPool
    segment_name: str
    segment_bytes: int
    endpoint: str
    context: zmq.Context = attrs.field(factory=zmq.Context)
    counters: collections.Counter = attrs.field(init=False, factory=collections.Counter)
    _router: Any = attrs.field(init=False, default=None)
    _bell: Doorbell | None = attrs.field(init=False, default=None)
    _table: ParkedTable[_Waiter] = attrs.field(init=False, factory=ParkedTable)
    _stopping: bool = attrs.field(init=False, default=False)
    _thread: threading.Thread | None = attrs.field(init=False, default=None)
    #: Sends replies to the gets that named a reply bell (docs/reliability.md).
    _bell_out: socket.socket | None = attrs.field(init=False, default=None)
    readers: ReaderRegistry = attrs.field(init=False, factory=ReaderRegistry)
    #: Held while the socket, the parked gets or the counters are used (never across a wait);
    #: reentrant, so a publish made while it is held (none is today) cannot deadlock.
    _lock: threading.RLock = attrs.field(init=False, factory=threading.RLock)

    def start(self) -> None:
        """Bind (in the caller's thread, so a failure is raised here) and start serving."""
        router = self.context.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        try:
            router.bind(self.endpoint)
        except zmq.ZMQError as exc:
            router.close()
            raise BindError(f"shm control endpoint {self.endpoint} cannot bind: {exc}") from exc
        self._router = router
        self._bell_out = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._bell_out.setblocking(False)
        self._bell = Doorbell()
        self.pool.on_publish.append(self.notify_published)
        self._thread = threading.Thread(target=self._run, name=f"kvferry-shm-{self.segment_name}", daemon=True)
        self._thread.start()

    def notify_published(self, key: str) -> None:
        """Called (any thread) after ``key`` was published in the pool, or failed: the gets
        parked on it are answered here and now."""
        bell = self._bell
        if bell is None:
            return
        with self._lock:
            if self._router is None or self._stopping:  # closed, or closing: the thread answers
                bell.ring(key)
                return
            before = self.counters["grants"]
            self._serve_published([key])
            self.counters["grants_direct"] += self.counters["grants"] - before
            if self._router.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                bell.ring()  # the sends above may have taken the thread's signal of a request

    def stop(self, timeout_s: float = 5.0) -> None:
        """Answer parked gets with "closing", stop the thread, close the socket. Idempotent."""
        if self._thread is None or self._stopping:
            return
        self._stopping = True
        assert self._bell is not None  # made by start(), as the thread
        self._bell.ring()
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            logger.error("shm control thread of %s did not stop within %.1f s", self.endpoint, timeout_s)
            return
        self._bell.close()
        self.context.term()
        self.readers.close()

    # ------------------------------------------------------------------ thread side only
    def _ring(self, waiter: _Waiter, message: dict[str, Any]) -> bool:
        """Send a reply to ``waiter``'s bell as one datagram; False when it could not leave (no
        such socket: its process closed it or is in another network namespace; its queue is
        full), and the reply then takes the socket."""
        if self._bell_out is None or waiter.bell is None:
            return False
        try:
            self._bell_out.sendto(encode({**message, "token": waiter.token}), waiter.bell)
        except OSError:
            self.counters["bell_undeliverable"] += 1
            return False
        self.counters["replies_bell"] += 1
        return True

    def _answer_get(self, waiter: _Waiter, message: dict[str, Any], *tickets: Ticket) -> None:
        """A get's reply: to its bell when it named one, else (or when that fails) the socket."""
        if not self._ring(waiter, message):
            self._reply(waiter.identity, message, *tickets)

    def _reply(self, identity: bytes, message: dict[str, Any], *tickets: Ticket) -> None:
        try:
            self._router.send_multipart([identity, encode(message)], zmq.NOBLOCK)
        except zmq.ZMQError as exc:  # receiver gone (EHOSTUNREACH) or its queue is full
            self.counters["replies_undeliverable"] += 1
            logger.debug("shm reply to a gone receiver dropped: %s", exc)
            for ticket in tickets:
                self.pool.release(ticket.ticket_id)

    def _granted(self, ticket: Ticket) -> dict[str, Any]:
        self.counters["grants"] += 1
        return {
            "ok": True,
            "seg": self.segment_name,
            "seg_bytes": self.segment_bytes,
            "off": ticket.handle.offset,
            "size": ticket.size,
            "ticket": ticket.ticket_id,
        }

    def _grant(self, waiter: _Waiter, ticket: Ticket) -> None:
        self._answer_get(waiter, {"id": waiter.request_id, **self._granted(ticket)}, ticket)

    def _get_many(self, identity: bytes, request_id: int, keys: tuple[str, ...], holder: Reader | None) -> None:
        self.counters["get_many"] += 1
        entries: list[dict[str, Any]] = []
        tickets: list[Ticket] = []
        for key in keys:
            ticket = self.pool.take(key, holder)
            if ticket is not None:
                tickets.append(ticket)
                entries.append(self._granted(ticket))
            else:
                entries.append(self._miss_entry(key))
        self._reply(identity, {"id": request_id, "ok": True, "grants": entries}, *tickets)

    def _miss_entry(self, key: str) -> dict[str, Any]:
        """Why ``key`` is not there, with its failure record when its sender failed it."""
        status = self.pool.status(key)
        reason = _MISS.get(status, status)
        self.counters["miss_" + reason] += 1
        entry: dict[str, Any] = {"ok": False, "reason": reason}
        failure = self.pool.failure(key) if reason == FAILED_REASON else None
        if failure is not None:
            entry[FAILURE_FIELD] = encode_failure(failure)
        return entry

    def _miss(self, waiter: _Waiter, reason: str) -> None:
        self.counters["miss_" + reason] += 1
        self._answer_get(waiter, {"id": waiter.request_id, "ok": False, "reason": reason})

    def _miss_key(self, waiter: _Waiter, key: str) -> None:
        self._answer_get(waiter, {"id": waiter.request_id, **self._miss_entry(key)})

    def _handle(self, identity: bytes, frame: bytes) -> None:
        request = decode_request(frame)
        if isinstance(request, Rejection):
            self.counters["bad_requests"] += 1
            if request.corr_id is not None:
                reply = {"id": request.corr_id, "ok": False, "reason": request.reason, "detail": request.detail}
                self._reply(identity, reply)
            return
        if isinstance(request, ReleaseRequest):
            freed = False
            if request.seg is None or request.seg == self.segment_name:
                for ticket_id in request.tickets:
                    self.counters["releases"] += 1
                    freed = self.pool.release(ticket_id) or freed
            else:  # granted by another incarnation of this endpoint: not ours to free
                self.counters["releases_foreign"] += 1
            if request.id is not None:
                self._reply(identity, {"id": request.id, "ok": True, "released": freed})
        elif isinstance(request, PingRequest):
            self._reply(identity, {"id": request.id, "ok": True, "health": self.pool.stats()})
        elif isinstance(request, GetManyRequest):
            self._get_many(identity, request.id, request.keys, self.readers.holder(request.pid))
        else:
            holder = self.readers.holder(request.pid)
            self._get(_Waiter(identity, request.id, holder, request.bell, request.token), request.key, request.wait_s)

    def _get(self, waiter: _Waiter, key: str, wait_s: float) -> None:
        ticket = self.pool.take(key, waiter.holder)
        if ticket is not None:
            self._grant(waiter, ticket)
        elif wait_s > 0 and not self._stopping and self.pool.status(key) not in _FINAL:
            self._table.park(key, waiter, time.monotonic(), wait_s)
        else:
            self._miss_key(waiter, key)

    def _serve_published(self, keys: list[str]) -> None:
        now = time.monotonic()
        for key in keys:

            def offer(waiter: _Waiter) -> bool:
                ticket = self.pool.take(key, waiter.holder)
                if ticket is not None:
                    self._grant(waiter, ticket)
                    return True
                if self.pool.status(key) == FAILED_REASON:  # its sender failed it: tell every waiter
                    self._miss_key(waiter, key)
                    return True
                return False

            self._answer(self._table.serve(key, now, offer), MissReason.TIMEOUT)

    def _answer(self, parked: list[Parked[_Waiter]], reason: str) -> None:
        for p in parked:
            self._miss(p.waiter, reason)

    def _expire_waiters(self) -> float | None:
        """Answer parked gets past their deadline; returns seconds to the next deadline."""
        now = time.monotonic()
        self._answer(self._table.expire(now), MissReason.TIMEOUT)
        return self._table.seconds_to_next(now)

    def _run(self) -> None:
        bell = self._bell
        assert bell is not None  # made by start() before the thread
        poller = select.poll()
        poller.register(self._router.getsockopt(zmq.FD), select.POLLIN)
        poller.register(bell.fileno, select.POLLIN)
        try:
            while not self._stopping:
                with self._lock:
                    keys = bell.take()
                    if keys:
                        self._serve_published(keys)
                    wait = self._expire_waiters()
                    if self._receive_batch():
                        wait = 0.0  # more requests are queued: look again before sleeping
                poller.poll(_poll_ms(wait))
            with self._lock:
                self._answer(self._table.drain(), MissReason.CLOSING)
        except Exception:  # the thread must never die silently: log, count, stop serving
            self.counters["thread_errors"] += 1
            logger.exception("shm control thread of %s failed; receivers will time out", self.endpoint)
        finally:
            with self._lock:
                self._router.close(0)
                self._router = None
                if self._bell_out is not None:
                    self._bell_out.close()
                    self._bell_out = None

    def _receive_batch(self) -> bool:
        """Handle the requests queued on the socket, at most 256 (lock held); True when more
        are left."""
        for _ in range(256):
            if not self._router.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                return False
            try:
                identity, frame = self._router.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return False
            except ValueError:  # not [identity, frame]
                self.counters["bad_requests"] += 1
                continue
            self._handle(identity, frame)
        return bool(self._router.getsockopt(zmq.EVENTS) & zmq.POLLIN)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def parked(self) -> int:
        """Parked gets (approximate when read from another thread; for health only)."""
        return len(self._table)
