"""The shm sender's control thread: answers receivers' gets from its pool, frees on release.

One thread owns one ROUTER socket bound at the sender's ``ipc://`` endpoint. It sleeps in
``poll`` on that socket and on a wake pipe; ``put`` (any thread) writes to the pipe after
publishing, so a parked "get" is answered the moment its key arrives, and the only timer is
the earliest deadline of a parked get. Grants carry a ticket; the receiver's ``release``
returns it and the pool frees the region when the last ticket of an entry is back (or its
lease/hold expires: a dead reader cannot pin the pool).
"""

from __future__ import annotations

import collections
import errno
import heapq
import itertools
import logging
import os
import threading
import time
from typing import Any

import attrs
import zmq

from kvferry.adapters.connectors.memory import LocalPool
from kvferry.adapters.connectors.shm_control import check_request, decode, encode
from kvferry.core.errors import BindError
from kvferry.core.pool import Ticket

__all__ = ["ControlServer"]

logger = logging.getLogger(__name__)

_MISS = {"unknown": "not_found", "published": "not_found"}


@attrs.define(eq=False)
class _Waiter:
    identity: bytes
    request_id: int
    key: str
    deadline: float
    done: bool = False


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
    _wake: tuple[int, int] = attrs.field(init=False, default=(-1, -1))
    _published: collections.deque = attrs.field(init=False, factory=collections.deque)
    _waiters: dict[str, collections.deque] = attrs.field(init=False, factory=dict)
    _deadlines: list[tuple[float, int, _Waiter]] = attrs.field(init=False, factory=list)
    _seq: Any = attrs.field(init=False, factory=itertools.count)
    _stopping: bool = attrs.field(init=False, default=False)
    _thread: threading.Thread | None = attrs.field(init=False, default=None)

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
        read_fd, write_fd = os.pipe()
        os.set_blocking(read_fd, False)
        os.set_blocking(write_fd, False)
        self._wake = (read_fd, write_fd)
        self.pool.on_publish.append(self.notify_published)
        self._thread = threading.Thread(target=self._run, name=f"kvferry-shm-{self.segment_name}",
                                        daemon=True)
        self._thread.start()

    def _poke(self) -> None:
        try:
            os.write(self._wake[1], b"\0")
        except BlockingIOError:
            pass  # the pipe is full: a wake-up is already pending
        except OSError as exc:
            if exc.errno != errno.EBADF:
                raise

    def notify_published(self, key: str) -> None:
        """Called (any thread) after ``key`` was published in the pool."""
        self._published.append(key)
        self._poke()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Answer parked gets with "closing", stop the thread, close the socket. Idempotent."""
        if self._thread is None or self._stopping:
            return
        self._stopping = True
        self._poke()
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            logger.error("shm control thread of %s did not stop within %.1f s", self.endpoint, timeout_s)
            return
        for fd in self._wake:
            os.close(fd)
        self.context.term()

    # ------------------------------------------------------------------ thread side only
    def _reply(self, identity: bytes, message: dict[str, Any], ticket: Ticket | None = None) -> None:
        try:
            self._router.send_multipart([identity, encode(message)], zmq.NOBLOCK)
        except zmq.ZMQError as exc:  # receiver gone (EHOSTUNREACH) or its queue is full
            self.counters["replies_undeliverable"] += 1
            logger.debug("shm reply to a gone receiver dropped: %s", exc)
            if ticket is not None:
                self.pool.release(ticket.ticket_id)

    def _grant(self, identity: bytes, request_id: int, ticket: Ticket) -> None:
        self.counters["grants"] += 1
        self._reply(identity, {
            "id": request_id, "ok": True, "seg": self.segment_name, "seg_bytes": self.segment_bytes,
            "off": ticket.handle.offset, "size": ticket.size, "ticket": ticket.ticket_id,
        }, ticket)

    def _miss(self, identity: bytes, request_id: int, reason: str) -> None:
        self.counters["miss_" + reason] += 1
        self._reply(identity, {"id": request_id, "ok": False, "reason": reason})

    def _handle(self, identity: bytes, frame: bytes) -> None:
        message = decode(frame)
        problem = "not a control message" if message is None else check_request(message)
        if problem is not None:
            self.counters["bad_requests"] += 1
            request_id = message.get("id") if message else None
            if isinstance(request_id, int):
                self._reply(identity, {"id": request_id, "ok": False, "reason": "bad_request",
                                       "detail": problem})
            return
        op = message["op"]
        if op == "release":
            self.counters["releases"] += 1
            freed = self.pool.release(message["ticket"])
            if "id" in message:
                self._reply(identity, {"id": message["id"], "ok": True, "released": freed})
        elif op == "ping":
            self._reply(identity, {"id": message["id"], "ok": True, "health": self.pool.stats()})
        else:
            self._get(identity, message["id"], message["key"], float(message.get("wait_s", 0.0)))

    def _get(self, identity: bytes, request_id: int, key: str, wait_s: float) -> None:
        ticket = self.pool.take(key)
        if ticket is not None:
            self._grant(identity, request_id, ticket)
        elif wait_s > 0 and not self._stopping and self.pool.status(key) != "expired":
            waiter = _Waiter(identity, request_id, key, time.monotonic() + wait_s)
            self._waiters.setdefault(key, collections.deque()).append(waiter)
            heapq.heappush(self._deadlines, (waiter.deadline, next(self._seq), waiter))
        else:
            status = self.pool.status(key)
            self._miss(identity, request_id, _MISS.get(status, status))

    def _serve_published(self) -> None:
        while self._published:
            key = self._published.popleft()
            queue = self._waiters.get(key)
            now = time.monotonic()
            while queue:
                waiter = queue[0]
                if waiter.deadline > now:
                    ticket = self.pool.take(key)
                    if ticket is None:
                        break
                    self._grant(waiter.identity, waiter.request_id, ticket)
                else:
                    self._miss(waiter.identity, waiter.request_id, "timeout")
                waiter.done = True
                queue.popleft()
            if queue is not None and not queue:
                del self._waiters[key]

    def _expire_waiters(self, everyone: bool = False) -> float | None:
        """Answer parked gets past their deadline; returns seconds to the next deadline."""
        now = time.monotonic()
        while self._deadlines and (everyone or self._deadlines[0][0] <= now):
            _, _, waiter = heapq.heappop(self._deadlines)
            if waiter.done:
                continue
            waiter.done = True
            queue = self._waiters.get(waiter.key)
            if queue is not None:
                queue.remove(waiter)
                if not queue:
                    del self._waiters[waiter.key]
            self._miss(waiter.identity, waiter.request_id, "closing" if everyone else "timeout")
        return self._deadlines[0][0] - now if self._deadlines else None

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._router, zmq.POLLIN)
        poller.register(self._wake[0], zmq.POLLIN)
        try:
            while not self._stopping:
                wait = self._expire_waiters()
                ready = dict(poller.poll(None if wait is None else max(1, int(wait * 1000) + 1)))
                if self._wake[0] in ready:
                    while True:
                        try:
                            if not os.read(self._wake[0], 4096):
                                break
                        except BlockingIOError:
                            break
                    self._serve_published()
                if self._router in ready:
                    for _ in range(256):  # bounded batch, then look at the pipe again
                        try:
                            identity, frame = self._router.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        except ValueError:  # not [identity, frame]
                            self.counters["bad_requests"] += 1
                            continue
                        self._handle(identity, frame)
            self._expire_waiters(everyone=True)
        except Exception:  # the thread must never die silently: log, count, stop serving
            self.counters["thread_errors"] += 1
            logger.exception("shm control thread of %s failed; receivers will time out", self.endpoint)
        finally:
            self._router.close(0)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def parked(self) -> int:
        """Parked gets (approximate when read from another thread; for health only)."""
        return len(self._deadlines)
