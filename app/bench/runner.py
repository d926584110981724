"""``kvferry bench``: kvferry's paths against the machine's limits and a naive baseline.

:func:`run_bench` measures, in one run on one machine and one payload (see
:class:`~kvferry.app.bench.model.BenchSettings`):

- limits: single-thread ``memcpy`` into a reused buffer; raw ZMQ tcp PUSH/PULL of the same
  bytes (``copy=False``, sender in another process); the kernel's TCP stream limit (loopback,
  ``sendall`` of a touched buffer, ``recv_into`` a reused, touched buffer, two processes);
- the baseline (:mod:`kvferry.app.bench.payload`): naive extraction, ``tobytes`` + join,
  copying send, sleep-polling receiver, ``frombuffer`` decode;
- kvferry: extraction, encode, decode, end-to-end transfers over shm (same host) and zmq tcp
  of 1 and ``requests`` requests through the transfer manager's default (zero-copy) receive,
  and, beside them, the copying receive (``zero_copy=False``, the compat layer's),
  heterogeneous TP 2->4, replicated-head TP 2->8 (4 KV heads) and an MLA latent TP 2->4
  against 2->2 for the same bytes,
  readiness latency of a small request, page faults per MB and peak RSS of both sides, the
  cost of the default checksums (crc32c where the native routine is built); optional
  connectors (``mooncake``, ``nixl``) beside them.

It returns the report (a JSON-able dict with ``ratios`` under the names of
:data:`~kvferry.app.bench.model.RATIO_NAMES`, every figure's median/min/max, the machine,
failures and data checks). A path that fails is recorded under ``failures`` and its ratios are
NaN (``null`` in JSON): the run goes on. Targets are reported, never asserted.

Torch runs ``threads`` intra-op threads (default 1) in every process, so the single-thread
``memcpy`` limit and each path compare like with like.
"""

from __future__ import annotations

import itertools
import logging
import math
import os
import platform
import sys
import time
from collections.abc import Callable, Mapping
from typing import Any, TypedDict

import attrs
import torch

from kvferry.adapters.checksums import DEFAULT_CHECKSUM, checksum_engine
from kvferry.app.bench.model import (
    RATIO_NAMES,
    TARGETS,
    BenchSettings,
    Stat,
    Target,
    compute_ratios,
    ratio_of,
)
from kvferry.app.bench.pairs import MAX_SPREAD, PairedRatio, paired_ratio, quartiles, relative_spread, verdict
from kvferry.app.bench.paths import COPYING, PAIR_LIMITS, RunState, connector_paths, mooncake_raw, nixl_pair
from kvferry.app.bench.placement import SENDER_PEER, plan_placement
from kvferry.app.bench.proc import Peer
from kvferry.app.bench.scenarios import Scenario, one_repetition
from kvferry.core.errors import KVFerryError

__all__ = ["run_bench", "run_once", "machine_info", "RATIO_INPUTS", "PAIRED_RATIOS", "SMALL", "RAW_TCP", "WAKE"]

logger = logging.getLogger(__name__)


class _SmallRequest(TypedDict):
    layers: int
    tokens: int


#: The raw TCP limit's path label.
RAW_TCP = "raw tcp (sendall / recv_into a reused buffer)"
#: The small request's floor: one datagram from the sender peer to the receiver peer blocked
#: waiting for it (figure ``wake``; alternated with the readiness rows, see ``PAIR_LIMITS``).
WAKE = "wake floor (one datagram to a waiting peer)"
#: The small request of the readiness measurement: 1 layer, 16 tokens.
SMALL: _SmallRequest = {"layers": 1, "tokens": 16}
#: Which figures each ratio is computed from (for the report).
RATIO_INPUTS: dict[str, tuple[str, ...]] = {
    "codec_ms": ("kvferry_codec",),
    "encode_speedup_vs_baseline": ("baseline_encode", "kvferry_encode"),
    "extraction_vs_memcpy": ("memcpy", "extraction"),
    "shm_e2e_vs_memcpy": ("memcpy", "shm_e2e_1"),
    "shm_8req_vs_memcpy": ("memcpy", "shm_e2e_n"),
    "shm_e2e_speedup_vs_baseline": ("baseline_e2e", "shm_e2e_1"),
    "zmq_1req_vs_raw": ("raw_zmq", "zmq_e2e_1"),
    "zmq_1req_vs_raw_tcp": ("raw_tcp", "zmq_e2e_1"),
    "zmq_8req_vs_raw": ("raw_zmq", "zmq_e2e_n"),
    "zmq_speedup_vs_baseline": ("baseline_e2e", "zmq_e2e_1"),
    "hetero_vs_homo": ("homo_2_2", "hetero_2_4"),
    "replicated_vs_homo": ("homo_2_2", "replicated_2_8"),
    "mla_vs_homo": ("homo_2_2", "mla_2_4"),
    "readiness_p50_ms": ("readiness_shm",),
    "readiness_shm_from_send_call_p50_ms": ("readiness_shm_from_call",),
    "faults_per_mb_sender": ("faults_per_mb_sender",),
    "faults_per_mb_receiver": ("faults_per_mb_receiver",),
    "rss_ratio_receiver": ("rss_ratio_receiver",),
}


