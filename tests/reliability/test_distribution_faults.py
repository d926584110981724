"""A receiving stage whose leader fails at every step of distribution (SPEC 6, 9.1).

Four ranks, CFG 2 x SP 2 (see ``distribution_scenarios``): the leader pulls, sends its CFG peer a payload
point-to-point, then both CFG ranks broadcast to their SP groups. The leader fails in every way
it can: its receive raises or misses (then every rank takes the same no-KV path), its fields
need the object fallback (every rank gets them), or its group fails or its process dies at each
of its four collective steps. Whatever happens:

- no rank waits longer than the collective deadline (two chained steps at most);
- no rank keeps KV it was not sent whole: a rank ends with bit-exact KV, no KV, or a typed
  TransferError; the leader never keeps KV it could not hand out;
- when the leader's group fails before anything was sent, every rank ends the same way.

Threads on the in-process group cover every "raises" step fast; real gloo processes cover
the same steps and a leader killed (SIGKILL) between steps.
"""

from __future__ import annotations

import datetime
import threading
from typing import Any

import pytest
from distribution_scenarios import LAYOUT, LEADER_STEPS, SCENARIOS, run_rank
from fault_kit import LineProc

from kvferry.adapters.collectives import InProcessWorld, build_parallel_groups
from kvferry.app.manager import StageGroups

WORLD = LAYOUT.world_size
#: Collective deadline of the scenarios (seconds); a rank may wait on two chained steps.
THREAD_T = 0.5
GLOO_T = 1.5
#: Slack for a loaded 2-core machine; far below what a hang would take.
SLACK_S = 8.0
#: A step's receivers: which ranks got their KV before the leader failed at step k.
#: (step 0/1: nothing reached rank 2 yet; step 2/3: rank 2 has it and serves rank 3.)
SERVED_BEFORE = {0: set(), 1: set(), 2: {2, 3}, 3: {2, 3}}


def _check(scenario: str, reports: dict[int, dict[str, Any]], timeout_s: float) -> None:
    behaviour, fail_at, mode = SCENARIOS[scenario]
    alive = {r: rep for r, rep in reports.items() if not (mode == "die" and r == 0)}
    assert len(alive) == (WORLD - 1 if mode == "die" else WORLD), reports
    for rep in alive.values():
        assert rep["seconds"] <= 2 * timeout_s + SLACK_S, (scenario, rep)  # nobody waits forever
        if rep["result"] == "kv":
            assert rep["exact"], (scenario, rep)  # KV is whole and bit-exact, or absent
        else:
            assert not rep["holds_kv"], (scenario, rep)  # a rank without a result holds nothing
    results = {r: rep["result"] for r, rep in alive.items()}
    if fail_at is None:
        want = "kv" if behaviour in ("kv", "odd_fields") else "no_kv"
        assert set(results.values()) == {want}, (scenario, results)  # one path for all
        return
    served = SERVED_BEFORE[fail_at]
    for rank, result in results.items():
        if rank in served:
            assert result == "kv", (scenario, results)
        else:
            assert result.startswith("error:Transfer"), (scenario, results)  # typed, by the deadline


# ------------------------------------------------------------------------------- threads
def _run_threads(scenario: str, rid: str) -> dict[int, dict[str, Any]]:
    world = InProcessWorld(WORLD)
    reports: dict[int, dict[str, Any]] = {}

    def rank_main(rank: int) -> None:
        handle = world.group(rank)
        parallel = build_parallel_groups(LAYOUT, rank, handle, lambda ranks: world.new_group(ranks, rank))
        groups = StageGroups(world=handle, tp=parallel.tp, cfg=parallel.cfg, sp=parallel.sp)
        reports[rank] = run_rank(rank, groups, scenario, rid, THREAD_T)

    threads = [threading.Thread(target=rank_main, args=(r,), daemon=True) for r in range(WORLD)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(2 * THREAD_T + SLACK_S)
        assert not t.is_alive(), f"{scenario}: a rank is still waiting"
    return reports


THREAD_SCENARIOS = [s for s, (_, _, mode) in SCENARIOS.items() if mode != "die"]


@pytest.mark.parametrize("scenario", THREAD_SCENARIOS)
def test_leader_failure_on_threads(scenario: str) -> None:
    _check(scenario, _run_threads(scenario, f"t-{scenario}"), THREAD_T)


# ---------------------------------------------------------------------------------- gloo
def _run_gloo(scenarios: list[str], tmp_path: Any) -> list[dict[int, dict[str, Any]]]:
    import torch.distributed as dist

    store = dist.TCPStore(
        "127.0.0.1", 0, WORLD, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=120)
    )
    procs = [
        LineProc(
            ["distribution_worker.py", str(r), str(WORLD), str(store.port), str(GLOO_T), ",".join(scenarios)],
            tmp_path,
            f"rank{r}",
        )
        for r in range(WORLD)
    ]
    try:
        for p in procs:
            assert "ready" in p.read(120.0)
        out: list[dict[int, dict[str, Any]]] = []
        for scenario in scenarios:
            dies = SCENARIOS[scenario][2] == "die"
            reports = {}
            for rank, p in enumerate(procs):
                if dies and rank == 0:
                    assert p.proc.wait(timeout=2 * GLOO_T + SLACK_S) == -9  # SIGKILLed itself
                    continue
                rep = p.read(2 * GLOO_T + SLACK_S + 30.0)
                assert rep["scenario"] == scenario, rep
                reports[rank] = rep
            out.append(reports)
        return out
    finally:
        for p in procs:
            p.kill()
            p.close()
        del store


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_leader_failure_on_gloo_processes(tmp_path: Any) -> None:
    """One set of 4 processes runs the receive faults and a group failure at every step (fresh
    groups each time: a failed collective leaves a gloo group broken), then a clean request."""
    scenarios = [
        "ok",
        "receive_raises",
        "receive_misses",
        "object_fallback",
        *(f"step{k}_raises" for k in range(LEADER_STEPS)),
        "ok",
    ]
    for scenario, reports in zip(scenarios, _run_gloo(scenarios, tmp_path)):
        _check(scenario, reports, GLOO_T)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_leader_killed_between_the_two_phases_on_gloo_processes(tmp_path: Any) -> None:
    """SIGKILL of the leader after it sent its CFG peer a size and before the bytes (step 1):
    rank 2 holds a size and waits for data that never comes; ranks 1 and 3 wait on broadcasts
    that never come. (Every other step is covered by the "raises" scenarios above.)"""
    scenario = "step1_dies"
    (reports,) = _run_gloo([scenario], tmp_path)
    _check(scenario, reports, GLOO_T)
