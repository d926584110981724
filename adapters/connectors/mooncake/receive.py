"""Receiver side of the mooncake connector: find the sender, claim, reserve, read, hand over.

One :meth:`ReceiveSide.fetch` is: resolve the sender's control endpoint (get metadata, else the
default from ``update_sender_info``) -> ask it for the key with the room left in the local pool
-> check the announced size (against the put's ``size`` when the metadata has it, and the room)
-> reserve that many bytes in the local pool -> the engine reads them from the sender's pool ->
tell the sender the claim is over -> return a pool buffer. Every failure releases what it took
and comes back as a reason word, or as the sender's failure record when it said the key will
never come; nothing here raises for a remote fault.

A sender that died is told from one not started yet by what this receiver saw of its endpoint
(:class:`kvferry.core.policy.SenderLiveness`): a lookup whose connection dropped while it was
out, or any lookup to an endpoint that answered before and has been unreachable for
:data:`~kvferry.core.policy.SENDER_DOWN_GRACE_S` since, comes back as ``sender_gone`` (the
connector's blocking get raises SenderUnavailable); to an endpoint never reached, a failed
connection stays ``sender_unavailable`` (the caller may wait for it until its deadline).
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import attrs

from kvferry.adapters.connectors.mooncake import wire
from kvferry.adapters.connectors.mooncake.client import Failure, PeerChannel
from kvferry.adapters.connectors.mooncake.engine import EnginePool
from kvferry.core.addressing import resolve_get_source
from kvferry.core.policy import SenderLiveness
from kvferry.core.pool import Region, RegionAllocator
from kvferry.core.recent import Recent
from kvferry.core.tombstones import SenderFailure

__all__ = [
    "SENDER_GONE",
    "Endpoint",
    "resolve_endpoint",
    "pin_margin_s",
    "reply_reads",
    "Space",
    "AllocatorSpace",
    "ReceiveSide",
]

logger = logging.getLogger(__name__)
#: The reason word of a lookup whose sender is given up on (see the module doc).
SENDER_GONE = "sender_gone"
#: Sender endpoints whose liveness is remembered (the oldest forgotten first).
_MAX_ENDPOINTS = 256


@attrs.frozen
class Endpoint:
    """Where to ask for a key: the sender's control ``host``/``port``; ``size`` in bytes when
    the put's metadata announced it (then the sender's answer must match), else None."""

    host: str
    port: int
    size: int | None = None


def resolve_endpoint(metadata: Mapping[str, Any] | None, default: tuple[str, int] | None) -> Endpoint | None:
    """The endpoint a get asks: :func:`kvferry.core.addressing.resolve_get_source`'s rule (None:
    unresolved, the get misses with ``no_sender``; wrongly typed metadata is a ConfigError)."""
    source = resolve_get_source(metadata, default)
    if source is None:
        return None
    assert source.host is not None  # needs_host: a named port came with its host
    return Endpoint(source.host, source.port, source.size)


def pin_margin_s(pin_s: float) -> float:
    """Safety margin (seconds) kept below a claim's pin time: the receiver starts timing when
    the reply arrives, a little after the sender started the pin. ``0 < margin <= pin_s/10``."""
    return min(1.0, pin_s / 10.0)


def reply_reads(reply: wire.LookupReply, local_offset: int) -> list[tuple[int, int, int]]:
    """The reads that bring a found reply's payload to ``local_offset`` of the pool: ``(local
    offset, remote address, length)`` of each piece in order, back to back (one read when the
    payload lies in one piece)."""
    if not reply.spans:
        return [(local_offset, reply.addr, reply.size)]
    out, at = [], local_offset
    for addr, length in reply.spans:
        out.append((at, addr, length))
        at += length
    return out


def _past_pin(held_s: float, pin_s: float) -> bool:
    """Whether a claim held ``held_s`` seconds since its reply may have been revoked by now."""
    return held_s > pin_s - pin_margin_s(pin_s)


class Space(Protocol):
    """Local pool space for incoming payloads (byte offsets into the engine pool)."""

    def take(self, nbytes: int) -> Region | None: ...

    def give(self, region: Region) -> None: ...

    def room(self) -> int: ...


@attrs.define(eq=False)
class AllocatorSpace:
    """A receiver's own allocator over the whole pool, behind a lock."""

    allocator: RegionAllocator
    lock: threading.Lock = attrs.Factory(threading.Lock)

    def take(self, nbytes: int) -> Region | None:
        with self.lock:
            return self.allocator.allocate(nbytes)

    def give(self, region: Region) -> None:
        with self.lock:
            self.allocator.free(region)

    def room(self) -> int:
        with self.lock:
            return self.allocator.largest_free


