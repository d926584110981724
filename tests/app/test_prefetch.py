"""Asynchronous prefetch (SPEC 7): hit, miss with synchronous fallback, consumed-then-failed
without retry, stale prefetches dropped, shutdown with work pending, and the disabled cases.

The manager's prefetch worker is a real thread; the connector spy records which thread made
each get and can hold a key's get on a gate, so orderings are forced, never slept for.
"""

from __future__ import annotations

import threading
import time
import types
from typing import Any

import pytest

from kvferry.adapters.collectives import InProcessWorld
from kvferry.app.compat import KVPrefetchConsumeError, OmniKVTransferManager
from kvferry.app.prefetch import Prefetcher
from kvferry.app.receive import ReceiveResult
from kvferry.core.outcomes import ReceiveKind, ReceiveOutcome
from kvferry.core.roles import GroupLayout, ReceiveRole

pytestmark = pytest.mark.timeout(60)

SPEC = {"block_ids": [3, 1, 5], "seq_len": 10}
INFO = {"host": "127.0.0.1", "zmq_port": 50151}


def _job(rid: str, info: Any = INFO) -> dict:
    job = {"request_id": rid}
    if info is not None:
        job["kv_sender_info"] = info
    return job


@pytest.fixture
def prefetching(kit, fake_time, closing):
    """``prefetching(connector, **config) -> OmniKVTransferManager`` with prefetch on; shut down after."""

    def make(
        connector: Any,
        *,
        async_prefetch: bool = True,
        tp_rank: int = 0,
        tp_size: int = 1,
        groups: Any = None,
        **config: Any,
    ) -> OmniKVTransferManager:
        config = kit.receiver_config(**config)
        m = OmniKVTransferManager(
            config,
            async_prefetch=async_prefetch,
            connector=connector,
            tp_rank=tp_rank,
            tp_size=tp_size,
            groups=groups,
            env={},
            clock=fake_time,
            sleep=fake_time.sleep,
        )
        return closing(m)

    return make


def _prefetch_threads(spy: Any) -> set[str]:
    return {name for _, _, name in spy.gets if name.startswith("kvferry-prefetch")}


# ------------------------------------------------------------------------------------- hit
def test_spec7_prefetch_hit_is_received_on_the_worker(kit, memory_connector, prefetching) -> None:
    model = kit.PagedModel()
    kit.send_all(model, memory_connector, 1, 1, {"r1": SPEC})
    spy = kit.BlockingSpyConnector(memory_connector)
    m = prefetching(spy)
    m.start_prefetch(_job("r1"))
    data, size = m.consume_prefetched_kv(kit.make_request("r1"))
    assert data is not None and size > 0
    kit.assert_kv_equal(data, *model.expected(SPEC["block_ids"], SPEC["seq_len"]))
    assert len(spy.gets) == 1 and _prefetch_threads(spy)
    assert spy.gets[0][1] == {"source_host": "127.0.0.1", "source_port": 50151}  # the job's sender info
    assert m.last_receive_outcome.ok and kit.pool_is_empty(memory_connector)


def test_spec7_consume_and_distribute_applies_a_prefetched_payload(kit, memory_connector, prefetching) -> None:
    model = kit.PagedModel()
    kit.send_all(model, memory_connector, 1, 1, {"r1": SPEC})
    spy = kit.BlockingSpyConnector(memory_connector)
    m = prefetching(spy)
    m.start_prefetch(_job("r1"))
    req = kit.make_request("r1", sender_info=INFO)
    assert m.consume_and_distribute_kv_cache(req) is True
    kit.assert_kv_equal(
        {"layer_blocks": {"key_cache": req.past_key_values.key_cache, "value_cache": req.past_key_values.value_cache}},
        *model.expected(SPEC["block_ids"], SPEC["seq_len"]),
    )
    assert req.sampling_params.past_key_values is req.past_key_values
    assert len(spy.gets) == 1 and _prefetch_threads(spy)  # no synchronous receive


