"""SPEC 3.1: the header codec over bytes (round trips, golden vectors, validation, limits)."""

from __future__ import annotations

import json
import struct
import time
import tracemalloc

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvferry.core.errors import ConfigError, PayloadError
from kvferry.core.header import (
    DTYPE_ITEMSIZE,
    FORMAT_VERSION,
    AbsentTensor,
    DecodeLimits,
    TensorDescriptor,
    TensorSpec,
    compute_checksum,
    decode_header,
    kv_tensor_specs,
    plan_layout,
    tensor_name,
    verify_checksum,
)

PROPERTY = settings(max_examples=120, deadline=None)

# ------------------------------------------------------------------------------- strategies
json_scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**63), 2**63), st.floats(allow_nan=False), st.text(max_size=12)
)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
shapes = st.lists(st.integers(0, 6), min_size=0, max_size=4).map(tuple)
layer_specs = st.one_of(st.none(), st.tuples(st.sampled_from(sorted(DTYPE_ITEMSIZE)), shapes))


@st.composite
def payload_plans(draw: st.DrawFn) -> dict:
    keys = draw(st.lists(layer_specs, max_size=100))
    values = draw(st.lists(layer_specs, max_size=len(keys)))
    return {
        "request_id": draw(st.text(max_size=20)),
        "block_ids": draw(st.lists(st.integers(-(2**40), 2**40), max_size=20)),
        "metadata": draw(st.dictionaries(st.text(max_size=8), json_values, max_size=5)),
        "keys": keys,
        "values": values,
        "align": draw(st.sampled_from([1, 2, 8, 64, 4096])),
        "version": draw(st.booleans()),
        "checksums": draw(st.sampled_from([None, "crc32", "crc32c"])),
    }


def _layout(plan: dict):
    num_layers, specs = kv_tensor_specs(plan["keys"], plan["values"])
    layout = plan_layout(
        plan["request_id"],
        plan["block_ids"],
        plan["metadata"],
        num_layers,
        specs,
        align=plan["align"],
        version=plan["version"],
        checksums=plan["checksums"],
    )
    if plan["checksums"]:
        layout = layout.with_checksums([(i * 2654435761) & 0xFFFFFFFF for i in range(len(layout.header.present))])
    return layout


def _payload(layout) -> bytes:
    return layout.header_bytes + bytes(layout.total_nbytes - layout.data_start)


# ------------------------------------------------------------------------------ properties
@PROPERTY
@given(payload_plans())
def test_plan_then_decode_round_trips(plan: dict) -> None:
    layout = _layout(plan)
    decoded = decode_header(_payload(layout))
    assert decoded.header == layout.header
    assert decoded.header.metadata == plan["metadata"]
    assert decoded.spans == layout.spans
    assert decoded.data_start == layout.data_start == len(layout.header_bytes)
    assert decoded.total_len == layout.total_nbytes
    # the first frame alone is enough to decode, given the total length
    assert decode_header(layout.header_bytes, total_len=layout.total_nbytes) == decoded
    entries = layout.header.tensors
    assert len(entries) == len(plan["keys"]) + len(plan["values"])
    assert [e.name for e in entries] == [tensor_name("key", i) for i in range(len(plan["keys"]))] + [
        tensor_name("value", i) for i in range(len(plan["values"]))
    ]
    assert layout.header.format_version == (FORMAT_VERSION if plan["version"] else None)


@PROPERTY
@given(payload_plans())
def test_spans_are_aligned_disjoint_in_order_and_inside(plan: dict) -> None:
    layout = _layout(plan)
    align = plan["align"]
    assert layout.data_start % align == 0
    pos = layout.data_start
    for entry, span in zip(layout.header.tensors, layout.spans):
        if isinstance(entry, AbsentTensor):
            assert span is None
            continue
        start, nbytes = span
        assert nbytes == entry.nbytes == TensorSpec(entry.name, entry.layer, entry.dtype, entry.shape).nbytes
        assert start == layout.data_start + entry.offset
        assert start >= pos  # packed in order, never overlapping
        if nbytes:
            assert start % align == 0
            assert start - pos < align  # no more padding than alignment needs
        pos = start + nbytes
    assert layout.total_nbytes == pos
    gap_bytes = sum(stop - start for start, stop in layout.gaps())
    assert gap_bytes + sum(s[1] for s in layout.spans if s) == layout.total_nbytes - layout.data_start