#: The ratios measured as interleaved pairs: ``name -> (figure, requests per repetition)``; the
#: limit's repetitions are figure ``{figure}_limit`` (``extraction``'s limit is memcpy, the
#: others' :data:`~kvferry.app.bench.paths.PAIR_LIMITS`).
PAIRED_RATIOS: dict[str, tuple[str, bool]] = {
    "extraction_vs_memcpy": ("extraction", False),
    "shm_e2e_vs_memcpy": ("shm_e2e_1", False),
    "shm_8req_vs_memcpy": ("shm_e2e_n", True),
    "zmq_1req_vs_raw_tcp": ("zmq_e2e_1", False),
    "hetero_vs_homo": ("hetero_2_4", False),
    "replicated_vs_homo": ("replicated_2_8", False),
    "mla_vs_homo": ("mla_2_4", False),
}


def _read(path: str) -> str:
    try:
        with open(path) as handle:
            return handle.read()
    except OSError:
        return ""


def machine_info(threads: int) -> dict[str, Any]:
    """CPU model, cores, memory, load and the versions that matter."""
    import zmq

    cpu = next(
        (
            line.split(":", 1)[1].strip()
            for line in _read("/proc/cpuinfo").splitlines()
            if line.startswith("model name")
        ),
        platform.processor() or "unknown",
    )
    mem_kb = next(
        (int(line.split()[1]) for line in _read("/proc/meminfo").splitlines() if line.startswith("MemTotal:")), 0
    )
    try:
        load = os.getloadavg()
    except OSError:
        load = (math.nan,) * 3
    return {
        "cpu_model": cpu,
        "cores": os.cpu_count(),
        "memory_gb": round(mem_kb / 1e6, 1),
        "load_avg_at_start": [round(x, 2) for x in load],
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": threads,
        "pyzmq": zmq.__version__,
        "libzmq": zmq.zmq_version(),
        "numpy": _version("numpy"),
        "cuda": torch.cuda.is_available(),
    }


def _version(module: str) -> str:
    try:
        return str(__import__(module).__version__)
    except (ImportError, AttributeError):
        return "missing"


def run_bench(
    settings: BenchSettings, *, threads: int = 1, progress: Callable[[str], None] | None = None
) -> dict[str, Any]:
    """Run every measurement ``settings.runs`` times; return the combined report (see the
    module docstring and :mod:`kvferry.app.bench.runs`)."""
    from kvferry.app.bench.runs import combine_reports

    say = progress or (lambda line: None)
    started = time.monotonic()
    reports = []
    for k in range(1, settings.runs + 1):
        prefix = f"run {k}/{settings.runs}: " if settings.runs > 1 else ""

        def tell(line: str, prefix: str = prefix) -> None:
            say(prefix + line)

        reports.append(run_once(settings, threads=threads, progress=tell))
    return combine_reports(reports, seconds=time.monotonic() - started)


def run_once(
    settings: BenchSettings, *, threads: int = 1, progress: Callable[[str], None] | None = None
) -> dict[str, Any]:
    """One whole measurement (fresh peer processes); its single-run report."""
    say = progress or (lambda line: None)
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    placement, where = plan_placement(settings.pin_cpus)
    say(f"placement: {where}")
    run = RunState(settings, threads, say, placement=placement)
    started = time.monotonic()
    machine = machine_info(threads)
    try:
        _measure(run)
    finally:
        for peer in list(run.peers):
            run.close_peer(peer)
        torch.set_num_threads(previous_threads)
    machine["placement"] = {
        "pinned": placement is not None,
        "line": where,
        **(placement.to_json() if placement is not None else {}),
        "peers": dict(run.peer_cpus),  # what each peer itself reported
    }
    return _report(run, machine, time.monotonic() - started)


