"""Streamed data replies: a large payload travels as a sequence of chunk messages.

Why: libzmq allocates every received message with ``malloc``; one 235 MB message is a fresh
mapping on the receiver (page faults on every page), and nothing can be copied out before all
of it arrived. Streamed, each message is at most ``chunk`` bytes: libzmq's buffer comes from
(and returns to) the heap, stays cache-warm, and the receiver copies each chunk into its
reused pool buffer as it arrives (``recv_into``), while the rest is still on the wire.

Wire form (after a request with ``"stream": true``; see :mod:`.protocol`)::

    [data header with "chunk": C]                            one message, no payload frame
    [{"v": 1, "op": "chunk", "id": id, "seq": i}, bytes]     one message per chunk, i = 0, 1, ...

Chunk ``i`` carries payload bytes ``chunk_span(total, C, i)`` of the concatenated payload
(``total`` = sum of the header's ``sizes``); both sides compute spans with the functions here
and nothing else. The sender queues a reply's messages back to back, so a chunk that is not
the next one expected (another id, a gap) means the stream broke: the receiver drops it.
"""

from __future__ import annotations

import errno
from collections.abc import Sequence
from typing import Any, TypeGuard

import attrs
import msgpack
import zmq

from kvferry.adapters.checksums import ArrivedFrames, ArrivingChecksums
from kvferry.adapters.connectors.zmq.protocol import (
    PROTOCOL_VERSION,
    Rejection,
    Reply,
    encode_reply,
    reply_from_map,
    unpack_control,
)
from kvferry.core.errors import ConfigError

__all__ = [
    "Chunk",
    "chunk_count",
    "chunk_span",
    "encode_chunk",
    "decode_incoming",
    "send_message",
    "send_payload",
    "discard_rest",
    "InboundStream",
]

_MAX_SEQ = (1 << 63) - 1


@attrs.frozen
class Chunk:
    """The header frame of one chunk message: reply ``corr_id``, position ``seq`` (0-based)."""

    corr_id: int
    seq: int