@PROPERTY
@given(payload_plans())
def test_align_1_without_extensions_is_the_reference_layout(plan: dict) -> None:
    plan = {**plan, "align": 1, "version": False, "checksums": None}
    layout = _layout(plan)
    body = layout.header_bytes[4:]
    obj = json.loads(body)
    assert list(obj) == ["rid", "bids", "meta", "td", "nl"]
    assert body == json.dumps(obj, separators=(",", ":")).encode()  # compact, ASCII, no padding
    offset = 0
    for desc in obj["td"]:
        if desc.get("x"):
            assert desc == {"n": desc["n"], "x": True}
            continue
        assert list(desc) == ["n", "i", "d", "s", "o", "b"]
        assert desc["o"] == offset  # back to back
        offset += desc["b"]


# ---------------------------------------------------------------------------- golden vectors
def _golden(header: str, data: bytes) -> bytes:
    raw = header.encode("utf-8")
    return struct.pack(">I", len(raw)) + raw + data


GOLDEN_HEADER = (
    '{"rid":"req-0","bids":[3,7],"meta":{"block_size":2,"num_layers":2,"dtype":"float16",'
    '"seq_len":3,"note":"\\u00e9"},"td":[{"n":"key_cache_0","i":0,"d":"float16","s":[3,1,2],'
    '"o":0,"b":12},{"n":"key_cache_1","x":true},{"n":"value_cache_0","i":0,"d":"float16",'
    '"s":[3,1,2],"o":12,"b":12},{"n":"value_cache_1","x":true}],"nl":2}'
)
GOLDEN = _golden(GOLDEN_HEADER, bytes(range(24)))


def test_reference_golden_vector_decodes() -> None:
    decoded = decode_header(GOLDEN)
    h = decoded.header
    assert h.request_id == "req-0" and h.block_ids == (3, 7) and h.num_layers == 2
    assert h.metadata == {"block_size": 2, "num_layers": 2, "dtype": "float16", "seq_len": 3, "note": "é"}
    assert h.format_version is None and h.checksum_algorithm is None
    assert h.tensors == (
        TensorDescriptor("key_cache_0", 0, "float16", (3, 1, 2), 0, 12),
        AbsentTensor("key_cache_1"),
        TensorDescriptor("value_cache_0", 0, "float16", (3, 1, 2), 12, 12),
        AbsentTensor("value_cache_1"),
    )
    assert decoded.data_start == 4 + len(GOLDEN_HEADER)
    assert decoded.spans == ((decoded.data_start, 12), None, (decoded.data_start + 12, 12), None)


def test_plan_reproduces_the_golden_vector_byte_for_byte() -> None:
    num_layers, specs = kv_tensor_specs([("float16", (3, 1, 2)), None], [("float16", (3, 1, 2)), None])
    meta = {"block_size": 2, "num_layers": 2, "dtype": "float16", "seq_len": 3, "note": "é"}
    layout = plan_layout("req-0", [3, 7], meta, num_layers, specs, align=1, version=False)
    assert layout.header_bytes + bytes(range(24)) == GOLDEN
    assert layout.total_nbytes == len(GOLDEN)


def test_older_reference_descriptors_without_layer_index_decode() -> None:
    header = (
        '{"rid":"r","bids":[0],"meta":{},"td":[{"n":"key_cache_1","d":"int8","s":[2],"o":0,"b":2},'
        '{"n":"key_cache_0","x":true},{"n":"value_cache_1","d":"int8","s":[2],"o":2,"b":2}],"nl":2}'
    )
    h = decode_header(_golden(header, b"abcd")).header
    assert [(t.name, t.layer) for t in h.present] == [("key_cache_1", 1), ("value_cache_1", 1)]


