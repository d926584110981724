"""The zmq connector's wire protocol: control messages, reply validation, endpoints.

Both roles use the functions here and nothing else to build and read messages, so the sender
and receiver cannot disagree. Control frames are msgpack maps of plain data (never pickle).

Receiver -> sender (a DEALER sends ONE frame; the sender's ROUTER sees ``[identity, body]``)::

    {"v": 1, "op": "get", "id": <int correlation id>, "key": <str>,
     "mode": "now" | "wait", "wait_s": <float seconds, >= 0>, "stream": true}

``stream`` (optional, default false): the receiver accepts a streamed data reply.

Sender -> receiver (``[header, *payload frames]``)::

    {"v": 1, "op": "data",  "id": id, "key": key, "sizes": [bytes per payload frame]}
    {"v": 1, "op": "data",  "id": id, "key": key, "sizes": [...], "chunk": <bytes>}
    {"v": 1, "op": "miss",  "id": id, "key": key, "reason": "not_found" | "expired" |
                                                           "timeout" | "closing"}
    {"v": 1, "op": "miss",  "id": id, "key": key, "reason": "failed",
     "failure": {"kind": <word>, "reason": <text>}}

A ``failed`` miss carries the sender's failure record for a key it will never publish (a
tombstone, :mod:`kvferry.core.tombstones`); a miss that says ``failed`` without a readable
record is a bad reply.
    {"v": 1, "op": "error", "id": id | None, "reason": <word>, "detail": <text>}

A data reply with ``chunk`` (only to a request with ``stream``) is streamed: the header comes
alone and the payload follows in separate messages (see :mod:`.stream`).

``wait_s`` is relative (the hosts' clocks are not compared): the sender parks a "wait" request
until the key is published or ``wait_s`` has passed on its own monotonic clock.

Decoding never raises: it returns a :class:`Request` / :class:`Reply` or a :class:`Rejection`
naming what was wrong, so a garbage message costs one counter increment and nothing else.
"""

from __future__ import annotations

import math
import os
import socket
from collections.abc import Mapping, Sequence
from typing import Any, Literal, overload

import attrs
import msgpack

from kvferry.core.addressing import resolve_get_source
from kvferry.core.control import Rejection
from kvferry.core.errors import BindError, ConfigError, PayloadError
from kvferry.core.parked import MISS_REASONS as PARKED_MISS_REASONS
from kvferry.core.tombstones import FAILED_REASON, FAILURE_FIELD, SenderFailure, decode_failure, encode_failure
from kvferry.core.validate import check_port

__all__ = [
    "PROTOCOL_VERSION",
    "MAX_CONTROL_BYTES",
    "MAX_KEY_CHARS",
    "MAX_PAYLOAD_FRAMES",
    "MODES",
    "MISS_REASONS",
    "Request",
    "Reply",
    "Rejection",
    "encode_request",
    "decode_request",
    "encode_reply",
    "decode_reply",
    "unpack_control",
    "reply_from_map",
    "check_data_frames",
    "ipc_path",
    "tcp_endpoint",
    "resolve_endpoint",
    "refuse_live_ipc",
    "MAX_IPC_PATH_BYTES",
]

PROTOCOL_VERSION = 1
#: Upper bound of one control frame in bytes (requests and reply headers); larger is garbage.
MAX_CONTROL_BYTES = 64 * 1024
#: Longest key accepted on the wire, in characters.
MAX_KEY_CHARS = 1024
#: Most payload frames one reply may carry.
MAX_PAYLOAD_FRAMES = 1 << 16
#: ``sun_path`` holds 108 bytes including the terminating NUL.
MAX_IPC_PATH_BYTES = 107

MODES = ("now", "wait")
MISS_REASONS = PARKED_MISS_REASONS  # the one closed set (kvferry.core.parked)
_MAX_ID = (1 << 63) - 1


@attrs.frozen
class Request:
    """One pull request. ``corr_id`` is unique per receiver connector; ``wait_s`` in seconds;
    ``stream``: the receiver accepts a streamed data reply."""

    corr_id: int
    key: str
    mode: str = "now"
    wait_s: float = 0.0
    stream: bool = False