def chunk_count(total: int, chunk: int) -> int:
    """Chunk messages a streamed payload of ``total`` bytes takes (0 for an empty payload)."""
    if total < 0 or chunk < 1:
        raise ConfigError(f"need total >= 0 and chunk >= 1, got {total} and {chunk}")
    return -(-total // chunk)


def chunk_span(total: int, chunk: int, seq: int) -> tuple[int, int]:
    """``(offset, nbytes)`` of chunk ``seq`` in the concatenated payload: every chunk holds
    ``chunk`` bytes but the last; the spans tile ``[0, total)`` in order."""
    count = chunk_count(total, chunk)
    if not 0 <= seq < count:
        raise ConfigError(f"chunk {seq} out of range: a {total}-byte payload has {count}")
    offset = seq * chunk
    return offset, min(chunk, total - offset)


def encode_chunk(corr_id: int, seq: int) -> bytes:
    """The header frame of chunk ``seq`` of reply ``corr_id``."""
    return msgpack.packb({"v": PROTOCOL_VERSION, "op": "chunk", "id": corr_id, "seq": seq}, use_bin_type=True)


def _chunk_number(value: Any) -> TypeGuard[int]:
    return not isinstance(value, bool) and isinstance(value, int) and 0 <= value <= _MAX_SEQ


def decode_incoming(frame: Any) -> Reply | Chunk | Rejection:
    """The first frame of any message a receiver gets: a reply header or a chunk header.
    Never raises."""
    obj = unpack_control(frame)
    if isinstance(obj, Rejection) or obj.get("op") != "chunk":
        return obj if isinstance(obj, Rejection) else reply_from_map(obj)
    corr_id, seq = obj.get("id"), obj.get("seq")
    if obj.get("v") != PROTOCOL_VERSION:
        return Rejection("bad_version", f"protocol version {obj.get('v')!r}")
    if not _chunk_number(corr_id):
        return Rejection("bad_reply", "chunk id must be an integer in [0, 2**63)")
    if not _chunk_number(seq):
        return Rejection("bad_reply", "chunk seq must be an integer in [0, 2**63)")
    return Chunk(corr_id, seq)


# ------------------------------------------------------------------------------- sender side


def send_message(sock: zmq.Socket, parts: Sequence[Any]) -> list[Any] | None:
    """Queue one multipart message without copying large parts (``copy=False``, tracked);
    never blocks. Returns the trackers libzmq has not finished with yet (empty when every part
    was small enough to be copied), or None when the peer (the first part names it on a
    ROUTER) is unreachable: then nothing was queued."""
    pending = []
    last = len(parts) - 1
    for index, part in enumerate(parts):
        flags = zmq.NOBLOCK | (zmq.SNDMORE if index < last else 0)
        try:
            tracker = sock.send(part, flags, copy=False, track=True)
        except zmq.ZMQError as exc:
            if index == 0 and exc.errno in (errno.EHOSTUNREACH, zmq.EAGAIN):
                return None
            raise
        if tracker is not None and not tracker.done:
            pending.append(tracker)
    return pending


def send_payload(
    sock: zmq.Socket,
    identity: bytes,
    corr_id: int,
    key: str,
    frames: Sequence[memoryview],
    whole: memoryview,
    chunk: int,
) -> tuple[list[Any], int] | None:
    """Queue a data reply: ``[identity, header, *frames]`` when ``chunk`` is 0, else the header
    then ``whole`` (the concatenated payload) in chunks of ``chunk`` bytes.

    Returns ``(pending trackers, chunk messages queued)``, or None when the peer was
    unreachable before anything was queued. A peer that vanishes mid-stream ends the stream
    early (the receiver drops an incomplete stream)."""
    sizes = tuple(f.nbytes for f in frames)
    header = encode_reply(Reply("data", corr_id, key, sizes=sizes, chunk=chunk))
    if not chunk:
        pending = send_message(sock, [identity, header, *frames])
        return None if pending is None else (pending, 0)
    pending = send_message(sock, [identity, header])
    if pending is None:
        return None
    total = whole.nbytes
    sent = 0
    for seq in range(chunk_count(total, chunk)):
        offset, nbytes = chunk_span(total, chunk, seq)
        piece = whole[offset : offset + nbytes]
        more = send_message(sock, [identity, encode_chunk(corr_id, seq), piece])
        if more is None:
            break
        pending.extend(more)
        sent += 1
    return pending, sent


# ------------------------------------------------------------------------------ receiver side


def discard_rest(sock: zmq.Socket) -> int:
    """Drop the remaining frames of the message being read; returns how many there were."""
    dropped = 0
    while sock.getsockopt(zmq.RCVMORE):
        sock.recv_into(bytearray(), flags=zmq.NOBLOCK)
        dropped += 1
    return dropped


@attrs.define(eq=False)
class InboundStream:
    """A streamed reply being received from one sender: where its bytes go, how far it got.

    With a view lent by the receive pool (``target``) every chunk is received straight into it
    (``recv_into``: libzmq's transient chunk buffer, then one copy into the pool); without one
    (no pool, or no room) the chunks' own zmq frames are kept (``frames``), so a size claimed
    in a header never drives an allocation. Into a target, the tensors' checksums are computed
    chunk by chunk as they land, while the chunk is still in the cache (``check``, from the
    header in the first chunk): the delivered frames carry them (``ArrivedFrames``), so the
    decode need not read the payload again after its last chunk.
    """

    reply: Reply
    total: int
    count: int
    last_s: float
    target: memoryview | None = None
    frames: list[memoryview] = attrs.Factory(list)
    next_seq: int = 0
    check: ArrivingChecksums | None = None

    @classmethod
    def start(cls, reply: Reply, lend: Any, now_s: float) -> InboundStream:
        """Begin receiving ``reply`` (a data header with ``chunk`` > 0); ``lend(nbytes)``
        gives a writable view to receive into, or None."""
        total = reply.size
        target = lend(total) if total else None
        return cls(reply, total, chunk_count(total, reply.chunk), now_s, target)

    @property
    def complete(self) -> bool:
        return self.next_seq >= self.count

    def expects(self, chunk: Chunk) -> bool:
        return chunk.corr_id == self.reply.corr_id and chunk.seq == self.next_seq

    def receive(self, sock: zmq.Socket, now_s: float) -> str | None:
        """Read the data frame of the expected chunk (its header frame was just read).
        Returns None, or what was wrong (the caller aborts the stream)."""
        if not sock.getsockopt(zmq.RCVMORE):
            return f"chunk {self.next_seq} has no data frame"
        offset, nbytes = chunk_span(self.total, self.reply.chunk, self.next_seq)
        if self.target is not None:
            got = sock.recv_into(self.target[offset : offset + nbytes], flags=zmq.NOBLOCK)
            if got == nbytes:
                if self.next_seq == 0:
                    self.check = ArrivingChecksums.start(self.target[:nbytes], self.total)
                if self.check is not None:
                    self.check.feed(self.target, offset + nbytes)
        else:
            frame = sock.recv(flags=zmq.NOBLOCK, copy=False)
            got = len(frame.buffer)
            self.frames.append(frame.buffer)
        extra = discard_rest(sock)
        if got != nbytes or extra:
            return f"chunk {self.next_seq} holds {got} bytes in {1 + extra} frames, expected {nbytes} in 1"
        self.next_seq += 1
        self.last_s = now_s
        return None

    def result(self) -> tuple[memoryview, ...]:
        """The received payload as frames: the one lent view (with the checksums computed as it
        arrived, when there are any), or the chunks' zmq frames."""
        frames: tuple[memoryview, ...]
        if self.target is not None and self.check is not None and self.check.complete:
            frames = ArrivedFrames((self.target,), self.check.values)
        else:
            frames = (self.target,) if self.target is not None else tuple(self.frames)
        self.abort()
        return frames

    def abort(self) -> None:
        """Drop this stream's references (a lent region goes back once nothing else holds it)."""
        self.target = None
        self.frames = []
        self.check = None
