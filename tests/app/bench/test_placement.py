"""Where the bench's peers run: the split of the CPUs (pure), its reading of sysfs, and real
worker processes placed on their side (they report the CPUs the kernel lets them use)."""

from __future__ import annotations

import os
import pathlib
import subprocess
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvferry.app.bench.placement import (
    SENDER_PEER,
    InstanceCpus,
    Placement,
    core_of,
    instance_cpus,
    plan_placement,
    split_cpus,
)
from kvferry.app.bench.proc import Peer, set_launcher
from kvferry.core.errors import ConfigError

ALLOWED = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
needs_two_cpus = pytest.mark.skipif(
    len(ALLOWED) < 2, reason=f"placing a peer is only visible with two CPUs or more (this process may use {ALLOWED})"
)


# -------------------------------------------------------------------------------- the split
@given(st.dictionaries(st.integers(0, 255), st.integers(0, 7), max_size=24))
def test_the_split_gives_each_side_whole_cores_and_every_cpu(cores: dict[int, int]) -> None:
    placement = split_cpus(cores)
    if len(cores) < 2:
        assert placement is None
        return
    assert placement is not None
    assert placement.sender and placement.receiver
    assert placement.sender.isdisjoint(placement.receiver)
    assert placement.sender | placement.receiver == set(cores)
    distinct = set(cores.values())
    if len(distinct) >= 2:  # SMT siblings never straddle the two sides
        sender_cores = {cores[c] for c in placement.sender}
        receiver_cores = {cores[c] for c in placement.receiver}
        assert sender_cores.isdisjoint(receiver_cores)
        assert len(sender_cores) == len(distinct) // 2
        # the sender's side holds the cores whose lowest CPU comes first
        lowest = sorted(min(c for c in cores if cores[c] == k) for k in distinct)
        assert {cores[c] for c in lowest[: len(distinct) // 2]} == sender_cores
    else:  # one core: its siblings split
        assert len(placement.sender) == len(cores) // 2


def test_two_cpus_one_each_and_siblings_kept_together() -> None:
    assert split_cpus({0: 0, 1: 1}) == Placement(frozenset({0}), frozenset({1}))
    # Linux numbers SMT siblings n/2 apart: cores 0 and 1 are CPUs {0, 2} and {1, 3}
    assert split_cpus({0: 0, 1: 1, 2: 0, 3: 1}) == Placement(frozenset({0, 2}), frozenset({1, 3}))
    assert split_cpus({5: 0, 9: 0}) == Placement(frozenset({5}), frozenset({9}))
    assert split_cpus({3: 0}) is None and split_cpus({}) is None
    p = Placement(frozenset({0}), frozenset({1}))
    assert p.cpus_for(SENDER_PEER) == {0} and p.cpus_for("receiver-shm") == {1}
    assert p.to_json() == {"sender": [0], "receiver": [1]}


@given(st.dictionaries(st.integers(0, 255), st.integers(0, 7), min_size=2, max_size=24))
def test_two_vllm_instances_bind_to_the_two_halves(cores: dict[int, int]) -> None:
    # the demo's and the engine bench's instances: the decode on the split's first half, the
    # prefill on the other, as VLLM_CPU_OMP_THREADS_BIND lists (CPUs in order, commas)
    placement = split_cpus(cores)
    assert placement is not None
    cpus = instance_cpus(placement)
    assert cpus.decode is not None and cpus.prefill is not None

    def listed(binding: str) -> list[int]:
        out = [int(c) for c in binding.split(",")]
        assert out == sorted(set(out))
        return out

    assert set(listed(cpus.decode)) == placement.sender and set(listed(cpus.prefill)) == placement.receiver
    assert cpus.tp2 == f"{cpus.decode}|{cpus.prefill}"
    assert cpus.to_json() == {"decode": cpus.decode, "prefill": cpus.prefill}


def test_without_a_split_vllm_binds_the_instances_itself() -> None:
    assert InstanceCpus(None, None).tp2 is None and InstanceCpus("0", None).tp2 is None
    assert instance_cpus(Placement(frozenset({0}), frozenset({1}))) == InstanceCpus("0", "1")
    placement, _ = plan_placement(True)
    expected = InstanceCpus(None, None) if placement is None else instance_cpus(placement)
    assert instance_cpus() == expected


def test_sysfs_names_each_cpus_core(tmp_path: pathlib.Path) -> None:
    for cpu, (package, core) in {0: (0, 0), 1: (0, 1), 2: (0, 0), 3: (0, 1)}.items():
        topology = tmp_path / f"cpu{cpu}" / "topology"
        topology.mkdir(parents=True)
        (topology / "physical_package_id").write_text(f"{package}\n")
        (topology / "core_id").write_text(f"{core}\n")
    cores = core_of([0, 1, 2, 3, 7], root=tmp_path)  # cpu7: not described, a core of its own
    assert cores[0] == cores[2] != cores[1] == cores[3]
    assert cores[7] not in (cores[0], cores[1])
    assert split_cpus(cores) == Placement(frozenset({0, 2}), frozenset({1, 3, 7}))


def test_the_plan_is_off_when_asked_and_within_the_allowed_cpus_otherwise() -> None:
    assert plan_placement(False) == (None, "not pinned (--no-pin)")
    placement, line = plan_placement(True)
    if len(ALLOWED) < 2:
        assert placement is None and "not pinned" in line
        return
    assert placement is not None
    assert placement.sender | placement.receiver == set(ALLOWED)
    assert line == f"sender on CPUs {sorted(placement.sender)}, receivers on {sorted(placement.receiver)}"


# ------------------------------------------------------------------------ real peer processes
@needs_two_cpus
def test_a_peer_started_on_cpus_runs_there_and_one_without_where_the_os_puts_it() -> None:
    one = {ALLOWED[-1]}
    with Peer.start("probe", cpus=one) as placed:
        assert placed.call("cpus", 60)["cpus"] == sorted(one)
        # the torch threads it starts later inherit the mask: every thread of the process has it
        tasks = os.listdir(f"/proc/{placed.pid}/task")
        assert tasks and all(os.sched_getaffinity(int(t)) == one for t in tasks)
    with Peer.start("probe") as free:  # the control: unpinned, it may use every allowed CPU
        assert free.call("cpus", 60)["cpus"] == ALLOWED


def test_a_placement_the_os_refuses_stops_the_peer_and_names_the_way_out() -> None:
    if not hasattr(os, "sched_setaffinity"):
        pytest.skip("this OS has no CPU affinity")
    started: list[subprocess.Popen] = []

    def launcher(argv: list[str], **popen: Any) -> subprocess.Popen:
        started.append(subprocess.Popen(argv, **popen))
        return started[-1]

    previous = set_launcher(launcher)
    try:
        with pytest.raises(ConfigError, match=r"cannot be placed on CPUs \[100000\].*--no-pin"):
            Peer.start("probe", cpus={100_000})  # no such CPU: the kernel refuses (EINVAL)
    finally:
        set_launcher(previous)
    assert len(started) == 1 and started[0].poll() is not None  # the worker did not stay behind