def _measure(run: RunState) -> None:
    from kvferry.app.bench.local import measure_local, measure_memcpy, memcpy_step
    from kvferry.app.bench.payload import make_paged_cache

    s = run.settings
    g = s.geometry
    t = s.timeout_s
    run.progress(f"payload: {g.describe()}; {s.reps} reps after {s.warmup} warm-up")
    sender = run.peer(SENDER_PEER)
    receiver = run.peer("receiver")
    small = attrs.evolve(g, **SMALL)
    # a sender cache for `requests` requests (>= 2: the TP cases read one request per rank)
    huge = s.huge_pages
    main = sender.call(
        "setup", t + 120, name="main", geometry=g.to_json(), requests=max(s.requests, 2), seed=s.seed, huge_pages=huge
    )
    run.extra["cache_huge_pages"] = main.get("huge_pages") or "not asked (--no-huge-pages): 4 KiB pages"
    sender.call("setup", t, name="small", geometry=small.to_json(), requests=1, seed=s.seed + 1, huge_pages=huge)
    receiver.call("rss_peak", t)

    run.progress("memcpy and in-process paths ...")
    run.record("memcpy", measure_memcpy(g.nbytes, s.reps, s.warmup, huge_pages=huge), g.nbytes)
    run.record("memcpy_cpu", measure_memcpy(g.nbytes, s.reps, s.warmup, time.process_time, huge), g.nbytes)
    run.limits["memcpy"] = memcpy_step(g.nbytes, huge)  # alternates with the paths of PAIR_LIMITS
    local_cache = make_paged_cache(g, 1, seed=s.seed, huge_pages=huge)
    local = measure_local(local_cache, s.reps, s.warmup, limit=run.limits["memcpy"])
    for name, stat in local["stats"].items():
        run.record(name, stat, g.nbytes)
    run.checks.update({f"local_{k}": v for k, v in local["checks"].items()})

    endpoint = sender.call("push_bind", t, nbytes=g.nbytes)["endpoint"]
    receiver.call("pull_connect", t, endpoint=endpoint)
    run.scenario(
        sender,
        receiver,
        Scenario("raw zmq tcp (PUSH/PULL, copy=False)", "raw_send", "raw_recv", lambda i: {}, lambda i: {}, g.nbytes),
        "raw_zmq",
    )
    _raw_tcp(run, sender, receiver)
    run.scenario(
        sender,
        receiver,
        Scenario(
            "baseline e2e (tobytes+join, copying send, sleep-poll)",
            "base_send",
            "base_recv",
            lambda i: {"cache": "main", "request": 0},
            lambda i: {},
            g.nbytes,
            expected=(("main", 0, None),),
        ),
        "baseline_e2e",
    )
    res = run.scenario(
        sender,
        receiver,
        Scenario(
            "baseline readiness (small request)",
            "base_send",
            "base_recv",
            lambda i: {"cache": "small", "request": 0},
            lambda i: {},
            small.nbytes,
            reps=s.readiness_reps,
        ),
        "baseline_readiness_e2e",
    )
    if res is not None:
        run.record("readiness_baseline", res.latency, small.nbytes)
    if "raw_tcp" in run.stats:  # the raw TCP pair stays connected: one repetition between zmq's
        raw = Scenario(RAW_TCP, "tcp_send", "tcp_recv", lambda i: {}, lambda i: {}, g.nbytes)
        run.limits["raw_tcp"] = lambda: one_repetition(sender, receiver, raw, t)
    wake = _wake(run, sender, receiver)
    if wake is not None:  # one bare wake before each repetition of the readiness rows
        run.limits["wake"] = lambda: one_repetition(sender, receiver, wake, t)
    if not run.limits.keys() & {"raw_tcp", "wake"}:
        run.close_peer(receiver)

    pool = max(s.requests, 4) * (g.nbytes + (1 << 20)) + (64 << 20)
    for name in ("shm", "zmq", *s.extra_connectors):
        if name == "mooncake":
            mooncake_raw(run)
        if name == "nixl":
            nixl_pair(run)
        connector_paths(run, sender, name, pool, small)
    run.limits.pop("raw_tcp", None)
    run.limits.pop("wake", None)
    run.close_peer(receiver)


