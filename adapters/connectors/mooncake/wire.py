"""Control-channel messages of the mooncake connector (msgpack maps, data only, never pickle).

The control channel is a ZMQ DEALER (receiver) -> ROUTER (sender) pair. The bytes themselves
never travel on it: the receiver learns where a payload lies in the sender's registered pool and
reads it with the transfer engine. Four messages exist:

- :class:`Lookup` (receiver -> sender): "give me ``key``; wait up to ``wait_s`` seconds for it;
  I can take at most ``room`` bytes now". A payload larger than ``room`` is not claimed (reply
  ``no_room`` with its ``size``), so a receiver with a full pool never consumes a reader slot it
  cannot use. A found payload is *claimed* for this reader: its region stays pinned (never freed or reused)
  for ``pin_s`` seconds or until the matching :class:`Done` arrives.
- :class:`LookupReply` (sender -> receiver): either ``found`` with ``claim``, ``addr`` (absolute
  address in the sender's registered pool), ``size`` (bytes), ``rpc_port`` (the sender engine's
  handshake port) and ``pin_s``; or not found with a ``reason`` word (:data:`MISS_REASONS`).
  A payload that lies in several places of the sender's registered memory (its header in the
  pool, its pages where the engine keeps them: an in-place put) comes with ``spans``, the
  ``[addr, length]`` pieces whose concatenation is the payload, in order (``addr`` is then the
  first one's); only a receiver whose lookup said ``spans_ok`` gets one.
  A miss whose reason is ``failed`` carries the sender's failure record in ``failure`` (the
  key will never come: :mod:`kvferry.core.tombstones`); no other reply carries one.
- :class:`Done` (receiver -> sender): the claim is over; ``ok`` says whether the read succeeded.
  The sender releases the claim (the region is freed once every expected reader finished) and
  answers :class:`Ack`, so when a receiver's get returns, the sender's accounting is final.

Every message carries ``v`` (:data:`WIRE_VERSION`). Decoding validates types and ranges before
anything is used; any malformed input raises :class:`~kvferry.core.errors.PayloadError` and
nothing else.
"""

from __future__ import annotations

import math
from typing import Any

import attrs
import msgpack

from kvferry.core.control import Rejection
from kvferry.core.errors import PayloadError
from kvferry.core.parked import MISS_REASONS as PARKED_MISS_REASONS
from kvferry.core.tombstones import FAILED_REASON, FAILURE_FIELD, SenderFailure, decode_failure

__all__ = [
    "WIRE_VERSION",
    "MAX_MESSAGE_BYTES",
    "MAX_KEY_CHARS",
    "MAX_SPANS",
    "MISS_REASONS",
    "Lookup",
    "LookupReply",
    "Done",
    "Ack",
    "Message",
    "encode",
    "decode",
]

WIRE_VERSION = 1
#: Control messages are tiny; anything larger is rejected before msgpack parses it.
MAX_MESSAGE_BYTES = 64 * 1024
MAX_KEY_CHARS = 4096
#: Most pieces of one payload a reply lists (a span takes at most 19 bytes of msgpack: 4096
#: fit well inside :data:`MAX_MESSAGE_BYTES`); a payload in more pieces is put by copy.
MAX_SPANS = 2048
_MAX_U64 = 2**64 - 1
_MAX_ID = 2**63 - 1
#: Why a lookup found nothing: never published / already consumed, lease passed, payload larger
#: than the receiver's ``room``, long-poll ended without the key, sender closing, malformed
#: request; the first four are :data:`kvferry.core.parked.MISS_REASONS` ("closed" is what senders
#: before that table said for "closing", still accepted); ``failed``: the sender recorded that the
#: key will never come (the reply carries the record).
MISS_REASONS = (*PARKED_MISS_REASONS, "no_room", "bad_request", "closed", FAILED_REASON)


