"""The shm connector's control channel: data-only messages and the receiver's client.

Receiver -> sender (a DEALER sends one msgpack frame; the sender's ROUTER adds the identity)::

    {"v": 1, "op": "get", "id": int, "key": str, "wait_s": float >= 0, "pid": int}
                                                                          -> one reply
    {"v": 1, "op": "get_many", "id": int, "keys": [str, ...], "pid": int}   -> one reply
    {"v": 1, "op": "ping", "id": int}                                     -> one reply
    {"v": 1, "op": "release", "ticket": int, "seg": str, "id": int}       -> one reply
    {"v": 1, "op": "release", "ticket": int, "seg": str}                  (no reply)
    {"v": 1, "op": "release", "tickets": [int, ...], "seg": str}          (no reply)

``pid`` (optional) is the reader's process id: the sender revokes a ticket held past
``hold_s`` only once that process is gone (without it, the ticket is revoked at ``hold_s``).
A "get" may also name a ``"bell"`` (bytes: an abstract unix datagram address starting with
:data:`BELL_PREFIX`) and a ``"token"`` (bytes, 8 to 64): the sender then sends its reply as one
datagram to that address, the same map with the token added, and falls back to the socket when
the datagram cannot be sent. A datagram from one process to another wakes the receiver at once;
a reply on the socket goes through libzmq's I/O thread on each side first (docs/reliability.md,
"The shm control socket"). The receiver keeps a reply only when its token is the one it sent.
``seg`` (optional) names the segment the ticket was granted in: a sender serving another
segment (a restarted sender at the same endpoint) ignores the release.

Sender -> receiver::

    {"v": 1, "id": int, "ok": true, "seg": str, "seg_bytes": int, "off": int, "size": int,
     "ticket": int}                                          (a granted read)
    {"v": 1, "id": int, "ok": false, "reason": "not_found" | "drained" | "expired" |
     "dropped" | "timeout" | "closing" | "bad_request" | "failed"}
    {"v": 1, "id": int, "ok": false, "reason": "failed", "failure": {"kind": str, "reason": str}}
                                                             (the sender recorded that the key
                                                             will never come: a tombstone,
                                                             kvferry.core.tombstones)
    {"v": 1, "id": int, "ok": true, "health": {...}}         (ping)
    {"v": 1, "id": int, "ok": true, "released": bool}       (release with an id; True when
                                                             this freed the region)
    {"v": 1, "id": int, "ok": true, "grants": [...]}         (get_many: per key, in order, a
                                                             granted read or a miss as above,
                                                             without "v" and "id")

A "get_many" never waits: each key is granted or missed at once (at most ``MAX_MANY_KEYS``).
A "get" with ``wait_s > 0`` is parked by the sender until the key is published (it answers at
once then) or ``wait_s`` passes on the sender's clock. Decoding never raises: the sender
decodes a request to a typed value (:class:`GetRequest`, :class:`GetManyRequest`,
:class:`PingRequest`, :class:`ReleaseRequest`) or a :class:`~kvferry.core.control.Rejection`
(:func:`decode_request`); a receiver reads a reply map, None when malformed (:func:`decode`).
"""

from __future__ import annotations

import itertools
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import attrs
import msgpack
import zmq

from kvferry.core.control import Rejection
from kvferry.core.errors import SenderUnavailable

__all__ = [
    "VERSION",
    "MAX_MESSAGE_BYTES",
    "MAX_MANY_KEYS",
    "OWED_FORGET_S",
    "LIVENESS_S",
    "BELL_PREFIX",
    "bell_address",
    "encode",
    "decode",
    "check_request",
    "decode_request",
    "GetRequest",
    "GetManyRequest",
    "PingRequest",
    "ReleaseRequest",
    "Request",
    "check_grant",
    "granted_tickets",
    "ControlClient",
]

