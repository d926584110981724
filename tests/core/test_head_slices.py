"""SPEC 2.4: head-slice plans in integers."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvferry.core.errors import RoutingError
from kvferry.core.head_slices import (
    TP_HEAD_SLICE_KEY,
    applied_head_slice,
    fan_out_slice,
    merge_order,
    plan_heads,
    sender_slices,
    slice_bounds,
    tp_head_slice_record,
)
from kvferry.core.topology import recv_rank_map

PROPERTY = settings(max_examples=150, deadline=None)


@st.composite
def valid_plans(draw: st.DrawFn) -> tuple[int, int, int]:
    smaller = draw(st.integers(1, 64))
    k = draw(st.integers(1, 64 // smaller))
    s, t = (smaller * k, smaller) if draw(st.booleans()) else (smaller, smaller * k)
    heads = max(s, t) * draw(st.integers(1, 8))
    return s, t, heads


def _sender_shard(s_tp: int, heads: int, rank: int) -> list[int]:
    width = heads // s_tp
    return list(range(rank * width, (rank + 1) * width))


@PROPERTY
@given(valid_plans())
def test_slice_then_merge_reproduces_every_receiver_shard(plan_args: tuple[int, int, int]) -> None:
    s, t, heads = plan_args
    # sender side: each sender cuts its shard (a list of head indices) per payload
    delivered: dict[tuple[int, int], list[int]] = {}
    for sender in range(s):
        shard = _sender_shard(s, heads, sender)
        for sl in sender_slices(s, t, heads, sender):
            start, stop = slice_bounds(len(shard), sl.offset_in_shard, sl.num_slices)
            assert (start, stop) == (sl.head_start, sl.head_stop)
            delivered[(sender, sl.target_rank)] = shard[start:stop]
    # receiver side: concatenate payloads in merge order
    seen: list[int] = []
    for plan in plan_heads(s, t, heads):
        merged = [h for src in merge_order(s, t, plan.target_rank) for h in delivered[(src, plan.target_rank)]]
        assert merged == list(range(plan.abs_head_start, plan.abs_head_stop))
        assert merged == list(range(plan.target_rank * heads // t, (plan.target_rank + 1) * heads // t))
        seen.extend(merged)
    assert sorted(seen) == list(range(heads))  # every head exactly once


@PROPERTY
@given(valid_plans())
def test_plan_is_consistent(plan_args: tuple[int, int, int]) -> None:
    s, t, heads = plan_args
    plans = plan_heads(s, t, heads)
    assert [p.target_rank for p in plans] == list(range(t))
    from_senders = {(sl.source_rank, sl.target_rank): sl for r in range(s) for sl in sender_slices(s, t, heads, r)}
    for plan in plans:
        assert plan.merge_order == recv_rank_map(s, t)[plan.target_rank]
        cursor = 0
        for sl in plan.slices:
            assert from_senders[(sl.source_rank, sl.target_rank)] == sl
            assert sl.recv_head_start == cursor
            assert sl.abs_head_start == plan.abs_head_start + cursor
            assert sl.abs_head_stop - sl.abs_head_start == sl.num_heads > 0
            assert sl.is_sliced is (s < t)
            cursor = sl.recv_head_stop
        assert cursor == heads // t
    assert len(from_senders) == max(s, t)


def test_golden_fan_out_2_to_4_with_8_heads() -> None:
    plans = plan_heads(2, 4, 8)
    assert [(p.abs_head_start, p.abs_head_stop, p.merge_order) for p in plans] == [
        (0, 2, (0,)),
        (2, 4, (0,)),
        (4, 6, (1,)),
        (6, 8, (1,)),
    ]
    sl = plans[3].slices[0]
    assert (sl.source_rank, sl.offset_in_shard, sl.num_slices, sl.head_start, sl.head_stop) == (1, 1, 2, 2, 4)
    assert fan_out_slice(2, 4, 3) == (1, 2)


def test_golden_fan_in_4_to_2_with_8_heads() -> None:
    plans = plan_heads(4, 2, 8)
    assert plans[1].merge_order == (2, 3)
    assert [(sl.head_start, sl.head_stop, sl.recv_head_start, sl.recv_head_stop) for sl in plans[1].slices] == [
        (0, 2, 0, 2),
        (0, 2, 2, 4),
    ]
    assert fan_out_slice(4, 2, 1) == (0, 1)
    assert fan_out_slice(2, 2, 1) == (0, 1)


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        ((8, 2, 3), "offset_in_shard"),
        ((8, 2, -1), "offset_in_shard"),
        ((8, 0, 0), "num_slices"),
        ((7, 2, 0), "divisible"),
        ((-1, 1, 0), "shard_heads"),
    ],
)
def test_slice_bounds_errors(args: tuple, needle: str) -> None:
    shard, slices, offset = args
    with pytest.raises(RoutingError, match=needle):
        slice_bounds(shard, offset, slices)


@PROPERTY
@given(st.integers(1, 64), st.integers(1, 64), st.data())
def test_slice_bounds_tile_the_shard(width: int, slices: int, data: st.DataObject) -> None:
    heads = width * slices
    bounds = [slice_bounds(heads, i, slices) for i in range(slices)]
    assert bounds[0][0] == 0 and bounds[-1][1] == heads
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
    bad = data.draw(st.integers(1, 64).filter(lambda n: heads % n != 0) if heads > 1 else st.just(None))
    if bad is not None and bad > 0:
        with pytest.raises(RoutingError, match="divisible"):
            slice_bounds(heads, 0, bad)


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        ((2, 4, 6), "num_heads 6 neither divides nor is divisible by target_tp 4"),
        ((4, 2, 3), "num_heads 3 neither divides nor is divisible by source_tp 4"),
        ((2, 3, 6), "divisible"),
        ((2, 4, 0), "num_heads"),
    ],
)
def test_plan_errors(args: tuple, needle: str) -> None:
    with pytest.raises(RoutingError, match=needle):
        plan_heads(*args)


def test_rank_errors() -> None:
    with pytest.raises(RoutingError, match="target_rank"):
        merge_order(4, 2, 2)
    with pytest.raises(RoutingError, match="target_rank"):
        fan_out_slice(2, 4, 4)
    with pytest.raises(RoutingError, match="source_rank"):
        sender_slices(2, 4, 8, 2)


def test_tag_record() -> None:
    record = tp_head_slice_record("sender", 1, 3, 2, 4, 1, 2)
    assert record == {
        "applied": True,
        "side": "sender",
        "target_rank": 3,
        "source_rank": 1,
        "from_tp": 2,
        "to_tp": 4,
        "offset_in_shard": 1,
        "num_slices": 2,
    }
    assert json.loads(json.dumps(record)) == record
    assert applied_head_slice({TP_HEAD_SLICE_KEY: record}) == record
    assert tp_head_slice_record("receiver", 0, 0, 1, 2, 0, 2)["side"] == "receiver"


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (("both", 0, 0, 1, 2, 0, 2), "side"),
        (("sender", 0, 0, 1, 2, 2, 2), "offset_in_shard"),
        (("sender", 0, 0, 1, 2, 0, 0), "num_slices"),
        (("sender", -1, 0, 1, 2, 0, 2), "source_rank"),
        (("sender", 0, 0, 0, 2, 0, 2), "from_tp"),
    ],
)
def test_tag_record_errors(args: tuple, needle: str) -> None:
    with pytest.raises(RoutingError, match=needle):
        tp_head_slice_record(*args)


@pytest.mark.parametrize(
    "metadata",
    [
        None,
        [],
        {},
        {"tp_head_slice": None},
        {"tp_head_slice": "x"},
        {"tp_head_slice": {"applied": False}},
        {"tp_head_slice": {}},
    ],
)
def test_untagged_metadata(metadata: object) -> None:
    assert applied_head_slice(metadata) is None
