"""A receiving stage of 4 gloo processes in every role layout of SPEC 6 (and the failures of 9.1).

The test process is the sending stage: for each scenario it builds ``from_tp`` zmq sender
managers (:func:`kvferry.app.wiring.build_manager`) and puts every request (and its CFG
companions) before the receivers start, so no step waits on timing. Four ``stage_worker.py``
processes then run every scenario in order on one gloo world, each with the sub-groups of its
:class:`GroupLayout`, through ``OmniKVTransferManager.receive_multi_kv_cache_distributed`` with
a CFG collector. Workers report digests of the KV fields each rank ends with; the test compares
them with digests of the sender caches' bytes.

Layouts as tp x sp x cfg (world rank = (cfg_rank*sp + sp_rank)*tp + tp_rank); TP is the
configured sender -> receiver mapping:

============  ======  =====  ====================================================
scenario      layout  TP     what it exercises
============  ======  =====  ====================================================
tp_cfg        2x1x2   2->2   TP leaders pull, CFG rank 1 gets branch ``cfg_text``
tp_sp         2x2x1   1->2   TP leaders pull (sender slices), SP broadcast
tp_cfg_sp     1x2x2   2->1   TP active by mapping: p2p to CFG ranks, then SP bcast
world         1x2x2   1->1   TP inactive: rank 0 pulls, world broadcast
pure_tp       4x1x1   2->4   every rank LOCAL, TP consensus keeps
tp_one_miss   4x1x1   4->4   rank 3's key never sent: consensus drops on all ranks
============  ======  =====  ====================================================

Every scenario also has a request whose sender does not exist: the pulling ranks time out at
their deadline and every rank returns False without hanging; a request after it still works.
"""

from __future__ import annotations

import json
import pathlib
import time
from typing import Any

import pytest
from stage_worker import expected_digest, finished_request, make_spec, sender_caches, spec_to_json

from kvferry.core.roles import GroupLayout

WORLD = 4
HIT_S = 30.0  # receive deadline of requests that were sent (reached only on a failure)
MISS_S = 0.5  # receive deadline of requests whose sender does not exist
#: A rank that waited for a message that never comes fails at MISS_S + 30 s (the collective
#: deadline); finishing within MISS_S + SLACK_S proves it did not (slack for a loaded machine).
SLACK_S = 15.0
RUN_DEADLINE_S = 200.0
CFG_IDS = {"cfg_text": "{rid}-text", "cfg_img": "{rid}-img"}

# name -> (layout (tp, sp, cfg), from_tp, to_tp, CFG companion roles)
SCENARIOS: dict[str, tuple[tuple[int, int, int], int, int, tuple[str, ...]]] = {
    "tp_cfg": ((2, 1, 2), 2, 2, ("cfg_text", "cfg_img")),
    "tp_sp": ((2, 2, 1), 1, 2, ("cfg_text",)),
    "tp_cfg_sp": ((1, 2, 2), 2, 1, ("cfg_text", "cfg_img")),
    "world": ((1, 2, 2), 1, 1, ("cfg_text",)),
    "pure_tp": ((4, 1, 1), 2, 4, ("cfg_text",)),
    "tp_one_miss": ((4, 1, 1), 4, 4, ()),
}


def _layout(name: str) -> GroupLayout:
    tp, sp, cfg = SCENARIOS[name][0]
    return GroupLayout(tp_size=tp, sp_size=sp, cfg_size=cfg)


def _cfg_ids(name: str, rid: str) -> dict[str, str]:
    return {role: CFG_IDS[role].format(rid=rid) for role in SCENARIOS[name][3]}


