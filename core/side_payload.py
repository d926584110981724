"""Side-payload framing for collectives inside the receiving stage (SPEC 3.2), over bytes.

Layout: ``[i32 big-endian side_len][side bytes][KV blob]``. The side bytes are data-only (the
adapters use msgpack; never pickle) and carry the request's KV fields with the heavy KV replaced
by placeholders; the KV blob is what follows, in the SPEC 3.1 format.

``side_len`` is read as a signed 32-bit integer: a value ``<= 0`` (and an empty message) means
"the sender failed" and comes back as :data:`SENDER_FAILED`, a value, not an exception, so every
rank of a group keeps calling the same collectives. Anything else that does not fit raises
:class:`PayloadError`. Splitting never copies: the parts are views of the input.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import Any

import attrs

from kvferry.core.errors import ConfigError, PayloadError

__all__ = [
    "SIDE_PREFIX_NBYTES",
    "MAX_SIDE_BYTES",
    "SenderFailed",
    "SENDER_FAILED",
    "SENDER_FAILED_MESSAGE",
    "pack_side_frames",
    "side_payload_nbytes",
    "split_side_payload",
]

SIDE_PREFIX_NBYTES = 4
MAX_SIDE_BYTES = 2**31 - 1
_PREFIX = struct.Struct(">i")


@attrs.frozen
class SenderFailed:
    """The sending rank had no payload (it failed to receive, or packing failed): a miss."""

    reason: str = "sender_failed"


SENDER_FAILED = SenderFailed()
#: What a failed sender transmits so its peers' receive calls still complete.
SENDER_FAILED_MESSAGE = _PREFIX.pack(0)


def _nbytes(buf: Any) -> int:
    return memoryview(buf).nbytes


def pack_side_frames(side_bytes: Any, blob_frames: Sequence[Any] = ()) -> list[Any]:
    """``[prefix, side_bytes, *blob_frames]``: frames whose concatenation is the side payload.

    ``side_bytes`` must be bytes-like with ``1 <= len <= MAX_SIDE_BYTES`` (an empty side part
    would read as "sender failed"); the blob frames are passed through uncopied.
    """
    try:
        size = _nbytes(side_bytes)
    except TypeError:
        raise ConfigError(f"side bytes must be bytes-like, got {type(side_bytes).__name__}") from None
    if not 1 <= size <= MAX_SIDE_BYTES:
        raise ConfigError(f"side bytes must be 1..{MAX_SIDE_BYTES} bytes long, got {size}")
    return [_PREFIX.pack(size), side_bytes, *blob_frames]


def side_payload_nbytes(side_bytes: Any, blob_frames: Sequence[Any] = ()) -> int:
    """Total length of the packed side payload, in bytes (the "size" phase of a collective)."""
    return SIDE_PREFIX_NBYTES + _nbytes(side_bytes) + sum(_nbytes(f) for f in blob_frames)


def split_side_payload(buf: Any) -> tuple[memoryview, memoryview] | SenderFailed:
    """``(side_view, blob_view)`` of a packed side payload, or :data:`SENDER_FAILED`.

    Raises PayloadError for anything malformed (not bytes-like, 1-3 bytes, a side length past
    the end); never anything else.
    """
    try:
        view = buf if isinstance(buf, memoryview) else memoryview(buf)
        if view.format != "B" or view.ndim != 1:
            view = view.cast("B")
    except (TypeError, ValueError) as exc:
        raise PayloadError(f"invalid side payload: not a contiguous bytes-like object ({exc})") from None
    if len(view) == 0:
        return SENDER_FAILED
    if len(view) < SIDE_PREFIX_NBYTES:
        raise PayloadError(f"invalid side payload: {len(view)} bytes, shorter than the 4-byte length")
    (side_len,) = _PREFIX.unpack(view[:SIDE_PREFIX_NBYTES])
    if side_len <= 0:
        return SENDER_FAILED
    end = SIDE_PREFIX_NBYTES + side_len
    if end > len(view):
        raise PayloadError(f"invalid side payload: side_len={side_len} exceeds buffer size={len(view)}")
    return view[SIDE_PREFIX_NBYTES:end], view[end:]
