"""Receive-and-distribute inside the receiving stage (SPEC 6) on in-process collective groups.

Four ranks are four threads of one :class:`InProcessWorld`; every rank has its own spy over one
shared memory connector, so a test sees which ranks touched the connector (only LOCAL and
LEADER ranks may). Deadlines of the connector side run on an injected clock; collectives use
real (bounded) timeouts, and every thread is joined with a bound.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from kvferry.adapters.collectives import InProcessWorld
from kvferry.app.compat.manager import OmniKVTransferManager
from kvferry.app.distribute import Distributor, kv_fields_of
from kvferry.app.manager import KVCache
from kvferry.core.roles import GroupLayout, ReceiveRole

pytestmark = pytest.mark.timeout(60)

SPEC = {"block_ids": [3, 1, 5], "seq_len": 10}
BRANCH = {"block_ids": [7, 2], "seq_len": 6}


def _manager(kit, spy: Any, groups: Any, fake: Any, from_tp: int, to_tp: int, **config: Any) -> OmniKVTransferManager:
    config = kit.receiver_config(from_tp, to_tp, **config)
    return OmniKVTransferManager(config, connector=spy, env={}, **kit.rank_kwargs(groups, fake))


def _role(groups: Any, from_tp: int, to_tp: int) -> ReceiveRole:
    return Distributor(groups, from_tp, to_tp, timeout_s=1.0, kv_factory=KVCache).plan().role


def _collector(rid: str, cfg_ids: list, manager: OmniKVTransferManager, device: Any) -> dict:
    """An engine's CFG collector: pulls the companion request's KV through the same manager."""
    data, size = manager.receive_kv_cache_for_request(cfg_ids[0], device)
    assert data is not None and size > 0
    kv = KVCache(data["layer_blocks"]["key_cache"], data["layer_blocks"]["value_cache"])
    return {"cfg_text_past_key_values": kv, "cfg_text_kv_metadata": data["metadata"]}


# ------------------------------------------------------------------------------- TP + CFG
def test_spec6_tp_cfg_followers_get_their_branch(kit, memory_connector, fake_time) -> None:
    """TP 2 x CFG 2: CFG rank 0 (leader) pulls primary + branch; CFG rank 1 gets the branch."""
    model = kit.PagedModel()
    kit.send_all(model, memory_connector, 2, 2, {"r1": SPEC, "r1__cfg_text": BRANCH})
    layout = GroupLayout(tp_size=2, cfg_size=2)
    spies = [kit.BlockingSpyConnector(memory_connector) for _ in range(4)]
    reqs = [kit.make_request("r1", cfg_kv_request_ids=["r1__cfg_text"]) for _ in range(4)]

    def rank_main(rank: int, groups: Any) -> tuple:
        m = _manager(kit, spies[rank], groups, fake_time, 2, 2)
        return _role(groups, 2, 2), m.receive_multi_kv_cache_distributed(reqs[rank], _collector)

    results = kit.run_ranks(layout, rank_main)
    assert [r[0] for r in results] == [
        ReceiveRole.LEADER,
        ReceiveRole.LEADER,
        ReceiveRole.FOLLOWER,
        ReceiveRole.FOLLOWER,
    ]
    assert [r[1] for r in results] == [True] * 4
    for rank, req in enumerate(reqs):
        tp_rank, cfg_rank = rank % 2, rank // 2
        kit.check_kv(req.past_key_values, model, SPEC, tp_rank, 2)
        assert req.sampling_params.past_key_values is req.past_key_values
        assert req.kv_metadata["seq_len"] == 10 and req.sampling_params.cfg_branch_roles == ["cfg_text"]
        kit.check_kv(req.sampling_params.cfg_text_past_key_values, model, BRANCH, tp_rank, 2)
        if cfg_rank == 1:
            assert req.sampling_params.cfg_active_branch == "cfg_text"
            assert spies[rank].gets == []  # followers never touch the connector
        else:
            assert spies[rank].get_keys == [f"r1_0_0_{tp_rank}_{tp_rank}", f"r1__cfg_text_0_0_{tp_rank}_{tp_rank}"]
    assert kit.pool_is_empty(memory_connector)


def test_spec6_tp_cfg_without_branches_copies_the_primary_to_cfg_rank_1(kit, memory_connector, fake_time) -> None:
    model = kit.PagedModel()
    kit.send_all(model, memory_connector, 2, 2, {"r1": SPEC})
    reqs = [kit.make_request("r1") for _ in range(4)]

    def rank_main(rank: int, groups: Any) -> bool:
        return _manager(
            kit, kit.BlockingSpyConnector(memory_connector), groups, fake_time, 2, 2
        ).receive_multi_kv_cache_distributed(reqs[rank])

    assert kit.run_ranks(GroupLayout(tp_size=2, cfg_size=2), rank_main) == [True] * 4
    for rank, req in enumerate(reqs):
        kit.check_kv(req.past_key_values, model, SPEC, rank % 2, 2)
    # the reference's padding: the primary alone, no branch bookkeeping
    assert not hasattr(reqs[2].sampling_params, "cfg_active_branch")
    assert not hasattr(reqs[2].sampling_params, "cfg_branch_roles")


def test_spec6_tp_cfg_branch_kv_given_through_the_branch_map(kit, memory_connector, fake_time) -> None:
    """TP 2 x CFG 3: one branch as ``cfg_text_past_key_values``, one only in the
    ``cfg_branch_past_key_values`` map; each follower gets its branch both ways (the
    reference's fields), the leader the list of roles."""
    model = kit.PagedModel()
    kit.send_all(model, memory_connector, 2, 2, {"r1": SPEC, "r1__cfg_text": BRANCH, "r1__cfg_img": SPEC})
    reqs = [kit.make_request("r1", cfg_kv_request_ids=["r1__cfg_text", "r1__cfg_img"]) for _ in range(6)]

    def collector(rid: str, cfg_ids: list, manager: OmniKVTransferManager, device: Any) -> dict:
        out = {}
        for cid, role in zip(cfg_ids, ("cfg_text", "cfg_img")):
            data, _ = manager.receive_kv_cache_for_request(cid, device)
            out[role] = (
                KVCache(data["layer_blocks"]["key_cache"], data["layer_blocks"]["value_cache"]),
                data["metadata"],
            )
        return {
            "cfg_text_past_key_values": out["cfg_text"][0],
            "cfg_text_kv_metadata": out["cfg_text"][1],
            "cfg_branch_past_key_values": {"cfg_img": out["cfg_img"][0]},
            "cfg_branch_kv_metadata": {"cfg_img": out["cfg_img"][1]},
        }

    def rank_main(rank: int, groups: Any) -> bool:
        m = _manager(kit, kit.BlockingSpyConnector(memory_connector), groups, fake_time, 2, 2)
        return m.receive_multi_kv_cache_distributed(reqs[rank], collector)

    assert kit.run_ranks(GroupLayout(tp_size=2, cfg_size=3), rank_main) == [True] * 6
    for rank, req in enumerate(reqs):
        tp_rank, cfg_rank = rank % 2, rank // 2
        params = req.sampling_params
        kit.check_kv(req.past_key_values, model, SPEC, tp_rank, 2)
        assert params.cfg_branch_roles == ["cfg_text", "cfg_img"]
        if cfg_rank == 0:
            assert params.cfg_active_branch is None
            continue
        role, spec = (("cfg_text", BRANCH), ("cfg_img", SPEC))[cfg_rank - 1]
        assert params.cfg_active_branch == role
        kit.check_kv(getattr(params, f"{role}_past_key_values"), model, spec, tp_rank, 2)
        assert set(params.cfg_branch_past_key_values) == {role}
        kit.check_kv(params.cfg_branch_past_key_values[role], model, spec, tp_rank, 2)
        assert params.cfg_branch_kv_metadata[role]["seq_len"] == spec["seq_len"]
        assert getattr(params, f"{role}_kv_metadata")["seq_len"] == spec["seq_len"]
        other = "cfg_img" if role == "cfg_text" else "cfg_text"
        assert getattr(params, f"{other}_past_key_values", None) is None  # only its own branch


# -------------------------------------------------------------------------------- TP + SP
def test_spec6_tp_sp_leader_broadcasts_to_its_sp_group(kit, memory_connector, fake_time) -> None:
    model = kit.PagedModel()
    kit.send_all(model, memory_connector, 4, 2, {"r1": SPEC})  # fan-in: each leader merges 2 shards
    spies = [kit.BlockingSpyConnector(memory_connector) for _ in range(4)]
    reqs = [kit.make_request("r1") for _ in range(4)]

    def rank_main(rank: int, groups: Any) -> bool:
        return _manager(kit, spies[rank], groups, fake_time, 4, 2).receive_multi_kv_cache_distributed(reqs[rank])

    assert kit.run_ranks(GroupLayout(tp_size=2, sp_size=2), rank_main) == [True] * 4
    for rank, req in enumerate(reqs):
        kit.check_kv(req.past_key_values, model, SPEC, rank % 2, 2)
        assert req.sampling_params.past_key_values is req.past_key_values
    assert [len(s.gets) for s in spies] == [2, 2, 0, 0]
    assert kit.pool_is_empty(memory_connector)


# -------------------------------------------------------------------------- TP + CFG + SP
def test_spec6_tp_cfg_sp_p2p_then_sp_broadcast(kit, memory_connector, fake_time) -> None:
    """CFG 2 x SP 2 x TP 1 (fed by 2 sender ranks): one leader, CFG p2p, then SP broadcasts."""
    model = kit.PagedModel()
    kit.send_all(model, memory_connector, 2, 1, {"r1": SPEC, "r1__cfg_text": BRANCH})
    spies = [kit.BlockingSpyConnector(memory_connector) for _ in range(4)]
    reqs = [kit.make_request("r1", cfg_kv_request_ids=["r1__cfg_text"]) for _ in range(4)]

    def rank_main(rank: int, groups: Any) -> bool:
        return _manager(kit, spies[rank], groups, fake_time, 2, 1).receive_multi_kv_cache_distributed(
            reqs[rank], _collector
        )

    assert kit.run_ranks(GroupLayout(tp_size=1, sp_size=2, cfg_size=2), rank_main) == [True] * 4
    assert [len(s.gets) for s in spies] == [4, 0, 0, 0]  # 2 shards x (primary + branch), leader only
    for rank, req in enumerate(reqs):
        cfg_rank, sp_rank = rank // 2, rank % 2  # world_rank = cfg_rank * sp_size + sp_rank
        kit.check_kv(req.past_key_values, model, SPEC, 0, 1)
        assert req.sampling_params.cfg_branch_roles == ["cfg_text"]
        assert getattr(req.sampling_params, "cfg_active_branch", None) == ("cfg_text" if cfg_rank else None)
        if cfg_rank == 1 or sp_rank == 0:
            kit.check_kv(req.sampling_params.cfg_text_past_key_values, model, BRANCH, 0, 1)
        else:  # CFG rank 0's SP group gets the primary and the list of roles, not every branch
            assert getattr(req.sampling_params, "cfg_text_past_key_values", None) is None


# --------------------------------------------------------------------------- TP inactive
def test_spec6_tp_inactive_rank_0_broadcasts_to_the_world(kit, memory_connector, fake_time) -> None:
    model = kit.PagedModel()
    kit.send_all(model, memory_connector, 1, 1, {"r1": SPEC})
    spies = [kit.BlockingSpyConnector(memory_connector) for _ in range(4)]
    reqs = [kit.make_request("r1") for _ in range(4)]

    def rank_main(rank: int, groups: Any) -> bool:
        return _manager(kit, spies[rank], groups, fake_time, 1, 1).receive_multi_kv_cache_distributed(reqs[rank])

    assert kit.run_ranks(GroupLayout(sp_size=2, cfg_size=2), rank_main) == [True] * 4
    for req in reqs:
        kit.check_kv(req.past_key_values, model, SPEC, 0, 1)
    assert [s.get_keys for s in spies] == [["omni_0_to_1_kv_cache_r1"], [], [], []]


# ----------------------------------------------------------------------- the leader misses
@pytest.mark.parametrize(
    "layout,from_tp,to_tp",
    [
        (GroupLayout(tp_size=2, cfg_size=2), 2, 2),
        (GroupLayout(tp_size=2, sp_size=2), 2, 2),
        (GroupLayout(tp_size=1, sp_size=2, cfg_size=2), 2, 1),
        (GroupLayout(sp_size=4), 1, 1),
    ],
    ids=["tp-cfg", "tp-sp", "tp-cfg-sp", "world"],
)
def test_spec6_leader_miss_completes_every_collective_and_all_return_false(
    kit, memory_connector, fake_time, layout, from_tp, to_tp
) -> None:
    """Nothing was sent: leaders time out (injected clock), send the no-KV sentinel, and every
    rank returns False promptly; no rank keeps stale KV."""
    reqs = [kit.make_request("lost") for _ in range(4)]
    for req in reqs:
        req.past_key_values = "stale"
        req.sampling_params.cfg_text_past_key_values = "stale"

    def rank_main(rank: int, groups: Any) -> bool:
        spy = kit.SpyConnector(memory_connector)  # polling: the deadline runs on the fake clock
        m = _manager(kit, spy, groups, fake_time, from_tp, to_tp, recv_timeout=1.0)
        return m.receive_multi_kv_cache_distributed(reqs[rank])

    start = time.monotonic()
    assert kit.run_ranks(layout, rank_main) == [False] * 4
    assert time.monotonic() - start < 10.0  # far below the 31 s collective timeout
    for req in reqs:
        assert req.past_key_values is None and req.sampling_params.cfg_text_past_key_values is None


def test_spec6_leader_receive_raising_still_runs_the_collectives(kit) -> None:
    reqs = [kit.make_request("r1") for _ in range(4)]

    def rank_main(rank: int, groups: Any) -> bool:
        def receive(req: Any) -> bool:
            raise RuntimeError("engine fault in the leader's receive")

        return Distributor(groups, 2, 2, timeout_s=5.0, kv_factory=KVCache).run(reqs[rank], receive, active=True)

    assert kit.run_ranks(GroupLayout(tp_size=2, sp_size=2), rank_main) == [False] * 4


# ------------------------------------------------------------------------------ consensus
def test_spec6_pure_tp_each_rank_pulls_its_own_shard(kit, memory_connector, fake_time) -> None:
    model = kit.PagedModel()
    kit.send_all(model, memory_connector, 2, 4, {"r1": SPEC})
    spies = [kit.BlockingSpyConnector(memory_connector) for _ in range(4)]
    reqs = [kit.make_request("r1") for _ in range(4)]

    def rank_main(rank: int, groups: Any) -> tuple:
        m = _manager(kit, spies[rank], groups, fake_time, 2, 4)
        return _role(groups, 2, 4), m.receive_multi_kv_cache_distributed(reqs[rank])

    results = kit.run_ranks(GroupLayout(tp_size=4), rank_main)
    assert results == [(ReceiveRole.LOCAL, True)] * 4
    for rank, req in enumerate(reqs):
        kit.check_kv(req.past_key_values, model, SPEC, rank, 4)
        assert spies[rank].get_keys == [f"r1_0_0_{rank // 2}_{rank}"]


def test_spec6_consensus_one_rank_misses_every_rank_drops(kit, memory_connector, fake_time) -> None:
    """TP rank 2's shard never arrives: ranks 0, 1, 3 received but all drop KV together, and the
    group stays in lockstep for the next request."""
    model = kit.PagedModel()
    kit.send_all(model, memory_connector, 4, 4, {"r1": SPEC, "r2": SPEC})
    reqs = {rid: [kit.make_request(rid) for _ in range(4)] for rid in ("r1", "r2")}

    def rank_main(rank: int, groups: Any) -> list[bool]:
        spy = kit.SpyConnector(memory_connector)
        if rank == 2:
            spy.hidden.add("r1_0_0_2_2")
        m = _manager(kit, spy, groups, fake_time, 4, 4, recv_timeout=1.0)
        return [m.receive_multi_kv_cache_distributed(reqs[rid][rank]) for rid in ("r1", "r2")]

    results = kit.run_ranks(GroupLayout(tp_size=4), rank_main)
    assert results == [[False, True]] * 4
    assert all(req.past_key_values is None and req.sampling_params.past_key_values is None for req in reqs["r1"])
    for rank, req in enumerate(reqs["r2"]):
        kit.check_kv(req.past_key_values, model, SPEC, rank, 4)


def test_spec6_dummy_requests_skip_every_collective(kit, memory_connector, fake_time) -> None:
    """A dummy id returns False at once on every rank, even alone (no peer would answer)."""
    world = InProcessWorld(4)
    groups = kit.stage_groups(world, 2, GroupLayout(tp_size=2, cfg_size=2))
    spy = kit.SpyConnector(memory_connector)
    m = _manager(kit, spy, groups, fake_time, 2, 2, recv_timeout=30.0)
    done: list[bool] = []
    thread = threading.Thread(
        target=lambda: done.append(m.receive_multi_kv_cache_distributed(kit.make_request("dummy_req_id/3"))),
        daemon=True,
    )
    thread.start()
    thread.join(5.0)
    assert done == [False] and spy.gets == [] and fake_time.elapsed == 0.0


@pytest.mark.parametrize("layout", [GroupLayout(tp_size=2, cfg_size=2), GroupLayout(tp_size=4)], ids=["cfg", "tp"])
def test_spec6_non_receiving_config_skips_every_collective(kit, memory_connector, fake_time, layout) -> None:
    """Not receiving: False at once on a lone rank whose peers never call (no collective entered)."""
    groups = kit.stage_groups(InProcessWorld(4), 1, layout)
    spy = kit.SpyConnector(memory_connector)
    m = _manager(kit, spy, groups, fake_time, 2, 2, need_recv_cache=False)
    done: list[bool] = []
    thread = threading.Thread(
        target=lambda: done.append(m.receive_multi_kv_cache_distributed(kit.make_request("r1"))), daemon=True
    )
    thread.start()
    thread.join(5.0)
    assert done == [False] and spy.gets == []


def test_spec6_tp_group_of_one_is_local_without_consensus(kit, memory_connector, fake_time) -> None:
    model = kit.PagedModel()
    kit.send_all(model, memory_connector, 1, 1, {"r1": SPEC})
    groups = kit.stage_groups(InProcessWorld(1), 0, GroupLayout())
    m = _manager(kit, kit.BlockingSpyConnector(memory_connector), groups, fake_time, 1, 1)
    req = kit.make_request("r1")
    assert _role(groups, 1, 1) is ReceiveRole.LOCAL
    assert m.receive_multi_kv_cache_distributed(req) is True
    kit.check_kv(req.past_key_values, model, SPEC, 0, 1)


def test_spec6_distribute_after_the_leader_applied(kit, memory_connector, fake_time) -> None:
    """``distribute_kv_cache(received=...)``: the leader received on its own, then all distribute."""
    model = kit.PagedModel()
    kit.send_all(model, memory_connector, 1, 1, {"r1": SPEC})
    reqs = [kit.make_request("r1") for _ in range(4)]

    def rank_main(rank: int, groups: Any) -> Any:
        m = _manager(kit, kit.BlockingSpyConnector(memory_connector), groups, fake_time, 1, 1)
        received = m.receive_kv_cache(reqs[rank]) if rank == 0 else False
        return m.distribute_kv_cache(reqs[rank], received=received)

    fields = kit.run_ranks(GroupLayout(sp_size=4), rank_main)
    for f, req in zip(fields, reqs):
        assert f is not None and f["kv_metadata"]["seq_len"] == 10
        kit.check_kv(req.past_key_values, model, SPEC, 0, 1)
        assert kv_fields_of(req) is not None


def test_spec6_local_rank_whose_receive_raises_still_joins_consensus(kit) -> None:
    """Pure TP: rank 1's receive raises (e.g. a prefetched payload that could not be used). It must
    still take part in the consensus exchange, so its peers drop KV instead of hanging."""
    reqs = [kit.make_request("r1") for _ in range(4)]

    def rank_main(rank: int, groups: Any) -> bool:
        def receive(req: Any) -> bool:
            if rank == 1:
                raise RuntimeError("post-processing failed on rank 1")
            req.past_key_values = KVCache([], [])
            return True

        return Distributor(groups, 4, 4, timeout_s=5.0, kv_factory=KVCache).run(reqs[rank], receive, active=True)

    assert kit.run_ranks(GroupLayout(tp_size=4), rank_main) == [False] * 4
    assert all(req.past_key_values is None for req in reqs)