class StageRun:
    """Senders in this process, receivers in 4 workers; results per (scenario, rid, rank)."""

    def __init__(self, itkit: Any, workdir: pathlib.Path) -> None:
        self.itkit, self.workdir = itkit, workdir
        self.specs: dict[str, Any] = {}
        self.caches: dict[str, list[Any]] = {}
        self.senders: list[Any] = []
        self.sender_outcomes: list[Any] = []
        self.results: dict[tuple[str, str, int], dict[str, Any]] = {}
        self.errors: list[str] = []
        self.dead_port = 0

    def send_everything(self) -> None:
        """Start every scenario's sender ranks here and put every request and companion."""
        from kvferry.app.wiring import build_manager

        itkit = self.itkit
        for name, (_, from_tp, to_tp, _) in SCENARIOS.items():
            spec = make_spec(
                from_tp=from_tp, to_tp=to_tp, base_port=itkit.free_base_port(from_tp), seed=len(self.specs)
            )
            self.specs[name] = spec
            self.caches[name] = sender_caches(spec)
            managers = []
            for rank in range(from_tp):
                managers.append(build_manager(spec.omni_kv_config("sender"), tp_rank=rank, tp_size=from_tp))
                self.senders.append(managers[-1])  # closed by close(), whatever fails next
            for rid in self.hits(name):
                for request in [rid, *_cfg_ids(name, rid).values()]:
                    for rank, manager in enumerate(managers):
                        if name == "tp_one_miss" and rid.endswith("miss3") and rank == 3:
                            continue  # receiver rank 3's only key is never sent
                        self.sender_outcomes += manager.send_requests(
                            finished_request(spec, request), self.caches[name][rank], spec.block_size, spec.dtype
                        )
        self.dead_port = itkit.free_base_port(4) + 100  # nobody listens on any rank's port here

    @staticmethod
    def hits(name: str) -> list[str]:
        extra = [f"{name}-miss3"] if name == "tp_one_miss" else []
        return [f"{name}-0", *extra, f"{name}-1"]

    def plan(self) -> list[dict[str, Any]]:
        out = []
        for name, ((tp, sp, cfg), _, _, _) in SCENARIOS.items():
            spec = self.specs[name]
            port = spec.advertised_port

            def item(rid: str, timeout: float = HIT_S, sender_port: int = port) -> dict[str, Any]:
                return {"rid": rid, "timeout": timeout, "sender_port": sender_port, "cfg": _cfg_ids(name, rid)}

            first, *middle, last = self.hits(name)
            requests = [item(first)]
            requests += [item(rid, MISS_S) for rid in middle]  # tp_one_miss: rank 3 times out
            if name == "tp_cfg":
                requests.append(item("dummy_req_id", MISS_S))
            requests += [item(f"{name}-nosender", MISS_S, self.dead_port), item(last)]
            out.append(
                {
                    "name": name,
                    "layout": {"tp": tp, "sp": sp, "cfg": cfg},
                    "spec": spec_to_json(spec),
                    "requests": requests,
                }
            )
        return out

    def run(self) -> None:
        plan_file = self.workdir / "plan.json"
        plan_file.write_text(json.dumps(self.plan()))
        store = self.workdir / "store"
        ranks = [
            self.itkit.LineWorker(
                ["receiver", str(r), str(WORLD), str(store), str(plan_file)], self.workdir / f"rank{r}.log"
            )
            for r in range(WORLD)
        ]
        deadline = time.monotonic() + RUN_DEADLINE_S
        try:
            for rank, worker in enumerate(ranks):
                while True:
                    msg = worker.read(max(1.0, deadline - time.monotonic()))
                    if "scenario" in msg:
                        self.results[(msg["scenario"], msg["rid"], msg["rank"])] = msg
                    elif "error" in msg:
                        self.errors.append(f"rank {rank}: {msg['error']}\n{worker.log_tail()}")
                        break
                    elif "done" in msg:
                        break
            for worker in ranks:
                worker.proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        finally:
            for worker in ranks:
                worker.kill_quietly()

    def sender_health(self) -> list[dict[str, Any]]:
        return [m.health()["sender"] for m in self.senders]

    def close(self) -> None:
        for manager in self.senders:
            manager.close()

    # ------------------------------------------------------------------------ expectations
    def rows(self, name: str, rid: str) -> list[dict[str, Any]]:
        assert not self.errors, self.errors
        missing = [r for r in range(WORLD) if (name, rid, r) not in self.results]
        assert not missing, f"{name}/{rid}: no result from ranks {missing}"
        return [self.results[(name, rid, r)] for r in range(WORLD)]

    def digest(self, name: str, request: str, world_rank: int) -> list[str]:
        """What ``world_rank`` must hold for ``request``: its TP coordinate's heads."""
        spec = self.specs[name]
        _, _, tp_rank = _layout(name).coords(world_rank)
        return expected_digest(spec, self.caches[name], request, spec.head_range(tp_rank))


@pytest.fixture(scope="module")
def stage(itkit: Any, tmp_path_factory: pytest.TempPathFactory) -> Any:
    run = StageRun(itkit, tmp_path_factory.mktemp("stage"))
    try:
        run.send_everything()
        assert all(o.ok for o in run.sender_outcomes), [o for o in run.sender_outcomes if not o.ok]
        run.run()
        yield run
    finally:
        run.close()