@attrs.frozen
class Reply:
    """A sender's answer. ``op`` is ``"data"``, ``"miss"`` or ``"error"``; ``sizes`` (data
    only) are the byte lengths of the payload frames; they follow the header frame, or, when
    ``chunk`` > 0, come as a stream of messages of at most ``chunk`` bytes each."""

    op: str
    corr_id: int | None
    key: str = ""
    reason: str = ""
    detail: str = ""
    sizes: tuple[int, ...] = ()
    chunk: int = 0
    #: A ``miss`` of a key its sender failed (reason ``failed``): the sender's record.
    failure: SenderFailure | None = None

    @property
    def size(self) -> int:
        """Total payload bytes (data replies)."""
        return sum(self.sizes)


def _pack(obj: Mapping[str, Any]) -> bytes:
    return msgpack.packb(dict(obj), use_bin_type=True)


def unpack_control(body: Any) -> dict[str, Any] | Rejection:
    """A control frame as a map (msgpack, at most MAX_CONTROL_BYTES), or why not. Never raises."""
    try:
        view = memoryview(body)
    except TypeError:
        return Rejection("bad_frame", f"control frame is a {type(body).__name__}")
    if view.nbytes > MAX_CONTROL_BYTES:
        return Rejection("too_large", f"control frame of {view.nbytes} bytes")
    try:
        obj = msgpack.unpackb(view, raw=False, strict_map_key=True, use_list=False)
    except (ValueError, TypeError, msgpack.UnpackException) as exc:
        return Rejection("bad_frame", f"not msgpack: {type(exc).__name__}")
    if not isinstance(obj, dict):
        return Rejection("bad_frame", f"control frame is a {type(obj).__name__}, not a map")
    return obj


@overload
def _corr_id(obj: Mapping[str, Any], *, optional: Literal[False] = False) -> int | Rejection: ...
@overload
def _corr_id(obj: Mapping[str, Any], *, optional: bool) -> int | None | Rejection: ...
def _corr_id(obj: Mapping[str, Any], *, optional: bool = False) -> int | None | Rejection:
    value = obj.get("id")
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= _MAX_ID:
        return Rejection("bad_request", f"id must be an integer in [0, 2**63), got {value!r}")
    return value


def _check_key(obj: Mapping[str, Any], corr_id: int | None) -> str | Rejection:
    key = obj.get("key")
    if not isinstance(key, str) or not key or len(key) > MAX_KEY_CHARS:
        return Rejection("bad_request", "key must be a non-empty string of <= 1024 chars", corr_id)
    return key


def _check_version(obj: Mapping[str, Any], corr_id: int | None) -> Rejection | None:
    if obj.get("v") != PROTOCOL_VERSION:
        return Rejection("bad_version", f"protocol version {obj.get('v')!r}", corr_id)
    return None


def encode_request(request: Request) -> bytes:
    """One request frame. Raises ConfigError for a request that could not be decoded back."""
    if request.mode not in MODES:
        raise ConfigError(f"mode must be one of {MODES}, got {request.mode!r}")
    if not isinstance(request.key, str) or not request.key or len(request.key) > MAX_KEY_CHARS:
        raise ConfigError(f"key must be a non-empty string of <= {MAX_KEY_CHARS} characters")
    if not 0 <= request.corr_id <= _MAX_ID:
        raise ConfigError(f"correlation id out of range: {request.corr_id}")
    wait = float(request.wait_s)
    if not (math.isfinite(wait) and wait >= 0):
        raise ConfigError(f"wait_s must be a finite number >= 0, got {request.wait_s!r}")
    body = {
        "v": PROTOCOL_VERSION,
        "op": "get",
        "id": request.corr_id,
        "key": request.key,
        "mode": request.mode,
        "wait_s": wait,
    }
    if request.stream:
        body["stream"] = True
    return _pack(body)


