"""SPEC 3.1 robustness: random bytes, truncations and mutations raise PayloadError and nothing else.

A deterministic random loop does the bulk (well over 10,000 inputs in the default run, in about
a second); hypothesis explores structural edits of the JSON header.
"""

from __future__ import annotations

import json
import random
import struct
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from kvferry.core.errors import PayloadError
from kvferry.core.header import DTYPE_ITEMSIZE, DecodedHeader, decode_header, kv_tensor_specs, plan_layout

DTYPES = sorted(DTYPE_ITEMSIZE)


def _valid_payloads(rng: random.Random, count: int) -> list[bytes]:
    out = []
    for i in range(count):
        layers = rng.randrange(0, 6)

        def spec() -> Any:
            return None if rng.random() < 0.2 else (rng.choice(DTYPES), (rng.randrange(0, 5), rng.randrange(1, 3)))

        n, specs = kv_tensor_specs([spec() for _ in range(layers)], [spec() for _ in range(layers)])
        checksums = "crc32" if i % 3 == 0 else None
        layout = plan_layout(
            f"req-{i}",
            [rng.randrange(100) for _ in range(rng.randrange(4))],
            {"seq_len": i, "t": "é"},
            n,
            specs,
            align=rng.choice([1, 8, 64]),
            version=bool(i % 2),
            checksums=checksums,
        )
        if checksums:
            layout = layout.with_checksums([rng.getrandbits(32) for _ in layout.header.present])
        data = bytes(rng.getrandbits(8) for _ in range(layout.total_nbytes - layout.data_start))
        out.append(layout.header_bytes + data)
    return out


def _check(raw: bytes, stats: dict[str, int]) -> None:
    """Decode; only PayloadError may escape, and a success must be internally consistent."""
    try:
        decoded = decode_header(raw)
    except PayloadError:
        stats["rejected"] += 1
        return
    stats["accepted"] += 1
    assert isinstance(decoded, DecodedHeader)
    for span in decoded.spans:
        if span is not None:
            assert decoded.data_start <= span[0] and span[0] + span[1] <= len(raw)


def test_random_truncated_and_mutated_bytes_raise_only_payload_error() -> None:
    rng = random.Random(20240531)
    stats = {"accepted": 0, "rejected": 0}
    payloads = _valid_payloads(rng, 60)
    for raw in payloads:
        header_end = 4 + struct.unpack(">I", raw[:4])[0]
        # every truncation inside the header, a few inside the data
        for cut in list(range(0, header_end + 1)) + [rng.randrange(0, len(raw) + 1) for _ in range(5)]:
            _check(raw[:cut], stats)
        # single-byte mutations, mostly in the header where they matter
        for _ in range(120):
            pos = rng.randrange(0, header_end) if rng.random() < 0.9 else rng.randrange(0, len(raw))
            mutated = bytearray(raw)
            mutated[pos] = rng.choice([rng.getrandbits(8), ord("9"), ord('"'), ord("{"), ord("-"), 0x80])
            _check(bytes(mutated), stats)
        # length-prefix lies
        for claim in (0, 1, header_end - 5, header_end - 3, len(raw), 2**31, 2**32 - 1):
            _check(struct.pack(">I", claim % 2**32) + raw[4:], stats)
    # pure noise, some with a plausible length prefix
    for _ in range(3000):
        noise = bytes(rng.getrandbits(8) for _ in range(rng.randrange(0, 64)))
        if rng.random() < 0.5:
            noise = struct.pack(">I", rng.randrange(0, 80)) + noise
        _check(noise, stats)
    total = stats["accepted"] + stats["rejected"]
    assert total >= 10_000, stats
    assert stats["rejected"] > total // 2 and stats["accepted"] > 0, stats


# ------------------------------------------------------------------- structural (hypothesis)
def _base_object() -> dict:
    n, specs = kv_tensor_specs([("float16", (2, 3)), None, ("int8", (4,))], [("float16", (2, 3)), ("bool", (0,)), None])
    layout = plan_layout("req", [1, 2], {"k": [1, 2]}, n, specs, align=8, version=True)
    return json.loads(layout.header_bytes[4:]), layout.total_nbytes - layout.data_start


BASE_OBJECT, BASE_DATA_LEN = _base_object()
any_json = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(), st.text(max_size=6)),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=8,
)
TOP_KEYS = ["rid", "bids", "meta", "td", "nl", "v", "ck", "zz"]
DESC_KEYS = ["n", "i", "d", "s", "o", "b", "c", "x", "zz"]


@st.composite
def edited_headers(draw: st.DrawFn) -> bytes:
    obj = json.loads(json.dumps(BASE_OBJECT))
    for _ in range(draw(st.integers(1, 3))):
        descriptors = obj.get("td") if isinstance(obj.get("td"), list) else []
        if descriptors and draw(st.booleans()):
            target = descriptors[draw(st.integers(0, len(descriptors) - 1))]
            key = draw(st.sampled_from(DESC_KEYS))
        else:
            target, key = obj, draw(st.sampled_from(TOP_KEYS))
        if not isinstance(target, dict):
            continue
        if draw(st.booleans()) and key in target:
            del target[key]
        else:
            target[key] = draw(any_json)
    body = json.dumps(obj, separators=(",", ":")).encode()
    return struct.pack(">I", len(body)) + body + bytes(draw(st.integers(0, BASE_DATA_LEN + 8)))


@settings(max_examples=400, deadline=None)
@given(edited_headers())
def test_structural_edits_raise_only_payload_error(raw: bytes) -> None:
    _check(raw, {"accepted": 0, "rejected": 0})
