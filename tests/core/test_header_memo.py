"""SPEC 3.1 codec speed paths: each one must give exactly what the plain path gives.

- the piecewise header rendering == ``json.dumps`` of the field table's object;
- ``kv_layout_template`` (built directly) == ``plan_template(*kv_tensor_specs(...))``;
- the top-level JSON reader == ``json.loads`` (or it declines, and json.loads decides);
- the column-wise descriptor check == the per-descriptor check (or it declines);
- a decode that reuses a remembered ``td`` == a decode with nothing remembered, for valid and
  mutated headers alike (a float or a bool where an int was remembered is still refused);
- checksums written into the rendered header in place == the header rendered again with them;
  a ``td`` that differs from a remembered one only in its checksums is read from the memo with
  those checksums, exactly as a fresh decode reads it.
"""

from __future__ import annotations

import json
import random
import struct

import attrs
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from kvferry.core.errors import ConfigError, PayloadError
from kvferry.core.header import (
    DTYPE_ITEMSIZE,
    DecodeLimits,
    PayloadHeader,
    TensorDescriptor,
    _header_object,
    decode_header,
    encode_header,
    kv_layout_template,
    kv_tensor_specs,
    plan_layout,
    plan_template,
)
from kvferry.core.header import decode as header_decode
from kvferry.core.header import json_reader as header_json
from kvferry.core.header.values import _checked, checksum_slots

PROPERTY = settings(max_examples=100, deadline=None)
DTYPES = sorted(DTYPE_ITEMSIZE)
shapes = st.lists(st.integers(0, 6), max_size=4).map(tuple)
layer_specs = st.one_of(st.none(), st.tuples(st.sampled_from(DTYPES), shapes))
json_values = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(), st.text(max_size=6)),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=8,
)


@st.composite
def kv_plans(draw: st.DrawFn) -> dict:
    keys = draw(st.lists(layer_specs, max_size=12))
    return {
        "keys": keys,
        "values": draw(st.lists(layer_specs, max_size=len(keys))),
        "rid": draw(st.text(max_size=10)),
        "bids": draw(st.lists(st.integers(-(2**64), 2**64), max_size=8)),
        "meta": draw(st.dictionaries(st.text(max_size=6), json_values, max_size=4)),
        "align": draw(st.sampled_from([1, 2, 64, 4096])),
        "version": draw(st.booleans()),
        "checksums": draw(st.sampled_from([None, "crc32"])),
    }


def _options(plan: dict) -> dict:
    return {"align": plan["align"], "version": plan["version"], "checksums": plan["checksums"]}


def _payload(plan: dict) -> bytes:
    n, specs = kv_tensor_specs(plan["keys"], plan["values"])
    layout = plan_layout(plan["rid"], plan["bids"], plan["meta"], n, specs, **_options(plan))
    if plan["checksums"]:
        layout = layout.with_checksums([(7 * i + 3) & 0xFFFFFFFF for i in range(len(layout.header.present))])
    return layout.header_bytes + bytes(layout.total_nbytes - layout.data_start)


def _outcome(raw: bytes, limits: DecodeLimits = DecodeLimits()) -> object:
    try:
        return decode_header(raw, limits=limits)
    except PayloadError as exc:
        return ("PayloadError", str(exc))


def _fresh(raw: bytes, limits: DecodeLimits = DecodeLimits()) -> object:
    saved, header_json._memo = header_json._memo, ()
    try:
        return _outcome(raw, limits)
    finally:
        header_json._memo = saved


# ------------------------------------------------------------------------------- rendering
@PROPERTY
@given(kv_plans())
def test_rendering_equals_json_dumps_of_the_table_object(plan: dict) -> None:
    layout = plan_layout(
        plan["rid"], plan["bids"], plan["meta"], *kv_tensor_specs(plan["keys"], plan["values"]), **_options(plan)
    )
    header = layout.header
    expected = json.dumps(_header_object(header), separators=(",", ":")).encode()
    assert encode_header(header)[4:] == expected
    padded = layout._rendered
    assert padded[4:].rstrip(b" ") == expected and len(padded) % plan["align"] == 0


@PROPERTY
@given(kv_plans())
def test_direct_kv_template_equals_the_spec_template(plan: dict) -> None:
    direct = kv_layout_template(plan["keys"], plan["values"], **_options(plan))
    via_specs = plan_template(*kv_tensor_specs(plan["keys"], plan["values"]), **_options(plan))
    assert direct == via_specs
    assert direct.layout(plan["rid"], plan["bids"], plan["meta"]) == via_specs.layout(
        plan["rid"], plan["bids"], plan["meta"]
    )