def _u64(name: str, limit: int = _MAX_U64):
    def check(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= limit:
            raise PayloadError(f"control message field {name!r} must be an int in [0, {limit}]")

    return check


def _seconds(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise PayloadError(f"control message field {attribute.name!r} must be a number")
    if not math.isfinite(value) or value < 0 or value > 86400 * 365:
        raise PayloadError(f"control message field {attribute.name!r} out of range: {value!r}")


def _key(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if not isinstance(value, str) or not value or len(value) > MAX_KEY_CHARS:
        raise PayloadError(f"control message key must be a non-empty str of <= {MAX_KEY_CHARS} chars")


def _bool(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if not isinstance(value, bool):
        raise PayloadError(f"control message field {attribute.name!r} must be a bool")


def _as_failure(value: Any) -> SenderFailure | None:
    """A reply's failure record: None, a record, or its plain-data form (PayloadError if not)."""
    if value is None or isinstance(value, SenderFailure):
        return value
    return decode_failure(value)


def _as_spans(value: Any) -> tuple[tuple[int, int], ...]:
    """A reply's spans: ``[addr, length]`` pairs (addr > 0, length > 0, both u64), at most
    :data:`MAX_SPANS` (PayloadError otherwise)."""
    if value is None or value == ():
        return ()
    if not isinstance(value, (list, tuple)) or len(value) > MAX_SPANS:
        raise PayloadError(f"control message field 'spans' must be a list of at most {MAX_SPANS} pairs")
    out = []
    for pair in value:
        if not isinstance(pair, (list, tuple)) or len(pair) != 2:
            raise PayloadError("control message field 'spans' must hold [addr, length] pairs")
        addr, length = pair
        for x in (addr, length):
            if isinstance(x, bool) or not isinstance(x, int) or not 0 < x <= _MAX_U64:
                raise PayloadError("a span's addr and length must be ints in [1, 2**64 - 1]")
        if addr + length > _MAX_U64:
            raise PayloadError("a span overflows the address space")
        out.append((addr, length))
    return tuple(out)


@attrs.frozen
class Lookup:
    """Receiver asks for ``key``; ``wait_s`` >= 0 seconds of long-poll (0: answer at once);
    ``room``: the largest payload (bytes) the receiver can take now; ``spans_ok``: it reads a
    payload given in pieces (a reply's ``spans``)."""

    id: int = attrs.field(validator=_u64("id", _MAX_ID))
    key: str = attrs.field(validator=_key)
    room: int = attrs.field(validator=_u64("room"))
    wait_s: float = attrs.field(default=0.0, validator=_seconds)
    spans_ok: bool = attrs.field(default=False, validator=_bool)


@attrs.frozen
class LookupReply:
    """Answer to the :class:`Lookup` with the same ``id``.

    Found: ``claim`` > 0, ``addr`` + ``size`` span the payload in the sender's pool (bytes),
    ``rpc_port`` is the sender engine's handshake port, the claim is pinned ``pin_s`` seconds;
    or, with ``spans``, the payload is their concatenation (lengths adding up to ``size``,
    ``addr`` the first span's).
    Not found: ``claim`` == 0, ``reason`` in :data:`MISS_REASONS` (``no_room`` sets ``size``;
    ``failed`` needs ``failure``, the sender's record, which no other reply has).
    """

    id: int = attrs.field(validator=_u64("id", _MAX_ID))
    found: bool = attrs.field(validator=_bool)
    claim: int = attrs.field(default=0, validator=_u64("claim", _MAX_ID))
    addr: int = attrs.field(default=0, validator=_u64("addr"))
    size: int = attrs.field(default=0, validator=_u64("size"))
    rpc_port: int = attrs.field(default=0, validator=_u64("rpc_port", 65535))
    pin_s: float = attrs.field(default=0.0, validator=_seconds)
    reason: str = attrs.field(default="")
    failure: SenderFailure | None = attrs.field(default=None, converter=_as_failure)
    spans: tuple[tuple[int, int], ...] = attrs.field(default=(), converter=_as_spans)

    def __attrs_post_init__(self) -> None:
        if self.found:
            if self.claim == 0 or self.rpc_port == 0 or self.addr == 0:
                raise PayloadError("a found reply needs claim, addr and rpc_port")
            if self.addr + self.size > _MAX_U64:
                raise PayloadError("reply span overflows the address space")
            if self.spans and (sum(n for _, n in self.spans) != self.size or self.spans[0][0] != self.addr):
                raise PayloadError("a reply's spans must add up to its size and start at its addr")
        elif self.spans:
            raise PayloadError("a miss has no spans")
        elif self.claim != 0 or self.reason not in MISS_REASONS:
            raise PayloadError(f"a miss needs claim 0 and a known reason, got {self.reason!r}")
        if (self.failure is not None) != (not self.found and self.reason == FAILED_REASON):
            raise PayloadError("a failure record comes with a 'failed' miss, and only with one")


@attrs.frozen
class Done:
    """The reader's claim ``claim`` on ``key`` is over; ``ok``: the bytes were read intact."""

    id: int = attrs.field(validator=_u64("id", _MAX_ID))
    key: str = attrs.field(validator=_key)
    claim: int = attrs.field(validator=_u64("claim", _MAX_ID))
    ok: bool = attrs.field(validator=_bool)


@attrs.frozen
class Ack:
    """The sender processed the :class:`Done` with the same ``id``."""

    id: int = attrs.field(validator=_u64("id", _MAX_ID))


Message = Lookup | LookupReply | Done | Ack
_OPS: dict[str, type] = {"lookup": Lookup, "reply": LookupReply, "done": Done, "ack": Ack}
_OP_OF: dict[type, str] = {cls: op for op, cls in _OPS.items()}


def encode(message: Message) -> bytes:
    """The msgpack bytes of ``message`` (a map with ``v``, ``op`` and the message's fields)."""
    body = attrs.asdict(message)
    if body.get(FAILURE_FIELD, 0) is None:  # ordinary replies stay as they were on the wire
        del body[FAILURE_FIELD]
    for field in ("spans", "spans_ok"):  # so do replies and lookups of one piece
        if field in body and not body[field]:
            del body[field]
    body["v"] = WIRE_VERSION
    body["op"] = _OP_OF[type(message)]
    return msgpack.packb(body, use_bin_type=True)


def decode(raw: bytes) -> Message | Rejection:
    """One control message, or a :class:`~kvferry.core.control.Rejection` saying why ``raw`` is
    not one (never raises)."""
    try:
        return _parse(raw)
    except PayloadError as exc:
        return Rejection("bad_request", str(exc))


def _parse(raw: bytes) -> Message:
    """Parse and validate one control message; raises PayloadError (only) when malformed."""
    if not isinstance(raw, (bytes, bytearray, memoryview)):
        raise PayloadError("control message must be bytes")
    if len(raw) > MAX_MESSAGE_BYTES:
        raise PayloadError(f"control message of {len(raw)} bytes exceeds {MAX_MESSAGE_BYTES}")
    try:
        body = msgpack.unpackb(bytes(raw), raw=False, strict_map_key=True)
    except (ValueError, TypeError, msgpack.UnpackException) as exc:
        # ValueError covers ExtraData, FormatError, StackError and bad UTF-8
        raise PayloadError(f"control message is not msgpack: {exc}") from exc
    if not isinstance(body, dict):
        raise PayloadError("control message must be a map")
    if body.get("v") != WIRE_VERSION:
        raise PayloadError(f"control message version {body.get('v')!r} is not {WIRE_VERSION}")
    op = body.get("op")
    cls = _OPS.get(op) if isinstance(op, str) else None
    if cls is None:
        raise PayloadError(f"unknown control op {op!r}")
    names = {field.name for field in attrs.fields(cls)}
    fields = {name: value for name, value in body.items() if name in names}
    try:
        return cls(**fields)
    except TypeError as exc:  # missing required field
        raise PayloadError(f"control message {op!r} is incomplete: {exc}") from exc
