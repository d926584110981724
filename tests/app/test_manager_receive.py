"""The receive path of :class:`KVTransferManager` on in-memory adapters (SPEC 2, 7).

All ranks of both stages live in this process and share one memory connector. Deadlines run on
an injected clock: a connector without a blocking get is polled, and the injected sleep records
the schedule (10 ms doubling to 500 ms) while advancing the clock, so no test really waits.
"""

from __future__ import annotations

import time
import types
from typing import Any

import pytest
import torch

from kvferry.adapters.torch_frames import encode_bytes, encode_frames
from kvferry.app.manager import KVTransferManager
from kvferry.core.errors import ConnectorUnavailable, SenderUnavailable
from kvferry.core.outcomes import ReceiveKind, SkipReason
from kvferry.core.tombstones import failure_record

BLOCK_SETS = ([3, 1, 5], [0], [7, 8, 9, 10, 11], [2, 4], [11, 0, 6], [1, 2, 3, 4])
SEQ_LENS = (10, 3, 20, 5, 12, 13)
POLLS = [0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.5, 0.5]


def _requests(n: int = 6) -> dict[str, dict[str, Any]]:
    return {f"req-{i}": {"block_ids": BLOCK_SETS[i % 6], "seq_len": SEQ_LENS[i % 6]} for i in range(n)}


