"""The benchmark's run state and its per-connector paths (primitives, manager, TP, readiness).

:class:`RunState` collects figures, failures and data checks while peers run scenarios; a
scenario that fails is recorded (its figures stay missing) and the run goes on.
"""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Callable
from typing import Any

import attrs

from kvferry.app.bench.model import BenchSettings, Geometry, Stat
from kvferry.app.bench.placement import Placement
from kvferry.app.bench.proc import Peer
from kvferry.app.bench.scenarios import (
    Scenario,
    ScenarioResult,
    key_items,
    manager_items,
    one_repetition,
    run_scenario,
    tp_items,
)
from kvferry.core.errors import KVFerryError

__all__ = ["RunState", "connector_configs", "connector_paths", "mooncake_raw", "nixl_pair", "SAME_HOST", "COPYING"]

#: The same-host connector: its 1-request figure is compared with memcpy, and TP runs on it.
SAME_HOST = "shm"
#: Label prefix of the copying-receive rows (``receive(..., zero_copy=False)``, the compat
#: layer's receive): reported beside the default path's rows, not in the headline ratios.
COPYING = "copying receive:"
#: The shm namespace benchmark runs use.
SHM_NAMESPACE = "kvfbench"


def connector_configs(name: str, settings: BenchSettings, pool: int) -> tuple[dict, dict]:
    """Sender and receiver configs of a connector for the benchmark (loopback, OS ports)."""
    if name == "zmq":
        return (
            {"type": "zmq", "role": "sender", "port": 0, "pool_bytes": pool, "max_payloads": 65536},
            {"type": "zmq", "role": "receiver", "request_timeout_s": settings.timeout_s},
        )
    if name == "shm":
        # One namespace for every run (a run's sender reaps segments a killed run left there);
        # the sender's tag comes from the orchestrator's pid (rank 1 adds 16), so concurrent
        # runs use different tags.
        tag = 1 + (os.getpid() % 2000) * 32
        return (
            {"type": "shm", "role": "sender", "port": tag, "namespace": SHM_NAMESPACE, "pool_bytes": pool},
            {"type": "shm", "role": "receiver", "namespace": SHM_NAMESPACE},
        )
    if name in ("mooncake", "nixl"):
        return (
            {"type": name, "role": "sender", "port": 0, "pool_bytes": pool},
            {"type": name, "role": "receiver", "pool_bytes": pool},
        )
    return (
        {"type": name, "role": "sender", "pool_bytes": pool},
        {"type": name, "role": "receiver", "pool_bytes": pool},
    )


#: The paths measured as interleaved pairs with a limit: figure -> the limit (a name of
#: :attr:`RunState.limits`), whose repetitions alternate with the path's (app/bench/pairs.py).
#: The TP rows' limit is the homogeneous TP 2 -> 2 row of the same bytes.
TP_HOMO = "homo_2_2"
PAIR_LIMITS: dict[str, str] = {
    "shm_e2e_1": "memcpy",
    "shm_e2e_n": "memcpy",
    "zmq_e2e_1": "raw_tcp",
    "hetero_2_4": TP_HOMO,
    "replicated_2_8": TP_HOMO,
    "mla_2_4": TP_HOMO,
    # the small request's readiness: a bare wake between the same two CPUs (runner.WAKE)
    "shm_readiness_e2e": "wake",
    "zmq_readiness_e2e": "wake",
}


