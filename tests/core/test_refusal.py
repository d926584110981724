"""The refusal record a marker carries (kvferry.core.refusal): round trip, bounds, and what is
not a refusal."""

from __future__ import annotations

import json

from hypothesis import given
from hypothesis import strategies as st

from kvferry.core.refusal import MAX_TEXT_CHARS, REFUSAL_KEY, Refusal

text = st.text(max_size=3 * MAX_TEXT_CHARS)


@given(st.text(min_size=1, max_size=40), text, text)
def test_the_record_round_trips_through_json(reason, detail, fix) -> None:
    refusal = Refusal(reason, detail, fix)
    meta = json.loads(json.dumps(refusal.metadata()))  # what a header carries
    assert Refusal.from_metadata(meta) == refusal
    assert all(len(x) <= MAX_TEXT_CHARS for x in (refusal.reason, refusal.detail, refusal.fix))
    assert refusal.detail == (detail if len(detail) <= MAX_TEXT_CHARS else detail[: MAX_TEXT_CHARS - 3] + "...")


@given(st.one_of(st.none(), st.integers(), st.text(), st.lists(st.integers()), st.dictionaries(st.text(), st.text())))
def test_anything_else_is_no_refusal(value) -> None:
    assert Refusal.from_metadata({REFUSAL_KEY: value}) is None or isinstance(value, dict)
    assert Refusal.from_metadata(value) is None or isinstance(value, dict)


def test_records_of_another_shape_are_no_refusal() -> None:
    good = Refusal("error", "d", "f").metadata()
    assert Refusal.from_metadata(good) == Refusal("error", "d", "f")
    for bad in (
        {REFUSAL_KEY: {**good[REFUSAL_KEY], "v": 2}},
        {REFUSAL_KEY: {**good[REFUSAL_KEY], "reason": ""}},
        {REFUSAL_KEY: {**good[REFUSAL_KEY], "detail": 7}},
        {"seq_len": 4},
        {},
    ):
        assert Refusal.from_metadata(bad) is None, bad


def test_describe_names_reason_detail_and_fix() -> None:
    assert Refusal("pool_full", "no room", "raise pool_bytes").describe() == "pool_full: no room; fix: raise pool_bytes"
    assert Refusal("no_blocks").describe() == "no_blocks"
