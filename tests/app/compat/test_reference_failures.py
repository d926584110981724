"""SPEC 9: each known failure of the reference, as a test that kvferry's manager does not have it.

Connector-internal failures (shared-memory segments surviving a crash, bind errors of a real
socket) are covered by the connector suites; here each one is checked at the manager's level on
in-memory adapters.
"""

from __future__ import annotations

import functools
import threading
import time
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvferry.adapters.collectives import InProcessWorld
from kvferry.app.compat import OmniKVTransferManager
from kvferry.app.manager import KVTransferManager
from kvferry.app.registry import ConnectorRegistry, create_connector
from kvferry.core.addressing import kv_port
from kvferry.core.errors import BindError, ConnectorUnavailable
from kvferry.core.outcomes import ReceiveKind, SendKind, SendReason, SkipReason
from kvferry.core.roles import GroupLayout

pytestmark = pytest.mark.timeout(60)

SPEC = {"block_ids": [3, 1, 5], "seq_len": 10}
PROPS = settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


# ------------------------------------------------------------------------------------ 9.1
def test_spec9_1_single_rank_timeout_does_not_desync_the_tp_group(kit, memory_connector, fake_time) -> None:
    """TP rank 3 times out alone on r1: all ranks drop r1 together, then r2 and r3 flow normally."""
    model = kit.PagedModel()
    kit.send_all(model, memory_connector, 4, 4, {"r1": SPEC, "r2": SPEC, "r3": SPEC})
    counters: list[Any] = [None] * 4

    def rank_main(rank: int, groups: Any) -> list[bool]:
        spy = kit.SpyConnector(memory_connector)
        if rank == 3:
            spy.hidden.add("r1_0_0_3_3")
        m = OmniKVTransferManager(
            kit.receiver_config(4, 4, recv_timeout=2.0),
            connector=spy,
            tp_rank=rank,
            tp_size=4,
            groups=groups,
            env={},
            clock=fake_time,
            sleep=fake_time.sleep,
        )
        counters[rank] = m.counters
        return [m.receive_multi_kv_cache_distributed(kit.make_request(rid)) for rid in ("r1", "r2", "r3")]

    assert kit.run_ranks(GroupLayout(tp_size=4), rank_main) == [[False, True, True]] * 4
    assert [c.timeouts for c in counters] == [0, 0, 0, 1]  # the miss is visible where it happened


# ------------------------------------------------------------------------------------ 9.2
TOPOLOGY = st.sampled_from([(1, 1), (1, 2), (2, 1), (2, 2), (2, 4), (4, 2), (4, 8), (8, 2), (1, 4), (4, 1)])
STAGES = st.sampled_from([(0, 1), (1, 2), ("llm", "dit"), ("0", "3")])
RIDS = st.text(st.sampled_from("abz_-/09"), min_size=1, max_size=12).filter(lambda s: not s.startswith("dummy"))


@PROPS
@given(topology=TOPOLOGY, stages=STAGES, rid=RIDS)
def test_spec9_2_sender_and_receiver_derive_same_keys(kit, topology, stages, rid) -> None:
    """Over every valid topology and stage naming, the keys all senders put are exactly the keys
    all receivers get, and every receiver rank gets its data (no request waits out a timeout)."""
    from_tp, to_tp = topology
    frm, to = stages
    model = kit.PagedModel(heads=8, num_layers=1, num_blocks=4)
    fake = kit.FakeTime()
    with create_connector({"type": "memory", "pool_bytes": 1 << 20}) as inner:
        spy = kit.SpyConnector(inner)
        put_keys: list[str] = []
        for rank in range(from_tp):
            sender = KVTransferManager(
                kit.sender_config(from_tp, to_tp, from_stage=frm, to_stage=to),
                tp_rank=rank,
                tp_size=from_tp,
                connector=spy,
                clock=fake,
                sleep=fake.sleep,
            )
            [outcome] = sender.send_requests(
                {rid: {"block_ids": [1, 2], "seq_len": 6}}, model.rank_cache(rank, from_tp), model.block_size, "float32"
            )
            assert outcome.ok
            put_keys += outcome.keys
        for rank in range(to_tp):
            receiver = KVTransferManager(
                kit.receiver_config(
                    from_tp, to_tp, from_stage=None, stage_id=to, engine_input_source=[frm], recv_timeout=0.0
                ),
                tp_rank=rank,
                tp_size=to_tp,
                connector=spy,
                clock=fake,
                sleep=fake.sleep,
            )
            result = receiver.receive(rid)
            assert result.ok, result.outcome
            kit.assert_kv_equal(result.payload, *model.expected([1, 2], 6, rank, to_tp))
            result.release()
        assert sorted(put_keys) == sorted(spy.get_keys) and len(set(put_keys)) == len(put_keys)
        assert kit.pool_is_empty(inner)


