"""The payload checksums with the fastest routine this machine has (docs/reliability.md).

The algorithms and their pure routines are core's (:mod:`kvferry.core.header.checksums`); this
module puts the optional native CRC-32C (``kvferry.adapters._crc32c``, built from
adapters/_crc32c.c when a C compiler is there) under the same name and picks the default:

- :data:`DEFAULT_CHECKSUM` is ``"crc32c"`` when the native routine is loaded (the crc32
  instruction on x86 CPUs with SSE4.2, found at run time; a table elsewhere), else ``"crc32"``
  (zlib's), so a build without a compiler never computes a slow pure CRC-32C for its own sends.
- A payload names its algorithm in its header (``"ck"``), so a receiver verifies what the sender
  chose; ``crc32`` payloads of older senders still verify. A ``crc32c`` payload reaching a
  receiver without the native routine is verified with the pure one (about 10 MB/s): correct,
  slow, and logged once with what to change.

``KVFERRY_NATIVE_CHECKSUM=0`` leaves the native routine unloaded (to test the fallback).
"""

from __future__ import annotations

import logging
import os
import zlib
from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType
from typing import Any

import attrs

from kvferry.core.errors import PayloadError
from kvferry.core.header import PayloadHeader, TensorDescriptor, decode_header
from kvferry.core.header import compute_checksum as _compute
from kvferry.core.header import verify_checksum as _verify
from kvferry.core.header.checksums import crc32c as _pure_crc32c

__all__ = [
    "CHECKSUMS",
    "DEFAULT_CHECKSUM",
    "NATIVE_CRC32C",
    "checksum_engine",
    "sending_checksum",
    "compute_checksum",
    "verify_checksum",
    "FUSED_COPY",
    "copy_crc32c",
    "ArrivingChecksums",
    "ArrivedFrames",
    "arrived_checksums",
]

_log = logging.getLogger(__name__)

_native: Any = None
if os.environ.get("KVFERRY_NATIVE_CHECKSUM", "1") != "0":
    try:  # the optional C extension (pyproject.toml ext-modules, optional = true)
        from kvferry.adapters import _crc32c as _native
    except ImportError:  # not built (no compiler) or not loadable here
        _native = None

#: Whether the native CRC-32C is loaded.
NATIVE_CRC32C: bool = _native is not None
_warned: list[bool] = []


def _slow_crc32c(data: Any, value: int = 0) -> int:
    if not _warned:
        _warned.append(True)
        _log.warning(
            "verifying a crc32c payload with the pure-Python CRC-32C (about 10 MB/s): the native "
            "kvferry.adapters._crc32c is not built here; reinstall kvferry with a C compiler present, "
            "or set the sender's checksums to 'crc32'"
        )
    return _pure_crc32c(data, value)


#: Checksum routines by header name, the fastest loaded: ``fn(buffer, running) -> int``.
CHECKSUMS: Mapping[str, Callable[[Any, int], int]] = MappingProxyType(
    {"crc32": zlib.crc32, "crc32c": _native.crc32c if NATIVE_CRC32C else _slow_crc32c}
)
#: The algorithm kvferry's senders write unless told otherwise (see the module docstring).
DEFAULT_CHECKSUM: str = "crc32c" if NATIVE_CRC32C else "crc32"


def checksum_engine(algorithm: str) -> str:
    """What computes ``algorithm`` here: ``zlib``, ``vpclmulqdq``, ``sse4.2`` or ``table`` (native) or
    ``python``."""
    if algorithm == "crc32":
        return "zlib"
    if algorithm == "crc32c":
        return str(_native.engine()) if NATIVE_CRC32C else "python"
    raise ValueError(f"unknown checksum algorithm {algorithm!r}")


def sending_checksum(algorithm: str | None) -> str | None:
    """The algorithm a sender configured with ``algorithm`` writes: itself, except ``crc32c``
    without the native routine, which becomes ``crc32`` (logged once: a pure CRC-32C would
    cost about 0.4 s per 4 MiB on every send)."""
    if algorithm != "crc32c" or NATIVE_CRC32C:
        return algorithm
    _log.warning(
        "checksums: sending crc32 instead of crc32c: the native kvferry.adapters._crc32c is not built "
        "here (reinstall kvferry with a C compiler present, or set checksums to 'crc32' to silence this)"
    )
    return "crc32"


def compute_checksum(algorithm: str, data: Any) -> int:
    """:func:`kvferry.core.header.compute_checksum` with the routines of :data:`CHECKSUMS`."""
    return _compute(algorithm, data, CHECKSUMS)