def decode_request(body: Any) -> Request | Rejection:
    """Read a request frame; never raises."""
    obj = unpack_control(body)
    if isinstance(obj, Rejection):
        return obj
    corr_id = _corr_id(obj)
    if isinstance(corr_id, Rejection):
        return corr_id
    bad = _check_version(obj, corr_id)
    if bad is not None:
        return bad
    if obj.get("op") != "get":
        return Rejection("unknown_op", f"unknown op {str(obj.get('op'))[:64]!r}", corr_id)
    key = _check_key(obj, corr_id)
    if isinstance(key, Rejection):
        return key
    mode = obj.get("mode")
    if mode not in MODES:
        return Rejection("bad_request", f"mode must be one of {MODES}", corr_id)
    wait = obj.get("wait_s", 0.0)
    if isinstance(wait, bool) or not isinstance(wait, (int, float)):
        return Rejection("bad_request", "wait_s must be a number", corr_id)
    if not (math.isfinite(wait) and wait >= 0):
        return Rejection("bad_request", "wait_s must be finite and >= 0", corr_id)
    stream = obj.get("stream", False)
    if not isinstance(stream, bool):
        return Rejection("bad_request", "stream must be true or false", corr_id)
    return Request(corr_id, key, mode, float(wait), stream)


def encode_reply(reply: Reply) -> bytes:
    """One reply header frame (the payload frames, if any, follow it)."""
    body: dict[str, Any] = {"v": PROTOCOL_VERSION, "op": reply.op, "id": reply.corr_id}
    if reply.op == "data":
        body["key"] = reply.key
        body["sizes"] = list(reply.sizes)
        if reply.chunk:
            body["chunk"] = reply.chunk
    elif reply.op == "miss":
        body["key"] = reply.key
        body["reason"] = reply.reason
        if reply.failure is not None:
            body["reason"], body[FAILURE_FIELD] = FAILED_REASON, encode_failure(reply.failure)
    elif reply.op == "error":
        body["reason"] = reply.reason
        body["detail"] = reply.detail[:1024]
    else:
        raise ConfigError(f"unknown reply op {reply.op!r}")
    return _pack(body)


def _read_sizes(obj: Mapping[str, Any], corr_id: int | None) -> tuple[int, ...] | Rejection:
    sizes = obj.get("sizes")
    if not isinstance(sizes, (list, tuple)) or len(sizes) > MAX_PAYLOAD_FRAMES:
        return Rejection("bad_reply", "sizes must be a list of <= 65536 integers", corr_id)
    for size in sizes:
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            return Rejection("bad_reply", f"frame size {size!r} is not a byte count", corr_id)
    return tuple(sizes)


def decode_reply(header: Any) -> Reply | Rejection:
    """Read a reply header frame; never raises. Check the frames with check_data_frames."""
    obj = unpack_control(header)
    return obj if isinstance(obj, Rejection) else reply_from_map(obj)


def reply_from_map(obj: Mapping[str, Any]) -> Reply | Rejection:
    """A reply header already unpacked by :func:`unpack_control`; never raises."""
    op = obj.get("op")
    corr_id = _corr_id(obj, optional=op == "error")
    if isinstance(corr_id, Rejection):
        return corr_id
    bad = _check_version(obj, corr_id)
    if bad is not None:
        return bad
    if op == "error":
        reason, detail = obj.get("reason"), obj.get("detail", "")
        if not isinstance(reason, str) or not isinstance(detail, str):
            return Rejection("bad_reply", "error reason/detail must be strings", corr_id)
        return Reply("error", corr_id, reason=reason[:64], detail=detail[:1024])
    if op not in ("data", "miss"):
        return Rejection("unknown_op", f"unknown reply op {str(op)[:64]!r}", corr_id)
    key = _check_key(obj, corr_id)
    if isinstance(key, Rejection):
        return key
    if op == "miss":
        reason = obj.get("reason")
        if reason == FAILED_REASON:
            try:
                failure = decode_failure(obj.get(FAILURE_FIELD))
            except PayloadError as exc:
                return Rejection("bad_reply", f"failed miss: {exc}", corr_id)
            return Reply("miss", corr_id, key, reason=reason, failure=failure)
        if reason not in MISS_REASONS:
            return Rejection("bad_reply", f"unknown miss reason {str(reason)[:64]!r}", corr_id)
        return Reply("miss", corr_id, key, reason=reason)
    sizes = _read_sizes(obj, corr_id)
    if isinstance(sizes, Rejection):
        return sizes
    chunk = obj.get("chunk", 0)
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 0:
        return Rejection("bad_reply", f"chunk {str(chunk)[:64]!r} is not a byte count", corr_id)
    return Reply("data", corr_id, key, sizes=sizes, chunk=chunk)


