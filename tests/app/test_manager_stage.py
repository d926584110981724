"""The typed manager's receiving-stage API: distribution across the stage's ranks, prefetch and
consensus drops (``KVTransferManager.distribute`` / ``receive_and_distribute`` /
``start_prefetch`` / ``consume_prefetched`` / ``wait_prefetch`` / ``shutdown_prefetch``).

Ranks are threads of one :class:`InProcessWorld`, each with its own spy over one real memory
connector, so a test sees which ranks touched the connector: a follower that ends with KV it
never pulled got it through the stage's collectives. Connector deadlines run on an injected
clock; collectives and joins are bounded.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

from kvferry.app import Distribution, DistributionStatus, PrefetchStart, PrefetchStatus
from kvferry.app.manager import KVTransferManager, StageGroups
from kvferry.core.errors import ConnectorUnavailable
from kvferry.core.outcomes import ReceiveKind
from kvferry.core.roles import GroupLayout, ReceiveRole

pytestmark = pytest.mark.timeout(60)

SPEC = {"block_ids": [3, 1, 5], "seq_len": 10}
INFO = {"host": "127.0.0.1", "zmq_port": 50151}


def _manager(kit, spy: Any, groups: StageGroups, fake: Any, from_tp: int, to_tp: int, **kw: Any) -> KVTransferManager:
    config = kit.receiver_config(from_tp, to_tp, **kw.pop("config", {}))
    return KVTransferManager(config, connector=spy, **kit.rank_kwargs(groups, fake), **kw)


# --------------------------------------------------------------------------- distribution
def test_leaders_pull_and_followers_get_their_kv_through_the_stage(kit, memory_connector, fake_time) -> None:
    """TP 2 x SP 2: the SP-rank-0 ranks lead (pull their TP shard, zero-copy), the others follow
    and never touch the connector, yet end with their TP rank's exact shard."""
    model = kit.PagedModel()
    kit.send_all(model, memory_connector, 2, 2, {"r1": SPEC})
    spies = [kit.BlockingSpyConnector(memory_connector) for _ in range(4)]
    reqs = [kit.make_request("r1") for _ in range(4)]

    def rank_main(rank: int, groups: StageGroups) -> Distribution:
        m = _manager(kit, spies[rank], groups, fake_time, 2, 2)
        return m.receive_and_distribute(reqs[rank], sender_info=INFO)

    results = kit.run_ranks(GroupLayout(tp_size=2, sp_size=2), rank_main)
    assert [d.status for d in results] == [DistributionStatus.HAS_KV] * 4
    assert [d.role for d in results] == [ReceiveRole.LEADER] * 2 + [ReceiveRole.FOLLOWER] * 2
    for rank, (dist, req) in enumerate(zip(results, reqs)):
        assert dist.ok and dist.request_id == "r1" and dist.drop is None
        kit.check_kv(req.past_key_values, model, SPEC, rank % 2, 2)
        assert req.sampling_params.past_key_values is req.past_key_values
    # the control: only leaders pulled; followers hold bytes they can only have got from a leader
    assert [len(s.gets) for s in spies] == [1, 1, 0, 0]
    assert results[0].received is not None and results[0].received.ok and results[0].received.held
    assert results[2].received is None and results[3].received is None
    for dist in results:
        dist.release()
    for req in reqs:
        req.past_key_values = req.sampling_params.past_key_values = None
    assert kit.pool_is_empty(memory_connector)


def test_a_leader_miss_leaves_every_rank_without_kv(kit, memory_connector, fake_time) -> None:
    """Nothing was sent: the leader times out on the injected clock and every rank ends NO_KV
    (followers are told so, they do not wait out the collective timeout); stale KV is cleared."""
    reqs = [kit.make_request("lost") for _ in range(4)]
    for req in reqs:
        req.past_key_values = "stale"

    def rank_main(rank: int, groups: StageGroups) -> Distribution:
        m = _manager(kit, kit.SpyConnector(memory_connector), groups, fake_time, 2, 2, config={"recv_timeout": 1.0})
        return m.receive_and_distribute(reqs[rank])

    results = kit.run_ranks(GroupLayout(tp_size=2, sp_size=2), rank_main)
    assert [d.status for d in results] == [DistributionStatus.NO_KV] * 4
    assert results[0].received is not None and results[0].received.outcome.kind is ReceiveKind.TIMED_OUT
    assert all(req.past_key_values is None for req in reqs)


