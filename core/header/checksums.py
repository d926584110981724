"""Checksum algorithms a payload header may name under ``"ck"`` (docs/wire-format.md).

Every algorithm is a function ``fn(buffer, running) -> int`` (unsigned 32 bit) continuing from
the value of the bytes before, as :func:`zlib.crc32` does, so ``fn(b, fn(a, 0)) == fn(a + b, 0)``.

- ``crc32``: zlib's CRC-32 (polynomial 0xEDB88320 reflected), what kvferry wrote first.
- ``crc32c``: CRC-32C (Castagnoli, reflected polynomial 0x82F63B78, initial value and final xor
  0xFFFFFFFF: iSCSI's, ext4's and Google's crc32c); ``crc32c(b"123456789") == 0xE3069283``.
  x86 CPUs compute it with one instruction per 8 bytes. The function here is the pure reference
  (a table, one byte a step: slow); ``kvferry.adapters.checksums`` supplies the native one under
  the same name and says which is in use.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

__all__ = ["CHECKSUM_ALGORITHMS", "CRC32C_POLY", "crc32c"]

#: CRC-32C's polynomial, bit-reflected.
CRC32C_POLY = 0x82F63B78


def _table() -> tuple[int, ...]:
    out = []
    for byte in range(256):
        reg = byte
        for _ in range(8):
            reg = (reg >> 1) ^ CRC32C_POLY if reg & 1 else reg >> 1
        out.append(reg)
    return tuple(out)


_TABLE = _table()


def crc32c(data: Any, value: int = 0) -> int:
    """CRC-32C of a bytes-like object continuing from ``value`` (pure Python: about 10 MB/s)."""
    table, reg = _TABLE, (value & 0xFFFFFFFF) ^ 0xFFFFFFFF
    for byte in memoryview(data).cast("B"):
        reg = table[(reg ^ byte) & 0xFF] ^ (reg >> 8)
    return reg ^ 0xFFFFFFFF


#: Checksum algorithms by header name: ``fn(buffer, running) -> int`` (unsigned 32 bit).
CHECKSUM_ALGORITHMS: Mapping[str, Callable[[Any, int], int]] = MappingProxyType({"crc32": zlib.crc32, "crc32c": crc32c})
