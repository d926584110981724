"""Where the bench's peer processes run: the sending stage on one half of the CPUs this
process may use, the receiving stage on the other half (docs/benchmarks.md, "Where the
processes run").

A deployment runs its stages on cores of their own (a prefill and a decode instance, an LLM
and a diffusion stage, each with its GPUs and CPU threads). On a small host, left to the
scheduler, the two stages time-share cores: a receiver woken by the sender's grant may run on
the sender's CPU while the sender still gathers, and the fan-out rows, which wake four receivers
at once, pay for it most (docs/benchmarks.md gives the figures). The runner itself (memcpy,
extraction, the codec figures) stays where the OS puts it.

- :func:`split_cpus`: pure; the allowed CPUs grouped by physical core (SMT siblings stay on
  one side), the cores split in two halves;
- :func:`core_of`: which physical core each CPU is, from sysfs (each CPU its own core where
  sysfs does not say);
- :func:`plan_placement`: the split of this process's CPUs, or why there is none;
- :func:`instance_cpus`: the same split as the core bindings of a decode and a prefill vLLM CPU
  instance beside each other (``kvferry demo --engine vllm``, ``kvferry bench --engine vllm``).
"""

from __future__ import annotations

import os
import pathlib
from collections.abc import Hashable, Iterable, Mapping
from typing import Any

import attrs

__all__ = ["Placement", "InstanceCpus", "split_cpus", "core_of", "plan_placement", "instance_cpus", "SENDER_PEER"]

#: The peer that runs the sending stage; every other peer runs a receiving one.
SENDER_PEER = "sender"
_SYS_CPU = pathlib.Path("/sys/devices/system/cpu")


@attrs.frozen
class Placement:
    """The CPUs of the sending stage's peer and of the receiving stages' peers (disjoint)."""

    sender: frozenset[int]
    receiver: frozenset[int]

    def cpus_for(self, peer: str) -> frozenset[int]:
        """The CPUs of the peer named ``peer``."""
        return self.sender if peer == SENDER_PEER else self.receiver

    def to_json(self) -> dict[str, list[int]]:
        return {"sender": sorted(self.sender), "receiver": sorted(self.receiver)}


def split_cpus(cores: Mapping[int, Hashable]) -> Placement | None:
    """Split the CPUs of ``cores`` (CPU -> its physical core) in two: the cores in order of
    their lowest CPU, the first half (rounded down) to the sender, the rest to the receivers;
    with a single core of several CPUs, its CPUs split instead. None for fewer than two CPUs."""
    if len(cores) < 2:
        return None
    groups: dict[Hashable, list[int]] = {}
    for cpu in sorted(cores):
        groups.setdefault(cores[cpu], []).append(cpu)
    ordered = sorted(groups.values(), key=lambda cpus: cpus[0])
    if len(ordered) < 2:  # one core with SMT siblings: split the siblings
        ordered = [[cpu] for cpu in ordered[0]]
    half = len(ordered) // 2
    sender = frozenset(cpu for group in ordered[:half] for cpu in group)
    receiver = frozenset(cpu for group in ordered[half:] for cpu in group)
    return Placement(sender, receiver)


def core_of(cpus: Iterable[int], root: pathlib.Path = _SYS_CPU) -> dict[int, Hashable]:
    """CPU -> ``(package, core)`` from ``{root}/cpuN/topology``; a CPU sysfs does not describe
    is a core of its own."""
    out: dict[int, Hashable] = {}
    for cpu in cpus:
        topology = root / f"cpu{cpu}" / "topology"
        try:
            package = int((topology / "physical_package_id").read_text().strip())
            core = int((topology / "core_id").read_text().strip())
        except (OSError, ValueError):
            out[cpu] = ("cpu", cpu)
            continue
        out[cpu] = (package, core)
    return out


def plan_placement(enabled: bool) -> tuple[Placement | None, str]:
    """The placement of this run's peers and a line saying what it is (or why there is none:
    switched off, one CPU, an OS without CPU affinity)."""
    if not enabled:
        return None, "not pinned (--no-pin)"
    getter: Any = getattr(os, "sched_getaffinity", None)
    if getter is None or not hasattr(os, "sched_setaffinity"):
        return None, "not pinned (this OS has no CPU affinity)"
    allowed = sorted(getter(0))
    placement = split_cpus(core_of(allowed))
    if placement is None:
        return None, f"not pinned (one CPU: {allowed})"
    return placement, f"sender on CPUs {sorted(placement.sender)}, receivers on {sorted(placement.receiver)}"


@attrs.frozen
class InstanceCpus:
    """Core bindings (vLLM CPU's ``VLLM_CPU_OMP_THREADS_BIND``) of a decode and a prefill
    instance run beside each other; None leaves an instance to vLLM's default."""

    decode: str | None
    prefill: str | None

    @property
    def tp2(self) -> str | None:
        """A TP 2 instance's binding: its rank 0 on the decode's CPUs, rank 1 on the prefill's."""
        return None if self.decode is None or self.prefill is None else f"{self.decode}|{self.prefill}"

    def to_json(self) -> dict[str, str | None]:
        return {"decode": self.decode, "prefill": self.prefill}


def _cpu_list(cpus: Iterable[int]) -> str:
    return ",".join(str(c) for c in sorted(cpus))


def instance_cpus(placement: Placement | None = None) -> InstanceCpus:
    """The decode on the first half of this process's CPUs and the prefill on the other, whole
    cores each (:func:`split_cpus`; ``placement`` where given instead); both left to vLLM's
    default where there is no split (one CPU, no CPU affinity)."""
    if placement is None:
        placement, _ = plan_placement(True)
    if placement is None:
        return InstanceCpus(None, None)
    return InstanceCpus(_cpu_list(placement.sender), _cpu_list(placement.receiver))