def check_data_frames(reply: Reply, frames: Sequence[Any]) -> Rejection | None:
    """None when ``frames`` (the payload frames after the header) match the reply's sizes."""
    if len(frames) != len(reply.sizes):
        return Rejection(
            "bad_frames",
            f"{len(frames)} payload frames, header says {len(reply.sizes)}",
            reply.corr_id,
        )
    for index, (frame, size) in enumerate(zip(frames, reply.sizes)):
        if memoryview(frame).nbytes != size:
            return Rejection("bad_frames", f"frame {index} size differs from header", reply.corr_id)
    return None


def ipc_path(directory: str, port: int | None) -> str:
    """The unix socket path of the sender on ``port``: ``{directory}/kvferry-zmq-{port}.ipc``.

    Sender and receiver both call this, so one (directory, port) names one endpoint. Raises
    ConfigError (naming ``ipc_dir`` / ``port``) for a relative or too long path or a port
    outside 1..65535 (None: a config without a port).
    """
    if not isinstance(directory, str) or not directory.startswith("/"):
        raise ConfigError(f"ipc_dir must be an absolute path, got {directory!r}")
    check_port("port (for ipc)", port)
    path = f"{directory.rstrip('/') or ''}/kvferry-zmq-{port}.ipc"
    if len(path.encode("utf-8")) > MAX_IPC_PATH_BYTES:
        raise ConfigError(f"ipc_dir {directory!r} is too long: socket path {path!r} exceeds {MAX_IPC_PATH_BYTES} bytes")
    return path


def tcp_endpoint(host: str, port: int | str) -> str:
    """``tcp://host:port`` (IPv6 literals in brackets; port ``"*"`` lets the OS choose)."""
    if not isinstance(host, str) or not host:
        raise ConfigError(f"host must be a non-empty string, got {host!r}")
    shown = f"[{host}]" if ":" in host and not host.startswith("[") else host
    return f"tcp://{shown}:{port}"


def resolve_endpoint(
    metadata: Mapping[str, Any] | None,
    default: tuple[str, int] | None,
    *,
    transport: str,
    ipc_dir: str,
) -> str | None:
    """The zmq endpoint a receiver asks, or None when nothing names a sender.

    Which sender: :func:`kvferry.core.addressing.resolve_get_source`'s rule (``metadata``, what
    ``put`` returned or a partial ``source_host``/``source_port`` dict, wins over ``default``, the
    ``(host, port)`` of ``update_sender_info``). Metadata naming ``transport: "ipc"`` uses its
    ``ipc_path`` (else the path of ``ipc_dir`` + port); otherwise the receiver's own ``transport``
    decides. Raises ConfigError for a host or port that is not one.
    """
    source = resolve_get_source(metadata, default, needs_host=False)
    if source is None:
        return None
    transport_of = (source.transport or transport) if source.from_metadata else transport
    if transport_of == "ipc":
        if source.ipc_path is not None and source.ipc_path.startswith("/"):
            return f"ipc://{source.ipc_path}"
        return f"ipc://{ipc_path(ipc_dir, source.port)}"
    if transport_of != "tcp":
        raise ConfigError(f"transport must be 'tcp' or 'ipc', got {transport_of!r}")
    if source.host is None:
        raise ConfigError("get metadata 'source_host' must be a non-empty host string, got None")
    return tcp_endpoint(source.host, source.port)


def refuse_live_ipc(path: str, host: str, port: int) -> None:
    """Raise BindError when a live process serves ``path``; a stale file is left to libzmq,
    which replaces it on bind."""
    if not os.path.exists(path):
        return
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.settimeout(1.0)
        probe.connect(path)
    except (ConnectionRefusedError, FileNotFoundError):
        return
    except OSError as exc:
        raise BindError(f"cannot bind ipc://{path} (host {host!r}, port {port}): {exc}") from None
    finally:
        probe.close()
    raise BindError(f"cannot bind ipc://{path} (host {host!r}, port {port}): another process serves it")
