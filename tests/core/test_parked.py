"""The parked-get table (core/parked.py): every waiter leaves exactly once, FIFO per key,
deadlines exact; checked against a plain list model over random programs."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvferry.core.errors import ConfigError
from kvferry.core.parked import MISS_REASONS, MissReason, ParkedTable

PROPERTY = settings(max_examples=300, deadline=None)
KEYS = ("a", "b", "c")

ops = st.lists(
    st.one_of(
        st.tuples(st.just("park"), st.sampled_from(KEYS), st.integers(1, 20)),
        st.tuples(st.just("serve"), st.sampled_from(KEYS), st.integers(0, 3)),
        st.tuples(st.just("tick"), st.integers(0, 10)),
        st.tuples(st.just("drain")),
    ),
    max_size=60,
)


@PROPERTY
@given(ops, st.one_of(st.none(), st.integers(1, 8)))
def test_property_table_matches_a_list_model(program: list[tuple], cap: int | None) -> None:
    table: ParkedTable[int] = ParkedTable(max_parked=cap)
    model: list[tuple[int, str, float]] = []  # (waiter id, key, deadline), in park order
    left: list[int] = []  # every waiter that left, in the order it left
    now, next_id = 0.0, 0
    for op in program:
        if op[0] == "park":
            _, key, wait = op
            parked = table.park(key, next_id, now, float(wait))
            if cap is not None and len(model) >= cap:
                assert parked is None
            else:
                assert parked is not None and parked.deadline == now + wait
                model.append((next_id, key, now + wait))
            next_id += 1
        elif op[0] == "serve":
            _, key, accept = op
            offered: list[int] = []

            def offer(waiter: int) -> bool:
                if len(offered) < accept:
                    offered.append(waiter)
                    return True
                return False

            timed_out = [p.waiter for p in table.serve(key, now, offer)]
            # expected: walk the key's waiters oldest first
            exp_served, exp_timed = [], []
            for waiter, k, deadline in list(model):
                if k != key:
                    continue
                if deadline <= now:
                    exp_timed.append(waiter)
                elif len(exp_served) < accept:
                    exp_served.append(waiter)
                else:
                    break
                model.remove((waiter, k, deadline))
            assert offered == exp_served and timed_out == exp_timed
            left += offered + timed_out
        elif op[0] == "tick":
            now += op[1]
            expired = table.expire(now)
            due = sorted((d, i) for i, _, d in model if d <= now)
            assert sorted((p.deadline, p.waiter) for p in expired) == due
            assert [p.deadline for p in expired] == sorted(p.deadline for p in expired)
            model = [m for m in model if m[2] > now]
            left += [p.waiter for p in expired]
        else:
            drained = table.drain()
            assert sorted(p.waiter for p in drained) == sorted(i for i, _, _ in model)
            left += [p.waiter for p in drained]
            model = []
        assert len(table) == len(model)
        assert table.next_deadline() == (min(d for _, _, d in model) if model else None)
        assert set(table.keys()) == {k for _, k, _ in model}
    # every waiter that was parked left at most once, and those still there never left
    assert len(left) == len(set(left))
    assert not set(left) & {i for i, _, _ in model}


def test_serve_stops_at_the_first_refusal_and_keeps_the_rest_in_order() -> None:
    table: ParkedTable[str] = ParkedTable()
    for name in ("first", "second", "third"):
        table.park("k", name, 0.0, 5.0)
    seen: list[str] = []
    assert table.serve("k", 1.0, lambda w: (seen.append(w), w == "first")[1]) == []
    assert seen == ["first", "second"]  # "second" was refused: it and "third" keep waiting
    assert len(table) == 2
    assert [p.waiter for p in table.serve("k", 6.0, lambda w: True)] == ["second", "third"]  # past deadline
    assert len(table) == 0 and table.next_deadline() is None


def test_expire_does_not_return_a_served_waiter() -> None:
    table: ParkedTable[str] = ParkedTable()
    table.park("k", "w", 0.0, 1.0)
    table.serve("k", 0.5, lambda w: True)
    assert table.expire(2.0) == [] and table.drain() == []


def test_bad_bounds_name_the_field() -> None:
    with pytest.raises(ConfigError, match="max_parked"):
        ParkedTable(max_parked=0)
    with pytest.raises(ConfigError, match="wait_s"):
        ParkedTable().park("k", 1, 0.0, float("inf"))


def test_the_miss_reasons_are_one_closed_set() -> None:
    assert MISS_REASONS == ("not_found", "expired", "timeout", "closing")
    assert {MissReason.NOT_FOUND, MissReason.EXPIRED, MissReason.TIMEOUT, MissReason.CLOSING} == set(MISS_REASONS)