VERSION = 1
MAX_MESSAGE_BYTES = 64 * 1024
#: Keys of one "get_many", tickets of one "release" (its reply stays well under the limit).
MAX_MANY_KEYS = 256
#: Seconds a receiver keeps looking for a reply it gave up on (a sender answers a parked get by
#: its wait_s; one that has not answered by then is gone, or was restarted).
OWED_FORGET_S = 300.0
_MAX_KEY = 4096
#: Seconds a request waits on the sender before it asks ``gone()`` whether the sender died
#: (then again each as long): a get to a dead sender ends this soon, not at its deadline.
LIVENESS_S = 0.2
#: What every reply datagram address ("bell") starts with: an abstract unix socket name.
BELL_PREFIX = b"\0kvferry-bell-"
_BELL_MAX = 107  # a unix socket address holds 108 bytes with the leading NUL
_TOKEN_BYTES = (8, 64)


def bell_address(pid: int, nonce: bytes) -> bytes:
    """The abstract unix datagram address of one reply bell of process ``pid``."""
    return BELL_PREFIX + f"{pid}-{nonce.hex()}".encode()


def encode(message: dict[str, Any]) -> bytes:
    return msgpack.packb({"v": VERSION, **message}, use_bin_type=True)


def decode(frame: bytes) -> dict[str, Any] | None:
    """A message map, or None when ``frame`` is not a valid version-1 message."""
    if len(frame) > MAX_MESSAGE_BYTES:
        return None
    try:
        message = msgpack.unpackb(frame, raw=False, strict_map_key=True)
    except (ValueError, msgpack.UnpackException, TypeError):
        return None
    if not isinstance(message, dict) or message.get("v") != VERSION:
        return None
    return message


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def check_request(message: dict[str, Any]) -> str | None:
    """Why a request is malformed, or None when it is well formed."""
    op = message.get("op")
    if op == "release":
        if "id" in message and not _is_int(message["id"]):
            return "bad id"
        if "seg" in message and not isinstance(message["seg"], str):
            return "release seg must be a segment name"
        if "tickets" in message:
            tickets = message["tickets"]
            ok = isinstance(tickets, list) and 0 < len(tickets) <= MAX_MANY_KEYS and all(map(_is_int, tickets))
            return None if ok and "ticket" not in message else "release tickets must be a list of integers"
        return None if _is_int(message.get("ticket")) else "release needs an integer ticket"
    if not _is_int(message.get("id")):
        return "missing id"
    if op == "ping":
        return None
    if op not in ("get", "get_many"):
        return f"unknown op {op!r}"
    if "pid" in message and not (_is_int(message["pid"]) and message["pid"] > 0):
        return "pid must be a positive integer"
    if op == "get_many":
        keys = message.get("keys")
        if not isinstance(keys, list) or not 0 < len(keys) <= MAX_MANY_KEYS:
            return f"keys must be a list of 1 to {MAX_MANY_KEYS} keys"
        if not all(isinstance(k, str) and len(k) <= _MAX_KEY for k in keys):
            return "keys must be strings of at most 4096 characters"
        return None
    key, wait = message.get("key"), message.get("wait_s", 0.0)
    if not isinstance(key, str) or len(key) > _MAX_KEY:
        return "key must be a string of at most 4096 characters"
    if isinstance(wait, bool) or not isinstance(wait, (int, float)) or not 0 <= wait < 1e7:
        return "wait_s must be a number of seconds >= 0"
    if "bell" in message or "token" in message:
        bell, token = message.get("bell"), message.get("token")
        if not (isinstance(bell, bytes) and bell.startswith(BELL_PREFIX) and len(bell) <= _BELL_MAX):
            return "bell must be an abstract socket address starting with " + repr(BELL_PREFIX)
        if not (isinstance(token, bytes) and _TOKEN_BYTES[0] <= len(token) <= _TOKEN_BYTES[1]):
            return "a bell needs a token of 8 to 64 bytes"
    return None


@attrs.frozen
class GetRequest:
    """One key; parked up to ``wait_s`` seconds when it is not there yet; ``pid``: the reader;
    ``bell`` and ``token``: where the reply goes as a datagram, and what it must carry."""

    id: int
    key: str
    wait_s: float = 0.0
    pid: int | None = None
    bell: bytes | None = None
    token: bytes | None = None