def _raw_tcp(run: RunState, sender: Peer, receiver: Peer) -> None:
    """The kernel's TCP stream limit: ``sendall`` of a touched buffer, ``recv_into`` a reused,
    touched buffer, over loopback between the two peer processes (figure ``raw_tcp``)."""
    g, t = run.settings.geometry, run.settings.timeout_s
    try:
        where = sender.call("tcp_listen", t, nbytes=g.nbytes)
        receiver.call("tcp_connect", t, host=where["host"], port=where["port"], nbytes=g.nbytes, timeout_s=t)
        sender.call("tcp_accept", t, timeout_s=t)
    except KVFerryError as exc:
        run.failures[RAW_TCP] = " ".join(str(exc).split())[:800]
        run.progress(f"{RAW_TCP}: FAILED ({run.failures[RAW_TCP][:200]})")
        return
    run.scenario(
        sender, receiver, Scenario(RAW_TCP, "tcp_send", "tcp_recv", lambda i: {}, lambda i: {}, g.nbytes), "raw_tcp"
    )


def _wake(run: RunState, sender: Peer, receiver: Peer) -> Scenario | None:
    """The bare wake between the two peers (figure ``wake``): the sender's command sends one
    datagram to the receiver's, which announced and blocked waiting for it; the scenario for
    its steps between the readiness rows' repetitions, or None when it could not be set up."""
    t = run.settings.timeout_s
    try:
        name = receiver.call("bell_bind", t)["name"]
        sender.call("bell_connect", t, name=name)
    except KVFerryError as exc:
        run.failures[WAKE] = " ".join(str(exc).split())[:800]
        run.progress(f"{WAKE}: FAILED ({run.failures[WAKE][:200]})")
        return None
    scenario = Scenario(WAKE, "bell_ring", "bell_wait", lambda i: {}, lambda i: {}, 0, reps=run.settings.readiness_reps)
    return scenario if run.scenario(sender, receiver, scenario, "wake") is not None else None


def _gbps(stat: Stat, nbytes: int) -> dict[str, float]:
    if stat.unit != "s" or not nbytes or stat.min <= 0:
        return {}
    return {"median": nbytes / stat.median / 1e9, "min": nbytes / stat.max / 1e9, "max": nbytes / stat.min / 1e9}


def _worst(run: RunState) -> None:
    """faults per MB and receiver RSS ratio: the worst kvferry path at full payload size, among
    the default paths (figures ``faults_per_mb_*``, ``rss_ratio_receiver``) and among the
    copying-receive rows (the same names with ``_copying``)."""
    full = [
        r for label, r in run.scenarios.items() if label.startswith(("kvferry", COPYING)) and "readiness" not in label
    ]
    for suffix, rows in (
        ("", [r for r in full if r.label.startswith("kvferry")]),
        ("_copying", [r for r in full if r.label.startswith(COPYING)]),
    ):
        if not rows:
            continue
        for side in ("sender", "receiver"):
            worst = max(rows, key=lambda r: getattr(r, f"{side}_faults_per_mb").median)
            run.stats[f"faults_per_mb_{side}{suffix}"] = getattr(worst, f"{side}_faults_per_mb")
            run.extra[f"faults_per_mb_{side}{suffix}_path"] = worst.label
        ratios = {r.label: r.receiver_rss_delta_kb * 1024 / r.held_nbytes for r in rows}
        worst_label = max(ratios, key=ratios.get)  # type: ignore[arg-type]
        run.stats[f"rss_ratio_receiver{suffix}"] = Stat.of([ratios[worst_label]], "ratio")
        run.extra[f"rss_ratio_receiver{suffix}_path"] = worst_label


#: An optional connector's raw limit figure, where it is not ``{name}_raw``.
RAW_FIGURES = {"nixl": "nixl_raw_read"}