# ----------------------------------------------------------------------------- bit-exact TP
@pytest.mark.parametrize("storage", ["pool", "objects"])
@pytest.mark.parametrize("from_tp,to_tp", [(1, 1), (1, 2), (2, 4), (4, 2), (2, 1), (4, 8)])
def test_spec7_receive_is_bit_exact_for_every_topology(
    kit, memory_connector_factory, make_receiver, from_tp, to_tp, storage
) -> None:
    """Every receiver rank gets exactly its heads of every request (SPEC 2.4 invariant)."""
    model = kit.PagedModel(heads=16, dtype=torch.bfloat16)
    conn = memory_connector_factory(storage=storage)
    requests = _requests()
    sent = kit.send_all(model, conn, from_tp, to_tp, requests)
    assert all(o.ok for o in sent) and len(sent) == from_tp * len(requests)
    for rank in range(to_tp):
        receiver = make_receiver(conn, from_tp, to_tp, rank=rank)
        for rid, spec in requests.items():
            result = receiver.receive(rid)
            assert result.ok, result.outcome
            kit.assert_kv_equal(result.payload, *model.expected(spec["block_ids"], spec["seq_len"], rank, to_tp))
            assert result.payload["request_id"] == rid and result.payload["block_ids"] == spec["block_ids"]
            assert result.nbytes == result.outcome.nbytes > 0
            assert len(result.outcome.keys) == max(1, from_tp // to_tp)
            result.release()  # a zero-copy result holds its pool buffers until then
        assert receiver.counters.get("recv.received") == len(requests)
    if storage == "pool":
        assert kit.pool_is_empty(conn)  # every buffer released, every payload consumed once


def test_spec7_received_tensors_own_their_memory(kit, memory_connector, make_receiver) -> None:
    """Pool buffers are released after the receive: the tensors must not alias the pool."""
    model = kit.PagedModel()
    kit.send_all(model, memory_connector, 1, 1, {"a": {"block_ids": [1, 2], "seq_len": 8}})
    result = make_receiver(memory_connector).receive("a")
    before = [t.clone() for t in result.payload["layer_blocks"]["key_cache"]]
    memory_connector.put(
        from_stage="0", to_stage="1", put_key="junk", data=torch.full((1 << 20,), 0x7F, dtype=torch.uint8)
    )  # reuses the pool
    assert all(kit.bits_equal(a, b) for a, b in zip(result.payload["layer_blocks"]["key_cache"], before))


def test_spec2_4_fan_in_layer_carried_by_one_shard_survives_pool_reuse(kit, memory_connector, make_receiver) -> None:
    """Merging copies (torch.cat), except a layer only one shard has: that one must be copied too."""

    def t(v: float) -> torch.Tensor:
        return torch.full((4, 2, 2), v)

    for src, keys in ((0, [t(1.0), None]), (1, [t(2.0), t(3.0)])):
        frames = encode_frames("r", keys, keys, [0], {}).frames
        memory_connector.put(from_stage="0", to_stage="1", put_key=f"r_0_0_{src}_0", data=list(frames))
    result = make_receiver(memory_connector, 2, 1).receive("r")
    assert result.ok
    layers = result.payload["layer_blocks"]["key_cache"]
    assert layers[0].shape == (4, 4, 2) and layers[1].shape == (4, 2, 2)
    memory_connector.put(
        from_stage="0", to_stage="1", put_key="junk", data=torch.full((1 << 20,), 0x7F, dtype=torch.uint8)
    )
    assert torch.equal(layers[1], t(3.0))
    assert torch.equal(layers[0], torch.cat([t(1.0), t(2.0)], dim=1))


def test_spec7_tensors_are_moved_to_the_target_device(kit, memory_connector, make_receiver) -> None:
    model = kit.PagedModel()
    kit.send_all(model, memory_connector, 2, 1, {"a": {"block_ids": [1, 2], "seq_len": 8}})
    result = make_receiver(memory_connector, 2, 1).receive("a", target_device="meta")
    assert result.ok
    tensors = result.payload["layer_blocks"]["key_cache"] + result.payload["layer_blocks"]["value_cache"]
    assert {t.device.type for t in tensors} == {"meta"}
    assert tensors[0].shape == (8, model.heads, model.head_dim)
    assert kit.pool_is_empty(memory_connector)


# -------------------------------------------------------------------------------- timeouts
def test_spec7_timeout_at_deadline_polls_10ms_doubling_to_500ms(
    kit, memory_connector, make_receiver, fake_time
) -> None:
    spy = kit.SpyConnector(memory_connector)  # no blocking get: the manager polls
    receiver = make_receiver(spy, config=kit.receiver_config(recv_timeout=2.0))
    result = receiver.receive("late")
    assert result.outcome.kind is ReceiveKind.TIMED_OUT and not result.ok and result.payload is None
    assert result.outcome.missing_keys == ("omni_0_to_1_kv_cache_late",)
    assert "1 of 1 keys missing" in result.outcome.detail
    assert fake_time.sleeps[:-1] == pytest.approx(POLLS)
    assert fake_time.sleeps[-1] == pytest.approx(2.0 - sum(POLLS))  # never sleeps past the deadline
    assert fake_time.elapsed == pytest.approx(2.0) and result.outcome.seconds == pytest.approx(2.0)
    assert len(spy.gets) == len(fake_time.sleeps) + 1
    assert receiver.counters.timeouts == 1 and receiver.counters.errors == 0


def test_spec7_timeout_names_only_the_missing_keys_and_releases_what_came(
    kit, memory_connector, make_receiver, fake_time
) -> None:
    model = kit.PagedModel()
    sender = KVTransferManager(
        kit.sender_config(2, 1),
        tp_rank=0,
        tp_size=2,
        connector=memory_connector,
        clock=fake_time,
        sleep=fake_time.sleep,
    )
    assert sender.send_requests({"r": {"block_ids": [1], "seq_len": 4}}, model.rank_cache(0, 2), 4, "f32")[0].ok
    receiver = make_receiver(
        kit.SpyConnector(memory_connector), 2, 1, config=kit.receiver_config(2, 1, recv_timeout=1.0)
    )
    result = receiver.receive("r")
    assert result.outcome.kind is ReceiveKind.TIMED_OUT
    assert result.outcome.keys == ("r_0_0_0_0", "r_0_0_1_0") and result.outcome.missing_keys == ("r_0_0_1_0",)
    assert fake_time.elapsed == pytest.approx(1.0)
    assert kit.pool_is_empty(memory_connector)


def test_spec7_per_call_timeout_overrides_config(kit, memory_connector, make_receiver, fake_time) -> None:
    receiver = make_receiver(kit.SpyConnector(memory_connector))
    assert receiver.receive("x", timeout_s=0.05).outcome.is_timeout
    assert fake_time.elapsed == pytest.approx(0.05)


def test_spec7_blocking_get_is_preferred_over_polling(kit, memory_connector, make_receiver, fake_time) -> None:
    model = kit.PagedModel()
    kit.send_all(model, memory_connector, 1, 1, {"a": {"block_ids": [1], "seq_len": 4}})
    spy = kit.BlockingSpyConnector(memory_connector)
    assert make_receiver(spy).receive("a").ok
    assert fake_time.sleeps == [] and len(spy.gets) == 1


def test_a_sender_found_dead_ends_the_receive_at_once_as_sender_gone(
    kit, memory_connector, make_receiver, fake_time
) -> None:
    # the connector's blocking get finds the sender dead at once (as the shm and zmq ones do);
    # the get is recorded and raises, without waiting out its timeout on the empty pool
    spy = kit.BlockingSpyConnector(memory_connector)
    spy.get_error = SenderUnavailable("the sender at ipc://x is gone (its process ended)")
    receiver = make_receiver(spy, config=kit.receiver_config(recv_timeout=30.0))
    start = time.monotonic()
    result = receiver.receive("lost")
    assert time.monotonic() - start < 10.0  # not the 30 s timeout, on any clock
    assert result.outcome.kind is ReceiveKind.SENDER_GONE and not result.ok and result.payload is None
    assert "gone" in result.outcome.detail and result.outcome.missing_keys == ("omni_0_to_1_kv_cache_lost",)
    assert fake_time.elapsed == 0.0 and fake_time.sleeps == [] and len(spy.gets) == 1  # no wait, no retry
    snap = receiver.counters.snapshot()
    assert snap["recv.sender_gone"] == 1 and snap["errors"] == 1 and snap.get("timeouts", 0) == 0


def test_a_key_its_sender_failed_is_refused_at_once_not_an_unexpected_error(
    kit, memory_connector, make_receiver, fake_time, caplog
) -> None:
    # a sender that records it will never publish a key (a connector's failure record, as the
    # vLLM connector's save path writes one): the blocking get raises FailedAtSender, which the
    # receive reports as the sender's refusal (kind and reason kept), with no traceback
    assert memory_connector.publish_failure("0", "1", "omni_0_to_1_kv_cache_doomed", failure_record("put", "no room"))
    receiver = make_receiver(memory_connector, config=kit.receiver_config(recv_timeout=30.0))
    result = receiver.receive("doomed")
    assert result.outcome.kind is ReceiveKind.REFUSED and not result.ok, result.outcome
    assert result.outcome.detail.startswith("put: ") and "no room" in result.outcome.detail
    assert fake_time.elapsed == 0.0 and fake_time.sleeps == []
    assert not [r for r in caplog.records if r.exc_info]
    assert receiver.counters.snapshot()["recv.refused"] == 1


# ------------------------------------------------------------------------------ sender info
def test_spec2_3_key_metadata_names_each_source_rank_endpoint(kit, memory_connector, make_receiver) -> None:
    model = kit.PagedModel()
    kit.send_all(model, memory_connector, 4, 2, {"r": {"block_ids": [1, 2], "seq_len": 8}})
    spy = kit.SpyConnector(memory_connector)
    receiver = make_receiver(spy, 4, 2, rank=1)
    result = receiver.receive("r", sender_info={"host": "10.1.2.3", "zmq_port": 50151})
    assert result.ok
    assert [(k, m) for k, m, _ in spy.gets] == [
        ("r_0_0_2_1", {"source_host": "10.1.2.3", "source_port": 50151 + 2 * 16}),
        ("r_0_0_3_1", {"source_host": "10.1.2.3", "source_port": 50151 + 3 * 16}),
    ]


def test_spec2_5_sender_info_keyed_by_stage_is_resolved(kit, memory_connector, make_receiver) -> None:
    spy = kit.SpyConnector(memory_connector)
    receiver = make_receiver(spy, config=kit.receiver_config(recv_timeout=0.0))
    info = {"0": {"host": "h0", "zmq_port": 6000}, 3: {"host": "h3", "zmq_port": 7000}}
    receiver.receive("r", sender_info=info)
    assert spy.gets[0][1] == {"source_host": "h0", "source_port": 6000}


@pytest.mark.parametrize(
    "info",
    [{"1": {"host": "a"}, "2": {"host": "b"}}, {"0": {"port": 1}}, "nonsense"],
    ids=["ambiguous", "no-host", "not-a-dict"],
)
def test_spec2_5_unresolved_sender_info_is_an_outcome(kit, memory_connector, make_receiver, fake_time, info) -> None:
    spy = kit.SpyConnector(memory_connector)
    receiver = make_receiver(spy)
    result = receiver.receive("r", sender_info=info)
    assert result.outcome.kind is ReceiveKind.SENDER_UNRESOLVED and result.outcome.detail
    assert spy.gets == [] and fake_time.elapsed == 0.0
    assert receiver.counters.errors == 1 and receiver.counters.timeouts == 0


def test_spec7_per_call_sender_info_overrides_but_does_not_replace_the_stored_one(
    kit, memory_connector, make_receiver
) -> None:
    spy = kit.SenderAwareSpy(memory_connector)
    receiver = make_receiver(spy, config=kit.receiver_config(recv_timeout=0.0))
    stored = receiver.update_sender_info({"host": "stored", "zmq_port": 5000})
    assert stored is not None and spy.sender_updates == [("stored", 5000)]
    receiver.receive("a", sender_info={"host": "override", "zmq_port": 6000})
    receiver.receive("b")
    # TP 1/1: the stored sender reaches the connector as its default (update_sender_info), and
    # get() is called without metadata, as the reference calls it
    assert [m for _, m, _ in spy.gets] == [{"source_host": "override", "source_port": 6000}, None]
    assert receiver.sender_endpoint.host == "stored" and spy.sender_updates == [("stored", 5000)]


@pytest.mark.parametrize(
    "from_tp, to_tp, rank, stored, per_call, expected",
    [
        # TP 1/1 (legacy keys, no source rank): metadata only for a request-scoped sender
        (1, 1, 0, None, None, [None]),
        (1, 1, 0, ("h", 5000), None, [None]),
        (1, 1, 0, ("h", 5000), ("p", 7000), [{"source_host": "p", "source_port": 7000}]),
        # TP > 1: each key names its source rank's port, from the stored or the request's sender
        (2, 2, 1, ("h", 5000), None, [{"source_host": "h", "source_port": 5016}]),
        (2, 2, 1, None, None, [None]),
        (
            4,
            2,
            1,
            None,
            ("p", 7000),
            [{"source_host": "p", "source_port": 7032}, {"source_host": "p", "source_port": 7048}],
        ),
        (2, 4, 3, ("h", 5000), None, [{"source_host": "h", "source_port": 5016}]),
    ],
)
def test_get_metadata_per_tp_case_as_the_reference(
    kit, memory_connector, make_receiver, from_tp, to_tp, rank, stored, per_call, expected
) -> None:
    spy = kit.SpyConnector(memory_connector)
    receiver = make_receiver(
        spy, from_tp, to_tp, rank=rank, config=kit.receiver_config(from_tp, to_tp, recv_timeout=0.0)
    )
    if stored is not None:
        receiver.update_sender_info({"host": stored[0], "zmq_port": stored[1]})
    info = None if per_call is None else {"host": per_call[0], "zmq_port": per_call[1]}
    receiver.receive("r", sender_info=info)
    assert [m for _, m, _ in spy.gets] == expected


def test_request_scoped_sender_without_port_is_unresolved(kit, memory_connector, make_receiver, fake_time) -> None:
    spy = kit.SpyConnector(memory_connector)
    result = make_receiver(spy).receive("r", sender_info={"host": "h"})
    assert result.outcome.kind is ReceiveKind.SENDER_UNRESOLVED and "no port" in result.outcome.detail
    assert spy.gets == [] and fake_time.elapsed == 0.0


def test_spec2_5_update_sender_info_rank_adjusts_the_connector_default(kit, memory_connector, make_receiver) -> None:
    spy = kit.SenderAwareSpy(memory_connector)
    receiver = make_receiver(spy, 2, 2, rank=1)
    receiver.update_sender_info({0: {"host": "h", "zmq_port": 50151}})
    assert spy.sender_updates == [("h", 50151 + 16)]
    assert receiver.update_sender_info({"5": {"host": "x"}, "6": {"host": "y"}}) is None  # ambiguous
    assert receiver.sender_endpoint.host == "h"


def test_spec2_5_update_sender_info_is_a_no_op_when_not_receiving(kit, memory_connector, make_receiver) -> None:
    receiver = make_receiver(memory_connector, config=kit.receiver_config(need_recv_cache=False))
    assert receiver.update_sender_info({"host": "h", "zmq_port": 1}) is None
    assert receiver.sender_endpoint is None


# ---------------------------------------------------------------------- decode and release
@pytest.mark.parametrize(
    "garbage",
    [b"\x00\x00\x00\x05{bad}", b"\xff" * 64, b"\x00\x00\x00\x02{}"],
    ids=["not-json", "huge-header-length", "missing-keys"],
)
def test_spec7_garbage_payload_is_a_decode_failure_and_is_released(
    kit, memory_connector, make_receiver, garbage
) -> None:
    memory_connector.put(from_stage="0", to_stage="1", put_key="omni_0_to_1_kv_cache_g", data=garbage)
    receiver = make_receiver(memory_connector)
    result = receiver.receive("g")
    assert result.outcome.kind is ReceiveKind.DECODE_FAILED and result.payload is None
    assert result.outcome.nbytes == len(garbage) and result.outcome.detail
    assert receiver.counters.errors == 1 and receiver.counters.timeouts == 0
    assert kit.pool_is_empty(memory_connector)


def test_spec7_pool_released_on_success_timeout_and_decode_failure(
    kit, memory_connector, make_receiver, fake_time
) -> None:
    model = kit.PagedModel()
    kit.send_all(model, memory_connector, 2, 1, {"ok": {"block_ids": [1, 2], "seq_len": 8}})
    memory_connector.put(from_stage="0", to_stage="1", put_key="bad_0_0_0_0", data=b"\x00\x00\x00\x01x")
    memory_connector.put(from_stage="0", to_stage="1", put_key="bad_0_0_1_0", data=b"\x00\x00\x00\x01x")
    memory_connector.put(
        from_stage="0",
        to_stage="1",
        put_key="half_0_0_0_0",
        data=encode_bytes("half", [torch.ones(2, 1, 1)], [torch.ones(2, 1, 1)], [0], {}),
    )
    receiver = make_receiver(
        kit.SpyConnector(memory_connector), 2, 1, config=kit.receiver_config(2, 1, recv_timeout=0.5)
    )
    kinds = [receiver.receive(rid).outcome.kind for rid in ("ok", "bad", "half")]
    assert kinds == [ReceiveKind.RECEIVED, ReceiveKind.DECODE_FAILED, ReceiveKind.TIMED_OUT]
    assert kit.pool_is_empty(memory_connector)
    assert memory_connector.health()["gets_hit"] == 5


def test_spec2_4_untagged_fan_out_payload_is_sliced_on_the_receiver(kit, memory_connector, make_receiver) -> None:
    """A sender that does not slice (the reference's full payload) is sliced by the receiver."""
    full = torch.arange(4 * 8 * 2, dtype=torch.float32).reshape(4, 8, 2)
    data = encode_bytes("r", [full], [full + 1], [0], {"seq_len": 4}, align=1, version=False)
    for target in (0, 1):
        memory_connector.put(from_stage="0", to_stage="1", put_key=f"r_0_0_0_{target}", data=data)
    for rank in (0, 1):
        result = make_receiver(memory_connector, 1, 2, rank=rank).receive("r")
        assert result.ok
        assert kit.bits_equal(result.payload["layer_blocks"]["key_cache"][0], full[:, rank * 4 : (rank + 1) * 4])
        assert kit.bits_equal(result.payload["layer_blocks"]["value_cache"][0], full[:, rank * 4 : (rank + 1) * 4] + 1)
        tag = result.payload["metadata"]["tp_head_slice"]
        assert tag["side"] == "receiver" and tag["target_rank"] == rank and tag["offset_in_shard"] == rank
        assert tag["num_slices"] == 2 and tag["applied"] is True


def test_spec2_4_tagged_payload_is_never_sliced_twice(kit, memory_connector, make_receiver, caplog) -> None:
    shard = torch.randn(4, 2, 2)
    tag = {
        "applied": True,
        "side": "sender",
        "target_rank": 0,
        "source_rank": 0,
        "from_tp": 1,
        "to_tp": 2,
        "offset_in_shard": 0,
        "num_slices": 2,
    }
    memory_connector.put(
        from_stage="0",
        to_stage="1",
        put_key="r_0_0_0_1",
        data=encode_bytes("r", [shard], [shard], [0], {"tp_head_slice": tag}),
    )
    with caplog.at_level("WARNING"):
        result = make_receiver(memory_connector, 1, 2, rank=1).receive("r")
    assert result.ok and kit.bits_equal(result.payload["layer_blocks"]["key_cache"][0], shard)
    assert any("sliced for rank 0" in r.getMessage() for r in caplog.records)


# ----------------------------------------------------------------------------------- hooks
def test_spec2_2_custom_send_and_receive_key_hooks_round_trip(
    kit, memory_connector, make_sender, make_receiver
) -> None:
    model = kit.PagedModel()
    sender = make_sender(memory_connector, 2, 1, rank=1, kv_send_key_builder=lambda rid, f, t: [f"{rid}@{f}->{t}#1"])
    assert sender.send_requests({"r": {"block_ids": [2], "seq_len": 4}}, model.rank_cache(1, 2), 4, "f32")[0].ok
    sender0 = make_sender(memory_connector, 2, 1, rank=0, kv_send_key_builder=lambda rid, f, t: [f"{rid}@{f}->{t}#0"])
    assert sender0.send_requests({"r": {"block_ids": [2], "seq_len": 4}}, model.rank_cache(0, 2), 4, "f32")[0].ok
    spy = kit.SpyConnector(memory_connector)
    receiver = make_receiver(
        spy, 2, 1, kv_recv_key_builder=lambda rid, f, t: [f"{rid}@{f}->{t}#0", f"{rid}@{f}->{t}#1"]
    )
    result = receiver.receive("r", sender_info={"host": "h", "zmq_port": 9000})
    assert result.ok
    kit.assert_kv_equal(result.payload, *model.expected([2], 4))
    # plain strings got their source ranks from the receive rank map (counts match)
    assert [m["source_port"] for _, m, _ in spy.gets] == [9000, 9016]


def test_spec2_4_merger_and_slicer_hooks_replace_the_defaults(kit, memory_connector, make_receiver) -> None:
    model = kit.PagedModel()
    kit.send_all(model, memory_connector, 2, 1, {"r": {"block_ids": [1], "seq_len": 4}})
    seen: dict[str, Any] = {}

    def merger(payloads: list) -> dict:
        seen["merged"] = [p["request_id"] for p in payloads]
        return payloads[1]  # keep sender rank 1's shard only

    def slicer(payload: dict) -> dict:
        seen["sliced"] = payload["request_id"]
        return {**payload, "metadata": {**payload["metadata"], "sliced_by": "hook"}}

    receiver = make_receiver(memory_connector, 2, 1, kv_payload_merger=merger, kv_payload_slicer=slicer)
    result = receiver.receive("r", zero_copy=False)
    assert result.ok and seen == {"merged": ["r", "r"], "sliced": "r"}
    assert result.payload["metadata"]["sliced_by"] == "hook"
    kit.assert_kv_equal(result.payload, *model.expected([1], 4, 1, 2))
    assert kit.pool_is_empty(memory_connector)  # hook output cloned out of the pool, buffers released


def test_spec7_failing_merge_hook_is_consumed_but_failed(kit, memory_connector, make_receiver) -> None:
    model = kit.PagedModel()
    kit.send_all(model, memory_connector, 2, 1, {"r": {"block_ids": [1], "seq_len": 4}})

    def merger(payloads: list) -> dict:
        raise ValueError("engine merge failed")

    result = make_receiver(memory_connector, 2, 1, kv_payload_merger=merger).receive("r")
    assert result.outcome.kind is ReceiveKind.CONSUMED_BUT_FAILED and "engine merge failed" in result.outcome.detail
    assert kit.pool_is_empty(memory_connector)


# ------------------------------------------------------------------------------ skip paths
@pytest.mark.parametrize("rid", ["dummy_req_id", "dummy_req_id/7", "dummy_req_id/warmup/2"])
def test_spec1_dummy_requests_never_wait(kit, memory_connector, make_receiver, fake_time, rid) -> None:
    spy = kit.SpyConnector(memory_connector)
    receiver = make_receiver(spy, config=kit.receiver_config(recv_timeout=30.0))
    result = receiver.receive(rid)
    assert result.outcome.kind is ReceiveKind.SKIPPED and result.outcome.skip_reason is SkipReason.DUMMY
    assert spy.gets == [] and fake_time.elapsed == 0.0 and fake_time.sleeps == []
    assert receiver.counters.get("recv.skipped.dummy") == 1


def test_spec7_not_receiving_and_missing_id_are_skipped(kit, memory_connector, make_receiver) -> None:
    spy = kit.SpyConnector(memory_connector)
    idle = make_receiver(spy, config=kit.receiver_config(need_recv_cache=False))
    assert idle.receive("r").outcome.skip_reason is SkipReason.NOT_RECEIVING
    assert make_receiver(spy).receive("").outcome.skip_reason is SkipReason.NO_REQUEST_ID
    assert spy.gets == []


def test_spec7_receiver_connector_failure_is_remembered(kit, make_receiver) -> None:
    calls: list[dict] = []

    def factory(config: dict) -> Any:
        calls.append(config)
        raise ConnectorUnavailable("no such package")

    receiver = make_receiver(None, connector_factory=factory)
    kinds = {receiver.receive(f"r{i}").outcome.kind for i in range(3)}
    assert kinds == {ReceiveKind.CONNECTOR_UNAVAILABLE} and len(calls) == 1
    assert receiver.counters.errors == 3 and receiver.connector_failure("receiver") is not None


def test_spec7_receiver_connector_created_lazily_with_receiver_role(kit, make_receiver) -> None:
    """A serving connector (zmq) is told its role; the receiver's own config never names the sender."""
    made: list[dict] = []

    def factory(config: dict) -> Any:
        made.append(config)
        return kit.SpyConnector(types.SimpleNamespace(get=lambda **kw: None))

    config = kit.receiver_config(
        connector_config={"type": "zmq", "zmq_port": 50051, "sender_host": "stale", "sender_port": 1}, recv_timeout=0.0
    )
    receiver = make_receiver(None, config=config, connector_factory=factory)
    assert made == []  # created on first use
    receiver.receive("r")
    receiver.receive("s")
    assert len(made) == 1 and made[0]["role"] == "receiver"
    assert "sender_host" not in made[0] and "sender_port" not in made[0] and "port" not in made[0]


# ----------------------------------------------------------------------- apply and counters
def test_spec7_apply_to_request_mirrors_onto_sampling_params(kit, memory_connector, make_receiver) -> None:
    model = kit.PagedModel()
    kit.send_all(model, memory_connector, 1, 1, {"r": {"block_ids": [1, 2], "seq_len": 6}})
    result = make_receiver(memory_connector).receive("r")
    req = kit.make_request("r")
    assert KVTransferManager.apply_to_request(req, result.payload) is True
    keys, values = model.expected([1, 2], 6)
    assert len(req.past_key_values) == model.num_layers
    assert all(kit.bits_equal(a, b) for a, b in zip(req.past_key_values.key_cache, keys))
    assert all(kit.bits_equal(a, b) for a, b in zip(req.past_key_values.value_cache, values))
    assert req.kv_metadata["seq_len"] == 6
    assert req.sampling_params.past_key_values is req.past_key_values
    assert req.sampling_params.kv_metadata == req.kv_metadata
    bare = kit.make_request("r", sampling_params=False)
    assert KVTransferManager.apply_to_request(bare, result.payload) and not hasattr(bare, "sampling_params")
    assert KVTransferManager.apply_to_request(kit.make_request(), None) is False


def test_spec9_10_counters_keep_timeouts_apart_from_errors(kit, memory_connector, make_receiver) -> None:
    model = kit.PagedModel()
    kit.send_all(model, memory_connector, 1, 1, {"ok": {"block_ids": [1], "seq_len": 4}})
    memory_connector.put(from_stage="0", to_stage="1", put_key="omni_0_to_1_kv_cache_bad", data=b"junk")
    receiver = make_receiver(kit.SpyConnector(memory_connector), config=kit.receiver_config(recv_timeout=0.1))
    for rid in ("ok", "bad", "missing", "dummy_req_id"):
        receiver.receive(rid)
    receiver.receive("x", sender_info={"1": {"host": "a"}, "2": {"host": "b"}})
    snap = receiver.counters.snapshot()
    assert snap["recv.received"] == 1 and snap["recv.decode_failed"] == 1 and snap["recv.timed_out"] == 1
    assert snap["recv.sender_unresolved"] == 1 and snap["recv.skipped.dummy"] == 1
    assert snap["timeouts"] == 1 and snap["errors"] == 2
    assert snap["recv.bytes"] > 0