# ------------------------------------------------------------------------------------ 9.3
def test_spec9_3_consume_once_payload_is_read_by_the_leader_only(kit, memory_connector, fake_time) -> None:
    """Every payload has one reader: the leader pulls it, the followers get it by distribution."""
    model = kit.PagedModel()
    kit.send_all(model, memory_connector, 2, 2, {"r1": SPEC})
    spies = [kit.BlockingSpyConnector(memory_connector) for _ in range(4)]
    reqs = [kit.make_request("r1") for _ in range(4)]

    def rank_main(rank: int, groups: Any) -> bool:
        m = OmniKVTransferManager(
            kit.receiver_config(2, 2),
            connector=spies[rank],
            tp_rank=groups.tp.rank,
            tp_size=2,
            groups=groups,
            env={},
            clock=fake_time,
            sleep=fake_time.sleep,
        )
        return m.receive_multi_kv_cache_distributed(reqs[rank])

    assert kit.run_ranks(GroupLayout(tp_size=2, sp_size=2), rank_main) == [True] * 4
    assert [len(s.gets) for s in spies] == [1, 1, 0, 0]
    assert all(r.past_key_values is not None for r in reqs)
    assert memory_connector.get(from_stage="0", to_stage="1", get_key="r1_0_0_0_0") is None  # consumed
    assert kit.pool_is_empty(memory_connector)


# ------------------------------------------------------------------------------------ 9.4
def test_spec9_4_full_pool_is_explicit_and_queued_payloads_are_kept(
    kit, memory_connector_factory, make_sender, make_receiver
) -> None:
    model = kit.PagedModel()
    conn = memory_connector_factory(pool_bytes=3 * 8320)  # room for three requests
    sender = make_sender(conn)
    finished = {f"q{i}": SPEC for i in range(5)}
    outcomes = sender.send_requests(finished, model.rank_cache(), 4, "float32")
    assert [o.kind for o in outcomes] == [SendKind.SENT] * 3 + [SendKind.FAILED] * 2
    assert {o.reason for o in outcomes[3:]} == {SendReason.POOL_FULL}
    receiver = make_receiver(conn)
    for rid in ("q0", "q1", "q2"):  # nothing queued was evicted to make room
        result = receiver.receive(rid)
        assert result.ok
        kit.assert_kv_equal(result.payload, *model.expected(SPEC["block_ids"], SPEC["seq_len"]))
        result.release()  # zero-copy: the reader gives its region back (not left to the garbage collector)
    retried = sender.send_requests({"q3": SPEC, "q4": SPEC}, model.rank_cache(), 4, "float32")
    assert all(o.ok for o in retried)  # back-pressure: room again once readers drained the pool


# ------------------------------------------------------------------------------------ 9.5
def test_spec9_5_nothing_delivered_is_never_sent(kit, memory_connector, make_sender, make_receiver) -> None:
    """One of two fan-out keys fails every attempt: the request is FAILED (not sent), names the
    failed key, and the receiver of that key reports the refusal (the sender put a marker
    under the failed key), not success; without the marker, a timeout."""
    model = kit.PagedModel()
    spy = kit.SpyConnector(memory_connector)
    spy.put_script = [None] + [(False, 0, {"reason": "error", "detail": "peer gone"})] * 3
    sender = make_sender(spy, 1, 2)
    [outcome] = sender.send_requests({"r": SPEC}, model.rank_cache(0, 1), 4, "float32")
    assert outcome.kind is SendKind.FAILED and not outcome.ok and outcome.reason is SendReason.PUT_FAILED
    assert outcome.keys == ("r_0_0_0_0",) and outcome.failed_keys == ("r_0_0_0_1",)
    assert outcome.refusal_keys == ("r_0_0_0_1",)
    assert sender.counters.get("send.sent") == 0 and sender.counters.get("send.failed") == 1
    assert make_receiver(memory_connector, 1, 2, rank=0).receive("r").ok
    late = make_receiver(
        kit.SpyConnector(memory_connector), 1, 2, rank=1, config=kit.receiver_config(1, 2, recv_timeout=0.5)
    ).receive("r")
    assert late.outcome.kind is ReceiveKind.REFUSED and "peer gone" in late.outcome.detail
    again = make_receiver(
        kit.SpyConnector(memory_connector), 1, 2, rank=1, config=kit.receiver_config(1, 2, recv_timeout=0.5)
    ).receive("r")
    assert again.outcome.kind is ReceiveKind.TIMED_OUT  # the marker was read once, like a payload