def test_unknown_keys_are_ignored_and_raw_utf8_is_accepted() -> None:
    header = '{"zz":[1,{"a":2}],"rid":"ü","bids":[],"meta":{"x":NaN},"td":[],"nl":0,"extra":true}'
    h = decode_header(_golden(header, b"")).header
    assert h.request_id == "ü" and h.tensors == ()


# ------------------------------------------------------------------------ malformed headers
VALID_DESC = {"n": "key_cache_0", "i": 0, "d": "int8", "s": [4], "o": 0, "b": 4}


def _with(desc: dict | None = None, **top) -> bytes:
    obj = {"rid": "r", "bids": [1], "meta": {}, "td": [desc or VALID_DESC], "nl": 1}
    obj.update(top)
    obj = {k: v for k, v in obj.items() if v is not _DROP}
    return _golden(json.dumps(obj), b"\x00" * 8)


_DROP = object()
BAD_CASES = {
    "missing rid": (_with(rid=_DROP), "rid", None),
    "rid not str": (_with(rid=5), "rid", None),
    "bids not list": (_with(bids="1"), "bids", None),
    "bids with str": (_with(bids=[1, "2"]), "bids", None),
    "bids with bool": (_with(bids=[True]), "bids", None),
    "meta list": (_with(meta=[]), "meta", None),
    "nl missing": (_with(nl=_DROP), "nl", None),
    "nl negative": (_with(nl=-1), "nl", None),
    "nl float": (_with(nl=1.0), "nl", None),
    "nl huge": (_with(nl=10**12), "nl", None),
    "td not list": (_with(td={}), "td", None),
    "descriptor not object": (_with(td=[3]), "descriptor", None),
    "name missing": (_with({**VALID_DESC, "n": None}), "name", None),
    "x not bool": (_with({"n": "key_cache_0", "x": 1}), "absent flag", "key_cache_0"),
    "dtype unknown": (_with({**VALID_DESC, "d": "object"}), "dtype", "key_cache_0"),
    "dtype not str": (_with({**VALID_DESC, "d": 1}), "dtype", "key_cache_0"),
    "shape mismatch": (_with({**VALID_DESC, "s": [5]}), "bytes", "key_cache_0"),
    "shape negative": (_with({**VALID_DESC, "s": [-4]}), "shape", "key_cache_0"),
    "shape not list": (_with({**VALID_DESC, "s": 4}), "shape", "key_cache_0"),
    "shape too many dims": (_with({**VALID_DESC, "s": [1] * 65}), "shape", "key_cache_0"),
    "offset negative": (_with({**VALID_DESC, "o": -1}), "offset", "key_cache_0"),
    "offset huge": (_with({**VALID_DESC, "o": 2**64}), "offset", "key_cache_0"),
    "span outside": (_with({**VALID_DESC, "o": 6}), "tensor span", "key_cache_0"),
    "span huge": (_with({**VALID_DESC, "s": [2**40], "b": 2**40}), "tensor span", "key_cache_0"),
    "missing b": (_with({k: v for k, v in VALID_DESC.items() if k != "b"}), "'b'", "key_cache_0"),
    "layer outside": (_with({**VALID_DESC, "n": "key_cache_1", "i": 1}), "layer", "key_cache_1"),
    "no layer, bad name": (
        _with({k: v for k, v in VALID_DESC.items() if k != "i"} | {"n": "k_0"}),
        "Invalid KV tensor name",
        "k_0",
    ),
    "no layer, no suffix": (
        _with({k: v for k, v in VALID_DESC.items() if k != "i"} | {"n": "key_cache_x"}),
        "Invalid KV tensor name",
        "key_cache_x",
    ),
    "name not a cache": (_with({**VALID_DESC, "n": "other_0"}), "name", "other_0"),
    "layer bool": (_with({**VALID_DESC, "i": False}), "layer", "key_cache_0"),
    "duplicate tensor": (_with(td=[VALID_DESC, VALID_DESC]), "twice", "key_cache_0"),
    "version unknown": (_with(v=2), "version", None),
    "version float": (_with(v=1.0), "version", None),
    "checksum alg unknown": (_with(ck="md5"), "checksum", None),
    "checksum alg list": (_with(ck=[]), "checksum", None),
    "checksum without alg": (_with({**VALID_DESC, "c": "00000000"}), "checksum", "key_cache_0"),
    "alg without checksum": (_with(ck="crc32"), "checksum", "key_cache_0"),
    "checksum not hex": (_with({**VALID_DESC, "c": "XYZ"}, ck="crc32"), "hex", "key_cache_0"),
}