@attrs.frozen
class GetManyRequest:
    """Up to :data:`MAX_MANY_KEYS` keys at once, never parked."""

    id: int
    keys: tuple[str, ...]
    pid: int | None = None


@attrs.frozen
class PingRequest:
    id: int


@attrs.frozen
class ReleaseRequest:
    """Give ``tickets`` back; ``seg``: the segment they were granted in (None: this one);
    ``id``: answer with whether the region was freed (None: no reply)."""

    tickets: tuple[int, ...]
    seg: str | None = None
    id: int | None = None


Request = GetRequest | GetManyRequest | PingRequest | ReleaseRequest


def decode_request(frame: bytes) -> Request | Rejection:
    """A receiver's request as a typed value, or a Rejection (with the id when it could be read)."""
    message = decode(frame)
    if message is None:
        return Rejection("bad_request", "not a control message")
    request_id = message.get("id")
    corr_id = request_id if _is_int(request_id) else None
    problem = check_request(message)
    if problem is not None:
        return Rejection("bad_request", problem, corr_id)
    op = message["op"]
    pid = message.get("pid")
    if op == "release":
        tickets = tuple(message["tickets"]) if "tickets" in message else (message["ticket"],)
        return ReleaseRequest(tickets, message.get("seg"), corr_id)
    assert corr_id is not None  # check_request: every other op has an id
    if op == "ping":
        return PingRequest(corr_id)
    if op == "get_many":
        return GetManyRequest(corr_id, tuple(message["keys"]), pid)
    wait_s = float(message.get("wait_s", 0.0))
    return GetRequest(corr_id, message["key"], wait_s, pid, message.get("bell"), message.get("token"))


def check_grant(message: dict[str, Any]) -> str | None:
    """Why a granted-read reply is unusable, or None."""
    for field in ("seg_bytes", "off", "size", "ticket"):
        if not _is_int(message.get(field)):
            return f"grant field {field!r} is not a non-negative integer"
    if not isinstance(message.get("seg"), str):
        return "grant without a segment name"
    if message["off"] + message["size"] > message["seg_bytes"]:
        return "grant outside its segment"
    return None


def granted_tickets(reply: dict[str, Any]) -> list[tuple[int, str | None]]:
    """Every ticket a reply grants, with its segment (None when the grant names none): one
    for a granted "get", one per granted key of a "get_many", none for a miss or anything
    else. What a receiver must release when the reply came after its caller gave up."""
    if not reply.get("ok"):
        return []
    grants = reply.get("grants")
    entries = grants if isinstance(grants, list) else [reply]
    out: list[tuple[int, str | None]] = []
    for entry in entries:
        if isinstance(entry, dict) and entry.get("ok") and _is_int(entry.get("ticket")):
            segment = entry.get("seg")
            out.append((entry["ticket"], segment if isinstance(segment, str) else None))
    return out


class _SenderGone(Exception):
    """Raised inside :class:`ControlClient` when ``gone()`` said the sender died."""