# ------------------------------------------------------------------------------------ 9.6
def test_spec9_6_sender_ports_never_collide_and_never_use_the_raw_base(kit) -> None:
    seen: dict[int, tuple] = {}
    for replica in range(3):
        for dp in range(4):
            for rank in range(4):
                for stage in range(3):
                    config = kit.sender_config(4, 4, from_stage=stage, to_stage=stage + 1, replica_id=replica)
                    port = KVTransferManager(config, tp_rank=rank, tp_size=4, dp_rank=dp).sender_port()
                    assert port not in seen, f"{(replica, dp, rank, stage)} collides with {seen[port]}"
                    assert port != config.base_port
                    seen[port] = (replica, dp, rank, stage)
    assert KVTransferManager(kit.sender_config(), tp_rank=0).sender_port() == 50151


def test_spec9_6_serving_connector_binds_the_rank_port_and_a_bind_failure_names_it(kit) -> None:
    calls: list[dict] = []

    def factory(config: dict) -> Any:
        calls.append(dict(config))
        raise BindError(f"cannot bind {config['host']}:{config['port']}: Address already in use")

    config = kit.sender_config(2, 2, connector_config={"type": "zmq", "zmq_port": 50051})
    sender = KVTransferManager(config, tp_rank=1, tp_size=2, connector_factory=factory)
    expected = kv_port(50051, 0, 1, 0, 0, tp_size=2)
    with pytest.raises(ConnectorUnavailable, match=f"127.0.0.1:{expected}"):
        sender.start()
    # the base port is consumed by the manager; the connector gets this rank's port only
    assert calls == [{"type": "zmq", "role": "sender", "host": "127.0.0.1", "port": expected}]
    assert expected == 50051 + 100 + 16


# ------------------------------------------------------------------------------------ 9.7
def test_spec9_7_dummy_requests_never_wait(kit, memory_connector, fake_time) -> None:
    spy = kit.SpyConnector(memory_connector)
    groups = kit.stage_groups(InProcessWorld(4), 0, GroupLayout(tp_size=4))
    m = OmniKVTransferManager(
        kit.receiver_config(4, 4, recv_timeout=30.0),
        async_prefetch=True,
        connector=spy,
        tp_rank=0,
        tp_size=4,
        groups=groups,
        env={},
        clock=fake_time,
        sleep=fake_time.sleep,
    )
    done: list[Any] = []

    def calls() -> None:  # alone in a group of 4: any collective would block
        req = kit.make_request("dummy_req_id", sender_info={"host": "h", "zmq_port": 1})
        done.append(m.manager.receive("dummy_req_id").outcome.skip_reason)
        done.append(m.receive_kv_cache(req))
        done.append(m.receive_kv_cache_for_request("dummy_req_id/1"))
        done.append(m.receive_multi_kv_cache_distributed(req))
        m.start_prefetch({"request_id": "dummy_req_id/2", "kv_sender_info": {"host": "h", "zmq_port": 1}})
        done.append(m.consume_and_distribute_kv_cache(kit.make_request("dummy_req_id/2")))

    thread = threading.Thread(target=calls, daemon=True)
    start = time.monotonic()
    thread.start()
    thread.join(10.0)
    m.close()
    assert done == [SkipReason.DUMMY, False, (None, 0), False, False]
    assert time.monotonic() - start < 5.0
    assert fake_time.elapsed == 0.0 and fake_time.sleeps == [] and spy.gets == []


# ------------------------------------------------------------------------------------ 9.8
def test_spec9_8_pool_buffers_released_on_every_path(kit, memory_connector, make_receiver, fake_time) -> None:
    """Success, partial timeout, decode failure, failed post-processing: nothing stays held."""
    model = kit.PagedModel()
    kit.send_all(model, memory_connector, 2, 1, {"ok": SPEC, "post": SPEC})
    kit.send_all(model, memory_connector, 2, 1, {"part": SPEC})
    memory_connector.get(from_stage="0", to_stage="1", get_key="part_0_0_1_0")[0].release()  # one shard lost
    for key in ("bad_0_0_0_0", "bad_0_0_1_0"):
        memory_connector.put(from_stage="0", to_stage="1", put_key=key, data=b"\x00\x00\x00\x02{]")
    spy = kit.SpyConnector(memory_connector)
    plain = make_receiver(spy, 2, 1, config=kit.receiver_config(2, 1, recv_timeout=0.5))

    def failing_merger(payloads: list) -> Any:
        raise RuntimeError("merge hook failed")

    hooked = make_receiver(spy, 2, 1, kv_payload_merger=failing_merger)
    kinds = [
        plain.receive("ok").outcome.kind,
        plain.receive("part").outcome.kind,
        plain.receive("bad").outcome.kind,
        hooked.receive("post").outcome.kind,
    ]
    assert kinds == [
        ReceiveKind.RECEIVED,
        ReceiveKind.TIMED_OUT,
        ReceiveKind.DECODE_FAILED,
        ReceiveKind.CONSUMED_BUT_FAILED,
    ]
    assert kit.pool_is_empty(memory_connector)


