"""SPEC 3.2: side-payload framing (round trip, sender-failed sentinel, malformed input)."""

from __future__ import annotations

import random
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvferry.core.errors import ConfigError, PayloadError
from kvferry.core.side_payload import (
    SENDER_FAILED,
    SENDER_FAILED_MESSAGE,
    SenderFailed,
    pack_side_frames,
    side_payload_nbytes,
    split_side_payload,
)


@settings(max_examples=150, deadline=None)
@given(st.binary(min_size=1, max_size=300), st.lists(st.binary(max_size=200), max_size=5))
def test_pack_then_split_round_trips_without_copying(side: bytes, blob_frames: list[bytes]) -> None:
    frames = pack_side_frames(side, blob_frames)
    assert frames[1] is side and all(a is b for a, b in zip(frames[2:], blob_frames))
    joined = bytearray(b"".join(frames))
    assert side_payload_nbytes(side, blob_frames) == len(joined)
    side_view, blob_view = split_side_payload(joined)
    assert bytes(side_view) == side and bytes(blob_view) == b"".join(blob_frames)
    joined[4] ^= 0xFF  # the side view shares the input's memory: no copy was made
    assert side_view[0] == joined[4] != side[0]


@pytest.mark.parametrize(
    "raw", [b"", SENDER_FAILED_MESSAGE, struct.pack(">i", -1) + b"junk", struct.pack(">i", -(2**31))]
)
def test_sender_failed_is_a_miss_value_not_an_error(raw: bytes) -> None:
    result = split_side_payload(raw)
    assert result == SENDER_FAILED and isinstance(result, SenderFailed)


@pytest.mark.parametrize("raw", [b"\x00", b"\x00\x00\x01", struct.pack(">i", 10) + b"short", 42, "text"])
def test_malformed_side_payloads_raise_payload_error(raw: object) -> None:
    with pytest.raises(PayloadError):
        split_side_payload(raw)


def test_pack_rejects_empty_or_non_buffer_side_bytes() -> None:
    with pytest.raises(ConfigError):
        pack_side_frames(b"", [b"blob"])
    with pytest.raises(ConfigError):
        pack_side_frames("text", [])


def test_random_and_truncated_inputs_give_only_views_miss_or_payload_error() -> None:
    rng = random.Random(11)
    valid = b"".join(pack_side_frames(b"side-bytes", [b"kv-blob" * 3]))
    outcomes = {"ok": 0, "miss": 0, "error": 0}
    inputs = [valid[:cut] for cut in range(len(valid) + 1)]
    inputs += [bytes(rng.getrandbits(8) for _ in range(rng.randrange(0, 40))) for _ in range(2000)]
    for raw in inputs:
        try:
            result = split_side_payload(raw)
        except PayloadError:
            outcomes["error"] += 1
            continue
        if isinstance(result, SenderFailed):
            outcomes["miss"] += 1
        else:
            side, blob = result
            assert 4 + len(side) + len(blob) == len(raw)
            outcomes["ok"] += 1
    assert all(outcomes.values()), outcomes