@attrs.define(eq=False)
class ReceiveSide:
    """Peers and local space of one connector. ``make_buffer(view, free)`` wraps a result."""

    ctx: Any
    pool: EnginePool
    space: Space
    control_timeout_s: float
    clock: Callable[[], float]
    make_buffer: Callable[[Any, Callable[[], None]], Any]
    #: the connector's name in log lines ("mooncake", "nixl": both receive through this class)
    name: str = "mooncake"
    _idle: dict[tuple[str, int], list[PeerChannel]] = attrs.field(init=False, factory=dict)
    _busy: set[PeerChannel] = attrs.field(init=False, factory=set)
    _lock: threading.Lock = attrs.field(init=False, factory=threading.Lock)
    _closed: bool = attrs.field(init=False, default=False)
    _liveness: Recent[tuple[str, int], SenderLiveness] = attrs.field(init=False, factory=lambda: Recent(_MAX_ENDPOINTS))

    def _reached(self, where: Endpoint) -> None:
        with self._lock:
            live = self._liveness.get((where.host, where.port)) or SenderLiveness()
            live.reached()
            self._liveness.note((where.host, where.port), live)  # the newest

    def _failed(self, where: Endpoint, failure: Failure) -> str:
        """``failure``'s reason, or ``sender_gone`` when the sender is to be given up on."""
        if failure.reason != "sender_unavailable":
            return failure.reason
        with self._lock:
            live = self._liveness.get((where.host, where.port))
            if live is None:  # noted, so a sender that never answers is bounded like the others
                live = SenderLiveness()
                self._liveness.note((where.host, where.port), live)
            gone = live.failed(self.clock(), dropped=failure.dropped)
        return SENDER_GONE if gone else failure.reason

    def _checkout(self, host: str, port: int) -> PeerChannel | None:
        """An idle channel to ``host:port`` or a new one: concurrent gets (threads) each use
        their own channel, so one long-poll never blocks another get."""
        with self._lock:
            if self._closed:
                return None
            idle = self._idle.get((host, port))
            peer = idle.pop() if idle else PeerChannel(self.ctx, host, port)
            self._busy.add(peer)
            return peer

    def _checkin(self, peer: PeerChannel) -> None:
        with self._lock:
            self._busy.discard(peer)
            if not self._closed and not peer.closed:
                self._idle.setdefault((peer.host, peer.port), []).append(peer)
                return
        peer.close()

    def _drop_peer(self, peer: PeerChannel) -> None:
        """Close a failed channel (its queue may hold stale messages); the next get opens anew."""
        peer.close()

    def _finish(self, peer: PeerChannel, key: str, claim: int, ok: bool) -> None:
        """End the claim; without an Ack the channel is dropped (the bytes read stay valid:
        the claim pinned them for the whole read)."""
        ack = peer.done(key, claim, ok, self.control_timeout_s)
        if isinstance(ack, Failure):
            logger.warning(
                "%s get %r: sender did not confirm the claim end: %s (%s)", self.name, key, ack.reason, ack.detail
            )
            self._drop_peer(peer)

    def fetch(
        self, key: str, where: Endpoint, wait_s: float, read_by: float | None = None
    ) -> tuple[Any, int] | str | SenderFailure:
        """``(pool buffer, size)``, a reason word, or the sender's failure record (see the
        module doc). ``read_by`` (a ``time.monotonic()`` instant): a blocking get's end; the
        read of a payload claimed before then ends by then too, and a read ended by it is
        ``timeout`` (the pool's ``transfer_timeout_s`` ends it otherwise: ``transfer_failed``).
        The region a failed read was given goes back to the space once the engine no longer
        writes into it (mooncake: maybe later, :class:`~.engine.LateReads`)."""
        peer = self._checkout(where.host, where.port)
        if peer is None:
            return "closed"
        try:
            return self._fetch(peer, key, where, wait_s, read_by)
        finally:
            self._checkin(peer)

    def _fetch(
        self, peer: PeerChannel, key: str, where: Endpoint, wait_s: float, read_by: float | None
    ) -> tuple[Any, int] | str | SenderFailure:
        reply = peer.lookup(key, self.space.room(), wait_s, self.control_timeout_s)
        if isinstance(reply, Failure):
            reason = self._failed(where, reply)
            logger.warning(
                "%s get %r from %s:%d: %s (%s)", self.name, key, where.host, where.port, reason, reply.detail
            )
            self._drop_peer(peer)
            return reason
        self._reached(where)
        if not reply.found:
            return reply.reason if reply.failure is None else reply.failure
        got_at = self.clock()
        size = reply.size
        if where.size is not None and where.size != size:
            logger.warning("%s get %r: sender announces %d bytes, put said %d", self.name, key, size, where.size)
            self._finish(peer, key, reply.claim, False)
            return "size_mismatch"
        region = self.space.take(size)
        if region is None:
            self._finish(peer, key, reply.claim, False)
            return "no_room"
        within = None if read_by is None else read_by - time.monotonic()
        give = functools.partial(self.space.give, region)
        # a read that fails gives the region back through `give` once nothing writes into it
        ok = self.pool.read_spans(f"{where.host}:{reply.rpc_port}", reply_reads(reply, region.offset), within, give)
        failure = "" if ok else "timeout" if read_by is not None and time.monotonic() >= read_by else "transfer_failed"
        if ok and _past_pin(self.clock() - got_at, reply.pin_s):
            # the sender may have revoked the claim and reused the region meanwhile
            failure = "expired"
            give()
        self._finish(peer, key, reply.claim, not failure)
        if failure:
            logger.warning("%s get %r of %d bytes from %s: %s", self.name, key, size, where.host, failure)
            return failure
        view = self.pool.tensor[region.offset : region.offset + size]
        return self.make_buffer(view, lambda: self.space.give(region)), size

    def fetch_many(self, keys: Sequence[str], where: Endpoint) -> list[tuple[Any, int] | str | SenderFailure]:
        """:meth:`fetch` of every key without waiting, as one exchange: the lookups go out
        together, the claimed payloads are read in one request of the engine
        (:meth:`~.engine.TensorPool.read_spans`), the claims end together. Per key, in order,
        what :meth:`fetch` returns for it (a key whose read failed, or that found no room here,
        gives its reader slot back to the sender: a later get can take it)."""
        if not keys:
            return []
        peer = self._checkout(where.host, where.port)
        if peer is None:
            return ["closed"] * len(keys)
        try:
            return self._fetch_many(peer, keys, where)
        finally:
            self._checkin(peer)

    def _fetch_many(
        self, peer: PeerChannel, keys: Sequence[str], where: Endpoint
    ) -> list[tuple[Any, int] | str | SenderFailure]:
        replies = peer.lookup_many(keys, self.space.room(), self.control_timeout_s)
        got_at = self.clock()
        out: list[tuple[Any, int] | str | SenderFailure] = ["not_found"] * len(keys)
        ends: list[tuple[str, int, bool]] = []
        claimed: list[tuple[int, wire.LookupReply, Region]] = []
        broken = False
        if any(not isinstance(r, Failure) for r in replies):
            self._reached(where)
        for i, (key, reply) in enumerate(zip(keys, replies)):
            if isinstance(reply, Failure):
                out[i], broken = self._failed(where, reply), True
                continue
            if not reply.found:
                out[i] = reply.reason if reply.failure is None else reply.failure
                continue
            region = self.space.take(reply.size)
            if region is None:
                out[i] = "no_room"
                ends.append((key, reply.claim, False))
                continue
            claimed.append((i, reply, region))
        if broken:
            logger.warning("%s get_many from %s:%d: %s", self.name, where.host, where.port, next(iter(set(out))))
        ok = True
        given: set[int] = set()  # claims whose regions a failed read gives back (read_spans' `ended`)
        if claimed:
            by_peer: dict[str, list[tuple[int, wire.LookupReply, Region]]] = {}
            for i, reply, region in claimed:
                by_peer.setdefault(f"{where.host}:{reply.rpc_port}", []).append((i, reply, region))
            for name, group in by_peer.items():
                spans = [s for _, reply, region in group for s in reply_reads(reply, region.offset)]
                regions = [region for _, _, region in group]
                ok = self.pool.read_spans(name, spans, None, functools.partial(self._give_all, regions))
                if not ok:
                    given.update(i for i, _, _ in group)
                    break
        failure = "" if ok else "transfer_failed"
        if ok and claimed and any(_past_pin(self.clock() - got_at, r.pin_s) for _, r, _ in claimed):
            failure = "expired"  # the sender may have revoked a claim and reused its region meanwhile
        ends += [(keys[i], reply.claim, not failure) for i, reply, _ in claimed]
        if ends:  # even over a channel that failed a lookup: each claim given back or ended now,
            # not left pinned until its hold time (a dead channel answers this at once)
            acks = peer.done_many(ends, self.control_timeout_s)
            lost = [a for a in acks if isinstance(a, Failure)]
            if lost:
                logger.warning(
                    "%s get_many from %s:%d: sender did not confirm %d claim ends: %s (%s)",
                    self.name,
                    where.host,
                    where.port,
                    len(lost),
                    lost[0].reason,
                    lost[0].detail,
                )
                broken = True
        if broken:
            self._drop_peer(peer)  # its queue may hold stale replies; unconfirmed claims end at their pin time
        for i, reply, region in claimed:
            if failure:
                if i not in given:
                    self.space.give(region)
                out[i] = failure
                continue
            view = self.pool.tensor[region.offset : region.offset + reply.size]
            out[i] = (self.make_buffer(view, functools.partial(self.space.give, region)), reply.size)
        if failure:
            logger.warning("%s get_many of %d payloads from %s: %s", self.name, len(claimed), where.host, failure)
        return out

    def _give_all(self, regions: Sequence[Region]) -> None:
        for region in regions:
            self.space.give(region)

    def close(self) -> None:
        """Close idle channels; busy ones are closed by their own thread once the context
        is terminated (their wait ends with ``closed``). Idempotent."""
        with self._lock:
            self._closed = True
            peers = [p for group in self._idle.values() for p in group]
            self._idle = {}
        for peer in peers:
            peer.close()