# ------------------------------------------------------------------------------------ 9.9
def test_spec9_9_the_sender_of_the_expected_stage_is_picked(kit, memory_connector, make_receiver) -> None:
    spy = kit.SpyConnector(memory_connector)
    config = kit.receiver_config(stage_id=3, engine_input_source=[2], recv_timeout=0.0)
    receiver = make_receiver(spy, config=config)
    info = {1: {"host": "stage1", "zmq_port": 6000}, 2: {"host": "stage2", "zmq_port": 7000}}
    receiver.receive("r", sender_info=info)
    assert spy.gets[-1][1] == {"source_host": "stage2", "source_port": 7000}
    guess = receiver.receive("r", sender_info={1: info[1], 4: {"host": "stage4", "zmq_port": 8000}})
    assert guess.outcome.kind is ReceiveKind.SENDER_UNRESOLVED and len(spy.gets) == 1  # no guessing


# ----------------------------------------------------------------------------------- 9.10
def test_spec9_10_exceptions_are_errors_not_missing_and_counted_apart(kit, memory_connector, make_receiver) -> None:
    spy = kit.SpyConnector(memory_connector)
    spy.get_error = RuntimeError("connector broke")
    receiver = make_receiver(spy, config=kit.receiver_config(recv_timeout=1.0))
    result = receiver.receive("r")
    assert result.outcome.kind is ReceiveKind.ERROR and "connector broke" in result.outcome.detail
    spy.get_error = None
    assert receiver.receive("s").outcome.kind is ReceiveKind.TIMED_OUT
    assert receiver.counters.errors == 1 and receiver.counters.timeouts == 1
    assert receiver.counters.get("recv.error") == 1 and receiver.counters.get("recv.timed_out") == 1


# ----------------------------------------------------------------------------------- 9.11
def test_spec9_11_receiver_is_woken_by_arrival_not_by_polling(kit, memory_connector, fake_time) -> None:
    model = kit.PagedModel()
    spy = kit.BlockingSpyConnector(memory_connector)
    entered = spy.entered["omni_0_to_1_kv_cache_r"] = threading.Event()
    receiver = KVTransferManager(
        kit.receiver_config(recv_timeout=20.0), connector=spy, clock=fake_time, sleep=fake_time.sleep
    )
    got: list[Any] = []
    thread = threading.Thread(target=lambda: got.append(receiver.receive("r")), daemon=True)
    thread.start()
    assert entered.wait(10.0)  # the receiver is blocked in the connector, waiting for arrival
    start = time.monotonic()
    kit.send_all(model, memory_connector, 1, 1, {"r": SPEC})
    thread.join(10.0)
    assert got and got[0].ok and time.monotonic() - start < 5.0
    assert fake_time.sleeps == [] and len(spy.gets) == 1


def test_spec9_11_frames_are_zero_copy_views(kit, memory_connector, make_sender) -> None:
    """Without a pool to write into, the payload goes out as header + tensor views (no join)."""
    model = kit.PagedModel()
    spy = kit.SpyConnector(memory_connector)
    [outcome] = make_sender(spy).send_requests({"r": SPEC}, model.rank_cache(), 4, "float32")
    [(_, frames)] = spy.puts
    assert isinstance(frames, list) and all(isinstance(f, (bytes, memoryview)) for f in frames)
    assert sum(memoryview(f).nbytes for f in frames) == outcome.nbytes
    assert sum(isinstance(f, memoryview) and f.nbytes >= 10 * 2 * 4 * 4 for f in frames) == 2 * model.num_layers


# ----------------------------------------------------------------------------------- 9.12
def test_spec9_12_connector_failure_is_loud_at_start_and_visible_per_request(kit, caplog) -> None:
    model = kit.PagedModel()
    factory = functools.partial(create_connector, registry=ConnectorRegistry())
    config = kit.sender_config(connector_config={"type": "memory", "pool_bytes": -1})
    sender = KVTransferManager(config, connector_factory=factory)
    with pytest.raises(ConnectorUnavailable, match="pool_bytes"):
        sender.start()
    [outcome] = sender.send_requests({"r": SPEC}, model.rank_cache(), 4, "float32")
    assert outcome.reason is SendReason.CONNECTOR_UNAVAILABLE and "pool_bytes" in str(sender.health()["failures"])
    with caplog.at_level("ERROR"):
        compat = OmniKVTransferManager(config, tp_rank=0, tp_size=1, env={}, connector_factory=factory)
    assert compat.connector is None
    assert any("no connector could be created" in r.getMessage() for r in caplog.records)