def _extra_ratios(run: RunState) -> dict[str, float]:
    """Ratios beyond the required set: what the manager adds over the primitives, the other
    readiness figures, and optional connectors against their own raw limits."""
    m = {name: stat.median for name, stat in run.stats.items()}
    get = lambda name: m.get(name, math.nan)  # noqa: E731
    n = run.settings.requests
    out = {
        "shm_primitives_vs_memcpy": ratio_of(get("memcpy"), get("shm_direct_1")),
        "shm_manager_vs_primitives": ratio_of(get("shm_direct_1"), get("shm_e2e_1")),
        "zmq_primitives_vs_raw": ratio_of(get("raw_zmq"), get("zmq_direct_1")),
        "zmq_primitives_vs_raw_tcp": ratio_of(get("raw_tcp"), get("zmq_direct_1")),
        "raw_zmq_vs_raw_tcp": ratio_of(get("raw_tcp"), get("raw_zmq")),
        "zmq_manager_vs_primitives": ratio_of(get("zmq_direct_1"), get("zmq_e2e_1")),
        "readiness_zmq_p50_ms": get("readiness_zmq") * 1e3,
        "readiness_zmq_from_send_call_p50_ms": get("readiness_zmq_from_call") * 1e3,
        "readiness_shm_primitives_p50_ms": get("readiness_shm_direct") * 1e3,
        "readiness_zmq_primitives_p50_ms": get("readiness_zmq_direct") * 1e3,
        "readiness_baseline_p50_ms": get("readiness_baseline") * 1e3,
        "shm_copying_e2e_vs_memcpy": ratio_of(get("memcpy"), get("shm_e2e_1_copy")),
        "zmq_copying_1req_vs_raw": ratio_of(get("raw_zmq"), get("zmq_e2e_1_copy")),
        "readiness_shm_copying_p50_ms": get("readiness_shm_copy") * 1e3,
        "readiness_zmq_copying_p50_ms": get("readiness_zmq_copy") * 1e3,
        "faults_per_mb_receiver_copying": get("faults_per_mb_receiver_copying"),
        "rss_ratio_receiver_copying": get("rss_ratio_receiver_copying"),
        "checksum_encode_extra_ms": (get("checksum_encode") - get("kvferry_encode")) * 1e3,
        "checksum_verify_ms": get("checksum_decode") * 1e3,
    }
    out.update(_cpu_ratios(run))
    for name in run.settings.extra_connectors:
        raw = get(RAW_FIGURES.get(name, f"{name}_raw"))
        out[f"{name}_1req_vs_raw"] = ratio_of(raw, get(f"{name}_e2e_1"))
        out[f"{name}_{n}req_vs_raw"] = ratio_of(n * raw, get(f"{name}_e2e_n"))
        out[f"readiness_{name}_p50_ms"] = get(f"readiness_{name}") * 1e3
    return out


#: CPU-time ratios: ``name -> (reference figure, kvferry figure)``; each the reference path's
#: CPU seconds (sender + receiver, medians) over the kvferry path's, larger is better.
CPU_RATIOS: dict[str, tuple[str, str]] = {
    "hetero_vs_homo_cpu": ("homo_2_2", "hetero_2_4"),
    "zmq_1req_vs_raw_tcp_cpu": ("raw_tcp", "zmq_e2e_1"),
    "zmq_1req_vs_raw_cpu": ("raw_zmq", "zmq_e2e_1"),
    "shm_8req_vs_1req_cpu": ("shm_e2e_1", "shm_e2e_n"),
}


def _cpu_of(run: RunState, figure: str) -> float:
    """Median CPU seconds (sender + receiver) of the path recorded as ``figure``."""
    result = run.scenarios.get(run.figure_paths.get(figure, ""))
    if result is None or result.sender_cpu is None or result.receiver_cpu is None:
        return math.nan
    return result.sender_cpu.median + result.receiver_cpu.median


def _cpu_ratios(run: RunState) -> dict[str, float]:
    n = run.settings.requests
    memcpy = run.stats["memcpy_cpu"].median if "memcpy_cpu" in run.stats else math.nan
    extraction = run.stats["extraction_cpu"].median if "extraction_cpu" in run.stats else math.nan
    out = {
        "extraction_vs_memcpy_cpu": ratio_of(memcpy, extraction),
        "shm_e2e_vs_memcpy_cpu": ratio_of(memcpy, _cpu_of(run, "shm_e2e_1")),
        "shm_8req_vs_memcpy_cpu": ratio_of(n * memcpy, _cpu_of(run, "shm_e2e_n")),
    }
    out.update({name: ratio_of(_cpu_of(run, ref), _cpu_of(run, path)) for name, (ref, path) in CPU_RATIOS.items()})
    out["shm_8req_vs_1req_cpu"] *= n  # per request: N requests against N times one
    return out