@pytest.mark.parametrize("case", sorted(BAD_CASES))
def test_each_malformed_header_raises_payload_error_with_reason(case: str) -> None:
    raw, reason, tensor = BAD_CASES[case]
    with pytest.raises(PayloadError) as info:
        decode_header(raw)
    message = str(info.value)
    assert reason in message
    if tensor is not None:
        assert repr(tensor) in message
    assert isinstance(info.value, ValueError)  # what callers of the reference catch


@pytest.mark.parametrize(
    "desc, nl, kind, layer",
    [
        ({**VALID_DESC, "i": 2}, 3, "key", 2),  # the name's suffix disagrees with i: i wins
        ({**VALID_DESC, "n": "key_cache_extra_suffix"}, 1, "key", 0),  # the name gives the role only
        ({**VALID_DESC, "n": "value_cache_+7"}, 1, "value", 0),
    ],
)
def test_layer_comes_from_i_and_role_from_the_name_prefix(desc: dict, nl: int, kind: str, layer: int) -> None:
    """As the reference decodes a descriptor: ``i`` is the layer, the prefix key/value."""
    [entry] = decode_header(_with(desc, nl=nl)).header.tensors
    assert (entry.kind, entry.layer) == (kind, layer)


@pytest.mark.parametrize(
    "raw, reason",
    [
        (b"", "missing 4-byte"),
        (b"\x00\x00", "missing 4-byte"),
        (b"\x00\x00\x00\x10{}", "exceeds buffer"),
        (b"\x00\x00\x00\x02{}", "lacks"),
        (b"\x00\x00\x00\x02[]", "not a JSON object"),
        (b"\x00\x00\x00\x02\xff\xfe", "not UTF-8 JSON"),
        (b'\x00\x00\x00\x03{"a', "not UTF-8 JSON"),
        (b"\x00\x00\x00\x03\xef\xbb\xbf", "not UTF-8 JSON"),
        (struct.pack(">I", 20000) + b"[" * 20000, "not UTF-8 JSON"),  # recursion
        (struct.pack(">I", 5000) + b"9" * 5000, "not UTF-8 JSON"),  # int too long to parse
    ],
)
def test_framing_faults(raw: bytes, reason: str) -> None:
    with pytest.raises(PayloadError, match=reason):
        decode_header(raw)


def test_non_buffer_input_is_a_payload_error() -> None:
    with pytest.raises(PayloadError):
        decode_header(12345)
    with pytest.raises(PayloadError):
        decode_header(GOLDEN, total_len=3)


