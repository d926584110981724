"""SPEC 2.1: TP topology and rank maps."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvferry.core.errors import RoutingError
from kvferry.core.topology import (
    TPTopology,
    rank_pairs,
    recv_rank_map,
    send_rank_map,
    source_ranks,
    target_ranks,
    validate_sizes,
    validate_topology,
)

PROPERTY = settings(max_examples=150, deadline=None)
MAX_TP = 64
ALL_VALID = [(s, t) for s in range(1, MAX_TP + 1) for t in range(1, MAX_TP + 1) if max(s, t) % min(s, t) == 0]
ALL_INVALID = [(s, t) for s in range(1, MAX_TP + 1) for t in range(1, MAX_TP + 1) if max(s, t) % min(s, t) != 0]


@st.composite
def valid_sizes(draw: st.DrawFn) -> tuple[int, int]:
    smaller = draw(st.integers(1, MAX_TP))
    k = draw(st.integers(1, MAX_TP // smaller))
    return (smaller * k, smaller) if draw(st.booleans()) else (smaller, smaller * k)


@st.composite
def invalid_sizes(draw: st.DrawFn) -> tuple[int, int]:
    return draw(st.sampled_from(ALL_INVALID))


def test_every_size_pair_in_bounds_is_classified() -> None:
    assert len(ALL_VALID) + len(ALL_INVALID) == MAX_TP * MAX_TP
    assert (2, 4) in ALL_VALID and (3, 2) in ALL_INVALID


@PROPERTY
@given(valid_sizes())
def test_send_maps_cover_every_receiver_once_per_pair(sizes: tuple[int, int]) -> None:
    s, t = sizes
    send = send_rank_map(s, t)
    assert sorted(send) == list(range(s))
    fed = [r for targets in send.values() for r in targets]
    assert set(fed) == set(range(t))
    pairs = rank_pairs(s, t)
    assert len(pairs) == len(set(pairs)) == max(s, t)


@PROPERTY
@given(valid_sizes())
def test_send_and_receive_maps_are_exact_inverses(sizes: tuple[int, int]) -> None:
    s, t = sizes
    send, recv = send_rank_map(s, t), recv_rank_map(s, t)
    assert sorted(recv) == list(range(t))
    from_send = {(a, b) for a, bs in send.items() for b in bs}
    from_recv = {(a, b) for b, as_ in recv.items() for a in as_}
    assert from_send == from_recv
    for receiver, senders in recv.items():
        assert list(senders) == sorted(senders)
        assert source_ranks(TPTopology(s, t, receiver)) == senders
    for sender, receivers in send.items():
        assert list(receivers) == sorted(receivers)
        assert target_ranks(TPTopology(s, t, sender)) == receivers


def test_rank_maps_exhaustive_up_to_64() -> None:
    for s, t in ALL_VALID:
        send, recv = send_rank_map(s, t), recv_rank_map(s, t)
        counts = [0] * t
        for sender, receivers in send.items():
            for r in receivers:
                counts[r] += 1
                assert sender in recv[r]
        # fan-out: each receiver read by one sender; fan-in: by k senders; pairs unique
        assert counts == [len(recv[r]) for r in range(t)]
        assert sum(counts) == max(s, t)


@PROPERTY
@given(valid_sizes(), st.data())
def test_formulas_from_the_spec(sizes: tuple[int, int], data: st.DataObject) -> None:
    s, t = sizes
    sender = data.draw(st.integers(0, s - 1))
    receiver = data.draw(st.integers(0, t - 1))
    if s == t:
        assert target_ranks(TPTopology(s, t, sender)) == (sender,)
        assert source_ranks(TPTopology(s, t, receiver)) == (receiver,)
    elif s > t:
        k = s // t
        assert target_ranks(TPTopology(s, t, sender)) == (sender // k,)
        assert source_ranks(TPTopology(s, t, receiver)) == tuple(range(receiver * k, receiver * k + k))
    else:
        k = t // s
        assert target_ranks(TPTopology(s, t, sender)) == tuple(range(sender * k, sender * k + k))
        assert source_ranks(TPTopology(s, t, receiver)) == (receiver // k,)


@PROPERTY
@given(invalid_sizes())
def test_non_divisible_sizes_raise_naming_both(sizes: tuple[int, int]) -> None:
    s, t = sizes
    topo = TPTopology(s, t, 0)  # building is fine; mapping is not
    for call in (
        lambda: validate_topology(topo),
        lambda: target_ranks(topo),
        lambda: source_ranks(topo),
        lambda: send_rank_map(s, t),
        lambda: recv_rank_map(s, t),
    ):
        with pytest.raises(RoutingError, match="divisible") as info:
            call()
        assert f"source_tp={s}" in str(info.value) and f"target_tp={t}" in str(info.value)


def test_routing_error_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="divisible"):
        validate_sizes(3, 2)


@pytest.mark.parametrize(
    ("args", "field"),
    [
        ((0, 1, 0), "source_tp"),
        ((-2, 1, 0), "source_tp"),
        ((1, 0, 0), "target_tp"),
        ((1, 1, -1), "local_rank"),
        ((True, 1, 0), "source_tp"),
        ((1.0, 1, 0), "source_tp"),
        ((1, "2", 0), "target_tp"),
    ],
)
def test_bad_topology_values_name_the_field(args: tuple, field: str) -> None:
    with pytest.raises(RoutingError, match=field):
        TPTopology(*args)


def test_properties() -> None:
    fan_in = TPTopology(4, 2, 0)
    fan_out = TPTopology(2, 8, 1)
    same = TPTopology(3, 3, 2)
    assert (fan_in.is_fan_in, fan_in.is_fan_out, fan_in.ratio, fan_in.is_heterogeneous) == (True, False, 2, True)
    assert (fan_out.is_fan_in, fan_out.is_fan_out, fan_out.ratio) == (False, True, 4)
    assert (same.is_heterogeneous, same.ratio, same.is_legacy) == (False, 1, False)
    assert TPTopology(1, 1, 0).is_legacy
    assert TPTopology(2, 3, 0).ratio == 1  # ratio is larger // smaller even when unmappable


def test_topology_is_a_frozen_value() -> None:
    topo = TPTopology(2, 4, 1)
    assert topo == TPTopology(2, 4, 1) and hash(topo) == hash(TPTopology(2, 4, 1))
    with pytest.raises(AttributeError):
        topo.local_rank = 0  # type: ignore[misc]


def test_rank_outside_its_stage_is_rejected() -> None:
    with pytest.raises(RoutingError, match="sender rank"):
        target_ranks(TPTopology(2, 4, 2))
    with pytest.raises(RoutingError, match="receiver rank"):
        source_ranks(TPTopology(4, 2, 2))
    # the same local rank is valid on the side that has it
    assert target_ranks(TPTopology(4, 2, 3)) == (1,)
    assert source_ranks(TPTopology(2, 4, 3)) == (1,)


def test_golden_maps() -> None:
    assert send_rank_map(2, 4) == {0: (0, 1), 1: (2, 3)}
    assert recv_rank_map(2, 4) == {0: (0,), 1: (0,), 2: (1,), 3: (1,)}
    assert send_rank_map(4, 2) == {0: (0,), 1: (0,), 2: (1,), 3: (1,)}
    assert recv_rank_map(4, 2) == {0: (0, 1), 1: (2, 3)}
    assert send_rank_map(1, 1) == {0: (0,)}
