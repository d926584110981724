"""What the zmq receiver's I/O thread reads: one-message replies and streamed payloads.

:class:`ReplyReader` drains a DEALER and turns each reply into an :class:`Outcome` handed to
``deliver``. A streamed data reply (:mod:`.stream`) is received chunk by chunk into a
region lent by the receive pool (``lend``; see :class:`.buffers.RecvPool`) and delivered,
as one memoryview of that region, when its last chunk is in. At most one stream per sender is
in progress (a sender queues a reply's messages back to back); anything else arriving from that
sender before the last chunk means the stream broke, and so does ``idle_s`` seconds without a
chunk: the stream is dropped, its region returns to the pool, and its request gets an error.

Used by the I/O thread only (no locks here); the callbacks take the client's lock.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import attrs
import zmq

from kvferry.adapters.connectors.zmq.protocol import Rejection, Reply, check_data_frames
from kvferry.adapters.connectors.zmq.stream import (
    Chunk,
    InboundStream,
    decode_incoming,
    discard_rest,
)

__all__ = ["Outcome", "ReplyReader"]

logger = logging.getLogger(__name__)
_BATCH = 256  # most messages read per socket per loop pass


@attrs.frozen
class Outcome:
    """What one request came to. ``kind``: ``"data"`` (``frames``: memoryviews of the received
    zmq frames, or the one view of a streamed payload's receive-pool region; ``size``: their
    total bytes), ``"miss"`` (``reason`` from the sender), ``"error"`` (the sender or the
    reply was wrong), ``"timeout"`` (no answer by the deadline) or ``"closed"``."""

    kind: str
    frames: tuple[Any, ...] = ()
    size: int = 0
    reason: str = ""
    #: A ``failed`` miss: the sender's record (kvferry.core.tombstones.SenderFailure).
    failure: Any = None


@attrs.define(eq=False)
class ReplyReader:
    """Reads replies per sender endpoint; ``deliver(endpoint, corr_id, outcome, key)``,
    ``count(counter_name)``; ``lend(nbytes)`` gives a writable receive-pool view or None."""

    deliver: Callable[[str, int | None, Outcome, str], None]
    count: Callable[[str], None]
    lend: Callable[[int], memoryview | None]
    idle_s: float
    clock: Callable[[], float]
    _streams: dict[str, InboundStream] = attrs.field(init=False, factory=dict)

    def read(self, endpoint: str, sock: zmq.Socket) -> None:
        """Handle every message waiting on ``sock`` (at most a batch per call)."""
        for _ in range(_BATCH):
            try:
                first = sock.recv(flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            message = decode_incoming(first.buffer)
            if isinstance(message, Chunk):
                self._on_chunk(endpoint, sock, message)
                continue
            rest = []
            while sock.getsockopt(zmq.RCVMORE):
                rest.append(sock.recv(flags=zmq.NOBLOCK, copy=False).buffer)
            if endpoint in self._streams:  # the sender moved on: that stream cannot complete
                self.drop(endpoint, "a new reply came before the stream's last chunk")
            if isinstance(message, Rejection):
                self._bad(endpoint, message.corr_id, message.reason + ": " + message.detail)
            elif message.op == "data":
                self._on_data(endpoint, message, tuple(rest))
            elif message.op == "miss":
                miss = Outcome("miss", reason=message.reason, failure=message.failure)
                self.deliver(endpoint, message.corr_id, miss, message.key)
            else:
                logger.warning("zmq sender %s answered an error: %s (%s)", endpoint, message.reason, message.detail)
                self.deliver(endpoint, message.corr_id, Outcome("error", reason=message.reason), "")

    def deadlines(self) -> list[float]:
        """When each stream in progress would be dropped for making no progress (clock s)."""
        return [s.last_s + self.idle_s for s in self._streams.values()]

    def expire(self) -> None:
        """Drop streams that made no progress for ``idle_s``."""
        now = self.clock()
        for endpoint, stream in list(self._streams.items()):
            if now - stream.last_s >= self.idle_s:
                self.drop(endpoint, f"no chunk for {self.idle_s:g} s")

    def drop(self, endpoint: str, why: str) -> None:
        """Abandon ``endpoint``'s stream in progress, if any; its request gets an error."""
        corr_id = self.abandon(endpoint)
        if corr_id is not None:
            self._bad(endpoint, corr_id, f"incomplete stream dropped: {why}")

    def abandon(self, endpoint: str) -> int | None:
        """Forget ``endpoint``'s stream in progress, if any, without answering its request;
        returns that request's id. (:meth:`drop` answers it; a dropped connection's requests are
        all answered by the client.)"""
        stream = self._streams.pop(endpoint, None)
        if stream is None:
            return None
        stream.abort()
        self.count("stream_aborts")
        return stream.reply.corr_id

    def close(self) -> None:
        for stream in self._streams.values():
            stream.abort()
        self._streams.clear()

    def _bad(self, endpoint: str, corr_id: int | None, detail: str) -> None:
        logger.warning("zmq receiver dropped a malformed reply from %s: %s", endpoint, detail)
        self.count("bad_replies")
        if corr_id is not None:
            self.deliver(endpoint, corr_id, Outcome("error", reason="bad_reply"), "")

    def _on_data(self, endpoint: str, reply: Reply, views: tuple[Any, ...]) -> None:
        if not reply.chunk:
            bad = check_data_frames(reply, views)
            if bad is not None:
                self._bad(endpoint, reply.corr_id, bad.detail)
                return
            self.deliver(endpoint, reply.corr_id, Outcome("data", views, reply.size), reply.key)
            return
        if views:
            self._bad(endpoint, reply.corr_id, "a streamed reply's header came with frames")
            return
        self.count("streams")
        stream = InboundStream.start(reply, self.lend, self.clock())
        self._streams[endpoint] = stream
        self._finish_if_complete(endpoint, stream)

    def _on_chunk(self, endpoint: str, sock: zmq.Socket, chunk: Chunk) -> None:
        stream = self._streams.get(endpoint)
        if stream is None or not stream.expects(chunk):
            discard_rest(sock)
            where = f"chunk {chunk.seq} of reply {chunk.corr_id}"
            if stream is not None:
                self.drop(endpoint, f"{where} out of order")
            else:
                self._bad(endpoint, None, f"{where} without a stream")
            return
        problem = stream.receive(sock, self.clock())
        if problem is not None:
            self.drop(endpoint, problem)
            return
        self._finish_if_complete(endpoint, stream)

    def _finish_if_complete(self, endpoint: str, stream: InboundStream) -> None:
        if stream.complete:
            del self._streams[endpoint]
            reply = stream.reply
            self.deliver(endpoint, reply.corr_id, Outcome("data", stream.result(), stream.total), reply.key)
