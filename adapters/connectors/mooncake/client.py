"""Receiver side of the mooncake control channel: one DEALER per sender endpoint.

:class:`PeerChannel` sends a :class:`~.wire.Lookup` and waits for the reply with the
same id, watching the socket's monitor at the same time: a refused connection or a dropped one
(the sender process died) ends the wait at once with ``sender_unavailable`` instead of waiting
out the deadline. ZMQ heartbeats detect a silent host within :data:`HEARTBEAT_TIMEOUT_MS`.
After any failure the channel is closed and the caller opens a new one (no stale replies).
:meth:`PeerChannel.lookup_many` and :meth:`PeerChannel.done_many` send several messages at once
and then wait for all their answers (matched by id, in any order): the sender answers each as
it answers one alone, so a batch costs one round trip on the wire instead of one per key.

Events from before a request are applied first, in order, and only the connection's state
after all of them counts: a drop that ZMQ already repaired by reconnecting (a wire cut while
the channel sat idle in the receiver's pool, a sender restarted on the same port) is history,
not a failure of the next request. Declaring such a request failed would be worse than slow:
the sender has claimed the payload for it (one of its readers) and answers into a socket the
receiver then closes, so every retry finds the key consumed ("not found") until the deadline.
A channel whose connection is down when a request is about to be sent fails before sending
(nothing reaches the sender, nothing is claimed). Once the request is out, a drop fails it at
once (its reply would go to the lost connection), but a reply that arrived is used even when
the monitor reports a drop in the same poll.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Sequence
from typing import Any

import attrs
import zmq
from zmq.utils.monitor import recv_monitor_message

from kvferry.adapters.connectors.mooncake import wire
from kvferry.core.control import Rejection

__all__ = ["HEARTBEAT_IVL_MS", "HEARTBEAT_TIMEOUT_MS", "Failure", "PeerChannel"]

HEARTBEAT_IVL_MS = 1000
HEARTBEAT_TIMEOUT_MS = 3000
_DEAD_EVENTS = (zmq.EVENT_DISCONNECTED, zmq.EVENT_CONNECT_RETRIED, zmq.EVENT_CLOSED)
_ids = itertools.count(1)
#: Numbers the monitor endpoints: pyzmq's default name comes from the socket's file descriptor,
#: which a new channel may reuse while the closed one's monitor is still bound ("Address
#: already in use" on a retry after a dropped connection).
_monitors = itertools.count(1)


@attrs.frozen
class Failure:
    """Why a lookup got no reply: ``reason`` is ``sender_unavailable``, ``timeout``,
    ``bad_reply`` or ``closed``; ``detail`` is human text. ``dropped``: the connection, made
    before, was lost while the request was out (its reply can no longer come)."""

    reason: str
    detail: str
    dropped: bool = False


@attrs.define(eq=False)
class PeerChannel:
    """Control channel to the sender at ``tcp://host:port``. One request at a time (locked)."""

    ctx: zmq.Context
    host: str
    port: int
    _sock: zmq.Socket = attrs.field(init=False)
    _monitor: zmq.Socket = attrs.field(init=False)
    _lock: threading.Lock = attrs.field(init=False, factory=threading.Lock)
    _connected: bool = attrs.field(init=False, default=False)
    closed: bool = attrs.field(init=False, default=False)

    def __attrs_post_init__(self) -> None:
        sock = self.ctx.socket(zmq.DEALER)
        sock.linger = 0
        sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
        if ":" in self.host:
            sock.setsockopt(zmq.IPV6, 1)
        self._monitor = sock.get_monitor_socket(addr=f"inproc://kvferry-mooncake-monitor-{id(self)}-{next(_monitors)}")
        where = f"[{self.host}]" if ":" in self.host else self.host
        sock.connect(f"tcp://{where}:{self.port}")
        self._sock = sock

    def lookup(self, key: str, room: int, wait_s: float, grace_s: float) -> wire.LookupReply | Failure:
        """Ask for ``key`` (long-poll ``wait_s`` s on the sender); give up after ``wait_s +
        grace_s`` seconds or as soon as the connection is seen to fail."""
        with self._lock:
            if self.closed:
                return Failure("sender_unavailable", "channel closed")
            request = wire.Lookup(next(_ids), key, room, wait_s, spans_ok=True)
            return self._ask(request, time.monotonic() + wait_s + grace_s, wire.LookupReply)

    def done(self, key: str, claim: int, ok: bool, grace_s: float) -> wire.Ack | Failure:
        """Tell the sender the claim is over and wait up to ``grace_s`` s for its Ack. Without
        an Ack the sender still frees the region when the claim's pin time passes."""
        with self._lock:
            if self.closed:
                return Failure("sender_unavailable", "channel closed")
            request = wire.Done(next(_ids), key, claim, ok)
            return self._ask(request, time.monotonic() + grace_s, wire.Ack)

    def lookup_many(self, keys: Sequence[str], room: int, grace_s: float) -> list[wire.LookupReply | Failure]:
        """Ask for every key of ``keys`` at once, none waiting on the sender (``wait_s`` 0);
        per key its reply, or a Failure when the batch got none for it within ``grace_s``."""
        with self._lock:
            if self.closed:
                return [Failure("sender_unavailable", "channel closed")] * len(keys)
            requests = [wire.Lookup(next(_ids), key, room, 0.0, spans_ok=True) for key in keys]
            return self._ask_many(requests, time.monotonic() + grace_s, wire.LookupReply)

    def done_many(self, ends: Sequence[tuple[str, int, bool]], grace_s: float) -> list[wire.Ack | Failure]:
        """:meth:`done` of every ``(key, claim, ok)`` at once; per claim its Ack or a Failure."""
        with self._lock:
            if self.closed:
                return [Failure("sender_unavailable", "channel closed")] * len(ends)
            requests = [wire.Done(next(_ids), key, claim, ok) for key, claim, ok in ends]
            return self._ask_many(requests, time.monotonic() + grace_s, wire.Ack)

    def _ask(self, request: wire.Lookup | wire.Done, deadline: float, kind: type) -> Any:
        """Send ``request`` and wait for its answer of type ``kind``; the context being
        terminated (connector closing) ends the wait with ``closed``."""
        return self._ask_many([request], deadline, kind)[0]

    def _ask_many(self, requests: Sequence[wire.Lookup | wire.Done], deadline: float, kind: type) -> list[Any]:
        """Send every request, then wait until each has its answer of type ``kind`` or the
        wait ends (a Failure for each still unanswered)."""
        if not requests:
            return []
        try:
            down = self._check_monitor(history=True)  # before these requests: a repaired drop is history
            if down is not None:
                return [down] * len(requests)  # the connection is down now: nothing was sent, nothing claimed
            for request in requests:
                self._sock.send(wire.encode(request), zmq.NOBLOCK)
            return self._await(requests, deadline, kind)
        except zmq.ZMQError as exc:
            if exc.errno == zmq.ETERM:
                return [Failure("closed", "connector closing")] * len(requests)
            return [Failure("sender_unavailable", f"control socket error: {exc}")] * len(requests)

    def _await(self, requests: Sequence[wire.Lookup | wire.Done], deadline: float, kind: type) -> list[Any]:
        answers: dict[int, Any] = {}
        pending = {request.id for request in requests}

        def result(failure: Failure | None = None) -> list[Any]:
            return [answers.get(request.id, failure) for request in requests]

        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._monitor, zmq.POLLIN)
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                return result(Failure("timeout", f"no reply from {self.host}:{self.port} in time"))
            events = dict(poller.poll(max(1, int(left * 1000))))
            if self._sock in events:  # first: replies that came are ours, whatever the monitor says
                while pending:
                    try:
                        raw = self._sock.recv(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    reply = wire.decode(raw)
                    if isinstance(reply, Rejection):
                        return result(Failure("bad_reply", reply.detail))
                    if reply.id in pending:
                        if not isinstance(reply, kind):
                            return result(Failure("bad_reply", f"unexpected {type(reply).__name__}"))
                        answers[reply.id] = reply
                        pending.discard(reply.id)
                    # else a reply to an earlier, abandoned request: ignore it
            if pending and self._monitor in events:
                failure = self._check_monitor()
                if failure is not None:
                    return result(failure)
        return result()

    def _check_monitor(self, history: bool = False) -> Failure | None:
        """Apply the queued monitor events in order. ``history`` False (a request is out): a
        Failure at the first drop, refusal or retry. True (before sending): a Failure only when
        the connection is down after all of them, None when it is up or being made again."""
        down: Failure | None = None
        while True:
            try:
                event = recv_monitor_message(self._monitor, zmq.NOBLOCK)
            except zmq.Again:
                return down
            kind = event["event"]
            if kind == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self._connected = True
                down = None  # (re)connected: an earlier drop is history
            elif kind == zmq.EVENT_CONNECTED:
                down = None  # a new connection is being made (its handshake follows)
            elif kind in _DEAD_EVENTS:
                what = "lost" if self._connected else "refused"
                down = Failure(
                    "sender_unavailable",
                    f"connection to {self.host}:{self.port} {what} ({zmq.Event(kind).name})",
                    dropped=self._connected and not history,
                )
                if not history:
                    return down

    def close(self) -> None:
        """Close the socket and its monitor. Idempotent."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
            try:
                self._sock.disable_monitor()  # raises ContextTerminated once the connector's close began
            except zmq.ContextTerminated:
                pass  # closing both sockets below is all a terminating context needs
            finally:  # always: a socket left open keeps the context's term() waiting forever
                self._monitor.close()
                self._sock.close()
