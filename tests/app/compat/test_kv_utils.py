"""The reference's routing helpers (REFERENCE_API "Routing helpers"): meanings, errors, hooks."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import attrs
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvferry.adapters import paged_cache
from kvferry.app.compat import kv_utils as cu
from kvferry.app.compat.kv_utils import (
    KVTPTopology,
    build_rank_aware_recv_keys,
    build_rank_aware_send_keys,
    clear_parallel_state,
    get_kv_connector_key,
    get_kv_source_ranks,
    get_kv_target_ranks,
    get_local_tp_rank,
    get_omni_replica_id,
    get_parallel_state,
    get_tp_world_size,
    kv_zmq_port,
    merge_received_rank_shards,
    set_parallel_state,
    slice_kv_tensor_heads,
    slice_layer_blocks,
    slice_received_rank_shard,
    validate_kv_tp_topology,
)
from kvferry.core.topology import TPTopology

PROPS = settings(max_examples=40, deadline=None)

# (source_tp, target_tp) pairs that can be mapped, fan-in, fan-out and equal.
sizes = st.sampled_from([1, 2, 4, 8]).flatmap(
    lambda small: st.sampled_from([1, 2, 4]).flatmap(
        lambda k: st.sampled_from([(small, small * k), (small * k, small)])
    )
)


@pytest.fixture(autouse=True)
def _no_parallel_state(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    clear_parallel_state()
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.delenv("VLLM_OMNI_REPLICA_ID", raising=False)
    yield
    clear_parallel_state()


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))
    )


def same_storage(view: torch.Tensor, base: torch.Tensor) -> bool:
    return view.untyped_storage().data_ptr() == base.untyped_storage().data_ptr()


# ----------------------------------------------------------------------------------- topology
def test_topology_value() -> None:
    topo = KVTPTopology(2, 4, 3)
    assert (topo.source_tp_size, topo.target_tp_size, topo.local_rank) == (2, 4, 3)
    assert topo.is_heterogeneous and topo.ratio == 2
    assert not KVTPTopology(2, 2, 0).is_heterogeneous and KVTPTopology(2, 2, 0).ratio == 1
    assert KVTPTopology(8, 2, 1).ratio == 4
    assert topo == KVTPTopology(2, 4, 3) and hash(topo) == hash(KVTPTopology(2, 4, 3))
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        topo.local_rank = 0  # type: ignore[misc]
    assert topo.to_core() == TPTopology(2, 4, 3)
    assert KVTPTopology.from_core(topo.to_core()) == topo


@pytest.mark.parametrize("args", [(0, 1, 0), (1, 0, 0), (-1, 2, 0), (2, -2, 0), (1, 1, -1), (True, 1, 0), (1.0, 1, 0)])
def test_topology_rejects_bad_sizes_and_rank(args: tuple[Any, ...]) -> None:
    with pytest.raises(ValueError):
        KVTPTopology(*args)


def test_topology_may_be_indivisible_until_validated() -> None:
    topo = KVTPTopology(2, 3, 0)
    with pytest.raises(ValueError, match="divisible") as info:
        validate_kv_tp_topology(topo)
    assert "2" in str(info.value) and "3" in str(info.value)
    for helper in (get_kv_target_ranks, get_kv_source_ranks):
        with pytest.raises(ValueError, match="divisible"):
            helper(topo)
    assert validate_kv_tp_topology(KVTPTopology(2, 4, 0)) is None


@PROPS
@given(sizes, st.integers(0, 31))
def test_ratio_is_larger_over_smaller(pair: tuple[int, int], rank: int) -> None:
    topo = KVTPTopology(pair[0], pair[1], rank)
    assert topo.ratio == max(pair) // min(pair) >= 1
    assert topo.is_heterogeneous == (pair[0] != pair[1])


def test_helpers_accept_core_and_reference_shaped_topologies() -> None:
    @attrs.frozen
    class Foreign:  # the reference's own KVTPTopology has these attribute names
        source_tp_size: int
        target_tp_size: int
        local_rank: int

    for topo in (KVTPTopology(2, 4, 1), TPTopology(2, 4, 1), Foreign(2, 4, 1)):
        assert get_kv_target_ranks(topo) == [2, 3]
    with pytest.raises(ValueError, match="not a TP topology"):
        get_kv_target_ranks(object())


# ------------------------------------------------------------------------------ parallel state
def test_parallel_state_holder(monkeypatch: pytest.MonkeyPatch) -> None:
    assert get_parallel_state() is None
    assert (get_local_tp_rank(), get_tp_world_size()) == (0, 1)
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert get_local_tp_rank() == 3 and get_tp_world_size() == 1
    set_parallel_state(1, 4)
    assert get_parallel_state() == (1, 4)
    assert (get_local_tp_rank(), get_tp_world_size()) == (1, 4)  # the state wins over the env
    set_parallel_state(0, 2)
    assert (get_local_tp_rank(), get_tp_world_size()) == (0, 2)
    clear_parallel_state()
    assert get_parallel_state() is None and get_local_tp_rank() == 3


@pytest.mark.parametrize("args", [(2, 2), (-1, 2), (0, 0), (True, 2), (0, 2.0)])
def test_parallel_state_rejects_impossible_values(args: tuple[Any, Any]) -> None:
    with pytest.raises(ValueError):
        set_parallel_state(*args)
    assert get_parallel_state() is None


@pytest.mark.parametrize("raw", ["x", "-1", "1.5"])
def test_invalid_local_rank_env_is_an_error_naming_it(monkeypatch: pytest.MonkeyPatch, raw: str) -> None:
    monkeypatch.setenv("LOCAL_RANK", raw)
    with pytest.raises(ValueError, match="LOCAL_RANK"):
        get_local_tp_rank()


def test_blank_local_rank_env_reads_as_zero(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCAL_RANK", " ")
    assert get_local_tp_rank() == 0
    monkeypatch.setenv("LOCAL_RANK", " 2 ")
    assert get_local_tp_rank() == 2


@pytest.mark.parametrize(
    "raw,expected", [(None, 0), ("3", 3), (" 7 ", 7), ("0", 0), ("-2", 0), ("abc", 0), ("", 0), ("1.0", 0)]
)
def test_replica_id_from_env(monkeypatch: pytest.MonkeyPatch, raw: str | None, expected: int) -> None:
    if raw is not None:
        monkeypatch.setenv("VLLM_OMNI_REPLICA_ID", raw)
    assert get_omni_replica_id() == expected


# --------------------------------------------------------------------------------------- ports
@pytest.mark.parametrize(
    "args,port",
    [
        ((50051, 0), 50151),
        ((50051, 0, 1, 0), 50167),
        ((50051, 0, 0, 1), 51175),
        ((50051, 1, 0, 0), 50152),
        ((50051, 3, 2, 2), 50051 + 100 + 2048 + 32 + 3),
        ((50051, 0, 0, -5), 50151),
        ((50051, 0, 0, "2"), 52199),
        ((50051, 0, 0, "bad"), 50151),
    ],
)
def test_port_golden_vectors(args: tuple[Any, ...], port: int) -> None:
    assert kv_zmq_port(*args) == port


def test_port_reads_replica_from_env_only_when_none(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_OMNI_REPLICA_ID", "2")
    assert kv_zmq_port(50051, 0) == 50151 + 2048
    assert kv_zmq_port(50051, 0, replica_id=None) == 50151 + 2048
    assert kv_zmq_port(50051, 0, replica_id=0) == 50151
    monkeypatch.setenv("VLLM_OMNI_REPLICA_ID", "-1")
    assert kv_zmq_port(50051, 0) == 50151


@pytest.mark.parametrize(
    "args,field",
    [
        ((50051, 16), "from_stage"),
        ((50051, 0, -1), "tp_rank"),
        ((50051, 0, 64), "rank slot"),
        ((65500, 0), "port"),
        ((0, 0), "base_port"),
    ],
)
def test_port_rejects_colliding_or_invalid_values(args: tuple[Any, ...], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        kv_zmq_port(*args)


@PROPS
@given(st.integers(1024, 40000), st.integers(0, 15), st.integers(0, 63), st.integers(-3, 20))
def test_port_is_the_reference_formula(base: int, stage: int, rank: int, replica: int) -> None:
    expected = base + 100 + max(replica, 0) * 1024 + rank * 16 + stage
    assert kv_zmq_port(base, stage, rank, replica) == expected


# ---------------------------------------------------------------------------------- rank maps
@pytest.mark.parametrize(
    "topo,targets,sources",
    [
        ((2, 2, 1), [1], [1]),
        ((2, 4, 1), [2, 3], [0]),
        ((4, 2, 1), [0], [2, 3]),
        ((1, 4, 0), [0, 1, 2, 3], [0]),
        ((4, 1, 0), [0], [0, 1, 2, 3]),
        ((2, 4, 3), None, [1]),
        ((4, 2, 3), [1], None),
    ],
)
def test_rank_map_golden_vectors(
    topo: tuple[int, int, int], targets: list[int] | None, sources: list[int] | None
) -> None:
    t = KVTPTopology(*topo)
    for helper, expected in ((get_kv_target_ranks, targets), (get_kv_source_ranks, sources)):
        if expected is None:  # the local rank is outside that side's stage
            with pytest.raises(ValueError):
                helper(t)
        else:
            result = helper(t)
            assert type(result) is list and result == expected


@PROPS
@given(sizes)
def test_rank_maps_are_inverse_and_cover_every_pair_once(pair: tuple[int, int]) -> None:
    src, dst = pair
    sent = [(s, t) for s in range(src) for t in get_kv_target_ranks(KVTPTopology(src, dst, s))]
    read = [(s, t) for t in range(dst) for s in get_kv_source_ranks(KVTPTopology(src, dst, t))]
    assert sorted(sent) == sorted(read) and len(set(sent)) == len(sent)
    assert {t for _, t in sent} == set(range(dst)) and {s for s, _ in sent} == set(range(src))


# ---------------------------------------------------------------------------------------- keys
def test_connector_key_golden_vectors() -> None:
    assert get_kv_connector_key("req", 0, 0, 1, 2) == "req_0_0_1_2"
    assert get_kv_connector_key("chatcmpl-a_b", "1", 3, 0, 7) == "chatcmpl-a_b_1_3_0_7"
    with pytest.raises(ValueError):
        get_kv_connector_key("req", 0, 0, -1, 0)


def test_send_key_golden_vectors() -> None:
    assert build_rank_aware_send_keys("r1", 0, 1, KVTPTopology(1, 1, 0)) == ["omni_0_to_1_kv_cache_r1"]
    assert build_rank_aware_send_keys("r1", 0, 1, KVTPTopology(2, 2, 1)) == ["r1_0_0_1_1"]
    assert build_rank_aware_send_keys("r1", 0, 1, KVTPTopology(2, 4, 1)) == ["r1_0_0_1_2", "r1_0_0_1_3"]
    assert build_rank_aware_send_keys("r1", 2, 3, KVTPTopology(4, 2, 3)) == ["r1_2_0_3_1"]


def test_recv_key_golden_vectors() -> None:
    assert build_rank_aware_recv_keys("r1", 0, 1, KVTPTopology(1, 1, 0)) == [("omni_0_to_1_kv_cache_r1", None)]
    assert build_rank_aware_recv_keys("r1", 0, 1, KVTPTopology(2, 4, 3)) == [("r1_0_0_1_3", 1)]
    keys = build_rank_aware_recv_keys("r1", 0, 1, KVTPTopology(4, 2, 1))
    assert keys == [("r1_0_0_2_1", 2), ("r1_0_0_3_1", 3)]
    assert all(type(k) is tuple for k in keys) and type(keys) is list


def test_send_key_hook() -> None:
    calls: list[tuple[Any, ...]] = []

    def hook(*args: Any) -> list[str]:
        calls.append(args)
        return ["custom-a", "custom-b"]

    topo = KVTPTopology(2, 4, 0)
    assert build_rank_aware_send_keys("r", 0, 1, topo, hook=hook) == ["custom-a", "custom-b"]
    assert calls == [("r", 0, 1)]
    assert build_rank_aware_send_keys("r", 0, 1, topo, hook=lambda *a: []) == ["r_0_0_0_0", "r_0_0_0_1"]
    assert build_rank_aware_send_keys("r", 0, 1, topo, hook=lambda *a: None) == ["r_0_0_0_0", "r_0_0_0_1"]
    assert build_rank_aware_send_keys("r", 0, 1, topo, hook="not callable") == ["r_0_0_0_0", "r_0_0_0_1"]  # type: ignore[arg-type]


def test_recv_key_hook() -> None:
    fan_in = KVTPTopology(4, 2, 1)  # reads senders 2 and 3
    calls: list[tuple[Any, ...]] = []

    def pairs(*args: Any) -> list[tuple[str, int | None]]:
        calls.append(args)
        return [("k0", 5), ("k1", None)]

    assert build_rank_aware_recv_keys("r", "a", "b", fan_in, hook=pairs) == [("k0", 5), ("k1", None)]
    assert calls == [("r", "a", "b")]
    assert build_rank_aware_recv_keys("r", 0, 1, fan_in, hook=lambda *a: ["x", "y"]) == [("x", 2), ("y", 3)]
    assert build_rank_aware_recv_keys("r", 0, 1, fan_in, hook=lambda *a: ["x"]) == [("x", None)]
    assert build_rank_aware_recv_keys("r", 0, 1, fan_in, hook=lambda *a: []) == [("r_0_0_2_1", 2), ("r_0_0_3_1", 3)]
    assert build_rank_aware_recv_keys("r", 0, 1, fan_in, hook=42) == [("r_0_0_2_1", 2), ("r_0_0_3_1", 3)]  # type: ignore[arg-type]


@PROPS
@given(sizes, st.text("abc_-/0", min_size=1, max_size=8), st.sampled_from([0, 3, "s"]))
def test_every_key_put_is_got(pair: tuple[int, int], rid: str, stage: Any) -> None:
    src, dst = pair
    put = [k for s in range(src) for k in build_rank_aware_send_keys(rid, stage, 9, KVTPTopology(src, dst, s))]
    got = [k for t in range(dst) for k, _ in build_rank_aware_recv_keys(rid, stage, 9, KVTPTopology(src, dst, t))]
    assert sorted(put) == sorted(got) and len(set(put)) == len(put)


# -------------------------------------------------------------------------------- head slicing
def test_slice_tensor_heads() -> None:
    t = torch.arange(3 * 4 * 2, dtype=torch.float32).reshape(3, 4, 2)
    part = slice_kv_tensor_heads(t, 1, 2)
    assert bits_equal(part, t[:, 2:4]) and same_storage(part, t)
    assert bits_equal(slice_kv_tensor_heads(t, 0, 1), t)
    assert slice_kv_tensor_heads(None, 0, 2) is None
    marker = ["not", "a", "tensor"]
    assert slice_kv_tensor_heads(marker, 0, 2) is marker


@pytest.mark.parametrize(
    "tensor,offset,num",
    [
        (torch.zeros(4), 0, 2),
        (torch.zeros(2, 4, 2), 0, 0),
        (torch.zeros(2, 4, 2), 0, -1),
        (torch.zeros(2, 4, 2), 2, 2),
        (torch.zeros(2, 4, 2), -1, 2),
        (torch.zeros(2, 6, 2), 0, 4),
    ],
)
def test_slice_tensor_heads_errors(tensor: torch.Tensor, offset: int, num: int) -> None:
    with pytest.raises(ValueError):
        slice_kv_tensor_heads(tensor, offset, num)


def test_slice_layer_blocks() -> None:
    k, v = torch.randn(2, 4, 3), torch.randn(2, 4, 3)
    out = slice_layer_blocks({"key_cache": [k, None], "value_cache": [v, None], "other": 1}, 1, 4)
    assert set(out) == {"key_cache", "value_cache"}
    assert bits_equal(out["key_cache"][0], k[:, 1:2]) and out["key_cache"][1] is None
    assert bits_equal(out["value_cache"][0], v[:, 1:2]) and out["value_cache"][1] is None
    assert slice_layer_blocks({}, 0, 2) == {"key_cache": [], "value_cache": []}
    assert slice_layer_blocks({"key_cache": [k]}, 0, 2)["value_cache"] == []
    assert slice_layer_blocks(None, 0, 2) == {"key_cache": [], "value_cache": []}
    with pytest.raises(ValueError):
        slice_layer_blocks([k], 0, 2)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------- merge
def payload(rid: str, keys: list[Any], values: list[Any], **extra: Any) -> dict[str, Any]:
    return {
        "request_id": rid,
        "layer_blocks": {"key_cache": keys, "value_cache": values},
        "block_ids": [1, 2],
        "metadata": {"seq_len": 2},
        **extra,
    }


def test_merge_trivial_cases() -> None:
    seen: list[Any] = []
    assert merge_received_rank_shards([1, 2], merger=lambda p: seen.append(p) or "merged") == "merged"
    assert seen == [[1, 2]]
    assert merge_received_rank_shards([]) is None
    one = payload("r", [torch.zeros(1, 1, 1)], [])
    assert merge_received_rank_shards([one]) is one
    assert merge_received_rank_shards(["raw", one]) == "raw"
    no_layers = {"request_id": "r"}
    assert merge_received_rank_shards([no_layers, one]) is no_layers
    assert merge_received_rank_shards([one, one], merger="not callable") is not one  # type: ignore[arg-type]


def test_merge_concatenates_along_heads() -> None:
    a = [torch.randn(3, 2, 4, dtype=torch.bfloat16) for _ in range(4)]
    b = [torch.randn(3, 2, 4, dtype=torch.bfloat16) for _ in range(4)]
    only = torch.randn(3, 2, 4)
    first = payload("r", [a[0], None, only, "x"], [a[1]], extra="dropped")
    second = payload("r2", [b[0], None, None, "y"], [b[1], b[2]])
    second["metadata"] = {"seq_len": 99}
    merged = merge_received_rank_shards([first, second])
    assert set(merged) == {"request_id", "layer_blocks", "block_ids", "metadata"}
    assert merged["request_id"] == "r"
    assert merged["block_ids"] == [1, 2] and merged["block_ids"] is not first["block_ids"]
    assert merged["metadata"] == {"seq_len": 2} and merged["metadata"] is not first["metadata"]
    keys, values = merged["layer_blocks"]["key_cache"], merged["layer_blocks"]["value_cache"]
    assert bits_equal(keys[0], torch.cat([a[0], b[0]], dim=1))
    assert keys[1] is None and keys[2] is only and keys[3] == "x"
    assert bits_equal(values[0], torch.cat([a[1], b[1]], dim=1)) and values[1] is b[2]


def test_merge_errors() -> None:
    good = payload("r", [torch.zeros(1, 2, 2)], [])
    with pytest.raises(ValueError, match="payload 1"):
        merge_received_rank_shards([good, None])
    with pytest.raises(ValueError):
        merge_received_rank_shards([good, payload("r", [torch.zeros(2, 2, 2)], [])])  # token counts differ
    missing = {"request_id": "r"}  # a dict without layers contributes none
    merged = merge_received_rank_shards([good, missing])
    assert bits_equal(merged["layer_blocks"]["key_cache"][0], good["layer_blocks"]["key_cache"][0])


# ---------------------------------------------------------------------------------------- slice
def test_slice_received_shard_slices_and_tags() -> None:
    k = torch.arange(2 * 8 * 3, dtype=torch.float16).reshape(2, 8, 3)
    v = k + 1
    original = payload("r", [k, None], [v, None], extra="kept")
    meta_before = dict(original["metadata"])
    out = slice_received_rank_shard(original, KVTPTopology(2, 8, 6))  # k=4, sender 1, slice 2 of 4
    assert out is not original and original["metadata"] == meta_before  # the input is not mutated
    assert out["extra"] == "kept" and out["request_id"] == "r" and out["block_ids"] == [1, 2]
    assert bits_equal(out["layer_blocks"]["key_cache"][0], k[:, 4:6]) and out["layer_blocks"]["key_cache"][1] is None
    assert bits_equal(out["layer_blocks"]["value_cache"][0], v[:, 4:6])
    assert out["metadata"] == {
        "seq_len": 2,
        "tp_head_slice": {
            "applied": True,
            "side": "receiver",
            "target_rank": 6,
            "source_rank": 1,
            "from_tp": 2,
            "to_tp": 8,
            "offset_in_shard": 2,
            "num_slices": 4,
        },
    }


def test_slice_received_shard_leaves_payload_alone() -> None:
    full = payload("r", [torch.zeros(1, 4, 2)], [])
    seen: list[Any] = []
    assert slice_received_rank_shard(full, KVTPTopology(1, 2, 1), slicer=lambda p: seen.append(p) or "s") == "s"
    assert seen == [full]
    for empty in (None, {}):
        assert slice_received_rank_shard(empty, KVTPTopology(1, 2, 1)) is empty
    for topo in (KVTPTopology(2, 2, 1), KVTPTopology(4, 2, 1)):  # not fan-out
        assert slice_received_rank_shard(full, topo) is full
    no_layers = {"request_id": "r", "metadata": {}}
    assert slice_received_rank_shard(no_layers, KVTPTopology(1, 2, 1)) is no_layers
    with pytest.raises(ValueError, match="divisible"):
        slice_received_rank_shard(payload("r", [torch.zeros(1, 3, 2)], []), KVTPTopology(1, 2, 1))
    with pytest.raises(ValueError, match="divisible"):
        slice_received_rank_shard(full, KVTPTopology(2, 3, 1))


def test_applied_tag_is_never_sliced_twice(caplog: pytest.LogCaptureFixture) -> None:
    tag = {
        "applied": True,
        "side": "sender",
        "target_rank": 1,
        "source_rank": 0,
        "from_tp": 1,
        "to_tp": 2,
        "offset_in_shard": 1,
        "num_slices": 2,
    }
    tagged = payload("r", [torch.zeros(1, 2, 2)], [])
    tagged["metadata"] = {"tp_head_slice": tag}
    with caplog.at_level(logging.WARNING, logger=cu.__name__):
        assert slice_received_rank_shard(tagged, KVTPTopology(1, 2, 1)) is tagged
    assert not caplog.records
    with caplog.at_level(logging.WARNING, logger=cu.__name__):
        assert slice_received_rank_shard(tagged, KVTPTopology(1, 2, 0)) is tagged
    assert len(caplog.records) == 1 and "target rank 1" in caplog.records[0].getMessage()
    tagged["metadata"]["tp_head_slice"] = {**tag, "applied": False}  # a tag not applied is sliced
    assert slice_received_rank_shard(tagged, KVTPTopology(1, 2, 1))["metadata"]["tp_head_slice"]["side"] == "receiver"


@PROPS
@given(sizes, st.sampled_from([1, 2, 3]), st.integers(0, 3), st.integers(0, 2**31))
def test_slice_then_merge_gives_each_receiver_its_heads(
    pair: tuple[int, int], heads_per: int, tokens: int, seed: int
) -> None:
    src, dst = pair
    heads = max(src, dst) * heads_per
    gen = torch.Generator().manual_seed(seed)
    full_k = torch.randint(-(2**15), 2**15, (tokens, heads, 2), generator=gen, dtype=torch.int16).view(torch.float16)
    full_v = torch.randint(-(2**15), 2**15, (tokens, heads, 2), generator=gen, dtype=torch.int16).view(torch.float16)
    per_sender = heads // src
    shards = [
        payload(
            "r",
            [full_k[:, s * per_sender : (s + 1) * per_sender], None],
            [full_v[:, s * per_sender : (s + 1) * per_sender], None],
        )
        for s in range(src)
    ]
    per_receiver = heads // dst
    for t in range(dst):
        topo = KVTPTopology(src, dst, t)
        got = [slice_received_rank_shard(shards[s], topo) for s in get_kv_source_ranks(topo)]
        merged = merge_received_rank_shards(got)
        want = slice(t * per_receiver, (t + 1) * per_receiver)
        assert bits_equal(merged["layer_blocks"]["key_cache"][0], full_k[:, want])
        assert bits_equal(merged["layer_blocks"]["value_cache"][0], full_v[:, want])
        assert merged["layer_blocks"]["key_cache"][1] is None


def test_normalize_layer_kv_is_kvferrys() -> None:
    assert cu.normalize_layer_kv is paged_cache.normalize_layer_kv
    layer = torch.randn(2, 3, 4, 2, 5)  # [2, blocks, block_size, heads, head_dim]
    key, value = cu.normalize_layer_kv(layer, req_id="r", layer_idx=0)
    assert bits_equal(key, layer[0]) and bits_equal(value, layer[1])
    assert cu.normalize_layer_kv(torch.zeros(3), req_id="r", layer_idx=1) is None
