"""Distribution scenarios with a leader that fails, shared by the thread and gloo tests.

The receiving stage is 4 ranks laid out CFG 2 x SP 2 (TP 1 with a sender TP of 2, so TP is
active): rank 0 is the leader; it sends its CFG peer (rank 2) a payload point-to-point, then
each CFG rank broadcasts to its SP group (ranks {0, 1} and {2, 3}). The leader's collective
calls are its *steps*: 0 send size, 1 send data (to rank 2), 2 broadcast size, 3 broadcast
data (to rank 1).

A scenario says how the leader fails: its receive raises or misses, its fields need the
object fallback, or its group fails (raises a TransferError, as a broken gloo link does) or its
process dies at step k. :func:`run_rank` runs one request on one rank and reports what that
rank ended with: ``"kv"`` (bit-exact), ``"no_kv"`` or ``"error:<type>"``, and how long it took.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from typing import Any

import attrs
import torch

from kvferry.app.distribute import Distributor, kv_fields_of
from kvferry.app.manager import KVCache, StageGroups
from kvferry.core.errors import TransferError
from kvferry.core.roles import GroupLayout

__all__ = [
    "LAYOUT",
    "FROM_TP",
    "TO_TP",
    "LEADER_STEPS",
    "SCENARIOS",
    "FaultyGroup",
    "Script",
    "run_rank",
    "expected_kv",
]

LAYOUT = GroupLayout(tp_size=1, sp_size=2, cfg_size=2)
FROM_TP, TO_TP = 2, 1
#: The leader's collective calls in this layout (see the module docstring).
LEADER_STEPS = 4
#: name -> (leader receive behaviour, failing step or None, failure mode)
SCENARIOS: dict[str, tuple[str, int | None, str]] = {
    "ok": ("kv", None, ""),
    "receive_raises": ("raise", None, ""),
    "receive_misses": ("miss", None, ""),
    "object_fallback": ("odd_fields", None, ""),
    **{f"step{k}_raises": ("kv", k, "raise") for k in range(LEADER_STEPS)},
    **{f"step{k}_dies": ("kv", k, "die") for k in range(LEADER_STEPS)},
}


def expected_kv(rid: str) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The primary KV the leader receives for ``rid`` (deterministic, 2 layers)."""
    gen = torch.Generator().manual_seed(sum(rid.encode()))
    keys = [torch.randn(3, 2, 4, generator=gen) for _ in range(2)]
    values = [torch.randn(3, 2, 4, generator=gen) for _ in range(2)]
    return keys, values


@attrs.define(eq=False)
class Script:
    """The leader's fault: fail at collective call ``fail_at`` (None: never) by ``mode``."""

    fail_at: int | None = None
    mode: str = "raise"
    calls: int = 0

    def step(self, what: str) -> None:
        index, self.calls = self.calls, self.calls + 1
        if index != self.fail_at:
            return
        if self.mode == "die":
            os.kill(os.getpid(), signal.SIGKILL)
        raise TransferError(f"injected: the leader's group failed at step {index} ({what})")


@attrs.define(eq=False)
class FaultyGroup:
    """A CollectiveGroup that runs ``script.step`` before every call of the wrapped group."""

    inner: Any
    script: Script

    @property
    def rank(self) -> int:
        return self.inner.rank

    @property
    def size(self) -> int:
        return self.inner.size

    def __getattr__(self, name: str) -> Callable[..., Any]:
        target = getattr(self.inner, name)
        if not callable(target):
            return target

        def call(*args: Any, **kwargs: Any) -> Any:
            self.script.step(name)
            return target(*args, **kwargs)

        return call


@attrs.define(eq=False)
class _Request:
    request_id: str
    past_key_values: Any = None
    kv_metadata: Any = None
    sampling_params: Any = None


class _Params:
    """Stands in for sampling params (any attribute may be set on it)."""


def _leader_receive(behaviour: str) -> Callable[[Any], bool]:
    def receive(req: Any) -> bool:
        if behaviour == "raise":
            raise RuntimeError("injected: the leader's receive failed")
        if behaviour == "miss":
            return False
        keys, values = expected_kv(req.request_id)
        req.past_key_values = KVCache(keys, values)
        req.kv_metadata = {"seq_len": 3}
        if behaviour == "odd_fields":  # the side codec refuses int keys: object fallback
            req.kv_metadata = {"seq_len": 3, "odd": {1: "int key"}}
        return True

    return receive


def _exact(req: Any) -> bool:
    keys, values = expected_kv(req.request_id)
    kv = req.past_key_values
    return (
        len(kv.key_cache) == len(keys)
        and all(torch.equal(a, b) for a, b in zip(kv.key_cache, keys))
        and all(torch.equal(a, b) for a, b in zip(kv.value_cache, values))
    )


def run_rank(world_rank: int, groups: StageGroups, scenario: str, rid: str, timeout_s: float) -> dict[str, Any]:
    """One request on one rank; the leader (rank 0) fails as ``scenario`` says."""
    behaviour, fail_at, mode = SCENARIOS[scenario]
    req = _Request(rid, sampling_params=_Params())
    if world_rank == 0 and fail_at is not None:
        script = Script(fail_at, mode)
        groups = StageGroups(
            *(None if g is None else FaultyGroup(g, script) for g in (groups.world, groups.tp, groups.cfg, groups.sp))
        )
    distributor = Distributor(groups, FROM_TP, TO_TP, timeout_s=timeout_s, kv_factory=KVCache)
    started = time.monotonic()
    try:
        ok = distributor.run(req, _leader_receive(behaviour), active=True)
        result = "kv" if ok else "no_kv"
    except Exception as exc:  # what a rank ended with is the observation
        result = f"error:{type(exc).__name__}"
        ok = False
    seconds = time.monotonic() - started
    holds = kv_fields_of(req) is not None
    return {
        "rank": world_rank,
        "scenario": scenario,
        "result": result,
        "seconds": seconds,
        "holds_kv": holds,
        "exact": bool(ok and holds and _exact(req)),
    }