def test_unusual_value_types_render_as_json_does() -> None:
    class Big(int):
        def __repr__(self) -> str:
            return "Big!"

    desc = TensorDescriptor("key_cache_0", 0, "int8", (Big(2),), Big(0), 2)
    header = PayloadHeader("r", [Big(5)], {"x": Big(1)}, Big(1), [desc])
    assert encode_header(header)[4:] == json.dumps(_header_object(header), separators=(",", ":")).encode()
    with pytest.raises(ConfigError):
        TensorDescriptor("key_cache_1", True, "int8", (1,), 0, 1)  # a bool is not a layer index
    kv_layout_template([("int8", (1,))], [])  # memoise (int8, (1,)) first
    with pytest.raises(ConfigError, match="shape"):
        kv_layout_template([("int8", (True,))], [])  # bools are not dimensions, memo or not
    with pytest.raises(ConfigError, match="align"):
        kv_layout_template([("int8", (1,))], [], align=True)


def test_templates_are_reused_for_a_repeated_signature() -> None:
    n, specs = kv_tensor_specs([("bfloat16", (7, 2, 4))] * 3, [("bfloat16", (7, 2, 4))] * 3)
    first = plan_template(n, specs)
    assert plan_template(*kv_tensor_specs([("bfloat16", (7, 2, 4))] * 3, [("bfloat16", (7, 2, 4))] * 3)) is first
    assert plan_template(n, list(specs)) == first  # a list is not memoised, same value
    assert plan_template(n, specs, align=8) is not first


# ----------------------------------------------------------------------- the JSON reader
json_texts = st.one_of(
    json_values.map(json.dumps),
    st.tuples(
        st.dictionaries(st.sampled_from(["rid", "td", "nl", "a"]), json_values, max_size=4),
        st.sampled_from([None, 0, 2]),
    ).map(lambda p: json.dumps(p[0], indent=p[1])),
    st.text(alphabet='{}[]":,. \t\n\r0123456789tdnulrfae\\', max_size=30),
)


@settings(max_examples=400, deadline=None)
@given(json_texts, st.sampled_from(["", " ", "\n\t", "\r "]))
def test_top_level_reader_agrees_with_json_loads(text: str, pad: str) -> None:
    text = pad + text + pad
    try:
        expected: object = json.loads(text)
    except (ValueError, RecursionError):
        expected = "refused"
    saved, header_json._memo = header_json._memo, ()  # nothing remembered: td comes back parsed
    try:
        found = header_json._read_object(text, DecodeLimits())
    except (StopIteration, ValueError, RecursionError):
        found = None
    finally:
        header_json._memo = saved
    if found is not None:
        assert expected != "refused" and found[0] == expected and type(expected) is dict
        assert json.dumps(found[0]) == json.dumps(expected)  # same types too (1 vs 1.0 vs true)
        if "td" in expected:  # the raw text of the (last) td value, which parses to it
            assert found[1] in text and json.dumps(json.loads(found[1])) == json.dumps(expected["td"])
        else:
            assert found[1] is None


def test_top_level_reader_edge_cases() -> None:
    saved, header_json._memo = header_json._memo, ()
    try:
        for text in ('{"a":1,"a":2}', ' { "td" : [ ] , "x" : { } } ', "{}", '{"td":[],"td":[1]}'):
            obj, _ = header_json._read_object(text, DecodeLimits())
            assert obj == json.loads(text)
    finally:
        header_json._memo = saved
    for text in ('{"a":1,}', '{"a" 1}', "{'a':1}", '{"a":1}}', '{"a":1} x', "", "[]", '{"a":01}', "\ufeff{}"):
        assert header_json._read_object(text, DecodeLimits()) is None


# ------------------------------------------------------------------- column-wise descriptors
@PROPERTY
@given(kv_plans(), st.data())
def test_column_check_agrees_with_the_per_descriptor_check(plan: dict, data: st.DataObject) -> None:
    td = json.loads(kv_layout_template(plan["keys"], plan["values"], **_options(plan)).td_text)
    for _ in range(data.draw(st.integers(0, 2))):
        if not td:
            break
        target = td[data.draw(st.integers(0, len(td) - 1))]
        key = data.draw(st.sampled_from(["n", "i", "d", "s", "o", "b", "c", "x", "zz"]))
        if data.draw(st.booleans()) and key in target:
            del target[key]
        else:
            target[key] = data.draw(json_values | st.sampled_from([1.0, True, -1, 2**63, "key_cache_0", [1.0]]))
    limits = DecodeLimits(max_ndim=data.draw(st.sampled_from([1, 64])))
    bulk = header_decode._bulk_descriptors(td, limits)
    try:
        plain: object = _checked([header_decode._dec_descriptor(item, limits) for item in td])
    except PayloadError:
        plain = "refused"
    if bulk is not None:
        assert plain != "refused" and tuple(bulk) == tuple(plain)
        assert (bulk.min_layers, bulk.checksummed, bulk.rel_spans, bulk.data_end) == (
            plain.min_layers,
            plain.checksummed,
            plain.rel_spans,
            plain.data_end,
        )