@attrs.define(eq=False)
class RunState:
    """One run's state: live peers, figures (``stats`` in their units, ``nbytes`` each moved),
    failures and data checks by path label, per-path results and notes."""

    settings: BenchSettings
    threads: int
    progress: Callable[[str], None]
    stats: dict[str, Stat] = attrs.Factory(dict)
    nbytes: dict[str, int] = attrs.Factory(dict)
    failures: dict[str, str] = attrs.Factory(dict)
    checks: dict[str, bool] = attrs.Factory(dict)
    scenarios: dict[str, ScenarioResult] = attrs.Factory(dict)
    extra: dict[str, Any] = attrs.Factory(dict)
    peers: list[Peer] = attrs.Factory(list)
    #: figure name -> the label of the scenario that produced it
    figure_paths: dict[str, str] = attrs.Factory(dict)
    #: limit name -> one repetition of it (returns seconds), for :data:`PAIR_LIMITS`
    limits: dict[str, Callable[[], float]] = attrs.Factory(dict)
    #: Where the peers run (:mod:`kvferry.app.bench.placement`); None: where the OS puts them.
    placement: Placement | None = None
    #: peer name -> the CPUs the peer itself reports it may run on (None: no CPU affinity)
    peer_cpus: dict[str, list[int] | None] = attrs.Factory(dict)

    def peer(self, name: str) -> Peer:
        """Start a peer process (torch limited to ``threads``), on its side's CPUs of
        :attr:`placement`; closed by :meth:`close_peer`. Waits for its first answer (the CPUs
        it runs on, kept in :attr:`peer_cpus`)."""
        env = {"OMP_NUM_THREADS": str(self.threads), "KVFERRY_BENCH_THREADS": str(self.threads)}
        cpus = None if self.placement is None else self.placement.cpus_for(name)
        peer = Peer.start(name, env=env, cpus=cpus)
        self.peers.append(peer)
        self.peer_cpus[name] = peer.call("cpus", self.settings.timeout_s)["cpus"]
        return peer

    def close_peer(self, peer: Peer) -> None:
        if peer in self.peers:
            self.peers.remove(peer)
        peer.close()

    def record(self, name: str, stat: Stat, nbytes: int) -> None:
        self.stats[name] = stat
        self.nbytes[name] = nbytes

    def scenario(
        self, sender: Peer, receiver: Peer, scenario: Scenario, figure: str, *, baseline_kb: int | None = None
    ) -> ScenarioResult | None:
        self.progress(f"{scenario.label} ...")
        start = time.monotonic()
        limit = self.limits.get(PAIR_LIMITS.get(figure, ""))
        if limit is not None and scenario.limit is None:
            scenario = attrs.evolve(scenario, limit=limit)
        try:
            result = run_scenario(sender, receiver, scenario, self.settings, receiver_baseline_kb=baseline_kb)
        except KVFerryError as exc:
            self.failures[scenario.label] = " ".join(str(exc).split())[:800]
            self.progress(f"{scenario.label}: FAILED ({self.failures[scenario.label][:200]})")
            return None
        self.scenarios[scenario.label] = result
        self.figure_paths[figure] = scenario.label
        self.record(figure, result.time, scenario.nbytes)
        if result.limit_time is not None:  # the limit's repetitions, in pair order
            self.record(f"{figure}_limit", result.limit_time, 0)
        if result.checked is not None:
            self.checks[scenario.label] = result.checked
        self.progress(f"{scenario.label}: median {result.time.median * 1e3:.2f} ms ({time.monotonic() - start:.1f} s)")
        return result


def mooncake_raw(run: RunState) -> None:
    """The engine's raw batched write throughput, when the mooncake module offers it."""
    g, s = run.settings.geometry, run.settings
    run.progress("raw mooncake batched write ...")
    try:
        from kvferry.adapters.connectors.mooncake.engine import bench_raw_transfer

        raw = bench_raw_transfer(g.nbytes, reps=s.reps)
    except (ImportError, KVFerryError) as exc:
        run.failures["raw mooncake"] = " ".join(str(exc).split())[:800]
        return
    run.record("mooncake_raw", Stat.of(raw["seconds"]), g.nbytes)


#: Pairs of the nixl connector against the raw READ, at least (one pair of the bench's payload
#: takes about 0.1 s; UCX over TCP on a small host varies a READ's time 3-5x from one to the
#: next, and the median of 5 pairs moved by 0.35 between runs, of 15 it moves less).
NIXL_PAIRS = 15


def nixl_pair(run: RunState) -> None:
    """A raw NIXL READ against the nixl connector's get of the same bytes on the same agent pair,
    repetitions interleaved (figures ``nixl_raw_read`` and ``nixl_pair_get``; ``reps`` pairs,
    at least :data:`NIXL_PAIRS`)."""
    g, s = run.settings.geometry, run.settings
    run.progress("raw NIXL READ vs nixl connector, interleaved ...")
    try:
        from kvferry.adapters.connectors.nixl.bench import bench_pair

        pair = bench_pair(g.nbytes, reps=max(s.reps, NIXL_PAIRS))
    except (ImportError, KVFerryError) as exc:
        run.failures["raw nixl"] = " ".join(str(exc).split())[:800]
        return
    run.record("nixl_raw_read", Stat.of(pair["raw"]["seconds"]), g.nbytes)
    run.record("nixl_pair_get", Stat.of(pair["connector"]["seconds"]), g.nbytes)