# ------------------------------------------------------------------------------------ miss
def test_spec7_prefetch_miss_falls_back_to_a_synchronous_receive(kit, memory_connector, prefetching) -> None:
    """The prefetch could not resolve its sender (a miss, nothing consumed): the request's own
    sender info serves the synchronous receive."""
    model = kit.PagedModel()
    kit.send_all(model, memory_connector, 1, 1, {"r1": SPEC})
    spy = kit.BlockingSpyConnector(memory_connector)
    m = prefetching(spy)
    m.start_prefetch(_job("r1", info={"5": {"host": "a"}, "6": {"host": "b"}}))  # ambiguous
    req = kit.make_request("r1", sender_info=INFO)
    assert m.consume_and_distribute_kv_cache(req) is True
    assert [name for _, _, name in spy.gets] == [threading.current_thread().name]
    assert req.past_key_values is not None and req.kv_metadata["seq_len"] == 10


def test_spec7_prefetch_timeout_is_a_miss_and_the_payload_stays(kit, memory_connector, prefetching, fake_time) -> None:
    model = kit.PagedModel()
    kit.send_all(model, memory_connector, 1, 1, {"r1": SPEC})
    spy = kit.SpyConnector(memory_connector)
    spy.hidden.add("omni_0_to_1_kv_cache_r1")  # not arrived yet as far as the prefetch sees
    m = prefetching(spy, recv_timeout=1.0)
    m.start_prefetch(_job("r1"))
    assert m.consume_prefetched_kv(kit.make_request("r1")) == (None, 0)
    assert m.last_receive_outcome.kind is ReceiveKind.TIMED_OUT and fake_time.elapsed == pytest.approx(1.0)
    spy.hidden.clear()
    req = kit.make_request("r1", sender_info=INFO)
    assert m.receive_kv_cache(req) is True


def test_spec7_consume_without_a_prefetch_is_a_miss(kit, memory_connector, prefetching) -> None:
    spy = kit.SpyConnector(memory_connector)
    assert prefetching(spy).consume_prefetched_kv(kit.make_request("never")) == (None, 0)
    assert spy.gets == []


# ------------------------------------------------------------------- consumed, then failed
def test_spec7_consumed_then_failed_raises_and_is_not_retried(kit, memory_connector, prefetching) -> None:
    memory_connector.put(from_stage="0", to_stage="1", put_key="omni_0_to_1_kv_cache_g", data=b"\x00\x00\x00\x03abc")
    spy = kit.BlockingSpyConnector(memory_connector)
    m = prefetching(spy)
    m.start_prefetch(_job("g"))
    with pytest.raises(KVPrefetchConsumeError) as info:
        m.consume_prefetched_kv(kit.make_request("g"))
    assert isinstance(info.value, RuntimeError) and info.value.request_id == "g"
    assert m.last_receive_outcome.kind is ReceiveKind.DECODE_FAILED
    assert len(spy.gets) == 1 and kit.pool_is_empty(memory_connector)


def test_spec7_consume_and_distribute_does_not_retry_a_consumed_payload(
    kit, memory_connector, prefetching, fake_time
) -> None:
    memory_connector.put(from_stage="0", to_stage="1", put_key="omni_0_to_1_kv_cache_g", data=b"\x00\x00\x00\x03abc")
    spy = kit.BlockingSpyConnector(memory_connector)
    m = prefetching(spy, recv_timeout=30.0)
    m.start_prefetch(_job("g"))
    req = kit.make_request("g", sender_info=INFO)
    assert m.consume_and_distribute_kv_cache(req) is False
    assert len(spy.gets) == 1 and _prefetch_threads(spy)  # no synchronous receive waiting 30 s
    assert req.past_key_values is None and fake_time.sleeps == []


