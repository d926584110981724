"""The zmq connector's receiver side: one I/O thread, one DEALER per sender endpoint.

Callers (any thread, several at once) hand a request to the I/O thread and wait on their own
``threading.Event`` with their own deadline: arrival wakes them, nothing sleep-polls. Only the
I/O thread touches the DEALER sockets. Each request has a correlation id unique in this
connector; a reply is handed only to the waiting request with the same id *and* endpoint.

A data reply that arrives after its caller gave up (its deadline passed) is not lost: when a
newer get of the same key from the same endpoint is waiting, it answers that one (the sender
gave the key to the first get, so it can only park the newer one until its wait ends);
otherwise it is kept in a bounded stash (``late_stash_bytes``, ``late_stash_s``) and handed to
the next get of that key from that endpoint. It never answers any other key.

DEALERs use ``IMMEDIATE``: a request is queued only to a live connection, so a request made
while the sender is away is never delivered later to a restarted sender.

A lost connection ends the requests it would have answered at once, not at their deadlines. The
I/O thread watches each DEALER's connection (a zmq socket monitor). When one that was up drops
(the sender's process ended, its host went silent past the heartbeat timeout, the network
broke), every request already sent on it gets ``Outcome("error", reason="disconnected")``:
its reply can no longer come. A request for an endpoint that was up and is down gets the same
once it has waited :data:`DOWN_GRACE_S` with the endpoint down (zmq reconnects on its own; a
sender back within the grace is asked as usual). An endpoint never connected yet is waited
for until the request's deadline, as a receiver started before its sender must.

Every request accepts a streamed reply (:mod:`.stream`): the I/O thread receives each chunk
into a region of the reused receive pool (:class:`.buffers.RecvPool`, ``recv_pool_bytes``)
as it arrives, and hands the caller that region as one memoryview once the last chunk is in;
the region returns to the pool when the caller's views of it are garbage. Small payloads come
in one message, as zmq frames. ``RCVHWM`` (``recv_hwm``, default 1) bounds how many messages
libzmq buffers per sender: its transient chunk buffers then stay one or two chunks of heap that
glibc reuses, instead of fresh mappings that fault.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable

import attrs
import zmq
from zmq.utils.monitor import recv_monitor_message

from kvferry.adapters.connectors.wake import Waker
from kvferry.adapters.connectors.zmq.buffers import RecvPool
from kvferry.adapters.connectors.zmq.config import ZmqConfig
from kvferry.adapters.connectors.zmq.inbound import Outcome, ReplyReader
from kvferry.adapters.connectors.zmq.protocol import Request, encode_request
from kvferry.adapters.connectors.zmq.stash import LateStash
from kvferry.core.policy import SENDER_DOWN_GRACE_S

__all__ = ["ZmqClient", "Outcome"]

logger = logging.getLogger(__name__)
_MAX_ENDPOINTS = 256
#: Seconds a request waits to be sent to an endpoint that was connected and is not now, before
#: it fails as ``disconnected`` (zmq retries the connection every 0.1-0.5 s meanwhile, so a
#: sender back within the grace is reconnected and asked): every connector's grace.
DOWN_GRACE_S = SENDER_DOWN_GRACE_S
_RECONNECT_IVL_MAX_MS = 500
#: A connection that carries nothing, not even heartbeats (sent every second), this long is
#: dropped: a sender whose host went silent (a cut wire, a frozen machine) ends its requests then.
HEARTBEAT_TIMEOUT_S = 5.0
#: A link is up once its ZMTP handshake succeeded (a TCP connection the sender refuses, e.g. a
#: CURVE key it does not know, never is: requests to it wait for their deadlines as before).
_LINK_EVENTS = zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED
COUNTERS = (
    "requests",
    "hits",
    "bytes_received",
    "misses_not_found",
    "misses_expired",
    "misses_timeout",
    "misses_closing",
    "misses_failed",
    "errors",
    "timeouts",
    "late_replies",
    "late_handed_over",
    "stash_hits",
    "stash_evicted",
    "bad_replies",
    "connect_failures",
    "loop_failures",
    "streams",
    "stream_aborts",
    "disconnects",
    "lost_in_flight",
    "failed_sender_down",
)


@attrs.define(eq=False)
class _Slot:
    corr_id: int
    endpoint: str
    key: str
    event: threading.Event = attrs.Factory(threading.Event)
    outcome: Outcome | None = None
    sent: bool = False  # handed to a live connection (set by the I/O thread)


@attrs.define(eq=False)
class _Outgoing:
    endpoint: str
    body: bytes
    deadline: float
    corr_id: int
    queued_s: float  # clock s: when the caller asked


@attrs.define(eq=False)
class _Link:
    """One sender endpoint's DEALER, the monitor of its connection, and that connection's
    state: ``up`` None until a handshake first succeeds, then True / False; ``down_since``
    (clock s) when it last dropped."""

    sock: zmq.Socket
    monitor: zmq.Socket
    up: bool | None = None
    down_since: float = 0.0

    def close(self) -> None:
        try:
            self.sock.disable_monitor()
        except zmq.ZMQError:
            pass
        self.monitor.close(linger=0)
        self.sock.close(linger=0)


def _gives_up_s(link: _Link, item: _Outgoing) -> float:
    """When ``item``, waiting to be sent over ``link`` (down), fails: a full grace after the
    later of its request and the drop."""
    return max(link.down_since, item.queued_s) + DOWN_GRACE_S


@attrs.define(eq=False)
class ZmqClient:
    """Pulls payloads from senders. Thread-safe; the I/O thread starts on first use.

    ``clock`` (monotonic seconds) times real waits: request deadlines and the stash's TTL.
    """

    config: ZmqConfig
    context: zmq.Context
    clock: Callable[[], float] = time.monotonic
    _lock: threading.Lock = attrs.field(init=False, factory=threading.Lock)
    _waker: Waker | None = attrs.field(init=False, default=None)
    _thread: threading.Thread | None = attrs.field(init=False, default=None)
    _next_id: int = attrs.field(init=False, default=1)
    _pending: dict[int, _Slot] = attrs.field(init=False, factory=dict)
    _submits: collections.deque = attrs.field(init=False, factory=collections.deque)
    _stash: LateStash = attrs.field(init=False)
    _counters: dict[str, int] = attrs.field(init=False, factory=lambda: dict.fromkeys(COUNTERS, 0))
    _endpoints: int = attrs.field(init=False, default=0)
    _closed: bool = attrs.field(init=False, default=False)
    _pool: RecvPool = attrs.field(init=False)
    _reader: ReplyReader = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        cfg = self.config
        self._stash = LateStash(cfg.late_stash_bytes, cfg.late_stash_s)
        self._pool = RecvPool(cfg.recv_pool_bytes)
        self._reader = ReplyReader(self._deliver, self._count, self._pool.lend, cfg.stream_idle_s, self.clock)

    # ---------------------------------------------------------------- callers

    def request(self, endpoint: str, key: str, mode: str, wait_s: float, timeout_s: float) -> Outcome:
        """Ask ``endpoint`` for ``key`` and wait up to ``timeout_s`` seconds for the answer."""
        with self._lock:
            if self._closed:
                return Outcome("closed")
            stashed = self._stash.take(endpoint, key, self.clock())
            self._counters["requests"] += 1
            if stashed is not None:
                self._counters["stash_hits"] += 1
                self._count_outcome_locked(stashed)
                return stashed
            waker = self._ensure_thread_locked()
            corr_id = self._next_id
            body = encode_request(Request(corr_id, key, mode, wait_s, True))  # ConfigError if bad
            self._next_id += 1
            slot = _Slot(corr_id, endpoint, key)
            self._pending[corr_id] = slot
            now = self.clock()
            self._submits.append(_Outgoing(endpoint, body, now + timeout_s, corr_id, now))
        waker.poke()
        slot.event.wait(max(0.0, timeout_s))
        with self._lock:
            self._pending.pop(corr_id, None)
            outcome = slot.outcome if slot.outcome is not None else Outcome("timeout")
            self._count_outcome_locked(outcome)
        return outcome

    def drop_request(self, request_id: str) -> None:
        """Forget stashed late payloads of ``request_id``."""
        with self._lock:
            self._stash.drop_request(request_id)

    def stats(self) -> dict[str, int]:
        with self._lock:
            out = dict(self._counters)
            out["stash_bytes"] = self._stash.nbytes
            out["stash_payloads"] = len(self._stash)
            out["in_flight"] = len(self._pending)
            out["endpoints"] = self._endpoints
        out.update(self._pool.stats())
        return out

    def close(self, timeout_s: float = 5.0) -> bool:
        """Stop the I/O thread (waiting callers get ``closed``). Idempotent."""
        with self._lock:
            self._closed = True
            for slot in self._pending.values():
                if slot.outcome is None:
                    slot.outcome = Outcome("closed")
                    slot.event.set()
            self._stash.clear()
            thread, waker = self._thread, self._waker
        if thread is None:
            if waker is not None:
                waker.close()
            self._pool.close()
            return True
        assert waker is not None  # the thread starts with its waker
        waker.poke()
        thread.join(timeout_s)
        if thread.is_alive():
            logger.error("zmq receive thread did not stop in %.1fs", timeout_s)
            return False
        waker.close()
        self._pool.close()
        return True

    # ---------------------------------------------------------------- bookkeeping

    def _ensure_thread_locked(self) -> Waker:
        """The I/O thread's waker; the thread starts (and the waker is made) on first use."""
        if self._waker is None:
            self._waker = Waker.create()
        waker = self._waker
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, args=(waker,), name="kvferry-zmq-recv", daemon=True)
            self._thread.start()
        return waker

    def _count_outcome_locked(self, outcome: Outcome) -> None:
        if outcome.kind == "data":
            self._counters["hits"] += 1
            self._counters["bytes_received"] += outcome.size
        elif outcome.kind == "miss":
            self._counters["misses_" + outcome.reason] += 1
        elif outcome.kind == "error":
            self._counters["errors"] += 1
        elif outcome.kind == "timeout":
            self._counters["timeouts"] += 1

    def _count(self, name: str) -> None:
        with self._lock:
            self._counters[name] += 1

    def _deliver(self, endpoint: str, corr_id: int | None, outcome: Outcome, key: str) -> None:
        with self._lock:
            slot = self._pending.get(corr_id) if corr_id is not None else None
            if slot is not None and slot.endpoint == endpoint and slot.outcome is None:
                slot.outcome = outcome
                slot.event.set()
                return
            if outcome.kind != "data":
                return  # e.g. the sender's own "timeout" answer, just after our deadline
            self._counters["late_replies"] += 1
            for other in self._pending.values():  # a newer get of this key, still waiting
                if other.outcome is None and other.endpoint == endpoint and other.key == key:
                    other.outcome = outcome
                    other.event.set()
                    self._counters["late_handed_over"] += 1
                    return
            if not self._closed:
                evicted = self._stash.put(endpoint, key, outcome, self.clock())
                self._counters["stash_evicted"] += evicted

    # ---------------------------------------------------------------- I/O thread

    def _connect(self, endpoint: str) -> _Link | None:
        cfg = self.config
        sock = self.context.socket(zmq.DEALER)
        sock.linger = 0
        sock.setsockopt(zmq.IMMEDIATE, 1)
        sock.setsockopt(zmq.RCVHWM, cfg.recv_hwm)
        sock.setsockopt(zmq.RECONNECT_IVL, 100)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, _RECONNECT_IVL_MAX_MS)
        sock.setsockopt(zmq.HEARTBEAT_IVL, 1000)
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, int(HEARTBEAT_TIMEOUT_S * 1000))
        if cfg.max_frame_bytes > 0:
            sock.setsockopt(zmq.MAXMSGSIZE, cfg.max_frame_bytes)
        if cfg.curve is not None:
            server_public, client_public, client_secret = cfg.curve.require_client()
            sock.curve_serverkey = server_public.encode("ascii")
            sock.curve_publickey = client_public.encode("ascii")
            sock.curve_secretkey = client_secret.encode("ascii")
        if endpoint.startswith("tcp://["):
            sock.ipv6 = True
        try:
            monitor = sock.get_monitor_socket(_LINK_EVENTS)
        except zmq.ZMQError as exc:
            logger.warning("zmq receiver cannot watch its connection to %s: %s", endpoint, exc)
            sock.close(linger=0)
            return None
        link = _Link(sock, monitor)
        try:
            sock.connect(endpoint)
        except zmq.ZMQError as exc:
            logger.warning("zmq receiver cannot connect to %s: %s", endpoint, exc)
            link.close()
            return None
        return link

    def _watch(self, endpoint: str, link: _Link) -> None:
        """Read ``link``'s connection events; a connection that drops ends the requests sent
        on it (their replies cannot come) and any stream in progress from it."""
        while True:
            try:
                event = recv_monitor_message(link.monitor, zmq.NOBLOCK)["event"]
            except zmq.Again:
                return
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                link.up = True
            elif event == zmq.EVENT_DISCONNECTED and link.up:
                link.up, link.down_since = False, self.clock()
                self._reader.abandon(endpoint)
                with self._lock:
                    self._counters["disconnects"] += 1
                    sent = [s for s in self._pending.values() if s.endpoint == endpoint and s.sent]
                    lost = self._fail_locked(sent, "lost_in_flight")
                logger.warning(
                    "zmq receiver lost its connection to %s; %d request(s) in flight on it failed at once "
                    "(the sender ended or the network broke)",
                    endpoint,
                    lost,
                )

    def _fail_locked(self, slots: list[_Slot], counter: str) -> int:
        """End ``slots`` still waiting as ``disconnected``, counting them under ``counter``;
        returns how many were still waiting."""
        failed = 0
        for slot in slots:
            if slot.outcome is None:
                slot.outcome = Outcome("error", reason="disconnected")
                slot.event.set()
                failed += 1
        self._counters[counter] += failed
        return failed

    def _run(self, waker: Waker) -> None:
        sockets: collections.OrderedDict[str, _Link] = collections.OrderedDict()
        outbox: dict[str, collections.deque] = {}
        poller = zmq.Poller()
        poller.register(waker.fileno, zmq.POLLIN)
        try:
            while not self._closed:
                events = dict(poller.poll(self._timeout_ms(sockets, outbox)))
                waker.drain()
                if self._closed:
                    break
                self._route_submits(sockets, outbox, poller)
                for endpoint, link in list(sockets.items()):
                    if events.get(link.sock, 0) & zmq.POLLIN:  # replies first: they came before a drop
                        self._reader.read(endpoint, link.sock)
                    if events.get(link.monitor, 0) & zmq.POLLIN:
                        self._watch(endpoint, link)
                self._reader.expire()
                self._flush(sockets, outbox, poller)
        except Exception:  # a bug or a zmq fault: fail the waiting callers, not silently
            logger.exception("zmq receive loop failed; it restarts on the next request")
            with self._lock:
                self._counters["loop_failures"] += 1
        finally:
            for link in sockets.values():
                link.close()
            self._reader.close()
            with self._lock:
                self._endpoints = 0
                if not self._closed:  # failed: answer every waiter, let a new thread start
                    for slot in self._pending.values():
                        if slot.outcome is None:
                            slot.outcome = Outcome("error", reason="loop_failed")
                            slot.event.set()
                    self._submits.clear()
                    self._thread = None

    def _timeout_ms(self, sockets: dict[str, _Link], outbox: dict[str, collections.deque]) -> int | None:
        deadlines = [q[0].deadline for q in outbox.values() if q]
        deadlines += self._reader.deadlines()
        deadlines += [
            _gives_up_s(link, outbox[e][0]) for e, link in sockets.items() if link.up is False and outbox.get(e)
        ]
        if not deadlines:
            return None
        return max(0, int((min(deadlines) - self.clock()) * 1000) + 1)

    def _route_submits(self, sockets, outbox, poller) -> None:
        with self._lock:
            submits = list(self._submits)
            self._submits.clear()
        for item in submits:
            if item.endpoint not in sockets:
                while len(sockets) >= _MAX_ENDPOINTS:
                    old_endpoint, old = sockets.popitem(last=False)
                    poller.unregister(old.sock)
                    poller.unregister(old.monitor)
                    old.close()
                    outbox.pop(old_endpoint, None)
                    self._reader.drop(old_endpoint, "connection closed (too many senders)")
                link = self._connect(item.endpoint)
                if link is None:
                    with self._lock:
                        self._counters["connect_failures"] += 1
                    continue  # its caller times out; the endpoint text was unusable
                sockets[item.endpoint] = link
                poller.register(link.sock, zmq.POLLIN)
                poller.register(link.monitor, zmq.POLLIN)
                with self._lock:
                    self._endpoints = len(sockets)
            sockets.move_to_end(item.endpoint)
            outbox.setdefault(item.endpoint, collections.deque()).append(item)

    def _flush(self, sockets, outbox, poller) -> None:
        now = self.clock()
        for endpoint, queue in outbox.items():
            link = sockets.get(endpoint)
            given_up = []  # waited the grace for an endpoint that was up and is down
            while link is not None and link.up is False and queue and now >= _gives_up_s(link, queue[0]):
                given_up.append(queue.popleft())
            if given_up:
                with self._lock:
                    slots = [s for i in given_up if (s := self._pending.get(i.corr_id)) is not None]
                    self._fail_locked(slots, "failed_sender_down")
            while queue and link is not None:
                item = queue[0]
                if item.deadline <= now:
                    queue.popleft()  # its caller has given up; never deliver it later
                    continue
                try:
                    link.sock.send(item.body, flags=zmq.NOBLOCK)
                except zmq.Again:
                    break  # no live connection yet: wait for POLLOUT (or the deadline)
                queue.popleft()
                with self._lock:
                    slot = self._pending.get(item.corr_id)
                    if slot is not None:
                        slot.sent = True
            if link is not None:
                poller.modify(link.sock, zmq.POLLIN | (zmq.POLLOUT if queue else 0))
