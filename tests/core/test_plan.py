"""The whole-stage transfer plan agrees with itself: keys, ports and heads line up."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvferry.core.addressing import kv_port
from kvferry.core.errors import RoutingError
from kvferry.core.plan import RECEIVER, SENDER, stage_plan, to_json_records

PROPERTY = settings(max_examples=100, deadline=None)


@st.composite
def plan_inputs(draw: st.DrawFn) -> dict:
    smaller = draw(st.integers(1, 16))
    k = draw(st.integers(1, 16 // smaller))
    s, t = (smaller * k, smaller) if draw(st.booleans()) else (smaller, smaller * k)
    return {
        "from_stage": draw(st.integers(0, 15)),
        "to_stage": draw(st.one_of(st.integers(0, 15), st.sampled_from(["dit", "7"]))),
        "from_tp": s,
        "to_tp": t,
        # any head count that fits both sizes: below them too (replicated heads)
        "num_heads": draw(
            st.one_of(
                st.none(),
                st.sampled_from([h for h in range(1, 65) if all(h % tp == 0 or tp % h == 0 for tp in (s, t))]),
            )
        ),
        "base_port": draw(st.integers(1024, 40000)),
        "replica": draw(st.integers(0, 3)),
        "dp_rank": draw(st.integers(0, 64 // s - 1)),
        "request_id": draw(st.text(min_size=1, max_size=12)),
    }


@PROPERTY
@given(plan_inputs())
def test_plan_is_self_consistent(args: dict) -> None:
    plans = stage_plan(
        args["from_stage"],
        args["to_stage"],
        args["from_tp"],
        args["to_tp"],
        num_heads=args["num_heads"],
        base_port=args["base_port"],
        replica=args["replica"],
        dp_rank=args["dp_rank"],
        request_id=args["request_id"],
    )
    senders = [p for p in plans if p.role == SENDER]
    receivers = [p for p in plans if p.role == RECEIVER]
    assert [p.tp_rank for p in senders] == list(range(args["from_tp"]))
    assert [p.tp_rank for p in receivers] == list(range(args["to_tp"]))
    # who puts each key, on which port
    put_by = {}
    for p in senders:
        assert p.port == kv_port(
            args["base_port"], args["from_stage"], p.tp_rank, args["replica"], args["dp_rank"], args["from_tp"]
        )
        for route in p.routes:
            assert route.key not in put_by
            put_by[route.key] = p
    got = [route for p in receivers for route in p.routes]
    assert sorted(put_by) == sorted(r.key for r in got)
    for p in receivers:
        for route in p.routes:
            sender = put_by[route.key]
            assert route.port == sender.port  # receivers pull where the sender binds
            if route.peer_rank is not None:
                assert route.peer_rank == sender.tp_rank
                assert p.tp_rank in [r.peer_rank for r in sender.routes]
    assert len({p.port for p in senders}) == len(senders)
    if args["num_heads"] is not None:
        delivered = sorted(
            {h for p in receivers for r in p.routes for h in range(r.heads.abs_head_start, r.heads.abs_head_stop)}
        )
        assert delivered == list(range(args["num_heads"]))  # replicated receivers share heads
        for p in receivers:
            assert [h for r in p.routes for h in range(r.heads.abs_head_start, r.heads.abs_head_stop)] == list(
                range(p.head_start, p.head_stop)
            )
    records = to_json_records(plans)
    assert json.loads(json.dumps(records)) == records
    assert len(records) == args["from_tp"] + args["to_tp"]


def test_golden_plan_2_to_4() -> None:
    records = to_json_records(stage_plan(0, 1, 2, 4, num_heads=8, base_port=50051, request_id="req-7"))
    assert records[1] == {
        "role": "sender",
        "stage": "0",
        "tp_rank": 1,
        "tp_size": 2,
        "replica": 0,
        "dp_rank": 0,
        "port": 50167,
        "heads": [4, 8],
        "keys": [
            {
                "key": "req-7_0_0_1_2",
                "to_rank": 2,
                "port": 50167,
                "heads": [4, 6],
                "shard_heads": [0, 2],
                "offset_in_shard": 0,
                "num_slices": 2,
            },
            {
                "key": "req-7_0_0_1_3",
                "to_rank": 3,
                "port": 50167,
                "heads": [6, 8],
                "shard_heads": [2, 4],
                "offset_in_shard": 1,
                "num_slices": 2,
            },
        ],
    }
    assert records[5] == {
        "role": "receiver",
        "stage": "1",
        "tp_rank": 3,
        "tp_size": 4,
        "replica": 0,
        "dp_rank": 0,
        "port": None,
        "heads": [6, 8],
        "merge_order": [1],
        "keys": [
            {
                "key": "req-7_0_0_1_3",
                "from_rank": 1,
                "port": 50167,
                "heads": [6, 8],
                "shard_heads": [2, 4],
                "offset_in_shard": 1,
                "num_slices": 2,
            },
        ],
    }


def test_golden_plan_legacy() -> None:
    records = to_json_records(stage_plan(0, 1, 1, 1, base_port=50051, request_id="r"))
    assert [r["keys"] for r in records] == [
        [{"key": "omni_0_to_1_kv_cache_r", "to_rank": 0, "port": 50151}],
        [{"key": "omni_0_to_1_kv_cache_r", "from_rank": None, "port": 50151}],
    ]
    assert records[1]["merge_order"] == [None]


def test_fan_in_merge_order() -> None:
    plans = stage_plan(2, 3, 4, 2, num_heads=8, base_port=50051, replica=1, request_id="x")
    receiver = plans[5]
    assert receiver.merge_order == (2, 3)
    assert [r.port for r in receiver.routes] == [50051 + 100 + 1024 + 32 + 2, 50051 + 100 + 1024 + 48 + 2]


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"from_tp": 3, "to_tp": 2}, "divisible"),
        ({"from_stage": 16}, "from_stage"),
        ({"num_heads": 6}, "num_heads"),
        ({"replica": -1}, "replica"),
        ({"dp_rank": 40}, "dp_rank"),
        ({"base_port": 65500}, "port"),
    ],
)
def test_plan_errors(kwargs: dict, needle: str) -> None:
    args = {
        "from_stage": 0,
        "to_stage": 1,
        "from_tp": 2,
        "to_tp": 4,
        "num_heads": 8,
        "base_port": 50051,
        "request_id": "r",
        **kwargs,
    }
    frm, to, s, t = args.pop("from_stage"), args.pop("to_stage"), args.pop("from_tp"), args.pop("to_tp")
    with pytest.raises(RoutingError, match=needle):
        stage_plan(frm, to, s, t, **args)