def verify_checksum(header: PayloadHeader, descriptor: TensorDescriptor, data: Any) -> None:
    """:func:`kvferry.core.header.verify_checksum` with the routines of :data:`CHECKSUMS`."""
    _verify(header, descriptor, data, CHECKSUMS)


#: Whether :func:`copy_crc32c` can copy and check in one read (the native routine is loaded).
FUSED_COPY: bool = NATIVE_CRC32C


def copy_crc32c(dst: Any, src: Any, chunk: int, spans: Sequence[tuple[int, int, int]], value: int = 0) -> int:
    """Copy ``src`` into the writable buffer ``dst`` in chunks of ``chunk`` bytes and return the
    CRC-32C of ``src`` continuing from ``value``, reading ``src`` once: chunk after chunk of
    ``src`` goes to ``dst[offset + k * stride]``, ``k < count``, for each ``(offset, stride,
    count)`` of ``spans`` in turn (offsets and strides in bytes). The chunks must cover ``src``
    exactly and lie inside ``dst`` (ValueError, nothing written). Only with the native routine
    (:data:`FUSED_COPY`); RuntimeError without it."""
    if _native is None:
        raise RuntimeError("copy_crc32c needs the native kvferry.adapters._crc32c")
    return int(_native.copy_crc32c(dst, src, chunk, spans, value))


@attrs.define(eq=False)
class ArrivingChecksums:
    """The checksums of a payload's tensors, computed while its bytes arrive in order (a
    streamed receive), each stretch right after it was written, still in the cache: the decode
    then compares them with the header's instead of reading the whole payload again
    (``kvferry.app.receive``; the decode's own check stays the judge of any difference).

    Start it from the payload's first bytes (:meth:`start`: None when they do not hold the whole
    header, the header does not decode or names no checksum; the decode then checks as usual),
    then :meth:`feed` every stretch of the payload in order. :attr:`values` maps each tensor's
    name to its checksum once all its bytes were fed."""

    algorithm: str
    #: ``(start, stop, name)`` of every tensor with bytes, by position in the payload
    spans: tuple[tuple[int, int, str], ...]
    values: dict[str, int] = attrs.Factory(dict)
    _running: int = 0
    _at: int = 0  # bytes fed so far
    _next: int = 0  # the first span not finished

    @classmethod
    def start(cls, head: Any, total: int) -> ArrivingChecksums | None:
        try:
            decoded = decode_header(head, total_len=total)
        except PayloadError:
            return None
        algorithm = decoded.header.checksum_algorithm
        if algorithm not in CHECKSUMS:
            return None
        spans = sorted(
            (span[0], span[0] + span[1], desc.name)
            for desc, span in zip(decoded.header.tensors, decoded.spans)
            if span is not None and span[1] and isinstance(desc, TensorDescriptor)
        )
        return cls(str(algorithm), tuple(spans))

    @property
    def complete(self) -> bool:
        """Whether every tensor's checksum is in :attr:`values`."""
        return self._next == len(self.spans)

    def feed(self, payload: memoryview, stop: int) -> None:
        """The payload's bytes ``[bytes fed so far, stop)`` are now in ``payload`` (a view of
        the whole payload): add them to the tensors they belong to."""
        fn, start = CHECKSUMS[self.algorithm], self._at
        while self._next < len(self.spans):
            a, b, name = self.spans[self._next]
            if a >= stop:
                break
            lo, hi = max(a, start), min(b, stop)
            if hi > lo:
                self._running = fn(payload[lo:hi], self._running)
            if b > stop:
                break
            self.values[name] = self._running
            self._running = 0
            self._next += 1
        self._at = max(self._at, stop)


class ArrivedFrames(tuple):  # type: ignore[type-arg]  # frames, as any tuple of them
    """A received payload's frames with the checksums computed as they arrived (``arrived``:
    tensor name -> value, :class:`ArrivingChecksums`); decodes as any tuple of frames."""

    arrived: Mapping[str, int]

    def __new__(cls, frames: Sequence[Any], arrived: Mapping[str, int]) -> ArrivedFrames:
        self = super().__new__(cls, frames)
        self.arrived = arrived
        return self


def arrived_checksums(data: Any) -> Mapping[str, int] | None:
    """The checksums computed as ``data`` arrived (:class:`ArrivedFrames`), else None."""
    return data.arrived if isinstance(data, ArrivedFrames) else None
