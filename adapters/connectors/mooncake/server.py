"""Sender side of the mooncake connector: the pool ledger and the control-channel server.

:class:`SenderState` owns the sender's :class:`~kvferry.core.pool.PoolLedger` behind one lock
(callers: ``put``/``reserve`` on the caller's thread, lookups on the server thread).
:class:`ControlServer` is one thread with a ROUTER socket bound on ``tcp://host:port``:

- a :class:`~.wire.Lookup` for a readable key claims it (a ledger ticket) and answers
  with its pool address; the region stays pinned until the matching ``Done`` or ``pin_s``;
- a lookup for a key not published yet with ``wait_s > 0`` is parked
  (:class:`~kvferry.core.parked.ParkedTable`) and answered when a put publishes the key (the put
  rings the loop's :class:`~kvferry.adapters.connectors.wake.Doorbell`) or when ``wait_s`` passes;
- a lookup for a key already consumed or expired is answered "not found"/"expired" at once;
- a lookup for a key its sender recorded as failed (:meth:`SenderState.fail`, a tombstone) is
  answered ``failed`` with the record at once, also one parked on it when the record is made.

Leases are swept on every wake-up (at the latest every :data:`SWEEP_S` seconds): an unread
payload past ``lease_s`` and a claim not finished within ``pin_s`` are logged and counted.

A payload put in pieces (:meth:`SenderState.add_pieces`: its header in the pool, the rest in
other registered memory the caller keeps) is answered with its spans to a lookup that reads
pieces, and refused (``bad_request``, counted ``pieces_refused``) to one that does not, before it
takes a reader's turn. When its entry is freed (read by every reader, expired, dropped) its
``on_free`` is called once, outside the lock: from then on the caller may reuse that memory.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import ClassVar

import attrs
import zmq

from kvferry.adapters.connectors.mooncake import wire
from kvferry.adapters.connectors.wake import Doorbell
from kvferry.core.control import Rejection
from kvferry.core.errors import BindError
from kvferry.core.parked import MissReason, Parked, ParkedTable
from kvferry.core.pool import EntryState, LeaseEntry, PoolLedger, Region
from kvferry.core.tombstones import FAILED_REASON

__all__ = ["SWEEP_S", "SenderState", "SenderSpace", "ControlServer", "bind_router"]

logger = logging.getLogger(__name__)

#: Longest sleep of the server loop between lease sweeps, in seconds.
SWEEP_S = 0.5


@attrs.define(eq=False)
class SenderState:
    """The sender's ledger, base address and counters; every method takes the lock itself.

    ``clock`` returns monotonic seconds. Invariant: a region returns to the allocator only when
    its entry is freed (all readers finished or the lease/pin passed), never while claimed.
    """

    ledger: PoolLedger
    base: int
    rpc_port: int
    pin_s: float
    clock: Callable[[], float]
    lock: threading.Lock = attrs.Factory(threading.Lock)
    counters: dict[str, int] = attrs.Factory(
        lambda: dict.fromkeys(
            (
                "claims",
                "delivered",
                "read_failed",
                "expired_unread",
                "revoked_claims",
                "bad_requests",
                "no_room_replies",
                "failures_recorded",
                "failed_replies",
                "pieces_refused",
            ),
            0,
        )
    )
    #: Payloads put in pieces, by their pool region's offset: the spans after the region's
    #: bytes, and what to call once the entry is freed.
    _pieces: dict[int, tuple[tuple[tuple[int, int], ...], Callable[[], None]]] = attrs.field(init=False, factory=dict)
    #: on_free calls of entries freed under the lock, made once it is released.
    _due: list[Callable[[], None]] = attrs.field(init=False, factory=list)

    def __attrs_post_init__(self) -> None:
        self.ledger.on_free = self._freed

    def _freed(self, entry: LeaseEntry) -> None:  # under the lock (the ledger's on_free)
        extra = self._pieces.pop(entry.handle.offset, None)
        if extra is not None:
            self._due.append(extra[1])

    @contextmanager
    def held(self) -> Iterator[PoolLedger]:
        """The ledger under the lock; the on_free calls of entries freed meanwhile are made
        after the lock is released (a caller's callback may take locks of its own)."""
        with self.lock:
            yield self.ledger
            due, self._due = self._due, []
        for call in due:
            try:
                call()
            except Exception:  # the caller's: never the control thread's end
                logger.exception("on_free of a payload put in pieces failed")

    def add_pieces(self, region: Region, spans: Sequence[tuple[int, int]], on_free: Callable[[], None]) -> None:
        """Say that the payload about to be published in ``region`` goes on with ``spans``
        (absolute ``(addr, length)`` in registered memory, in order); call it before
        publishing (under :meth:`held`)."""
        self._pieces[region.offset] = (tuple((int(a), int(n)) for a, n in spans), on_free)

    def drop_pieces(self, region: Region) -> None:
        """Forget the pieces of a region that was not published after all (no on_free call)."""
        self._pieces.pop(region.offset, None)

    def sweep(self) -> None:
        """Expire leases and stale claims now; report each as such (log + counter)."""
        with self.held() as ledger:
            report = ledger.expire(self.clock())
            for item in report:
                self.counters["expired_unread" if item.kind == "unread" else "revoked_claims"] += 1
        for item in report:
            if item.kind == "unread":
                logger.warning(
                    "mooncake lease expired for %r: %d of %d readers never came (%d bytes)",
                    item.entry.key,
                    item.entry.readers_left,
                    item.entry.readers,
                    item.entry.size,
                )
            else:
                logger.warning("mooncake claim on %r not finished in %.1f s; revoked", item.entry.key, self.pin_s)

    def answer(self, lookup: wire.Lookup) -> wire.LookupReply | None:
        """A reply for ``lookup``, or None when the key is not published yet (park it)."""
        self.sweep()
        with self.lock:
            leases = self.ledger.leases
            entry = leases.entry(lookup.key)
            if entry is None:
                status = leases.status(lookup.key)
                if status == "unknown":
                    return None
                failure = leases.failure(lookup.key) if status == EntryState.FAILED else None
                if failure is not None:
                    self.counters["failed_replies"] += 1
                    return wire.LookupReply(lookup.id, False, reason=FAILED_REASON, failure=failure)
                reason = "expired" if status == EntryState.EXPIRED else "not_found"
                return wire.LookupReply(lookup.id, False, reason=reason)
            if entry.size > lookup.room:
                self.counters["no_room_replies"] += 1
                return wire.LookupReply(lookup.id, False, size=entry.size, reason="no_room")
            extra = self._pieces.get(entry.handle.offset)
            if extra is not None and not lookup.spans_ok:
                self.counters["pieces_refused"] += 1
                logger.warning(
                    "lookup of %r refused: the payload lies in %d pieces and the receiver does not read "
                    "pieces (a kvferry older than this sender); upgrade it",
                    lookup.key,
                    len(extra[0]) + 1,
                )
                return wire.LookupReply(lookup.id, False, reason="bad_request")
            ticket = self.ledger.take(lookup.key, self.clock())
            if ticket is None:  # lease passed between entry() and take()
                return wire.LookupReply(lookup.id, False, reason="expired")
            self.counters["claims"] += 1
            region: Region = ticket.handle
            addr = self.base + region.offset
            spans = () if extra is None else ((addr, region.nbytes), *extra[0])
            return wire.LookupReply(
                lookup.id,
                True,
                claim=ticket.ticket_id,
                addr=addr,
                size=ticket.size,
                rpc_port=self.rpc_port,
                pin_s=self.pin_s,
                spans=spans,
            )

    def finish(self, done: wire.Done) -> None:
        """The reader finished its claim: release the ticket (idempotent). A failed read gives
        its reader slot back, so the receiver's retry can read the payload while its lease
        lasts."""
        with self.held() as ledger:
            if done.ok:
                ledger.release(done.claim)
            else:
                ledger.give_back(done.claim, self.clock())
            self.counters["delivered" if done.ok else "read_failed"] += 1

    def fail(self, key: str, failure: object) -> bool:
        """Record that ``key`` will never be published (``failure``: the sender's record; no
        pool space): a payload readable under it is dropped first (a claim on it keeps its
        region until it ends). Returns what the lease table says (False: not recorded)."""
        with self.held() as ledger:
            _, recorded = ledger.fail(key, failure)
            if recorded:
                self.counters["failures_recorded"] += 1
            return recorded

    def count(self, name: str) -> None:
        """Add one to counter ``name`` (under the lock)."""
        with self.lock:
            self.counters[name] = self.counters.get(name, 0) + 1


@attrs.define(eq=False)
class SenderSpace:
    """Receive space of a sender-role connector: its gets allocate from the ledger's allocator
    (one pool, one allocator), as reserved-but-unpublished regions."""

    state: SenderState

    def take(self, nbytes: int) -> Region | None:
        with self.state.lock:
            got = self.state.ledger.reserve(nbytes)
        return got if isinstance(got, Region) else None

    def give(self, region: Region) -> None:
        with self.state.lock:
            self.state.ledger.abort(region)

    def room(self) -> int:
        with self.state.lock:
            return self.state.ledger.allocator.largest_free


def bind_router(ctx: zmq.Context, host: str, port: int) -> tuple[zmq.Socket, int]:
    """A ROUTER bound on ``tcp://host:port`` (port 0: OS-chosen); returns it and the real port.

    A bind failure is fatal and raises BindError naming host and port.
    """
    sock = ctx.socket(zmq.ROUTER)
    sock.linger = 0
    sock.setsockopt(zmq.ROUTER_MANDATORY, 0)
    if ":" in host:
        sock.setsockopt(zmq.IPV6, 1)
    where = f"[{host}]" if ":" in host else host
    endpoint = f"tcp://{where}:{port if port else '*'}"
    try:
        sock.bind(endpoint)
    except zmq.ZMQError as exc:
        sock.close()
        raise BindError(f"mooncake control channel cannot bind {host}:{port}: {exc}") from exc
    bound = sock.getsockopt(zmq.LAST_ENDPOINT).decode()
    return sock, int(bound.rsplit(":", 1)[1])


@attrs.frozen
class _Waiter:
    ident: bytes
    lookup: wire.Lookup


@attrs.define(eq=False)
class ControlServer:
    """The sender's control thread. ``notify(key)`` after a publish; ``close()`` to stop."""

    ctx: zmq.Context
    router: zmq.Socket
    state: SenderState
    _bell: Doorbell = attrs.field(init=False, factory=Doorbell)
    _stopping: bool = attrs.field(init=False, default=False)
    _thread: threading.Thread | None = attrs.field(init=False, default=None)
    _table: ParkedTable[_Waiter] = attrs.field(init=False, factory=ParkedTable)
    NAME: ClassVar[str] = "mooncake"  # in log lines

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="kvferry-mooncake-control", daemon=True)
        self._thread.start()

    @property
    def parked(self) -> int:
        """Lookups waiting for their key right now (a snapshot written by the thread)."""
        return len(self._table)

    @property
    def running(self) -> bool:
        """True while the control thread is alive."""
        return self._thread is not None and self._thread.is_alive()

    def notify(self, key: str) -> None:
        """Wake the server: ``key`` was published (serve parked lookups for it). Any thread."""
        self._bell.ring(key)

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the thread (parked lookups get ``closing``) and close the sockets. Idempotent."""
        if self._stopping:
            return
        self._stopping = True
        self._bell.ring()
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                logger.error("mooncake control thread did not stop within %.1f s", timeout_s)
                return
        self._bell.close()

    # -- the thread -----------------------------------------------------------------------

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.router, zmq.POLLIN)
        poller.register(self._bell.fileno, zmq.POLLIN)
        try:
            while not self._stopping:
                events = dict(poller.poll(int(self._sleep_s() * 1000)))
                if self._bell.fileno in events:
                    for key in self._bell.take():
                        self._serve_parked(key)
                if self._stopping:
                    break
                if self.router in events:
                    self._drain_router()
                self.state.sweep()
                self._answer(self._table.expire(time.monotonic()), MissReason.TIMEOUT)
        finally:
            self._answer(self._table.drain(), MissReason.CLOSING)
            self.router.close()

    def _sleep_s(self) -> float:
        """Seconds until the next parked deadline or lease event, at most SWEEP_S. Parked
        lookups run on the real clock (a receiver is waiting); leases on the injected one."""
        waits = [SWEEP_S]
        parked = self._table.seconds_to_next(time.monotonic())
        if parked is not None:
            waits.append(parked)
        with self.state.lock:
            lease_deadline = self.state.ledger.leases.next_deadline()
        if lease_deadline is not None:
            waits.append(lease_deadline - self.state.clock())
        return max(0.0, min(waits))

    def _drain_router(self) -> None:
        while True:
            try:
                frames = self.router.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 2:
                self.state.count("bad_requests")
                continue
            ident, raw = frames
            message = wire.decode(raw)
            if isinstance(message, Rejection):
                self._rejected(ident, raw, message)
            elif isinstance(message, wire.Lookup):
                self._lookup(ident, message)
            elif isinstance(message, wire.Done):
                self.state.finish(message)
                self._send(ident, wire.Ack(message.id))
            else:
                self.state.count("bad_requests")

    def _rejected(self, ident: bytes, raw: bytes, rejection: Rejection) -> None:
        """A message the mooncake wire does not know: counted and dropped (a subclass may
        answer its own messages here first)."""
        self.state.count("bad_requests")
        logger.warning("%s control: dropped a malformed message: %s", self.NAME, rejection.detail)

    def _lookup(self, ident: bytes, lookup: wire.Lookup) -> None:
        reply = self.state.answer(lookup)
        if reply is not None:
            self._send(ident, reply)
        elif lookup.wait_s > 0:
            self._table.park(lookup.key, _Waiter(ident, lookup), time.monotonic(), lookup.wait_s)
        else:
            self._send(ident, wire.LookupReply(lookup.id, False, reason=MissReason.NOT_FOUND))

    def _serve_parked(self, key: str) -> None:
        def offer(waiter: _Waiter) -> bool:
            reply = self.state.answer(waiter.lookup)
            if reply is None:  # still unknown: it and the later lookups keep waiting
                return False
            self._send(waiter.ident, reply)
            return True

        self._answer(self._table.serve(key, time.monotonic(), offer), MissReason.TIMEOUT)

    def _answer(self, parked: list[Parked[_Waiter]], reason: str) -> None:
        for p in parked:
            self._send(p.waiter.ident, wire.LookupReply(p.waiter.lookup.id, False, reason=reason))

    def _send(self, ident: bytes, reply: wire.LookupReply | wire.Ack) -> None:
        try:
            self.router.send_multipart([ident, wire.encode(reply)], zmq.NOBLOCK)
        except zmq.ZMQError as exc:  # peer gone or its queue full: it will time out on its side
            logger.warning("mooncake control: reply to a receiver failed: %s", exc)