GOOD = {"n": "key_cache_1", "i": 1, "d": "int16", "s": [2, 3], "o": 64, "b": 12}
COLUMN_FAULTS = {
    "float dim": {"s": [2.0, 3]},
    "bool dim": {"s": [True, 12]},
    "negative dim": {"s": [-2, -3]},
    "float offset": {"o": 64.0},
    "bool layer": {"i": True},
    "negative layer": {"i": -1},
    "huge offset": {"o": 2**63},
    "unknown dtype": {"d": "float128"},
    "dtype not str": {"d": 2},
    "name/layer disagree": {"i": 0},
    "name not a cache": {"n": "key_cache_x"},
    "long name": {"n": "key_cache_0000000001"},
    "nbytes mismatch": {"b": 13},
    "shape not list": {"s": 6},
    "too many dims": {"s": [1] * 65 + [6], "b": 12},
    "checksum upper": {"c": "ABCDEF01"},
    "checksum int": {"c": 1},
    "absent flag": {"x": False},
    "null checksum": {"c": None},
}


@pytest.mark.parametrize("fault", sorted(COLUMN_FAULTS))
def test_column_check_declines_every_fault(fault: str) -> None:
    other = {"n": "value_cache_1", "i": 1, "d": "int16", "s": [2, 3], "o": 0, "b": 12}
    td = [dict(GOOD, **COLUMN_FAULTS[fault]), dict(other)]
    if "c" in COLUMN_FAULTS[fault]:
        td[1]["c"] = "0000abcd"
    assert header_decode._bulk_descriptors(td, DecodeLimits()) is None
    assert header_decode._bulk_descriptors([GOOD, other], DecodeLimits()) is not None
    assert header_decode._bulk_descriptors([GOOD, dict(other, n="key_cache_1")], DecodeLimits()) is None  # twice


def test_column_check_takes_a_plain_model_layout() -> None:
    tpl = kv_layout_template([("bfloat16", (9, 2, 4))] * 4, [("bfloat16", (9, 2, 4))] * 4, checksums="crc32")
    td = json.loads(tpl.td_text)
    assert tuple(header_decode._bulk_descriptors(td, DecodeLimits())) == tpl.entries


# ------------------------------------------------------------------- remembered td texts
@PROPERTY
@given(kv_plans(), st.data())
def test_a_remembered_td_decodes_exactly_as_a_fresh_one(plan: dict, data: st.DataObject) -> None:
    raw = _payload(plan)
    assert _outcome(raw) == _fresh(raw)  # primes the memo with this td
    header_len = struct.unpack(">I", raw[:4])[0]
    for _ in range(6):
        mutated = bytearray(raw)
        pos = data.draw(st.integers(0, max(4, 4 + header_len - 1)))
        if pos < len(mutated):
            mutated[pos] = data.draw(
                st.sampled_from([ord("0"), ord("1"), ord("."), ord("e"), ord(" "), ord("t"), 0x7F])
            )
        limits = data.draw(st.sampled_from([DecodeLimits(), DecodeLimits(max_ndim=1), DecodeLimits(max_tensors=1)]))
        assert _outcome(bytes(mutated), limits) == _fresh(bytes(mutated), limits)


def test_a_float_or_bool_where_an_int_was_remembered_is_refused() -> None:
    n, specs = kv_tensor_specs([("int8", (4,))], [("int8", (4,))])
    raw = plan_layout("r", [1], {}, n, specs, align=1).header_bytes + bytes(8)
    decode_header(raw)  # remember this td
    obj = json.loads(raw[4:-8])
    for key, bad in (("o", 0.0), ("b", 4.0), ("i", False), ("s", [4.0]), ("s", [True])):
        desc = dict(obj["td"][0], **{key: bad})
        body = json.dumps({**obj, "td": [desc, obj["td"][1]]}, separators=(",", ":")).encode()
        with pytest.raises(PayloadError):
            decode_header(struct.pack(">I", len(body)) + body + bytes(8))


def test_a_repeated_layout_reuses_its_validated_descriptors() -> None:
    n, specs = kv_tensor_specs([("bfloat16", (5, 2, 4))] * 3, [("bfloat16", (5, 2, 4))] * 3)
    a = plan_layout("req-a", [1, 2], {"s": 1}, n, specs)
    b = plan_layout("req-bb", [3], {"s": 2}, n, specs)
    da = decode_header(a.header_bytes, total_len=a.total_nbytes)
    db = decode_header(b.header_bytes, total_len=b.total_nbytes)
    assert db.header.tensors is da.header.tensors  # no second validation
    assert db.header.request_id == "req-bb" and db.spans == b.spans and da.spans == a.spans
    with pytest.raises(PayloadError, match="tensor span"):  # spans are still checked per payload
        decode_header(b.header_bytes, total_len=b.total_nbytes - 1)