def _paired(run: RunState, limit: str, subject: str, scale: float = 1.0) -> PairedRatio | None:
    """The ratio of figure ``limit`` over figure ``subject`` from their repetitions taken in
    pairs (``scale`` times each pair's ratio); None unless both were measured, pair for pair."""
    a, b = run.stats.get(limit), run.stats.get(subject)
    if a is None or b is None or len(a.samples) != len(b.samples):
        return None
    return paired_ratio(a.samples, b.samples, scale)


def ratio_bounds(stats: Mapping[str, Stat], requests: int, name: str) -> tuple[float, float]:
    """The range ratio ``name`` of :func:`compute_ratios` spans when each figure it is computed
    from (:data:`RATIO_INPUTS`) moves between its own first and third quartiles: the least and
    the most of the ratio over every such choice (NaN, NaN when a figure is missing)."""
    inputs = RATIO_INPUTS.get(name, ())
    if not inputs or any(f not in stats for f in inputs):
        return math.nan, math.nan
    corners = [quartiles(stats[f].samples or (stats[f].median,)) for f in inputs]
    values = []
    for choice in itertools.product((0, 1), repeat=len(inputs)):
        moved = dict(stats)
        for figure, pick, corner in zip(inputs, choice, corners):
            moved[figure] = attrs.evolve(stats[figure], median=corner[pick])
        values.append(compute_ratios(moved, requests)[name])
    finite = [v for v in values if math.isfinite(v)]
    return (min(finite), max(finite)) if len(finite) == len(values) else (math.nan, math.nan)


def _pairs(run: RunState, ratios: dict[str, float]) -> dict[str, Any]:
    """The interleaved ratios (replacing ``ratios``' values by the median of their pairs), every
    ratio's spread and verdict, and the run's noise figure per limit."""
    pairs: dict[str, Any] = {}
    spreads: dict[str, float] = {}
    bounds: dict[str, tuple[float, float]] = {}
    limit_samples: dict[str, list[float]] = {}
    for name, (figure, per_request) in PAIRED_RATIOS.items():
        paired = _paired(run, f"{figure}_limit", figure, run.settings.requests if per_request else 1)
        if paired is None:
            continue
        limit_name = PAIR_LIMITS.get(figure, "memcpy")
        limit_samples.setdefault(limit_name, []).extend(run.stats[f"{figure}_limit"].samples)
        pairs[name] = {**paired.to_json(), "limit": limit_name}
        ratios[name] = paired.value
        spreads[name] = paired.spread
        bounds[name] = (paired.low, paired.high)
    paired_limits = set(limit_samples)
    for figure, limit_name in PAIR_LIMITS.items():  # limits no ratio divides by: their noise too
        steps = run.stats.get(f"{figure}_limit")
        if steps is not None and limit_name not in paired_limits:
            limit_samples.setdefault(limit_name, []).extend(steps.samples)
    for name in RATIO_NAMES:  # the rest: the larger spread of the figures it divides
        if name not in spreads:
            inputs = [run.stats[f] for f in RATIO_INPUTS.get(name, ()) if f in run.stats]
            spreads[name] = max((relative_spread(s.samples) for s in inputs), default=math.nan)
            bounds[name] = ratio_bounds(run.stats, run.settings.requests, name)
    return {
        "pairs": pairs,
        "spreads": {name: _finite(spreads[name]) for name in RATIO_NAMES},
        "bounds": {name: [_finite(b) for b in bounds[name]] for name in RATIO_NAMES},
        "verdicts": {
            name: verdict(ratios[name], TARGETS[name], spreads[name], bounds=bounds[name]) for name in RATIO_NAMES
        },
        "noise": {name: _finite(relative_spread(samples)) for name, samples in limit_samples.items()},
        "max_spread": MAX_SPREAD,
        "wake_floor": _wake_floor(run),
    }


def _wake_floor(run: RunState) -> dict[str, float | None]:
    """The bare wake taken between the shm readiness row's repetitions: its median (ms), its
    spread, and the readiness from the send call in wakes (the median of each repetition's
    readiness over the wake just before it): a host whose wakes slow moves the first and not
    the last; a slower small-request path moves the last. Empty when the wake was not taken."""
    steps, ready = run.stats.get("shm_readiness_e2e_limit"), run.stats.get("readiness_shm_from_call")
    if steps is None:
        return {}
    out = {"p50_ms": steps.median * 1e3, "spread": _finite(relative_spread(steps.samples))}
    if ready is not None and len(ready.samples) == len(steps.samples):
        out["readiness_in_wakes"] = _finite(paired_ratio(ready.samples, steps.samples).value)
    return out


