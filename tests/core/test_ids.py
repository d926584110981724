"""SPEC 1 and 2.2: dummy ids and connector keys."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvferry.core.errors import RoutingError
from kvferry.core.ids import (
    DUMMY_REQUEST_ID,
    ConnectorKey,
    LegacyKey,
    connector_key,
    is_dummy_request,
    legacy_key,
    parse_connector_key,
    parse_legacy_key,
    recv_keys,
    send_keys,
)
from kvferry.core.topology import TPTopology, recv_rank_map, source_ranks

PROPERTY = settings(max_examples=150, deadline=None)

request_ids = st.text(min_size=0, max_size=24)
stages = st.one_of(st.integers(0, 1000), st.text(alphabet="abcdefgh-.0123456789", min_size=1, max_size=6))


@st.composite
def valid_sizes(draw: st.DrawFn, max_tp: int = 64) -> tuple[int, int]:
    smaller = draw(st.integers(1, max_tp))
    k = draw(st.integers(1, max_tp // smaller))
    return (smaller * k, smaller) if draw(st.booleans()) else (smaller, smaller * k)


# --- golden vectors (the reference's formats, byte for byte) -----------------------------------


def test_golden_legacy_key() -> None:
    assert legacy_key(0, 1, "req-7") == "omni_0_to_1_kv_cache_req-7"
    assert legacy_key("llm", "dit", "a_b") == "omni_llm_to_dit_kv_cache_a_b"


def test_golden_connector_key() -> None:
    assert connector_key("req-7", 0, 0, 1, 3) == "req-7_0_0_1_3"
    assert connector_key("chatcmpl-ab_12", "2", 5, 0, 0) == "chatcmpl-ab_12_2_5_0_0"


def test_golden_send_and_recv_keys() -> None:
    assert send_keys("req-7", 0, 1, TPTopology(1, 1, 0)) == ("omni_0_to_1_kv_cache_req-7",)
    assert recv_keys("req-7", 0, 1, TPTopology(1, 1, 0)) == (("omni_0_to_1_kv_cache_req-7", None),)
    assert send_keys("req-7", 0, 1, TPTopology(2, 4, 1)) == ("req-7_0_0_1_2", "req-7_0_0_1_3")
    assert recv_keys("req-7", 0, 1, TPTopology(2, 4, 3)) == (("req-7_0_0_1_3", 1),)
    assert send_keys("r", 0, 1, TPTopology(4, 2, 3)) == ("r_0_0_3_1",)
    assert recv_keys("r", 0, 1, TPTopology(4, 2, 1)) == (("r_0_0_2_1", 2), ("r_0_0_3_1", 3))
    assert send_keys("r", 3, 4, TPTopology(2, 2, 1)) == ("r_3_0_1_1",)
    # one side TP 1, the other 2: rank-aware, not legacy
    assert send_keys("r", 0, 1, TPTopology(1, 2, 0)) == ("r_0_0_0_0", "r_0_0_0_1")


# --- the central invariant --------------------------------------------------------------------


@PROPERTY
@given(valid_sizes(), request_ids, stages, stages)
def test_all_send_keys_equal_all_recv_keys(sizes: tuple[int, int], rid: str, frm: object, to: object) -> None:
    s, t = sizes
    sent: list[str] = []
    for sender in range(s):
        sent.extend(send_keys(rid, frm, to, TPTopology(s, t, sender)))
    got: list[tuple[str, int | None]] = []
    for receiver in range(t):
        got.extend(recv_keys(rid, frm, to, TPTopology(s, t, receiver)))
    assert len(sent) == len(set(sent))  # no key put twice
    assert sorted(sent) == sorted(k for k, _ in got)
    if s <= 1 and t <= 1:
        assert got == [(legacy_key(frm, to, rid), None)]
    else:
        for key, from_rank in got:
            parsed = parse_connector_key(key)
            assert parsed.from_rank == from_rank
            assert parsed.request_id == rid and parsed.chunk_id == 0


@PROPERTY
@given(valid_sizes(8), request_ids, st.data())
def test_recv_keys_follow_merge_order(sizes: tuple[int, int], rid: str, data: st.DataObject) -> None:
    s, t = sizes
    receiver = data.draw(st.integers(0, t - 1))
    pairs = recv_keys(rid, 0, 1, TPTopology(s, t, receiver))
    if s == t == 1:
        return
    assert tuple(r for _, r in pairs) == recv_rank_map(s, t)[receiver]


def test_non_divisible_topology_raises() -> None:
    with pytest.raises(RoutingError, match="divisible"):
        send_keys("r", 0, 1, TPTopology(3, 2, 0))
    with pytest.raises(RoutingError, match="divisible"):
        recv_keys("r", 0, 1, TPTopology(2, 3, 0))


# --- parsing ----------------------------------------------------------------------------------


@PROPERTY
@given(
    request_ids,
    st.one_of(st.integers(0, 10**6), st.text(alphabet="abc-.9", min_size=1, max_size=5)),
    st.integers(0, 10**6),
    st.integers(0, 1024),
    st.integers(0, 1024),
)
def test_connector_key_round_trip(rid: str, stage: object, chunk: int, src: int, dst: int) -> None:
    key = connector_key(rid, stage, chunk, src, dst)
    parsed = parse_connector_key(key)
    assert parsed == ConnectorKey(rid, str(stage), chunk, src, dst)
    assert str(parsed) == key


@PROPERTY
@given(request_ids, st.text(alphabet="abc-.9", min_size=1, max_size=5), st.integers(0, 99))
def test_legacy_key_round_trip(rid: str, frm: str, to: int) -> None:
    key = legacy_key(frm, to, rid)
    parsed = parse_legacy_key(key)
    assert parsed == LegacyKey(frm, str(to), rid)
    assert str(parsed) == key


@pytest.mark.parametrize(
    "key", ["", "abc", "a_0_0_1", "r_0_x_1_2", "r_0_0_-1_2", "r_0_0_1_02", "r__0_1_2", "r_0_0_1_²"]
)
def test_parse_rejects_malformed_keys(key: str) -> None:
    with pytest.raises(RoutingError):
        parse_connector_key(key)


@pytest.mark.parametrize(
    "key", ["", "omni__to_1_kv_cache_r", "omni_0_kv_cache_r", "x_0_to_1_kv_cache_r", "omni_0_to_1_r"]
)
def test_parse_legacy_rejects_malformed_keys(key: str) -> None:
    with pytest.raises(RoutingError):
        parse_legacy_key(key)


@pytest.mark.parametrize(
    ("args", "field"),
    [
        (("r", 0, -1, 0, 0), "chunk_id"),
        (("r", 0, 0, -1, 0), "from_rank"),
        (("r", 0, 0, 0, True), "to_rank"),
        (("r", 1.5, 0, 0, 0), "from_stage"),
        ((7, 0, 0, 0, 0), "request_id"),
    ],
)
def test_connector_key_rejects_bad_parts(args: tuple, field: str) -> None:
    with pytest.raises(RoutingError, match=field):
        connector_key(*args)


# --- hooks ------------------------------------------------------------------------------------


def test_send_hook_non_empty_result_wins() -> None:
    calls = []

    def hook(rid: str, frm: object, to: object) -> list[str]:
        calls.append((rid, frm, to))
        return ["k1", "k2"]

    assert send_keys("r", 0, 1, TPTopology(2, 4, 0), hook=hook) == ("k1", "k2")
    assert calls == [("r", 0, 1)]


@pytest.mark.parametrize("empty", [[], (), None])
def test_empty_hook_result_falls_back_to_default(empty: object) -> None:
    topo = TPTopology(2, 4, 0)
    assert send_keys("r", 0, 1, topo, hook=lambda *a: empty) == send_keys("r", 0, 1, topo)
    assert recv_keys("r", 0, 1, topo, hook=lambda *a: empty) == recv_keys("r", 0, 1, topo)


def test_recv_hook_pairs_used_as_is() -> None:
    hook = lambda *a: [("x", 5), ("y", None)]  # noqa: E731
    assert recv_keys("r", 0, 1, TPTopology(4, 2, 0), hook=hook) == (("x", 5), ("y", None))


def test_recv_hook_strings_get_ranks_when_counts_match() -> None:
    topo = TPTopology(4, 2, 1)
    assert recv_keys("r", 0, 1, topo, hook=lambda *a: ["a", "b"]) == (("a", 2), ("b", 3))
    assert source_ranks(topo) == (2, 3)


def test_recv_hook_strings_get_none_when_counts_differ() -> None:
    topo = TPTopology(4, 2, 1)
    assert recv_keys("r", 0, 1, topo, hook=lambda *a: ["a"]) == (("a", None),)
    assert recv_keys("r", 0, 1, topo, hook=lambda *a: ["a", "b", "c"]) == (
        ("a", None),
        ("b", None),
        ("c", None),
    )


def test_bad_hook_results_are_rejected() -> None:
    with pytest.raises(RoutingError):
        send_keys("r", 0, 1, TPTopology(2, 2, 0), hook=lambda *a: [1])
    with pytest.raises(RoutingError):
        recv_keys("r", 0, 1, TPTopology(2, 2, 0), hook=lambda *a: [("a", 1, 2)])
    with pytest.raises(RoutingError, match="from_rank"):
        recv_keys("r", 0, 1, TPTopology(2, 2, 0), hook=lambda *a: [("a", -1)])


# --- dummy requests ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("rid", "dummy"),
    [
        (DUMMY_REQUEST_ID, True),
        ("dummy_req_id/0", True),
        ("dummy_req_id/", True),
        ("dummy_req_id_0", False),
        ("dummy_req_idx", False),
        ("xdummy_req_id", False),
        ("", False),
        (None, False),
        (7, False),
    ],
)
def test_dummy_rule(rid: object, dummy: bool) -> None:
    assert is_dummy_request(rid) is dummy


@given(st.text(max_size=10))
@settings(max_examples=50, deadline=None)
def test_any_suffix_after_slash_is_dummy(suffix: str) -> None:
    assert is_dummy_request(DUMMY_REQUEST_ID + "/" + suffix)
    assert is_dummy_request(suffix) is (suffix == DUMMY_REQUEST_ID or suffix.startswith(DUMMY_REQUEST_ID + "/"))
