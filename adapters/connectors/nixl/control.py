"""The nixl connector's control channel: the mooncake connector's, plus one exchange.

Payload lookups, claims and their end (``Lookup``/``LookupReply``/``Done``/``Ack``) are the
mooncake connector's messages (:mod:`kvferry.adapters.connectors.mooncake.wire`), served by the
same ROUTER loop. What NIXL adds is the sender's *agent*: a receiver must add the sender's agent
metadata before it can READ its pool. It asks once per sender endpoint:

- ``{"v": 1, "op": "nixl_agent", "id": n}`` (receiver -> sender), answered by
- ``{"v": 1, "op": "nixl_agent_reply", "id": n, "agent": str, "metadata": bin}``.

Both are msgpack maps (data only, never pickle); decoding validates every field and never
raises (a malformed message is a :class:`~kvferry.core.control.Rejection` or None).
A found ``LookupReply`` names the sender's control port as its ``rpc_port``: the receiver's
peer key ``"host:port"`` is the endpoint it asked.
"""

from __future__ import annotations

import itertools
import logging
import time
from typing import Any, ClassVar

import attrs
import msgpack
import zmq

from kvferry.adapters.connectors.mooncake import wire
from kvferry.adapters.connectors.mooncake.server import ControlServer
from kvferry.core.control import Rejection

__all__ = [
    "MAX_METADATA_BYTES",
    "AgentRequest",
    "AgentReply",
    "encode_request",
    "decode_request",
    "encode_reply",
    "decode_reply",
    "NixlControlServer",
    "fetch_agent",
]

logger = logging.getLogger(__name__)

#: Agent metadata is a few hundred bytes for UCX over TCP; more than this is refused.
MAX_METADATA_BYTES = 1 << 20
MAX_AGENT_CHARS = 256
_ids = itertools.count(1)
_MAX_ID = 2**63 - 1


@attrs.frozen
class AgentRequest:
    id: int


@attrs.frozen
class AgentReply:
    id: int
    agent: str
    metadata: bytes


def encode_request(request: AgentRequest) -> bytes:
    return msgpack.packb({"v": wire.WIRE_VERSION, "op": "nixl_agent", "id": request.id}, use_bin_type=True)


def encode_reply(reply: AgentReply) -> bytes:
    body = {"v": wire.WIRE_VERSION, "op": "nixl_agent_reply", "id": reply.id, "agent": reply.agent}
    body["metadata"] = reply.metadata
    return msgpack.packb(body, use_bin_type=True)


def _map(raw: Any, limit: int) -> dict[str, Any] | None:
    if not isinstance(raw, (bytes, bytearray, memoryview)) or len(raw) > limit:
        return None
    try:
        body = msgpack.unpackb(bytes(raw), raw=False, strict_map_key=True)
    except (ValueError, TypeError, msgpack.UnpackException):
        return None
    if not isinstance(body, dict) or body.get("v") != wire.WIRE_VERSION:
        return None
    ident = body.get("id")
    if isinstance(ident, bool) or not isinstance(ident, int) or not 0 <= ident <= _MAX_ID:
        return None
    return body


def decode_request(raw: Any) -> AgentRequest | None:
    """The agent request in ``raw``, or None when it is not one."""
    body = _map(raw, wire.MAX_MESSAGE_BYTES)
    if body is None or body.get("op") != "nixl_agent":
        return None
    return AgentRequest(body["id"])


def decode_reply(raw: Any) -> AgentReply | Rejection:
    """The agent reply in ``raw``, or a Rejection saying why not (never raises)."""
    body = _map(raw, MAX_METADATA_BYTES + 4096)
    if body is None or body.get("op") != "nixl_agent_reply":
        return Rejection("bad_reply", "not a nixl agent reply")
    agent, metadata = body.get("agent"), body.get("metadata")
    if not isinstance(agent, str) or not agent or len(agent) > MAX_AGENT_CHARS:
        return Rejection("bad_reply", "nixl agent reply: bad agent name")
    if not isinstance(metadata, bytes) or not metadata or len(metadata) > MAX_METADATA_BYTES:
        return Rejection("bad_reply", "nixl agent reply: bad metadata")
    return AgentReply(body["id"], agent, metadata)


@attrs.define(eq=False)
class NixlControlServer(ControlServer):
    """The mooncake control loop, also answering agent requests with ``agent``/``metadata``."""

    agent: str = ""
    metadata: bytes = b""

    NAME: ClassVar[str] = "nixl"

    def _rejected(self, ident: bytes, raw: bytes, rejection: Rejection) -> None:
        request = decode_request(raw)
        if request is None:
            super()._rejected(ident, raw, rejection)
            return
        self.state.count("agent_requests")
        self._reply_raw(ident, encode_reply(AgentReply(request.id, self.agent, self.metadata)))

    def _reply_raw(self, ident: bytes, raw: bytes) -> None:
        try:
            self.router.send_multipart([ident, raw], zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            logger.warning("nixl control: agent reply failed: %s", exc)


def fetch_agent(ctx: zmq.Context, host: str, port: int, timeout_s: float) -> tuple[str, bytes] | None:
    """Ask the sender at ``tcp://host:port`` for its agent name and metadata; None when no valid
    answer comes within ``timeout_s`` seconds (sender gone, refused, malformed reply)."""
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    try:
        if ":" in host:
            sock.setsockopt(zmq.IPV6, 1)
        where = f"[{host}]" if ":" in host else host
        sock.connect(f"tcp://{where}:{port}")
        request = AgentRequest(next(_ids))
        sock.send(encode_request(request), zmq.NOBLOCK)
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not sock.poll(max(1, int(left * 1000)), zmq.POLLIN):
                logger.warning("nixl: no agent reply from %s:%d in %.1f s", host, port, timeout_s)
                return None
            reply = decode_reply(sock.recv(zmq.NOBLOCK))
            if isinstance(reply, Rejection):
                logger.warning("nixl: bad agent reply from %s:%d: %s", host, port, reply.detail)
                return None
            if reply.id == request.id:
                return reply.agent, reply.metadata
    except zmq.ZMQError as exc:
        logger.warning("nixl: agent request to %s:%d failed: %s", host, port, exc)
        return None
    finally:
        sock.close()