def test_distribute_hands_over_what_the_leader_already_applied(kit, fake_time) -> None:
    """``distribute(req)`` without a receive: world broadcast (TP inactive) of the KV rank 0
    applied itself; rank 1 starts with nothing and ends with rank 0's tensors' values."""
    key, value = torch.arange(12.0).reshape(3, 4), -torch.arange(12.0).reshape(3, 4)
    reqs = [kit.make_request("r1") for _ in range(2)]
    KVTransferManager.apply_to_request(
        reqs[0], {"layer_blocks": {"key_cache": [key], "value_cache": [value]}, "metadata": {"seq_len": 3}}
    )

    created: list[dict] = []

    def factory(config: dict) -> Any:
        created.append(config)
        raise ConnectorUnavailable("distribute must not create a connector")

    def rank_main(rank: int, groups: StageGroups) -> Distribution:
        m = _manager(kit, None, groups, fake_time, 1, 1, connector_factory=factory)
        return m.distribute(reqs[rank])

    results = kit.run_ranks(GroupLayout(cfg_size=2), rank_main)
    assert [(d.role, d.status) for d in results] == [
        (ReceiveRole.LEADER, DistributionStatus.HAS_KV),
        (ReceiveRole.FOLLOWER, DistributionStatus.HAS_KV),
    ]
    got = reqs[1].past_key_values
    assert torch.equal(got.key_cache[0], key) and torch.equal(got.value_cache[0], value)
    assert got.key_cache[0] is not key and reqs[1].kv_metadata == {"seq_len": 3}
    assert created == []


def test_dummy_requests_and_sending_stages_are_skipped_on_every_rank(kit, memory_connector, fake_time) -> None:
    spies = [kit.SpyConnector(memory_connector) for _ in range(2)]

    def rank_main(rank: int, groups: StageGroups) -> list[Distribution]:
        m = _manager(kit, spies[rank], groups, fake_time, 1, 1)
        sender = KVTransferManager(kit.sender_config(), groups=groups, connector=spies[rank])
        return [
            m.receive_and_distribute(kit.make_request("dummy_req_id")),
            m.receive_and_distribute(kit.make_request("")),
            sender.receive_and_distribute(kit.make_request("r1")),
        ]

    results = kit.run_ranks(GroupLayout(cfg_size=2), rank_main)
    assert all(d.status is DistributionStatus.SKIPPED and not d.ok for row in results for d in row)
    assert spies[0].gets == [] and spies[1].gets == []


# ------------------------------------------------------------------------------ consensus
def test_consensus_drops_kv_a_tp_peer_missed_and_counts_it(kit, memory_connector, fake_time) -> None:
    """Pure TP 4: rank 2's shard of r1 never arrives. Ranks 0, 1, 3 received it but every rank
    drops it together (counted as dropped_by_consensus, its pool buffers given back); the
    group stays in lockstep, so r2 arrives on every rank."""
    model = kit.PagedModel()
    kit.send_all(model, memory_connector, 4, 4, {"r1": SPEC, "r2": SPEC})
    reqs = {rid: [kit.make_request(rid) for _ in range(4)] for rid in ("r1", "r2")}
    managers: list[Any] = [None] * 4

    def rank_main(rank: int, groups: StageGroups) -> list[Distribution]:
        spy = kit.SpyConnector(memory_connector)
        if rank == 2:
            spy.hidden.add("r1_0_0_2_2")
        m = managers[rank] = _manager(kit, spy, groups, fake_time, 4, 4, config={"recv_timeout": 1.0})
        return [m.receive_and_distribute(reqs[rid][rank]) for rid in ("r1", "r2")]

    results = kit.run_ranks(GroupLayout(tp_size=4), rank_main)
    first = [row[0] for row in results]
    assert [d.status for d in first] == [
        DistributionStatus.DROPPED_BY_CONSENSUS,
        DistributionStatus.DROPPED_BY_CONSENSUS,
        DistributionStatus.NO_KV,
        DistributionStatus.DROPPED_BY_CONSENSUS,
    ]
    for rank in (0, 1, 3):
        d = first[rank]
        assert d.drop is not None and d.drop.kind is ReceiveKind.DROPPED_BY_CONSENSUS and d.drop.request_id == "r1"
        assert d.received is not None and d.received.ok and not d.received.held  # released here
        assert managers[rank].counters.get("recv.dropped_by_consensus") == 1
    assert managers[2].counters.get("recv.dropped_by_consensus") == 0 and first[2].drop is None
    assert all(req.past_key_values is None for req in reqs["r1"])
    assert [row[1].status for row in results] == [DistributionStatus.HAS_KV] * 4
    for rank, row in enumerate(results):
        kit.check_kv(reqs["r2"][rank].past_key_values, model, SPEC, rank, 4)
        row[1].release()