def _fresh(
    run: RunState,
    sender: Peer,
    scenarios: list[tuple[Scenario, str]],
    name: str,
    recv_cfg: dict,
    where: dict | None,
    *,
    group: str | None = None,
    ranks: int = 1,
    from_tp: int = 1,
    to_tp: int = 1,
    manager_options: dict | None = None,
) -> list[ScenarioResult | None]:
    """Run ``(scenario, figure)`` pairs against a fresh receiver process: connector ``name``
    (and managers ``group`` for ``ranks`` receiver ranks) opened, RSS baseline taken, then the
    scenarios in order. The receiver's peak RSS then covers these paths alone."""
    t = run.settings.timeout_s
    receiver = run.peer(f"receiver-{name}")
    results: list[ScenarioResult | None] = [None] * len(scenarios)
    try:
        _open_receiver(
            receiver, t, name, recv_cfg, where, group=group, ranks=ranks, from_tp=from_tp, to_tp=to_tp,
            manager_options=manager_options,
        )  # fmt: skip
        base_kb = receiver.call("rss_reset", t)["rss_kb"]
        for i, (scenario, figure) in enumerate(scenarios):
            results[i] = run.scenario(sender, receiver, scenario, figure, baseline_kb=base_kb)
    except KVFerryError as exc:
        label = scenarios[0][0].label
        run.failures[label] = " ".join(str(exc).split())[:800]
        run.progress(f"{label}: FAILED ({run.failures[label][:200]})")
    finally:
        run.close_peer(receiver)
    return results


def _open_receiver(
    receiver: Peer,
    t: float,
    name: str,
    recv_cfg: dict,
    where: dict | None,
    *,
    group: str | None,
    ranks: int,
    from_tp: int,
    to_tp: int,
    manager_options: dict | None,
) -> None:
    """Open connector ``name`` in ``receiver`` (and managers ``group`` for ``ranks`` ranks)."""
    receiver.call("kv_open", t, name=name, config=recv_cfg, sender=where)
    if group is not None:
        receiver.call(
            "mgr_open",
            t,
            name=group,
            role="receiver",
            ranks=list(range(ranks)),
            from_tp=from_tp,
            to_tp=to_tp,
            timeout_s=t,
            connectors=[name] * ranks,
            **(manager_options or {}),
        )