def _kv_fields(row: dict[str, Any]) -> set[str]:
    return {k for k in row["fields"] if k.endswith("past_key_values")}


def _assert_hit_everywhere(stage: StageRun, name: str, rid: str) -> list[dict[str, Any]]:
    rows = stage.rows(name, rid)
    assert [r["ok"] for r in rows] == [True] * WORLD, rows
    for rank, row in enumerate(rows):
        assert row["fields"]["past_key_values"] == stage.digest(name, rid, rank), f"rank {rank} primary KV differs"
        assert row["fields"]["kv_metadata"]["seq_len"] == finished_request(stage.specs[name], rid)[rid]["seq_len"]
    return rows


def _assert_branch(stage: StageRun, name: str, rid: str, rank: int, row: dict[str, Any], role: str) -> None:
    companion = _cfg_ids(name, rid)[role]
    assert row["fields"][f"{role}_past_key_values"] == stage.digest(name, companion, rank), (
        f"rank {rank}: branch {role} differs"
    )


# --------------------------------------------------------------------------------- tests
@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("rid_index", [0, -1])
def test_tp_cfg_rank_i_gets_branch_i(stage: StageRun, rid_index: int) -> None:
    """TP 2 x CFG 2: each TP leader pulls its shard and the companions; CFG rank 1 gets the
    primary plus ``cfg_text`` only (marked active); CFG rank 0 keeps every branch."""
    rid = StageRun.hits("tp_cfg")[rid_index]
    rows = _assert_hit_everywhere(stage, "tp_cfg", rid)
    layout = _layout("tp_cfg")
    for rank, row in enumerate(rows):
        cfg_rank, _, _ = layout.coords(rank)
        assert row["fields"]["cfg_branch_roles"] == ["cfg_text", "cfg_img"]
        if cfg_rank == 0:
            assert _kv_fields(row) == {"past_key_values", "cfg_text_past_key_values", "cfg_img_past_key_values"}
            assert "cfg_active_branch" not in row["fields"]
            _assert_branch(stage, "tp_cfg", rid, rank, row, "cfg_img")
        else:  # its branch also as the one-entry map, as the reference sets it
            assert _kv_fields(row) == {"past_key_values", "cfg_text_past_key_values", "cfg_branch_past_key_values"}
            assert row["fields"]["cfg_branch_past_key_values"] == {
                "cfg_text": row["fields"]["cfg_text_past_key_values"]
            }
            assert row["fields"]["cfg_active_branch"] == "cfg_text"
        _assert_branch(stage, "tp_cfg", rid, rank, row, "cfg_text")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_tp_sp_followers_get_their_leaders_shard(stage: StageRun) -> None:
    """TP 2 x SP 2, sender TP 1 (fan-out, sliced by the sender): SP rank 1 of each TP rank gets
    exactly its SP leader's shard and branches by broadcast."""
    for rid in StageRun.hits("tp_sp"):
        rows = _assert_hit_everywhere(stage, "tp_sp", rid)
        for rank, row in enumerate(rows):
            assert _kv_fields(row) == {"past_key_values", "cfg_text_past_key_values"}
            _assert_branch(stage, "tp_sp", rid, rank, row, "cfg_text")
        assert rows[0]["fields"]["past_key_values"] != rows[1]["fields"]["past_key_values"]  # two shards


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_tp_cfg_sp_point_to_point_then_sp_broadcast(stage: StageRun) -> None:
    """TP active by mapping (2 -> 1) with CFG 2 x SP 2: one leader merges both sender shards,
    CFG rank 1 gets branch ``cfg_text`` point to point, each CFG rank broadcasts to its SP peer."""
    layout = _layout("tp_cfg_sp")
    for rid in StageRun.hits("tp_cfg_sp"):
        rows = _assert_hit_everywhere(stage, "tp_cfg_sp", rid)
        for rank, row in enumerate(rows):
            cfg_rank, sp_rank, _ = layout.coords(rank)
            assert row["fields"]["cfg_branch_roles"] == ["cfg_text", "cfg_img"]
            assert row["fields"].get("cfg_active_branch") == (None if cfg_rank == 0 else "cfg_text")
            if cfg_rank == 0 and sp_rank == 1:  # CFG rank 0's SP group: the primary and the roles only
                assert _kv_fields(row) == {"past_key_values"}, f"rank {rank}"
                continue
            want = {"past_key_values", "cfg_text_past_key_values"}
            want |= {"cfg_img_past_key_values"} if cfg_rank == 0 else {"cfg_branch_past_key_values"}
            assert _kv_fields(row) == want, f"rank {rank}"
            _assert_branch(stage, "tp_cfg_sp", rid, rank, row, "cfg_text")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_tp_inactive_world_broadcast(stage: StageRun) -> None:
    """Sender and receiver TP 1 in a world of 4: rank 0 pulls (legacy key) and broadcasts the
    request's KV fields, branches included, to the world group."""
    for rid in StageRun.hits("world"):
        rows = _assert_hit_everywhere(stage, "world", rid)
        for rank, row in enumerate(rows):
            assert _kv_fields(row) == {"past_key_values", "cfg_text_past_key_values"}
            _assert_branch(stage, "world", rid, rank, row, "cfg_text")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_pure_tp_every_rank_pulls_its_shard_and_keeps_it(stage: StageRun) -> None:
    """TP 4 (sender TP 2): every rank is LOCAL, pulls its own head slice and its companions,
    and the consensus keeps them; four distinct shards."""
    for rid in StageRun.hits("pure_tp"):
        rows = _assert_hit_everywhere(stage, "pure_tp", rid)
        for rank, row in enumerate(rows):
            assert row["outcome"] == "received"
            _assert_branch(stage, "pure_tp", rid, rank, row, "cfg_text")
        assert len({json.dumps(r["fields"]["past_key_values"]) for r in rows}) == WORLD


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_tp_consensus_one_rank_misses_every_rank_drops(stage: StageRun) -> None:
    """SPEC 9.1: rank 3's key is never sent; ranks 0-2 received theirs, yet every rank drops
    its KV, nobody hangs, and the next request is received by all (the group stayed in step)."""
    rid = "tp_one_miss-miss3"
    rows = stage.rows("tp_one_miss", rid)
    assert [r["ok"] for r in rows] == [False] * WORLD
    # ranks 0-2 did receive: their drop is a typed outcome of its own, not a timeout
    assert [r["outcome"] for r in rows] == ["dropped_by_consensus"] * 3 + ["timed_out"]
    assert rows[3]["missing"] == [f"{rid}_0_0_3_3"]
    for rank, row in enumerate(rows):
        assert _kv_fields(row) == set(), f"rank {rank} kept KV its peer does not have"
        assert row["seconds"] < MISS_S + SLACK_S
    assert rows[3]["seconds"] >= MISS_S * 0.9
    _assert_hit_everywhere(stage, "tp_one_miss", "tp_one_miss-1")


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", list(SCENARIOS))
def test_no_sender_every_rank_returns_false_by_the_deadline(stage: StageRun, name: str) -> None:
    """The pulling ranks find no sender: they time out at MISS_S, every collective still runs on
    every rank, every rank returns False well before a collective would time out, with no KV
    left on the request; the next request of the scenario is received by every rank."""
    rows = stage.rows(name, f"{name}-nosender")
    assert [r["ok"] for r in rows] == [False] * WORLD
    pulling = [r for r in rows if r["outcome"] is not None]
    assert pulling and all(r["outcome"] == "timed_out" for r in pulling), rows
    for rank, row in enumerate(rows):
        assert _kv_fields(row) == set() and "kv_metadata" not in row["fields"], f"rank {rank}: {row['fields']}"
        assert row["seconds"] < MISS_S + SLACK_S, f"rank {rank} took {row['seconds']:.1f} s"
    assert max(r["seconds"] for r in pulling) >= MISS_S * 0.9  # they did wait for their deadline
    _assert_hit_everywhere(stage, name, StageRun.hits(name)[-1])


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_dummy_request_never_waits_on_any_rank(stage: StageRun) -> None:
    rows = stage.rows("tp_cfg", "dummy_req_id")
    assert [r["ok"] for r in rows] == [False] * WORLD
    assert all(r["seconds"] < MISS_S for r in rows), [r["seconds"] for r in rows]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_every_sent_key_was_pulled_exactly_once(stage: StageRun) -> None:
    """Followers never touched the connector and no key was pulled twice or left behind."""
    assert not stage.errors, stage.errors
    for health in stage.sender_health():
        assert health["held_payloads"] == 0, health
        assert health["gets_served"] == health["puts"], health