# ------------------------------------------------------------------------------- prefetch
@pytest.fixture
def prefetching(kit, fake_time, closing):
    """``prefetching(connector, **config) -> KVTransferManager`` with prefetch on; closed after."""

    def make(connector: Any, *, prefetch: bool | None = True, **config: Any) -> KVTransferManager:
        config = kit.receiver_config(**config)
        return closing(
            KVTransferManager(config, connector=connector, clock=fake_time, sleep=fake_time.sleep, prefetch=prefetch)
        )

    return make


def _worker_gets(spy: Any) -> list[str]:
    return [name for _, _, name in spy.gets if name.startswith("kvferry-prefetch")]


def test_a_prefetch_hit_is_received_on_the_worker_and_used_by_receive_and_distribute(
    kit, memory_connector, prefetching
) -> None:
    model = kit.PagedModel()
    kit.send_all(model, memory_connector, 1, 1, {"r1": SPEC})
    spy = kit.BlockingSpyConnector(memory_connector)
    m = prefetching(spy)
    assert m.prefetch_enabled
    assert m.start_prefetch("r1", sender_info=INFO) == PrefetchStart("r1", True, "ok")
    assert m.wait_prefetch(10.0)
    req = kit.make_request("r1")
    dist = m.receive_and_distribute(req)  # no sender info here: only the prefetch can have it
    assert dist.status is DistributionStatus.HAS_KV and dist.role is ReceiveRole.LOCAL
    kit.check_kv(req.past_key_values, model, SPEC, 0, 1)
    assert len(spy.gets) == 1 and len(_worker_gets(spy)) == 1  # the worker's get, no second one
    assert dist.received is not None and not dist.received.held  # a prefetch copies out
    assert kit.pool_is_empty(memory_connector)


def test_consume_prefetched_answers_hit_miss_and_consumed(kit, memory_connector, prefetching) -> None:
    model = kit.PagedModel()
    kit.send_all(model, memory_connector, 1, 1, {"a": SPEC})
    memory_connector.put(from_stage="0", to_stage="1", put_key="omni_0_to_1_kv_cache_g", data=b"\x00\x00\x00\x03abc")
    spy = kit.BlockingSpyConnector(memory_connector)
    m = prefetching(spy)
    assert m.consume_prefetched("a").status is PrefetchStatus.MISS and spy.gets == []  # none started

    assert m.start_prefetch("a", sender_info=INFO).started
    hit = m.consume_prefetched("a")
    assert hit.hit and hit.result is not None and hit.result.payload["request_id"] == "a"
    kit.assert_kv_equal(hit.result.payload, *model.expected(SPEC["block_ids"], SPEC["seq_len"]))
    assert m.consume_prefetched("a").status is PrefetchStatus.MISS  # taken once

    assert m.start_prefetch("g", sender_info=INFO).started
    gone = m.consume_prefetched("g")
    assert gone.status is PrefetchStatus.CONSUMED and gone.result.outcome.kind is ReceiveKind.DECODE_FAILED
    assert spy.get_keys == ["omni_0_to_1_kv_cache_a", "omni_0_to_1_kv_cache_g"]
    assert kit.pool_is_empty(memory_connector)


def test_a_consumed_payload_is_not_waited_for_again(kit, memory_connector, prefetching, fake_time) -> None:
    memory_connector.put(from_stage="0", to_stage="1", put_key="omni_0_to_1_kv_cache_g", data=b"\x00\x00\x00\x03abc")
    spy = kit.BlockingSpyConnector(memory_connector)
    m = prefetching(spy, recv_timeout=30.0)
    assert m.start_prefetch("g", sender_info=INFO).started
    dist = m.receive_and_distribute(kit.make_request("g"), sender_info=INFO)
    assert dist.status is DistributionStatus.NO_KV
    assert dist.received is not None and dist.received.outcome.kind is ReceiveKind.DECODE_FAILED
    assert spy.get_keys == ["omni_0_to_1_kv_cache_g"] and fake_time.sleeps == []