def connector_paths(run: RunState, sender: Peer, name: str, pool: int, small: Geometry) -> None:
    """Over connector ``name``, each path with a fresh receiver process: one request through
    the library's primitives (extraction into the connector, views on the receiver: the floor
    the manager can reach); then through the transfer manager (its default, zero-copy receive)
    1 and N requests, the small request's readiness, the same two with the copying receive,
    and, on the same-host connector, TP 2->2 against 2->4."""
    s, g, t = run.settings, run.settings.geometry, run.settings.timeout_s
    send_cfg, recv_cfg = connector_configs(name, s, pool)
    try:
        info = sender.call("kv_open", t, name=name, config=send_cfg)
        sender.call("mgr_open", t, name=name, role="sender", ranks=[0], from_tp=1, to_tp=1)
    except KVFerryError as exc:
        run.failures[f"{name} connector"] = " ".join(str(exc).split())[:800]
        run.progress(f"{name}: connector unavailable ({run.failures[f'{name} connector'][:200]})")
        return
    where = {"host": info["host"], "port": info["port"]} if "port" in info else None
    try:

        def direct(label: str, tag: str, cache: str, nbytes: int, **kw: Any) -> Scenario:
            return Scenario(
                label,
                "kv_send",
                "kv_recv",
                lambda i: {"name": name, "cache": cache, "items": key_items(tag, i, 1)[0]},
                lambda i: {"name": name, "items": key_items(tag, i, 1)[1]},
                nbytes,
                **kw,
            )

        _, ready = _fresh(
            run,
            sender,
            [
                (
                    direct(
                        f"kvferry {name} primitives e2e, 1 request (no manager)",
                        f"{name}d",
                        "main",
                        g.nbytes,
                        expected=(("main", 0, None),),
                    ),
                    f"{name}_direct_1",
                ),
                (
                    direct(
                        f"kvferry {name} primitives readiness (small request)",
                        f"{name}dr",
                        "small",
                        small.nbytes,
                        reps=s.readiness_reps,
                    ),
                    f"{name}_direct_readiness_e2e",
                ),
            ],
            name,
            recv_cfg,
            where,
        )
        if ready is not None:
            run.record(f"readiness_{name}_direct", ready.latency, small.nbytes)

        def managed(
            label: str, tag: str, count: int, cache: str, nbytes: int, copy: bool = False, **kw: Any
        ) -> Scenario:
            return Scenario(
                label,
                "mgr_send",
                "mgr_recv",
                lambda i: {"name": name, "cache": cache, "items": manager_items(tag, i, count)[0]},
                lambda i: {"name": name, "items": manager_items(tag, i, count)[1], "sender": where, "copy": copy},
                nbytes,
                **kw,
            )

        n = s.requests
        for label, tag, count, figure in (
            (f"kvferry {name} e2e, 1 request", f"{name}1", 1, f"{name}_e2e_1"),
            (f"kvferry {name} e2e, {n} requests", f"{name}n", n, f"{name}_e2e_n"),
        ):
            _fresh(
                run,
                sender,
                [
                    (
                        managed(
                            label,
                            tag,
                            count,
                            "main",
                            count * g.nbytes,
                            expected=tuple(("main", r, None) for r in range(count)),
                        ),
                        figure,
                    )
                ],
                name,
                recv_cfg,
                where,
                group=name,
            )
        (ready,) = _fresh(
            run,
            sender,
            [
                (
                    managed(
                        f"kvferry {name} readiness (small request)",
                        f"{name}r",
                        1,
                        "small",
                        small.nbytes,
                        reps=s.readiness_reps,
                    ),
                    f"{name}_readiness_e2e",
                )
            ],
            name,
            recv_cfg,
            where,
            group=name,
        )
        if ready is not None:
            run.record(f"readiness_{name}", ready.latency, small.nbytes)
            if ready.call_latency is not None:
                run.record(f"readiness_{name}_from_call", ready.call_latency, small.nbytes)
        # the copying receive (``zero_copy=False``, what kvferry.app.compat does, as the reference
        # API did): figures "{name}_e2e_1_copy" and "readiness_{name}_copy", beside the rows above
        _fresh(
            run,
            sender,
            [
                (
                    managed(
                        f"{COPYING} {name} e2e, 1 request",
                        f"{name}1c",
                        1,
                        "main",
                        g.nbytes,
                        copy=True,
                        expected=(("main", 0, None),),
                    ),
                    f"{name}_e2e_1_copy",
                )
            ],
            name,
            recv_cfg,
            where,
            group=name,
        )
        (ready,) = _fresh(
            run,
            sender,
            [
                (
                    managed(
                        f"{COPYING} {name} readiness (small request)",
                        f"{name}rc",
                        1,
                        "small",
                        small.nbytes,
                        copy=True,
                        reps=s.readiness_reps,
                    ),
                    f"{name}_readiness_copy_e2e",
                )
            ],
            name,
            recv_cfg,
            where,
            group=name,
        )
        if ready is not None:
            run.record(f"readiness_{name}_copy", ready.latency, small.nbytes)
        if name == SAME_HOST:
            tp_paths(run, sender, name, send_cfg, recv_cfg, where)
    finally:
        try:
            sender.call("kv_close", t, name=name)
        except KVFerryError as exc:
            run.failures[f"{name} close"] = str(exc)[:800]


