"""Routing of KV heads between TP stages of real models: replicated heads and MLA latents."""

from __future__ import annotations

import itertools
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvferry.core.errors import RoutingError
from kvferry.core.head_slices import fan_out_slice, merge_order
from kvferry.core.routing import (
    check_head_count,
    latent_source,
    rank_heads,
    reference_routing,
    route_heads,
    route_latent,
)
from kvferry.core.topology import rank_pairs, recv_rank_map, send_rank_map

TP_SIZES = (1, 2, 4, 8, 16)
PROPERTY = settings(max_examples=400, deadline=None)


def _fits(heads: int, tp: int) -> bool:
    return heads % tp == 0 or tp % heads == 0


def _holds(tp: int, heads: int, rank: int) -> list[int]:
    """What the engine gives a rank, written out independently of the code under test."""
    if tp <= heads:
        return list(range(rank * heads // tp, (rank + 1) * heads // tp))
    return [rank * heads // tp]


def _check_routing(s: int, t: int, heads: int) -> None:
    routing = route_heads(s, t, heads)
    # nothing twice: one payload per pair
    pairs = [(x.source_rank, x.target_rank) for x in routing.slices]
    assert len(pairs) == len(set(pairs))
    # senders' view and receivers' view agree
    sent = {(src, x.target_rank) for src in range(s) for x in routing.sends(src)}
    read = {(x.source_rank, dst) for dst in range(t) for x in routing.reads(dst)}
    assert sent == read == set(pairs)
    for dst in range(t):
        got: list[int] = []
        for x in routing.reads(dst):
            shard = _holds(s, heads, x.source_rank)
            part = shard[x.head_start : x.head_stop]
            # the sender holds what it sends; the slice is one of num_slices equal parts
            assert part == list(range(x.abs_head_start, x.abs_head_stop))
            width = x.head_stop - x.head_start
            assert len(shard) == width * x.num_slices
            assert x.head_start == width * x.offset_in_shard
            assert x.recv_head_start == len(got) and x.recv_head_stop == len(got) + width
            got.extend(part)
        # every receiver gets exactly its heads, each once
        assert got == _holds(t, heads, dst)
    # replicas of one head share its receivers evenly: no idle replica while another serves twice
    for head in range(heads):
        replicas = [r for r in range(s) if head in _holds(s, heads, r)]
        load = Counter({r: 0 for r in replicas})
        for x in routing.slices:
            if x.abs_head_start <= head < x.abs_head_stop:
                load[x.source_rank] += 1
        assert set(load) == set(replicas)  # nobody outside the holders sends it
        assert not (max(load.values()) >= 2 and min(load.values()) == 0)
        assert max(load.values()) - min(load.values()) <= 1


MATRIX = [(h, s, t) for h in (1, 2, 4, 8) for s in (1, 2, 4, 8) for t in TP_SIZES if max(s, t) % min(s, t) == 0]


def test_the_issue_matrix_has_80_cases() -> None:
    assert len(MATRIX) == 80


@pytest.mark.parametrize(("heads", "s", "t"), MATRIX)
def test_every_case_of_the_matrix_routes(heads: int, s: int, t: int) -> None:
    _check_routing(s, t, heads)


@PROPERTY
@given(st.integers(1, 64), st.sampled_from(TP_SIZES), st.sampled_from(TP_SIZES))
def test_property_routes_exactly_when_heads_fit_both_sizes(heads: int, s: int, t: int) -> None:
    if _fits(heads, s) and _fits(heads, t):
        _check_routing(s, t, heads)
    else:
        with pytest.raises(RoutingError) as info:
            route_heads(s, t, heads)
        message = str(info.value)
        assert f"num_heads {heads}" in message
        assert f"source_tp={s}" in message and f"target_tp={t}" in message


@PROPERTY
@given(st.integers(1, 8), st.integers(0, 4), st.integers(0, 4), st.booleans())
def test_property_reference_cases_keep_the_reference_rank_map(mult: int, a: int, b: int, wide: bool) -> None:
    s, t = 2**a, 2**b
    heads = max(s, t) * mult  # divisible by the larger size: the reference's family
    routing = route_heads(s, t, heads)
    assert routing.pairs() == rank_pairs(s, t)
    for x in routing.slices:
        if s < t:  # fan-out: slice t % k of k
            k = t // s
            assert (x.offset_in_shard, x.num_slices) == (x.target_rank % k, k)
        else:
            assert (x.offset_in_shard, x.num_slices) == (0, 1)


def test_golden_vectors() -> None:
    # Qwen2.5-7B (4 KV heads), TP 2 -> TP 8: each head on two receivers, cut from its sender
    r = route_heads(2, 8, 4)
    assert [(x.source_rank, x.target_rank, x.abs_head_start, x.offset_in_shard, x.num_slices) for x in r.slices] == [
        (0, 0, 0, 0, 2), (0, 1, 0, 0, 2), (0, 2, 1, 1, 2), (0, 3, 1, 1, 2),
        (1, 4, 2, 0, 2), (1, 5, 2, 0, 2), (1, 6, 3, 1, 2), (1, 7, 3, 1, 2),
    ]  # fmt: skip
    # TP 8 -> TP 2 with 4 heads: sender s holds head s // 2; the first replica of each serves
    r = route_heads(8, 2, 4)
    assert [(x.source_rank, x.target_rank, x.abs_head_start, x.recv_head_start) for x in r.slices] == [
        (0, 0, 0, 0), (2, 0, 1, 1), (4, 1, 2, 0), (6, 1, 3, 1),
    ]  # fmt: skip
    assert r.sends(1) == () and r.sources(0) == (0, 2)
    # both sides replicated: 8 -> 16 at 4 heads, each sender replica serves two receivers
    r = route_heads(8, 16, 4)
    assert [r.sources(t)[0] for t in range(16)] == [t // 2 for t in range(16)]
    assert all(x.num_slices == 1 for x in r.slices)
    # 16 -> 8 at 4 heads: receiver t reads sender 2t only
    r = route_heads(16, 8, 4)
    assert [r.sources(t) for t in range(8)] == [(2 * t,) for t in range(8)]
    # Llama-3.1-70B, 8 heads, TP 4 -> TP 16
    r = route_heads(4, 16, 8)
    assert [(x.target_rank, x.source_rank, x.abs_head_start) for x in r.reads(5)] == [(5, 1, 2)]
    # the engine's placement
    assert [rank_heads(8, 4, r) for r in range(8)] == [(h, h + 1) for h in (0, 0, 1, 1, 2, 2, 3, 3)]
    assert [rank_heads(2, 4, r) for r in range(2)] == [(0, 2), (2, 4)]


@pytest.mark.parametrize(("s", "t"), [(a, b) for a, b in itertools.product(TP_SIZES, TP_SIZES)])
def test_latent_goes_whole_from_one_sender_spread_over_senders(s: int, t: int) -> None:
    r = route_latent(s, t)
    for dst in range(t):
        (x,) = r.reads(dst)
        assert (x.head_start, x.head_stop, x.num_slices) == (0, 1, 1)
    load = Counter(x.source_rank for x in r.slices)
    if t >= s:  # every sender serves t/s receivers
        assert sorted(load) == list(range(s)) and set(load.values()) == {t // s}
    else:  # t senders serve one each, spread over the stage
        assert sorted(load) == [dst * (s // t) for dst in range(t)]


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(TP_SIZES), st.sampled_from(TP_SIZES), st.data())
def test_latent_source_is_the_one_sender_route_latent_reads_from(s: int, t: int, data: st.DataObject) -> None:
    dst = data.draw(st.integers(0, t - 1))
    src = latent_source(s, t, dst)
    assert 0 <= src < s
    (x,) = route_latent(s, t).reads(dst)
    assert x.source_rank == src and (x.head_start, x.head_stop) == (0, 1)
    # the sender's side agrees: it sends the whole latent to exactly the receivers that name it
    assert [y.target_rank for y in route_latent(s, t).sends(src) if y.target_rank == dst] == [dst]
    served = [r for r in range(t) if latent_source(s, t, r) == src]
    assert len(served) == max(1, t // s)


def test_latent_source_refuses_what_cannot_be_mapped() -> None:
    with pytest.raises(RoutingError, match="divisible"):
        latent_source(2, 3, 0)
    with pytest.raises(RoutingError, match="not a receiver rank"):
        latent_source(2, 4, 4)
    with pytest.raises(RoutingError, match="target_rank"):
        latent_source(2, 4, -1)


def test_bad_input_names_sizes_and_head_count() -> None:
    with pytest.raises(RoutingError, match=r"num_heads 6 neither divides nor is divisible by target_tp 4"):
        check_head_count(2, 4, 6)
    with pytest.raises(RoutingError, match="divisible"):
        route_heads(2, 3, 6)
    with pytest.raises(RoutingError, match="num_heads must be >= 1"):
        route_heads(2, 2, 0)
    with pytest.raises(RoutingError, match="not a sender rank"):
        route_heads(2, 4, 4).sends(2)
    with pytest.raises(RoutingError, match="not a receiver rank"):
        route_heads(2, 4, 4).reads(4)
    with pytest.raises(RoutingError, match="outside the stage"):
        rank_heads(4, 8, 4)


@settings(max_examples=150, deadline=None)  # TP sizes up to 128; each example is O(ranks^2)
@given(st.integers(1, 16), st.integers(1, 8), st.booleans())
def test_property_reference_rank_map_is_route_heads_at_max_tp(smaller: int, k: int, fan_out: bool) -> None:
    """One routing function: the reference's rank map (SPEC 2.1) and its fan-out slices (SPEC
    2.4) are route_heads at a virtual head count of max(S, T), computed here from the SPEC's
    formulas, not from the code under test."""
    s, t = (smaller, smaller * k) if fan_out else (smaller * k, smaller)
    routing = route_heads(s, t, max(s, t))
    assert reference_routing(s, t) == routing
    for sender in range(s):
        if s == t:
            expected: tuple[int, ...] = (sender,)
        elif s > t:
            expected = (sender // (s // t),)
        else:
            expected = tuple(range(sender * (t // s), (sender + 1) * (t // s)))
        assert routing.targets(sender) == expected == send_rank_map(s, t)[sender]
    for receiver in range(t):
        if s > t:
            expected = tuple(range(receiver * (s // t), (receiver + 1) * (s // t)))
        else:
            expected = (receiver * s // t,)
        assert routing.sources(receiver) == expected == recv_rank_map(s, t)[receiver]
        assert merge_order(s, t, receiver) == expected
        offsets = {(sl.offset_in_shard, sl.num_slices) for sl in routing.reads(receiver)}
        assert offsets == {(receiver % (t // s), t // s) if s < t else (0, 1)}
        assert fan_out_slice(s, t, receiver) == offsets.pop()