# ------------------------------------------------------------------------------ stale ones
def test_spec7_stale_prefetch_is_dropped(kit, memory_connector, prefetching) -> None:
    """A is held on a gate while B is started: A is dropped (its result discarded), B is served."""
    model = kit.PagedModel()
    kit.send_all(model, memory_connector, 1, 1, {"a": SPEC, "b": SPEC})
    spy = kit.BlockingSpyConnector(memory_connector)
    gate, entered = spy.hold("omni_0_to_1_kv_cache_a")
    m = prefetching(spy)
    m.start_prefetch(_job("a"))
    assert entered.wait(10.0)
    m.start_prefetch(_job("b"))  # A is running: it cannot be cancelled, only dropped
    gate.set()
    data, _ = m.consume_prefetched_kv(kit.make_request("b"))
    assert data is not None and data["request_id"] == "b"
    assert m.consume_prefetched_kv(kit.make_request("a")) == (None, 0)
    assert kit.pool_is_empty(memory_connector)  # the dropped receive released its buffer


def test_spec7_consuming_another_id_drops_the_outstanding_prefetch(kit, memory_connector, prefetching) -> None:
    model = kit.PagedModel()
    kit.send_all(model, memory_connector, 1, 1, {"a": SPEC})
    m = prefetching(kit.BlockingSpyConnector(memory_connector))
    m.start_prefetch(_job("a"))
    assert m.consume_prefetched_kv(kit.make_request("other")) == (None, 0)
    assert m.consume_prefetched_kv(kit.make_request("a")) == (None, 0)  # dropped, not kept


def test_spec7_same_id_in_flight_is_not_started_twice(kit, memory_connector, prefetching) -> None:
    model = kit.PagedModel()
    kit.send_all(model, memory_connector, 1, 1, {"a": SPEC})
    spy = kit.BlockingSpyConnector(memory_connector)
    gate = spy.gates["omni_0_to_1_kv_cache_a"] = threading.Event()
    m = prefetching(spy)
    m.start_prefetch(_job("a"))
    m.start_prefetch(_job("a"))
    gate.set()
    data, _ = m.consume_prefetched_kv(kit.make_request("a"))
    assert data is not None and spy.get_keys == ["omni_0_to_1_kv_cache_a"]


# -------------------------------------------------------------------------------- shutdown
def _result(rid: str) -> ReceiveResult:
    return ReceiveResult(ReceiveOutcome.received(rid), {"request_id": rid})


def test_spec7_shutdown_cancels_pending_work_and_stops_the_worker() -> None:
    gate, entered = threading.Event(), threading.Event()
    calls: list[str] = []

    def receive(rid: str, info: Any, device: Any) -> ReceiveResult:
        calls.append(rid)
        if rid == "a":
            entered.set()
            assert gate.wait(10.0)
        return _result(rid)

    p = Prefetcher(
        receive, enabled=True, role=lambda: ReceiveRole.LOCAL, free_ratio=lambda: None, min_free_ratio=0.0, wait_s=10.0
    )
    assert p.start(_job("a")) == (True, "ok")
    assert entered.wait(10.0)
    assert p.start(_job("b")) == (True, "ok")  # queued behind the running A
    assert p.in_flight == "b"
    stopper = threading.Thread(target=p.shutdown, daemon=True)
    stopper.start()
    deadline = time.monotonic() + 10.0
    while p.in_flight is not None and time.monotonic() < deadline:  # shutdown dropped B
        stopper.join(0.001)
    assert p.in_flight is None
    gate.set()
    stopper.join(10.0)
    assert not stopper.is_alive()
    assert calls == ["a"]  # B never ran
    assert p.take("b") is None and p.start(_job("c")) == (False, "shut_down")
    p.shutdown()  # idempotent


def test_spec7_prefetch_after_shutdown_is_a_no_op(kit, memory_connector, prefetching) -> None:
    model = kit.PagedModel()
    kit.send_all(model, memory_connector, 1, 1, {"a": SPEC})
    spy = kit.BlockingSpyConnector(memory_connector)
    m = prefetching(spy)
    m.shutdown_prefetch()
    m.start_prefetch(_job("a"))
    assert m.consume_prefetched_kv(kit.make_request("a")) == (None, 0)
    assert spy.gets == []
    m.shutdown_prefetch()
    assert m.receive_kv_cache(kit.make_request("a", sender_info=INFO))  # the payload is still there