def test_a_prefetched_refusal_is_answered_at_once_by_the_receive_that_follows(
    kit, memory_connector, prefetching, fake_time
) -> None:
    """An ambiguous cache (no kv_layout) is refused by the sender, which leaves a marker; the
    worker takes it, so the synchronous receive must not wait 30 s for a payload that never comes."""
    gen = torch.Generator().manual_seed(0)
    cache = [torch.randn(6, 2, 4, 8, generator=gen) for _ in range(2)]
    sender = KVTransferManager(kit.sender_config(), connector=memory_connector, clock=fake_time, sleep=fake_time.sleep)
    [sent] = sender.send_requests({"r1": {"block_ids": [4, 1], "seq_len": 6}}, cache, 4, "float32")
    assert not sent.ok
    spy = kit.BlockingSpyConnector(memory_connector)
    m = prefetching(spy, recv_timeout=30.0)
    assert m.start_prefetch("r1", sender_info=INFO).started and m.wait_prefetch(10.0)
    refused = m.consume_prefetched("r1")
    assert refused.status is PrefetchStatus.MISS and refused.result.outcome.kind is ReceiveKind.REFUSED
    again = m.receive("r1", sender_info=INFO)
    assert again.outcome.kind is ReceiveKind.REFUSED and fake_time.elapsed == 0.0
    assert len(spy.gets) == 1 and m.counters.get("recv.refused") == 1  # counted once, when taken


def test_prefetch_not_started_says_why(kit, memory_connector, prefetching, fake_time) -> None:
    spy = kit.BlockingSpyConnector(memory_connector)
    m = prefetching(spy)
    assert m.start_prefetch("r1", sender_info=None) == PrefetchStart("r1", False, "no_sender_info")
    assert m.start_prefetch("", sender_info=INFO) == PrefetchStart("", False, "no_request_id")
    off = prefetching(spy, prefetch=False)
    assert not off.prefetch_enabled and off.start_prefetch("r1", sender_info=INFO).reason == "disabled"
    from_config = prefetching(spy, prefetch=None, enable_kv_async_prefetch=True)
    assert from_config.prefetch_enabled
    on_device = prefetching(spy, connector_config={"type": "memory", "memory_pool_device": "cuda"})
    assert not on_device.prefetch_enabled
    m.shutdown_prefetch()
    assert m.start_prefetch("r1", sender_info=INFO) == PrefetchStart("r1", False, "shut_down")
    assert spy.gets == []


def test_followers_never_prefetch(kit, memory_connector, fake_time) -> None:
    spies = [kit.SpyConnector(memory_connector) for _ in range(2)]  # polling: deadlines on the fake clock

    def rank_main(rank: int, groups: StageGroups) -> tuple[ReceiveRole, PrefetchStart]:
        m = _manager(kit, spies[rank], groups, fake_time, 1, 1, prefetch=True)
        try:
            return m.receive_role(), m.start_prefetch("absent", sender_info=INFO)
        finally:
            m.close()  # shuts the worker down, waiting for a started receive

    results = kit.run_ranks(GroupLayout(cfg_size=2), rank_main)
    assert results[1] == (ReceiveRole.FOLLOWER, PrefetchStart("absent", False, "follower"))
    assert results[0][0] is ReceiveRole.LEADER and results[0][1].started
    assert spies[1].gets == []


def test_wait_prefetch_is_bounded_and_shutdown_keeps_receiving(kit, memory_connector, prefetching) -> None:
    model = kit.PagedModel()
    kit.send_all(model, memory_connector, 1, 1, {"a": SPEC, "b": SPEC})
    spy = kit.BlockingSpyConnector(memory_connector)
    gate, entered = spy.hold("omni_0_to_1_kv_cache_a")
    m = prefetching(spy)
    assert m.start_prefetch("a", sender_info=INFO).started
    assert entered.wait(10.0)
    assert m.wait_prefetch(0.01) is False  # held on the gate: still running
    gate.set()
    assert m.wait_prefetch(10.0) is True
    m.shutdown_prefetch()  # the finished prefetch is dropped (its copy is discarded)
    assert m.consume_prefetched("a").status is PrefetchStatus.MISS
    assert not m.start_prefetch("b", sender_info=INFO).started
    b = m.receive("b", sender_info=INFO, zero_copy=False)
    assert b.ok and [name for _, _, name in spy.gets][-1] == threading.current_thread().name
    kit.assert_kv_equal(b.payload, *model.expected(SPEC["block_ids"], SPEC["seq_len"]))