# --------------------------------------------------------------------------------- limits
def test_length_lies_fail_fast_without_allocating() -> None:
    claims_4gib = struct.pack(">I", 0xFFFFFFFF) + b"{" * 96
    started = time.perf_counter()
    for _ in range(1000):
        with pytest.raises(PayloadError, match="exceeds the limit"):
            decode_header(claims_4gib)
    assert time.perf_counter() - started < 2.0  # microseconds each, far from 4 GiB of work
    header = (
        '{"rid":"r","bids":[],"meta":{},"td":[{"n":"key_cache_0","i":0,"d":"float32",'
        '"s":[1073741824],"o":0,"b":4294967296}],"nl":1}'
    )
    with pytest.raises(PayloadError, match="tensor span"):
        decode_header(_golden(header, b"x" * 10))
    tracemalloc.start()
    try:
        for lie in (
            claims_4gib,
            _golden(header, b"x" * 10),
            _with(nl=2**40),
            _with({**VALID_DESC, "s": [2**62], "b": 2**62}),
        ):
            with pytest.raises(PayloadError):
                decode_header(lie)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 64 * 1024  # a few small objects, nothing sized by the claims


def test_limits_are_configurable() -> None:
    small = DecodeLimits(max_header_bytes=64)
    with pytest.raises(PayloadError, match="limit 64"):
        decode_header(GOLDEN, limits=small)
    with pytest.raises(PayloadError, match="limit 1"):
        decode_header(_with(td=[VALID_DESC, {"n": "value_cache_0", "x": True}]), limits=DecodeLimits(max_tensors=1))
    with pytest.raises(PayloadError, match="nl=1"):
        decode_header(_with(), limits=DecodeLimits(max_layers=0))


# ---------------------------------------------------------------------- local misuse / misc
def test_plan_rejects_local_misuse_with_config_error() -> None:
    n, specs = kv_tensor_specs([("int8", (2,))], [])
    for bad in (0, 3, -64, True, 1.0):
        with pytest.raises(ConfigError, match="align"):
            plan_layout("r", [], {}, n, specs, align=bad)
    with pytest.raises(ConfigError, match="checksum"):
        plan_layout("r", [], {}, n, specs, checksums="md5")
    with pytest.raises(ConfigError, match="JSON"):
        plan_layout("r", [], {"x": object()}, n, specs)
    with pytest.raises(ConfigError, match="metadata"):
        plan_layout("r", [], None, n, specs)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="layer"):
        plan_layout("r", [], {}, 0, specs)
    with pytest.raises(ConfigError, match="dtype"):
        TensorSpec("key_cache_0", 0, "float128", (1,))
    with pytest.raises(ConfigError, match="value layers"):
        kv_tensor_specs([], [("int8", (1,))])
    with pytest.raises(ConfigError):
        tensor_name("query", 0)
    with pytest.raises(ConfigError, match="TensorSpec"):
        plan_layout("r", [], {}, 1, [("int8", (1,))])
    with pytest.raises(ConfigError, match="checksums"):
        plan_layout("r", [], {}, n, specs).with_checksums([1])


def test_checksums_verify_and_name_the_tensor() -> None:
    n, specs = kv_tensor_specs([("uint8", (4,))], [("uint8", (0,))])
    data = b"abcd"
    layout = plan_layout("r", [], {}, n, specs, align=1, checksums="crc32")
    layout = layout.with_checksums([compute_checksum("crc32", data), compute_checksum("crc32", b"")])
    decoded = decode_header(layout.header_bytes + data)
    key, value = decoded.header.present
    verify_checksum(decoded.header, key, data)
    verify_checksum(decoded.header, value, memoryview(b""))
    assert compute_checksum("crc32", [b"ab", b"cd"]) == compute_checksum("crc32", data)
    with pytest.raises(PayloadError, match="key_cache_0.*mismatch"):
        verify_checksum(decoded.header, key, b"abce")
    plain = decode_header(plan_layout("r", [], {}, n, specs).header_bytes + bytes(64)).header
    verify_checksum(plain, plain.present[0], b"anything")  # nothing to verify: no-op


def test_values_are_frozen_and_kind_is_derived() -> None:
    desc = TensorDescriptor("value_cache_3", 3, "bfloat16", [2, 2], 0, 8)
    assert desc.kind == "value" and desc.shape == (2, 2)
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        desc.offset = 1  # type: ignore[misc]