def tp_paths(run: RunState, sender: Peer, name: str, send_cfg: dict, recv_cfg: dict, where: dict | None) -> None:
    """TP 2->2 against 2->4 for the same bytes: sender rank ``r`` serves from its own connector
    bound at ``port + r*16`` (as a deployment's ranks do); the receiver ranks pull by routing."""
    g, t = run.settings.geometry, run.settings.timeout_s
    if where is None:
        run.failures[f"{name} TP paths"] = "the sender connector reports no port to route ranks by"
        return
    rank1 = f"{name}_rank1"
    pool = 2 * (g.nbytes + (1 << 20)) + (64 << 20)
    try:
        sender.call("kv_open", t, name=rank1, config={**send_cfg, "port": where["port"] + 16, "pool_bytes": pool})
    except KVFerryError as exc:
        run.failures[f"{name} TP paths"] = " ".join(str(exc).split())[:800]
        return
    try:
        # (label, figure, to_tp, model KV heads, cache, layout): every row moves 2 * g.nbytes
        rows: list[tuple[str, str, int, int | None, str, str | None]] = [
            ("homogeneous TP 2->2", "homo_2_2", 2, None, "main", None),
            ("heterogeneous TP 2->4", "hetero_2_4", 4, None, "main", None),
        ]
        if g.heads >= 2 and g.heads % 2 == 0 and g.heads < 8:
            # each sender rank holds g.heads/2 of the model's g.heads KV heads (a cache of its own,
            # contiguous as an engine's), so at TP 8 every head is on two receivers
            half = attrs.evolve(g, heads=g.heads // 2)
            sender.call(
                "setup", t + 60, name="half", geometry=half.to_json(), requests=2, seed=run.settings.seed + 2,
                huge_pages=run.settings.huge_pages,
            )  # fmt: skip
            rows.append((f"replicated TP 2->8 at {g.heads} KV heads", "replicated_2_8", 8, g.heads, "half", "flash"))
        # an MLA latent: each layer's K half read as [blocks, block_size, heads*head_dim]
        rows.append(("MLA latent TP 2->4", "mla_2_4", 4, 1, "main:latent", "mla"))
        # The homogeneous row runs first against a receiver that stays open; each other row's
        # repetitions then alternate with one of the homogeneous row's (its pair limit).
        homo: Peer | None = None
        try:
            for label, figure, to_tp, kv_heads, cache, layout in rows:
                group = f"{name}_{figure}"
                routing_kw = {"num_kv_heads": None if layout == "mla" else kv_heads, "kv_layout": layout}
                sender.call(
                    "mgr_open", t, name=group, role="sender", ranks=[0, 1], from_tp=2, to_tp=to_tp,
                    connectors=[name, rank1], **routing_kw,
                )  # fmt: skip
                scenario = _tp_scenario(
                    f"kvferry {name} {label}", f"{name}{figure}", group, to_tp, kv_heads, cache, where, g
                )
                if figure == TP_HOMO:
                    homo = run.peer(f"receiver-{name}-{figure}")
                    _open_receiver(
                        homo, t, name, recv_cfg, where, group=group, ranks=to_tp, from_tp=2, to_tp=to_tp,
                        manager_options=routing_kw,
                    )  # fmt: skip
                    base_kb = homo.call("rss_reset", t)["rss_kb"]
                    if run.scenario(sender, homo, scenario, figure, baseline_kb=base_kb) is not None:
                        run.limits[TP_HOMO] = _limit_steps(sender, homo, scenario, t, run.settings)
                    continue
                _fresh(
                    run, sender, [(scenario, figure)], name, recv_cfg, where, group=group, ranks=to_tp,
                    from_tp=2, to_tp=to_tp, manager_options=routing_kw,
                )  # fmt: skip
        finally:
            run.limits.pop(TP_HOMO, None)
            if homo is not None:
                run.close_peer(homo)
    except KVFerryError as exc:
        run.failures[f"{name} TP paths"] = " ".join(str(exc).split())[:800]
    finally:
        sender.call("kv_close", t, name=rank1)


def _tp_scenario(
    label: str, tag: str, group: str, to_tp: int, kv_heads: int | None, cache: str, where: dict, g: Geometry
) -> Scenario:
    """One TP row's scenario: TP 2 -> ``to_tp`` of ``2 * g.nbytes`` through managers ``group``."""

    def items(i: int) -> tuple[list[dict], list[dict], Any]:
        return tp_items(tag, i, 2, to_tp, g.heads, num_kv_heads=kv_heads, cache=cache)

    return Scenario(
        label,
        "mgr_send",
        "mgr_recv",
        lambda i: {"name": group, "cache": cache, "items": items(i)[0]},
        lambda i: {"name": group, "items": items(i)[1], "sender": where},
        2 * g.nbytes,
        expected=items(0)[2],
    )


def _limit_steps(
    sender: Peer, receiver: Peer, scenario: Scenario, t: float, settings: BenchSettings
) -> Callable[[], float]:
    """One repetition of ``scenario`` a call, each with a request id of its own (after the ids
    its own run used), as a pair limit of another path."""
    index = itertools.count(settings.warmup + (scenario.reps or settings.reps))
    return lambda: one_repetition(sender, receiver, scenario, t, next(index))