def test_the_memo_is_bounded() -> None:
    rng = random.Random(3)
    for i in range(40):
        n, specs = kv_tensor_specs([("int8", (i + 1,))], [])
        decode_header(plan_layout("r", [], {}, n, specs, align=1).header_bytes + bytes(i + 1))
    assert len(header_json._memo) <= header_json._MEMO_SIZE
    big = [("int8", (rng.randrange(1, 9),))] * 3000  # a td text over the memo's size limit
    n, specs = kv_tensor_specs(big, [])
    layout = plan_layout("r", [], {}, n, specs, align=1)
    decode_header(layout.header_bytes, total_len=layout.total_nbytes)
    assert all(len(m.raw) <= header_json._MEMO_MAX_TEXT for m in header_json._memo)


# ------------------------------------------------------------------- checksums in place
def _checksummed_layout(plan: dict) -> object:
    n, specs = kv_tensor_specs(plan["keys"], plan["values"])
    return plan_layout(plan["rid"], plan["bids"], plan["meta"], n, specs, **{**_options(plan), "checksums": "crc32"})


u32s = st.lists(st.integers(0, 2**40), min_size=24, max_size=24)  # > u32: the layout keeps the low 32 bits


@PROPERTY
@given(kv_plans(), u32s)
def test_checksums_written_in_place_equal_the_header_rendered_again(plan: dict, values: list[int]) -> None:
    layout = _checksummed_layout(plan)
    present = len(layout.header.present)
    values = values[:present]
    assert (layout._ck_at is not None) == (present > 0)  # every rendered template header has its slots
    fast = layout.with_checksums(values)
    again = attrs.evolve(layout, ck_at=None).with_checksums(values)  # the header rendered from scratch
    assert fast.header_bytes == again.header_bytes and fast.header == again.header and fast == again
    assert [t.checksum for t in fast.header.present] == [v & 0xFFFFFFFF for v in values]
    # compared as rendered: a NaN in the metadata (JSON allows it) is not equal to itself, and the
    # decoder's NaN is json's own object, not the one the header was made with
    decoded = decode_header(fast.header_bytes, total_len=fast.total_nbytes).header
    assert encode_header(decoded) == encode_header(fast.header)


@PROPERTY
@given(kv_plans(), u32s, st.data())
def test_a_td_differing_only_in_checksums_is_read_from_the_memo(plan: dict, values: list[int], data) -> None:
    layout = _checksummed_layout(plan)
    present = len(layout.header.present)
    assume(present > 0)
    first = layout.with_checksums([1] * present)
    second = layout.with_checksums(values[:present])
    saved, header_json._memo = header_json._memo, ()
    try:
        decode_header(first.header_bytes, total_len=first.total_nbytes)  # remembers its td
        remembered = header_json._memo
        got = decode_header(second.header_bytes, total_len=second.total_nbytes)
        assert header_json._memo is remembered  # read from the memo: nothing parsed or remembered
        assert got == _fresh(second.header_bytes + bytes(second.total_nbytes - second.data_start))
        assert [t.checksum for t in got.header.present] == [v & 0xFFFFFFFF for v in values[:present]]
        # a checksum the decoder refuses (not 8 lowercase hex digits) is not taken from the memo
        at = data.draw(st.sampled_from(second._ck_at)) + data.draw(st.integers(0, 7))
        for bad in (b"A", b"g", b'"'):
            raw = bytearray(second.header_bytes + bytes(second.total_nbytes - second.data_start))
            raw[at : at + 1] = bad
            outcome = _outcome(bytes(raw))
            assert outcome == _fresh(bytes(raw)) and isinstance(outcome, tuple)  # refused, as fresh
    finally:
        header_json._memo = saved


def test_checksum_slots_are_found_only_in_the_encoders_form() -> None:
    tpl = kv_layout_template([("int8", (4,)), None], [("int8", (4,))], checksums="crc32")
    slots = checksum_slots(tpl.td_text, tpl.entries)
    assert slots is not None and [tpl.td_text[s : s + 8] for s in slots] == ["00000000"] * 2
    spaced = json.dumps(json.loads(tpl.td_text))  # the same descriptors, other whitespace
    assert checksum_slots(spaced, tpl.entries) is None
    assert checksum_slots(tpl.td_text.replace('"x":true', '"x":true,"c":"00000000"'), tpl.entries) is None
    plain = kv_layout_template([("int8", (4,))], [("int8", (4,))])
    assert checksum_slots(plain.td_text, plain.entries) is None and plain.ck_slots is None
