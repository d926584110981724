"""The checksum algorithms a header may name (core/header/checksums.py): published vectors,
zlib-style continuation, and the header round trip of the algorithm's name."""

from __future__ import annotations

import zlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvferry.core.errors import PayloadError
from kvferry.core.header import (
    CHECKSUM_ALGORITHMS,
    compute_checksum,
    decode_header,
    kv_tensor_specs,
    plan_layout,
    verify_checksum,
)
from kvferry.core.header.checksums import crc32c

# CRC-32C check value and the iSCSI vectors of RFC 3720, appendix B.4.
VECTORS = [
    (b"123456789", 0xE3069283),
    (bytes(32), 0x8A9136AA),
    (b"\xff" * 32, 0x62A8AB43),
    (bytes(range(32)), 0x46DD794E),
    (bytes(range(31, -1, -1)), 0x113FDB5C),
    (b"", 0),
]


@pytest.mark.parametrize(("data", "expected"), VECTORS)
def test_crc32c_matches_the_published_vectors(data: bytes, expected: int) -> None:
    assert crc32c(data) == expected
    assert compute_checksum("crc32c", data) == expected


@settings(max_examples=200, deadline=None)
@given(data=st.binary(max_size=300), cut=st.integers(0, 300))
def test_crc32c_continues_like_zlib_crc32(data: bytes, cut: int) -> None:
    cut = min(cut, len(data))
    assert crc32c(data[cut:], crc32c(data[:cut])) == crc32c(data)
    assert compute_checksum("crc32c", [data[:cut], data[cut:]]) == crc32c(data)
    assert compute_checksum("crc32", [data[:cut], data[cut:]]) == zlib.crc32(data)


@settings(max_examples=100, deadline=None)
@given(data=st.binary(min_size=1, max_size=64), bit=st.integers(0, 511))
def test_crc32c_sees_every_single_bit_flip(data: bytes, bit: int) -> None:
    flipped = bytearray(data)
    flipped[(bit // 8) % len(data)] ^= 1 << (bit % 8)
    assert crc32c(bytes(flipped)) != crc32c(data)


def test_crc32c_differs_from_crc32() -> None:  # the algorithm's name in the header matters
    assert crc32c(b"123456789") != zlib.crc32(b"123456789")
    assert sorted(CHECKSUM_ALGORITHMS) == ["crc32", "crc32c"]


@pytest.mark.parametrize("algorithm", sorted(CHECKSUM_ALGORITHMS))
def test_the_header_names_its_algorithm_and_verifies_with_it(algorithm: str) -> None:
    n, specs = kv_tensor_specs([("uint8", (9,))], [("uint8", (0,))])
    data = b"123456789"
    layout = plan_layout("r", [], {}, n, specs, align=1, checksums=algorithm)
    layout = layout.with_checksums([compute_checksum(algorithm, data), compute_checksum(algorithm, b"")])
    assert f'"ck":"{algorithm}"'.encode() in layout.header_bytes
    decoded = decode_header(layout.header_bytes + data)
    assert decoded.header.checksum_algorithm == algorithm
    key = decoded.header.present[0]
    verify_checksum(decoded.header, key, data)
    with pytest.raises(PayloadError, match=f"key_cache_0.*{algorithm} mismatch"):
        verify_checksum(decoded.header, key, b"123456780")


def test_a_routine_table_can_be_passed_in() -> None:
    calls = []

    def recording(data: bytes, value: int) -> int:
        calls.append(bytes(data))
        return crc32c(data, value)

    assert compute_checksum("crc32c", [b"ab", b"c"], {"crc32c": recording}) == crc32c(b"abc")
    assert calls == [b"ab", b"c"]