# --------------------------------------------------------------------------------- disabled
def _assert_not_prefetched(kit, m: OmniKVTransferManager, spy: Any, job: dict) -> None:
    m.start_prefetch(job)
    assert m.consume_prefetched_kv(kit.make_request(job["request_id"])) == (None, 0)
    assert spy.gets == []


def test_spec7_prefetch_disabled_by_default(kit, memory_connector, prefetching) -> None:
    kit.send_all(kit.PagedModel(), memory_connector, 1, 1, {"a": SPEC})
    spy = kit.SpyConnector(memory_connector)
    _assert_not_prefetched(kit, prefetching(spy, async_prefetch=False), spy, _job("a"))


def test_spec7_prefetch_enabled_by_config(kit, memory_connector, prefetching) -> None:
    kit.send_all(kit.PagedModel(), memory_connector, 1, 1, {"a": SPEC})
    m = prefetching(kit.BlockingSpyConnector(memory_connector), async_prefetch=False, enable_kv_async_prefetch=True)
    m.start_prefetch(_job("a"))
    assert m.consume_prefetched_kv(kit.make_request("a"))[0] is not None


def test_spec7_prefetch_skipped_without_sender_info(kit, memory_connector, prefetching) -> None:
    kit.send_all(kit.PagedModel(), memory_connector, 1, 1, {"a": SPEC})
    spy = kit.SpyConnector(memory_connector)
    _assert_not_prefetched(kit, prefetching(spy), spy, _job("a", info=None))


def test_spec7_prefetch_skipped_on_a_follower(kit, memory_connector, prefetching) -> None:
    kit.send_all(kit.PagedModel(), memory_connector, 2, 2, {"a": SPEC})
    groups = kit.stage_groups(InProcessWorld(4), 2, GroupLayout(tp_size=2, cfg_size=2))  # CFG rank 1
    spy = kit.SpyConnector(memory_connector)
    m = prefetching(spy, tp_rank=0, tp_size=2, groups=groups, from_tp=2, to_tp=2)
    _assert_not_prefetched(kit, m, spy, _job("a"))


def test_spec7_prefetch_force_disabled_by_a_cfg_collector(kit, memory_connector) -> None:
    kit.send_all(kit.PagedModel(), memory_connector, 1, 1, {"a": SPEC})
    spy = kit.SpyConnector(memory_connector)
    od = types.SimpleNamespace(
        omni_kv_config={
            "connector_config": {"type": "memory"},
            "omni_from_stage": 0,
            "omni_to_stage": 1,
            "stage_id": 1,
            "need_recv_cache": True,
            "enable_kv_async_prefetch": True,
        },
        cfg_kv_collect_func=lambda *a: {},
    )
    with OmniKVTransferManager.from_od_config(od, connector=spy, tp_rank=0, tp_size=1, env={}) as m:
        _assert_not_prefetched(kit, m, spy, _job("a"))


def test_spec7_prefetch_force_disabled_by_a_device_pool(kit, memory_connector, prefetching) -> None:
    kit.send_all(kit.PagedModel(), memory_connector, 1, 1, {"a": SPEC})
    spy = kit.SpyConnector(memory_connector)
    m = prefetching(spy, connector_config={"type": "memory", "memory_pool_device": "cuda"})
    _assert_not_prefetched(kit, m, spy, _job("a"))


def test_spec7_prefetch_skipped_when_free_memory_is_low(kit, memory_connector, fake_time) -> None:
    kit.send_all(kit.PagedModel(), memory_connector, 1, 1, {"a": SPEC})
    spy = kit.SpyConnector(memory_connector)
    with OmniKVTransferManager(
        kit.receiver_config(kv_prefetch_min_free_mem_ratio=0.5),
        async_prefetch=True,
        connector=spy,
        tp_rank=0,
        tp_size=1,
        env={},
        clock=fake_time,
        sleep=fake_time.sleep,
        free_memory_ratio=lambda: 0.2,
    ) as m:
        _assert_not_prefetched(kit, m, spy, _job("a"))