#: Optional connectors' ratios against their own limit, measured as interleaved pairs:
#: ``name -> (limit figure, subject figure, target)`` (reported when both figures were taken).
CONNECTOR_PAIRS: dict[str, tuple[str, str, Target]] = {
    "nixl_get_vs_raw_read": ("nixl_raw_read", "nixl_pair_get", Target(">=", 0.8)),
}


def _connector_pairs(run: RunState) -> dict[str, Any]:
    """Each :data:`CONNECTOR_PAIRS` ratio measured in this run: the pairs' median, quartiles,
    spread, target and verdict."""
    out: dict[str, Any] = {}
    for name, (limit_name, subject_name, target) in CONNECTOR_PAIRS.items():
        paired = _paired(run, limit_name, subject_name)
        if paired is None:
            continue
        out[name] = {
            **paired.to_json(),
            "limit": limit_name,
            "target": str(target),
            "verdict": verdict(paired.value, target, paired.spread, bounds=(paired.low, paired.high)),
        }
    return out


def _finite(value: float) -> float | None:
    return value if isinstance(value, (int, float)) and math.isfinite(value) else None


def _report(run: RunState, machine: dict[str, Any], seconds: float) -> dict[str, Any]:
    _worst(run)
    ratios = compute_ratios(run.stats, run.settings.requests)
    steadiness = _pairs(run, ratios)
    extra = _extra_ratios(run)
    figures = {
        name: {**stat.to_json(), "nbytes": run.nbytes.get(name), "gbps": _gbps(stat, run.nbytes.get(name, 0))}
        for name, stat in run.stats.items()
    }
    per_path = {
        label: {
            "time_s": r.time.to_json(),
            "latency_s": r.latency.to_json(),
            "sender_faults_per_mb": r.sender_faults_per_mb.to_json(),
            "receiver_faults_per_mb": r.receiver_faults_per_mb.to_json(),
            "sender_peak_rss_delta_mb": r.sender_rss_delta_kb * 1024 / 1e6,
            "receiver_peak_rss_delta_mb": r.receiver_rss_delta_kb * 1024 / 1e6,
            "held_mb": r.held_nbytes / 1e6,
            "data_checked": r.checked,
            "sender_busy_s": None if r.sender_busy is None else r.sender_busy.to_json(),
            "receiver_after_sender_s": None if r.receiver_tail is None else r.receiver_tail.to_json(),
            "sender_cpu_s": None if r.sender_cpu is None else r.sender_cpu.to_json(),
            "receiver_cpu_s": None if r.receiver_cpu is None else r.receiver_cpu.to_json(),
        }
        for label, r in run.scenarios.items()
    }
    ck = run.stats.get("checksum_encode"), run.stats.get("kvferry_encode")
    checksum = {}
    if ck[0] is not None and ck[1] is not None:
        checksum = {
            "encode_extra_ms": (ck[0].median - ck[1].median) * 1e3,
            "decode_verify_ms": run.stats["checksum_decode"].median * 1e3,
            "algorithm": DEFAULT_CHECKSUM,
            "engine": checksum_engine(DEFAULT_CHECKSUM),
            "encode_gbps": run.settings.geometry.nbytes / ck[0].median / 1e9,
        }
    return {
        "kvferry_bench": 1,
        "ratios": {name: _finite(ratios[name]) for name in RATIO_NAMES},
        "extra_ratios": {name: _finite(value) for name, value in extra.items()},
        "connector_pairs": _connector_pairs(run),
        "targets": {name: str(TARGETS[name]) for name in RATIO_NAMES},
        "meets_target": {name: TARGETS[name].met(ratios[name]) for name in RATIO_NAMES},
        **steadiness,
        "ratio_inputs": {name: list(v) for name, v in RATIO_INPUTS.items()},
        "figures": figures,
        "paths": per_path,
        "checksum_cost": checksum,
        "notes": run.extra,
        "failures": run.failures,
        "data_checks": run.checks,
        "settings": run.settings.to_json(),
        "machine": machine,
        "seconds": round(seconds, 1),
        "argv": sys.argv[1:],
    }