@attrs.define(eq=False)
class ControlClient:
    """Requests to one sender's control endpoint from any number of threads.

    Each call checks a DEALER socket out of a small pool (sockets are not thread-safe), so
    concurrent calls never share one. A reply that arrives after its caller gave up is handed
    to ``on_stale`` (the caller releases a stale grant so the sender can free its region).
    ``close()`` wakes every waiting call (it returns None) through a pipe, then closes all
    sockets; no socket is ever used by two threads or closed while in use. ``gone()`` (when
    given) says whether the sender is known to be dead: a request that waited
    :data:`LIVENESS_S` asks it, and raises SenderUnavailable when it says so.

    Fire-and-forget releases (:meth:`send_release`) leave on one dedicated socket, in call
    order, so :meth:`flush_releases` (a ping on that socket) returns once the sender processed
    every release sent before it.

    With ``bells`` (the default), each request socket has a reply bell beside it: an abstract
    unix datagram socket its "get" names, with the client's secret token, so the sender's reply
    wakes the waiting call directly. Replies are read from either, matched by id as before; a
    datagram without the token is dropped (``foreign_datagrams``). Where no bell can be made,
    the socket alone carries the replies.
    """

    context: zmq.Context
    endpoint: str
    on_stale: Callable[[dict[str, Any]], None]
    gone: Callable[[], bool] | None = None
    bells: bool = True
    foreign_datagrams: int = attrs.field(init=False, default=0)
    _token: bytes = attrs.field(init=False, factory=lambda: os.urandom(16))
    #: The reply bell of each request socket (by ``id()``), and its address.
    _bells: dict[int, tuple[socket.socket, bytes]] = attrs.field(init=False, factory=dict)
    _idle: list[zmq.Socket] = attrs.field(init=False, factory=list)
    _busy: int = attrs.field(init=False, default=0)
    _cond: threading.Condition = attrs.field(init=False, factory=threading.Condition)
    _ids: Any = attrs.field(init=False, factory=lambda: itertools.count(1))
    _closed: bool = attrs.field(init=False, default=False)
    _wake: tuple[int, int] = attrs.field(init=False, factory=os.pipe)
    _release_sock: zmq.Socket | None = attrs.field(init=False, default=None)
    _release_lock: threading.Lock = attrs.field(init=False, factory=threading.Lock)
    #: Sockets whose caller gave up on a reply (by ``id()``): the request ids and when.
    _owing: dict[int, dict[int, float]] = attrs.field(init=False, factory=dict)

    def _checkout(self) -> zmq.Socket | None:
        with self._cond:
            if self._closed:
                return None
            self._busy += 1
            if self._idle:
                # a socket that owes a reply goes first: the next request reads that late reply
                # (on_stale releases what it grants) instead of leaving it queued on an idle socket
                for at in range(len(self._idle) - 1, -1, -1):
                    if id(self._idle[at]) in self._owing:
                        return self._idle.pop(at)
                return self._idle.pop()
        try:
            sock = self.context.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 1000)
            sock.setsockopt(zmq.IMMEDIATE, 1)  # never queue for a peer that is not there
            sock.connect(self.endpoint)
        except zmq.ZMQError:
            self._checkin(None)
            return None
        if self.bells:
            self._open_bell(sock)
        return sock

    def _open_bell(self, sock: zmq.Socket) -> None:
        """Give ``sock`` a reply bell (none where the system cannot make one)."""
        bell = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        address = bell_address(os.getpid(), os.urandom(8))
        try:
            bell.bind(address)
        except OSError:  # no abstract unix sockets here: replies come on the socket alone
            bell.close()
            return
        bell.setblocking(False)
        with self._cond:
            self._bells[id(sock)] = (bell, address)

    def _close_socket(self, sock: zmq.Socket) -> None:
        """Close ``sock`` and its bell (caller holds ``_cond`` or owns the socket alone)."""
        bell = self._bells.pop(id(sock), None)
        if bell is not None:
            bell[0].close()
        sock.close()

    def _checkin(self, sock: zmq.Socket | None) -> None:
        with self._cond:
            self._busy -= 1
            if sock is not None:
                if self._closed:
                    self._close_socket(sock)
                else:
                    self._idle.append(sock)
            self._cond.notify_all()

    def _wait(
        self, sock: zmq.Socket, event: int, deadline: float, watch: bool = False, bell: socket.socket | None = None
    ) -> bool:
        """Wait for ``event`` on ``sock`` (or a datagram on ``bell``) until ``deadline``; False
        on timeout or close. ``watch``: every :data:`LIVENESS_S` without the event, ask
        ``gone()``; _SenderGone when it says the sender died."""
        poller = zmq.Poller()
        poller.register(sock, event)
        poller.register(self._wake[0], zmq.POLLIN)
        if bell is not None:
            poller.register(bell.fileno(), zmq.POLLIN)
        gone = self.gone if watch else None
        while not self._closed:
            remaining = deadline - time.monotonic()
            # past the deadline, one look without waiting: a reply that is there already (this
            # process was stopped or starved until after it) is taken, not left granted to no one
            wait = min(remaining, LIVENESS_S) if gone is not None else remaining
            ready = dict(poller.poll(int(wait * 1000) + 1 if remaining > 0 else 0))
            if ready.get(sock, 0) & event or (bell is not None and bell.fileno() in ready):
                return True
            if self._wake[0] in ready or remaining <= 0:
                return False
            if gone is not None and gone():
                raise _SenderGone
        return False

    def _take_reply(self, sock: zmq.Socket, bell: socket.socket | None) -> dict[str, Any] | None:
        """The next reply on ``bell`` or else on ``sock``, without waiting; None when neither
        holds one (or what came was not a reply of this client's sender)."""
        if bell is not None:
            try:
                frame = bell.recv(MAX_MESSAGE_BYTES + 1)
            except OSError:  # BlockingIOError: nothing there
                frame = None
            if frame is not None:
                reply = decode(frame)
                if reply is None or reply.pop("token", None) != self._token:
                    with self._cond:  # several threads' sockets may each drop one
                        self.foreign_datagrams += 1
                    return None
                return reply
        try:
            return decode(sock.recv(zmq.NOBLOCK))
        except zmq.Again:
            return None

    def _send(self, sock: zmq.Socket, frame: bytes, deadline: float, watch: bool = False) -> bool:
        while True:
            try:
                sock.send(frame, zmq.NOBLOCK)
                return True
            except zmq.Again:
                if not self._wait(sock, zmq.POLLOUT, deadline, watch):
                    return False

    def request(self, message: dict[str, Any], timeout_s: float) -> dict[str, Any] | None:
        """Send ``message`` (an ``id`` is added) and wait up to ``timeout_s`` seconds for its
        reply. None when the sender is unreachable or silent, or the client closes;
        SenderUnavailable as soon as ``gone()`` says the sender died (see the class doc)."""
        sock = self._checkout()
        if sock is None:
            return None
        request_id = next(self._ids)
        deadline = time.monotonic() + timeout_s
        sent = False
        bell, address = self._bells.get(id(sock), (None, b""))
        if bell is not None and message.get("op") == "get" and id(sock) not in self._owing:
            # a socket that owes a late reply asks on the socket alone: its answer then comes
            # after that reply (one pipe, in order), which this request reads and releases first
            message = {**message, "bell": address, "token": self._token}
        try:
            if not self._send(sock, encode({**message, "id": request_id}), deadline, watch=True):
                return None
            sent = True
            while self._wait(sock, zmq.POLLIN, deadline, watch=True, bell=bell):
                reply = self._take_reply(sock, bell)
                if reply is None:
                    continue
                if reply.get("id") == request_id:
                    return reply
                self._settle(sock, reply.get("id"))
                self.on_stale(reply)
            self._owe(sock, request_id)
            return None
        except _SenderGone:
            if sent:
                self._owe(sock, request_id)
            raise SenderUnavailable(f"the sender at {self.endpoint} is gone (its process ended)") from None
        except zmq.ZMQError:
            return None
        finally:
            self._checkin(sock)

    def _owe(self, sock: zmq.Socket, request_id: int) -> None:
        """``sock``'s caller gave up on ``request_id``: its reply may still come."""
        now = time.monotonic()
        with self._cond:
            pending = self._owing.setdefault(id(sock), {})
            pending[request_id] = now
            for old in [r for r, when in pending.items() if now - when > OWED_FORGET_S]:
                del pending[old]  # never answered (the sender is gone): stop looking for it

    def _settle(self, sock: zmq.Socket, request_id: Any) -> None:
        """A late reply to ``request_id`` was read on ``sock``."""
        with self._cond:
            pending = self._owing.get(id(sock))
            if pending is not None:
                pending.pop(request_id, None)
                if not pending:
                    del self._owing[id(sock)]

    def notify(self, message: dict[str, Any], timeout_s: float = 1.0) -> bool:
        """Send a message that has no reply (``release``). False when it could not be sent."""
        sock = self._checkout()
        if sock is None:
            return False
        try:
            return self._send(sock, encode(message), time.monotonic() + timeout_s)
        except zmq.ZMQError:
            return False
        finally:
            self._checkin(sock)

    def _release_socket(self) -> zmq.Socket | None:
        """The release socket (caller holds ``_release_lock``); None once closed."""
        if self._closed:
            return None
        if self._release_sock is None:
            try:
                sock = self.context.socket(zmq.DEALER)
                sock.setsockopt(zmq.LINGER, 1000)  # queued releases get a second to leave at close
                sock.setsockopt(zmq.IMMEDIATE, 1)  # never queue for a sender that is not there
                sock.connect(self.endpoint)
            except zmq.ZMQError:
                return None
            self._release_sock = sock
        return self._release_sock

    def prepare_releases(self) -> None:
        """Open the release socket now (its connection is then up before the first release)."""
        with self._release_lock:
            self._release_socket()

    @property
    def closed(self) -> bool:
        return self._closed

    def send_release(self, ticket: int, segment: str, timeout_s: float) -> bool:
        """Send a release of ``ticket`` (granted in ``segment``) without waiting for the
        sender (fire-and-forget). zmq queues it, bounded by the socket's high-water mark: a
        full queue, or a connection not up yet, waits up to ``timeout_s``. False when it could
        not be sent (the sender is gone or stuck, or the client closed)."""
        return self.send_releases([ticket], segment, timeout_s)

    def send_releases(self, tickets: list[int], segment: str | None, timeout_s: float) -> bool:
        """:meth:`send_release` of several tickets of one segment (None: a grant that named
        none; the message then names none either), in one message each ``MAX_MANY_KEYS``."""
        ok = True
        named = {} if segment is None else {"seg": segment}
        for at in range(0, len(tickets), MAX_MANY_KEYS):
            part = tickets[at : at + MAX_MANY_KEYS]
            one = {"ticket": part[0]} if len(part) == 1 else {"tickets": part}
            ok = self._send_release_frame(encode({"op": "release", **one, **named}), timeout_s) and ok
        return ok

    def _send_release_frame(self, frame: bytes, timeout_s: float) -> bool:
        with self._release_lock:
            sock = self._release_socket()
            if sock is None:
                return False
            try:
                return self._send(sock, frame, time.monotonic() + timeout_s)
            except zmq.ZMQError:
                return False

    def flush_releases(self, timeout_s: float) -> bool:
        """Return True once the sender processed every release :meth:`send_release` sent
        before this call (one ping round trip on the release socket); False on timeout."""
        with self._release_lock:
            sock = self._release_socket()
            if sock is None:
                return False
            request_id = next(self._ids)
            deadline = time.monotonic() + timeout_s
            try:
                if not self._send(sock, encode({"op": "ping", "id": request_id}), deadline):
                    return False
                while self._wait(sock, zmq.POLLIN, deadline):
                    reply = decode(sock.recv())
                    if reply is not None and reply.get("id") == request_id:
                        return True
            except zmq.ZMQError:
                return False
            return False

    def close(self, timeout_s: float = 5.0) -> bool:
        """Wake waiting calls, wait (bounded) for them to return, close every socket.
        Pending notifications get up to ``LINGER`` to flush. Idempotent. False when a call
        was still running (its socket closes when it returns)."""
        with self._cond:
            if self._closed:
                return self._busy == 0
            self._closed = True
            os.write(self._wake[1], b"x")
            self._cond.wait_for(lambda: self._busy == 0, timeout_s)
            sockets, self._idle = self._idle, []
            idle = self._busy == 0
            for sock in sockets:
                self._close_socket(sock)
        with self._release_lock:  # a release in progress saw the wake-up and returned
            if self._release_sock is not None:
                self._release_sock.close()
                self._release_sock = None
        if idle:  # a call still running past the wait keeps polling the pipe: leave it open
            for fd in self._wake:
                os.close(fd)
        return idle
