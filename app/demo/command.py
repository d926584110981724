"""``kvferry demo``: a real two-stage pipeline on this machine, verified bit for bit.

A sender stage of ``--from-tp`` ranks and a receiver stage of ``--to-tp`` ranks run as separate
processes (gloo groups inside each stage), each rank building its manager from an
``omni_kv_config`` dict like an engine would. Senders extract requests from synthetic paged
caches with a real model's geometry and send them over the chosen connector; receivers pull,
merge/slice heads, agree as a TP group (consensus) and compare every tensor with what the
sender's cache holds. Progress shows while it runs (a bar on a terminal, otherwise a line every
few seconds); a table (or ``--json``) ends it: per-request transfer time apart from queueing and
verification, the one transfer figure (per request, the memcpy of its bytes over its transfer
time, as the benchmark's ``shm_e2e_vs_memcpy``; memcpy measured in the same run), and the wall
time split into start-up, transfers, checking, pacing and shutdown (parts that add up; the
transfers are the very times the figure is the median over). By default the senders send a
request only once every receiver rank verified the one before, and the first once every rank
is ready (paced: each transfer is timed as the benchmark times its end to end, the receivers
waiting and nothing else running): the parent, which learns each verification from the ranks'
reports, releases a semaphore per sender rank; every wait on it is bounded, and a run that
stops early (or ends) sets a stop event and lets every sender through, so none is left waiting.
``--overlap`` lets requests overlap (a pipeline under load: its transfer times then include the
contention with verification, and the summary labels them so and shows the queueing). Exit
status is 0 only when every request arrived bit-exact on every receiver rank.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import queue as queue_mod
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

import attrs

from kvferry.adapters.platform import free_base_port, free_port
from kvferry.app.demo.model import CONNECTOR_CHOICES, PRESETS, DemoSpec, model_preset, request_plan
from kvferry.app.demo.progress import Progress
from kvferry.app.demo.timing import (
    RequestStamps,
    RequestTiming,
    WallSplit,
    percentile,
    transfer_figure,
    wall_split,
)
from kvferry.core.models import MODELS
from kvferry.core.plan import stage_plan

__all__ = ["configure", "run_demo", "report_json", "DemoReport"]

#: Per engine, the defaults of (--requests, --min-tokens, --max-tokens).
_DEFAULTS = {"synthetic": (64, 256, 4096), "vllm": (4, 64, 1024)}

#: How long the other ranks get to report once one rank has failed, before the run stops them.
_AFTER_ERROR_S = 5.0


@attrs.frozen
class DemoReport:
    """What a run showed. Times in seconds unless ``_ms``; ``latency_ms_*``: sender call return ->
    every receiver rank has the request, queueing included; ``transfer_ms_*``, ``queue_ms_*``,
    ``check_ms_*``: the per-request split of :func:`~kvferry.app.demo.timing.request_timing`;
    ``transfer_gbps`` and ``transfer_vs_memcpy``: the median over requests of a request's
    bytes over its transfer time and of its memcpy time over its transfer time
    (:func:`~kvferry.app.demo.timing.transfer_figure`); ``memcpy_gbps``: a single-thread memcpy
    of the mean request's bytes on this machine, measured before the stages start; ``wall``:
    the wall time's split (paced: ``wall.transfer_s`` is the sum of the very transfer times the
    figure is the median over). Every figure is computed from ``stamps``."""

    requests: int
    bit_exact: int
    outcomes: dict[str, int]
    bytes: int
    seconds: float
    latency_ms_p50: float
    latency_ms_p99: float
    errors: tuple[str, ...]
    routing: tuple[dict[str, Any], ...]
    model: str
    connector: str
    from_tp: int
    to_tp: int
    transfer_ms_p50: float = math.nan
    transfer_ms_p99: float = math.nan
    queue_ms_p50: float = math.nan
    check_ms_p50: float = math.nan
    transfer_gbps: float = math.nan
    transfer_vs_memcpy: float = math.nan
    memcpy_gbps: float = math.nan
    wall: WallSplit = WallSplit(0.0, 0.0, 0.0, 0.0, 0.0)
    #: one request at a time (the default), or requests overlapping (``--overlap``)
    paced: bool = True
    #: per request received everywhere, in order: (the first sender rank's send call, the last
    #: receiver rank done verifying it); in a paced run no two overlap
    windows: tuple[tuple[float, float], ...] = ()
    #: per request received everywhere, in order: its ranks' stamps, from which every figure
    #: above is computed
    stamps: tuple[RequestStamps, ...] = ()
    #: when the parent learnt that every rank of both stages was ready (monotonic clock); a
    #: paced run lets the first request go only then
    t_ready: float = math.nan

    @property
    def ok(self) -> bool:
        return self.bit_exact == self.requests and not self.errors


def _memcpy_gbps(nbytes: int) -> float:
    """Single-thread memcpy into a reused, touched buffer (the benchmark's limit), GB/s."""
    if nbytes <= 0:
        return math.nan
    from kvferry.app.bench.local import measure_memcpy

    return nbytes / measure_memcpy(nbytes, reps=5, warmup=1).median / 1e9


def run_demo(
    spec: DemoSpec,
    progress: Callable[[int, int], None] | None = None,
    tick: Callable[[], None] | None = None,
    *,
    mp_context: Any = None,
    after_error_s: float = _AFTER_ERROR_S,
) -> DemoReport:
    """Run the pipeline of ``spec``; returns the report (never raises for transfer faults).
    ``progress(done, total)`` after each request every receiver rank has; ``tick()`` about
    every second while waiting. The ranks are processes of ``mp_context`` (a
    :mod:`multiprocessing` context; default: spawn). After a rank fails (an error, or it
    died), the others get ``after_error_s`` seconds to report, then the run stops."""
    from kvferry.app.demo.worker import run_worker, run_worker_process

    reqs = request_plan(spec)
    total = len(reqs)
    memcpy_gbps = _memcpy_gbps(sum(spec.kv_bytes(r.seq_len) for r in reqs) // total)
    launch = time.monotonic()
    threads = spec.connector == "memory"
    ctx = mp_context if mp_context is not None else mp.get_context("spawn")
    q: Any = queue_mod.Queue() if threads else ctx.Queue()
    workers: list[Any] = []
    shared = None
    # paced (the default): one semaphore per sender rank, released once per request it may send
    gates: list[Any] = (
        [] if spec.overlap else [(threading.Semaphore(0) if threads else ctx.Semaphore(0)) for _ in range(spec.from_tp)]
    )
    # set when the run stops early (a rank failed, the deadline passed): a sender let through
    # then sends nothing more; without it a sender waits for its turn at most its gate timeout
    stop: Any = None if spec.overlap else (threading.Event() if threads else ctx.Event())

    def let_through(times: int = 1) -> None:
        for gate in gates:
            for _ in range(times):
                gate.release()

    def open_gates() -> None:
        if stop is not None and not stop.is_set():
            stop.set()
            let_through(total + 1)  # every turn a sender could still wait for

    if threads:
        from kvferry.adapters.collectives import InProcessWorld
        from kvferry.app.manager import StageGroups
        from kvferry.app.registry import create_connector

        shared = create_connector({"type": "memory", "pool_bytes": spec.pool_size()})
        worlds = {"sender": InProcessWorld(spec.from_tp), "receiver": InProcessWorld(spec.to_tp)}
        for role, size in (("sender", spec.from_tp), ("receiver", spec.to_tp)):
            for rank in range(size):
                g = worlds[role].group(rank)
                groups = StageGroups(world=g, tp=g if role == "receiver" else None) if size > 1 else StageGroups()
                gate = gates[rank] if gates and role == "sender" else None
                workers.append(
                    threading.Thread(
                        target=run_worker,
                        args=(role, rank, attrs.asdict(spec), q),
                        kwargs={"groups": groups, "connector": shared, "gate": gate, "stop": stop},
                        name=f"kvferry-demo-{role}-{rank}",
                        daemon=True,
                    )
                )
    else:
        for role, size in (("sender", spec.from_tp), ("receiver", spec.to_tp)):
            for rank in range(size):
                gate = gates[rank] if gates and role == "sender" else None
                args = (role, rank, attrs.asdict(spec), q, gate, stop if gate is not None else None)
                workers.append(ctx.Process(target=run_worker_process, args=args, daemon=True))
    for w in workers:
        w.start()
    if progress:
        progress(0, total)  # the display knows the total from the start (lines during start-up too)
    sent: dict[str, list[dict]] = {}
    received: dict[str, list[dict]] = {}
    errors: list[str] = []
    done = 0
    start = None
    ready = 0
    deadline = time.monotonic() + 120 + spec.timeout_s * 2 + total * 2
    finished_recv: set[str] = set()
    try:
        while done < len(workers) and time.monotonic() < deadline:
            try:
                msg = q.get(timeout=1.0)
            except queue_mod.Empty:
                if tick:
                    tick()
                if not threads and not any(w.is_alive() for w in workers):
                    break
                if not threads and any(w.exitcode not in (None, 0) for w in workers):
                    # a rank killed before it could report (a signal, the OOM killer)
                    deadline = min(deadline, time.monotonic() + after_error_s)
                continue
            kind = msg.get("kind")
            if kind == "ready":
                ready += 1
                if ready == len(workers):
                    start = time.monotonic()
                    let_through()  # the first request
            elif kind == "sent":
                sent.setdefault(msg["request_id"], []).append(msg)
            elif kind == "received":
                received.setdefault(msg["request_id"], []).append(msg)
                if len(received[msg["request_id"]]) == spec.to_tp:
                    finished_recv.add(msg["request_id"])
                    let_through()  # verified by every receiver rank: the next request may go
                    if progress:
                        progress(len(finished_recv), total)
                    if len(finished_recv) == total and spec.done_file:
                        open(spec.done_file, "w").close()
            elif kind == "error":
                errors.append(f"{msg['role']} rank {msg['rank']}: {msg['error']}")
                if spec.done_file:
                    open(spec.done_file, "w").close()
                # a failed rank fails the run: its peers would otherwise wait for it until the
                # whole run's deadline (minutes); they get a short while to report, then stop
                deadline = min(deadline, time.monotonic() + after_error_s)
                open_gates()  # no sender waits for a turn that will not come, none sends more
            elif kind == "done":
                done += 1
    finally:
        open_gates()  # at the end, or stopped early: a sender still waiting gives up now
        if spec.done_file:
            open(spec.done_file, "w").close()
        for w in workers:
            w.join(timeout=min(2.0, after_error_s) if errors else 10)  # after a failure: stuck
            if not threads and w.is_alive():
                w.terminate()
                w.join(timeout=5)
        if shared is not None:
            shared.close()
    end = time.monotonic()
    if done < len(workers):
        errors.append(f"only {done} of {len(workers)} workers finished")
    if not threads:
        errors.extend(f"worker {i} exited with code {w.exitcode}" for i, w in enumerate(workers) if w.exitcode)
    outcomes: dict[str, int] = {}
    exact = 0
    latencies: list[float] = []
    timings: list[RequestTiming] = []
    stamps: list[RequestStamps] = []
    nbytes = 0
    last_verified = start or end
    for req in reqs:
        rows = received.get(req.request_id, [])
        kinds = {r["outcome"] for r in rows}
        if len(rows) == spec.to_tp and all(r["ok"] for r in rows):
            key = "received"
        elif "timed_out" in kinds:
            key = "timed_out"
        else:
            key = "failed"
        outcomes[key] = outcomes.get(key, 0) + 1
        if len(rows) == spec.to_tp and all(r["bit_exact"] for r in rows):
            exact += 1
        sends = sent.get(req.request_id, [])
        request_bytes = sum(s["bytes"] for s in sends)
        nbytes += request_bytes
        if rows:
            last_verified = max(last_verified, *(r["t_verified"] for r in rows))
        if rows and sends:
            latencies.append(max(r["t"] for r in rows) - max(s["t"] for s in sends))
        if key == "received" and len(sends) == spec.from_tp:
            rows = sorted(rows, key=lambda r: r["rank"])
            sends = sorted(sends, key=lambda s: s["rank"])
            stamp = RequestStamps(
                req.request_id,
                request_bytes,
                tuple(s["t_call"] for s in sends),
                tuple(s["t"] for s in sends),
                tuple(r["t_wait"] for r in rows),
                tuple(r["t"] for r in rows),
                tuple(r["t_verified"] for r in rows),
            )
            stamps.append(stamp)
            timings.append(stamp.timing())
    # paced, one request after the other: its transfer, then its verification's tail, add up
    # without overlap; overlapping requests count each one's slowest rank's verification
    if spec.overlap:
        wall = wall_split(launch, start or end, last_verified, end, (t.check_s for t in timings))
    else:
        transfers, tails = [t.transfer_s for t in timings], [t.tail_s for t in timings]
        wall = wall_split(launch, start or end, last_verified, end, tails, transfers)
    routing = tuple(
        p.to_json()
        for p in stage_plan(
            0, 1, spec.from_tp, spec.to_tp, num_heads=spec.routed_heads, base_port=spec.base_port, request_id="<rid>"
        )
    )
    figure = transfer_figure([s.nbytes for s in stamps], [t.transfer_s for t in timings], memcpy_gbps)
    ms = lambda values, q: percentile(values, q) * 1e3  # noqa: E731
    return DemoReport(
        total,
        exact,
        outcomes,
        nbytes,
        wall.total_s,
        ms(latencies, 50),
        ms(latencies, 99),
        tuple(errors),
        routing,
        spec.model,
        spec.connector,
        spec.from_tp,
        spec.to_tp,
        transfer_ms_p50=ms([t.transfer_s for t in timings], 50),
        transfer_ms_p99=ms([t.transfer_s for t in timings], 99),
        queue_ms_p50=ms([t.queue_s for t in timings], 50),
        check_ms_p50=ms([t.check_s for t in timings], 50),
        transfer_gbps=figure.gbps,
        transfer_vs_memcpy=figure.vs_memcpy,
        memcpy_gbps=memcpy_gbps,
        wall=wall,
        paced=not spec.overlap,
        windows=tuple(s.window for s in stamps),
        stamps=tuple(stamps),
        t_ready=start if start is not None else math.nan,
    )


def _table(report: DemoReport) -> str:
    w = report.wall
    if report.paced:
        how = (
            "the senders' send call -> every receiver rank holds it, one request at a time with the receivers "
            "waiting, as kvferry bench times its e2e"
        )
        rate = "median over requests, as the bench's shm_e2e_vs_memcpy: {}"
        wall = [
            f"  wall time       {w.total_s:.2f} s = start-up {w.startup_s:.2f} + transfers {w.transfer_s:.2f} "
            f"+ checking {w.checking_s:.2f} + pacing {w.pacing_s:.2f} + shutdown {w.shutdown_s:.2f}",
            "                  (start-up: processes, imports, synthetic caches, connections; transfers: the "
            "requests' transfer times above, summed; checking: from the last rank holding a request to the "
            "last done verifying it; pacing: letting each request go once the previous one is verified)",
        ]
    else:
        how = (
            "UNDER CONTENTION (--overlap): senders' put -> every receiver rank has it, queueing excluded; "
            "requests overlap, the ranks sharing the cores with verification and extraction"
        )
        rate = (
            "median over requests: {}; under contention, so not the bench's shm_e2e_vs_memcpy, which a default "
            "(paced) run gives"
        )
        wall = [
            f"  wall time       {w.total_s:.2f} s = start-up {w.startup_s:.2f} + receiving {w.receiving_s:.2f} "
            f"+ checking {w.checking_s:.2f} + shutdown {w.shutdown_s:.2f}",
            "                  (start-up: processes, imports, synthetic caches, connections; receiving: requests "
            "in flight together, waiting and overlapping, so no transfer time)",
        ]
    lines = [
        f"kvferry demo: {report.model}, TP {report.from_tp} -> {report.to_tp}, connector {report.connector}",
        "",
        f"  requests        {report.requests}",
        f"  bit-exact       {report.bit_exact}/{report.requests}",
        "  outcomes        " + ", ".join(f"{k} {v}" for k, v in sorted(report.outcomes.items())),
        f"  bytes           {report.bytes / 1e9:.2f} GB",
        f"  transfer        p50 {report.transfer_ms_p50:.1f} ms, p99 {report.transfer_ms_p99:.1f} ms "
        f"per request ({how})",
        f"                  = {report.transfer_vs_memcpy:.2f}x a memcpy of its bytes ("
        + rate.format(f"{report.transfer_gbps:.2f} GB/s, memcpy {report.memcpy_gbps:.2f} GB/s, 1 thread, this run")
        + ")",
    ]
    if not report.paced:
        lines.append(
            f"  queueing        p50 {report.queue_ms_p50:.1f} ms (the payload committed, its receivers still "
            "checking earlier requests)"
        )
    lines += [
        f"  verification    p50 {report.check_ms_p50:.1f} ms per request (every tensor compared bit for bit)",
        *wall,
        "",
        "  routing per rank:",
    ]
    for rec in report.routing:
        lines.append("    " + _route_line(rec))
    if report.errors:
        lines += ["", "  errors:"] + [f"    {e}" for e in report.errors]
    lines += ["", "  PASS: every request arrived bit-exact" if report.ok else "  FAIL"]
    return "\n".join(lines)


def _route_line(rec: dict[str, Any]) -> str:
    sending = rec.get("role") == "sender"
    parts = []
    for k in rec.get("keys") or []:
        peer = k.get("to_rank") if sending else k.get("from_rank")
        heads = k.get("heads")
        span = f"heads {heads[0]}:{heads[1]}" if heads else ""
        parts.append(f"{'->' if sending else '<-'} rank {peer} {span} (port {k.get('port')})")
    kind = "sender  " if sending else "receiver"
    return f"{kind} rank {rec.get('tp_rank')}: " + "; ".join(parts)


def configure(sub: argparse.ArgumentParser) -> Callable[[argparse.Namespace], int]:
    sub.add_argument("--connector", choices=sorted(CONNECTOR_CHOICES), default="shm")
    sub.add_argument("--from-tp", type=int, default=2)
    sub.add_argument("--to-tp", type=int, default=4)
    sub.add_argument("--preset", choices=sorted(PRESETS), default="qwen2.5-7b")
    sub.add_argument(
        "--model",
        help=f"a real model's KV geometry, overriding --preset ({', '.join(MODELS)}); MLA models move latents",
    )
    sub.add_argument("--layers", type=int)
    sub.add_argument("--kv-heads", type=int)
    sub.add_argument("--head-dim", type=int)
    sub.add_argument("--block-size", type=int)
    sub.add_argument(
        "--engine",
        choices=["synthetic", "vllm"],
        default="synthetic",
        help="synthetic: caches of a real model's geometry (default); vllm: a vLLM prefill and decode "
        "instance on a tiny model made on the spot (needs the vllm extra; docs/vllm.md)",
    )
    sub.add_argument("--requests", type=int, help=f"default {_DEFAULTS['synthetic'][0]} ({_DEFAULTS['vllm'][0]} vllm)")
    sub.add_argument(
        "--min-tokens", type=int, help=f"default {_DEFAULTS['synthetic'][1]} ({_DEFAULTS['vllm'][1]} vllm)"
    )
    sub.add_argument(
        "--max-tokens", type=int, help=f"default {_DEFAULTS['synthetic'][2]} ({_DEFAULTS['vllm'][2]} vllm)"
    )
    sub.add_argument("--seed", type=int, default=0)
    sub.add_argument("--timeout", type=float, default=60.0, help="receive deadline per request (s)")
    sub.add_argument(
        "--overlap",
        action="store_true",
        help="send requests without waiting for the previous one's verification (a pipeline under load; "
        "by default one request at a time, each transfer timed as kvferry bench times its e2e)",
    )
    sub.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    sub.add_argument("--dump", metavar="DIR", help="also write a few payload files for `kvferry inspect`")
    return run


def run(args: argparse.Namespace, *, mp_context: Any = None) -> int:
    """Run ``kvferry demo`` for parsed ``args``; the ranks are processes of ``mp_context``
    (default: spawn, fresh interpreters). Returns the exit status."""
    engine = getattr(args, "engine", "synthetic")
    for name, default in zip(("requests", "min_tokens", "max_tokens"), _DEFAULTS[engine]):
        if getattr(args, name, None) is None:
            setattr(args, name, default)
    if engine == "vllm":
        return _run_vllm(args)
    if args.connector == "mooncake":
        try:
            import mooncake.engine  # noqa: F401
        except ImportError:
            print(
                "kvferry demo: the mooncake connector needs `pip install kvferry[mooncake]` and libibverbs1",
                file=sys.stderr,
            )
            return 2
    tmp = tempfile.mkdtemp(prefix="kvferry-demo-")
    try:  # the scratch folder (the stages' done file) goes on every path
        return _run_in(args, tmp, mp_context)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _run_vllm(args: argparse.Namespace) -> int:
    if args.requests < 1:
        print("kvferry demo: --requests must be at least 1", file=sys.stderr)
        return 2
    if not 1 <= args.min_tokens <= args.max_tokens:
        print("kvferry demo: need 1 <= --min-tokens <= --max-tokens", file=sys.stderr)
        return 2
    from kvferry.app.demo.vllm_demo import run_vllm_demo

    return run_vllm_demo(args)


def _run_in(args: argparse.Namespace, tmp: str, mp_context: Any = None) -> int:
    model, layers, heads, head_dim, dtype, block = PRESETS[args.preset]
    latent = 0
    try:
        if getattr(args, "model", None):
            geo = model_preset(args.model)
            model, layers, heads, head_dim, dtype = (
                geo[k] for k in ("model", "layers", "kv_heads", "head_dim", "dtype")
            )
            latent = geo.get("latent_dim", 0)
        spec = DemoSpec(
            connector=args.connector,
            from_tp=args.from_tp,
            to_tp=args.to_tp,
            model=model,
            layers=args.layers or layers,
            kv_heads=args.kv_heads or heads,
            head_dim=args.head_dim or head_dim,
            dtype=dtype,
            block_size=args.block_size or block,
            requests=args.requests,
            min_tokens=args.min_tokens,
            max_tokens=args.max_tokens,
            seed=args.seed,
            base_port=free_base_port(args.from_tp),
            store_ports=(free_port(), free_port()),
            timeout_s=args.timeout,
            namespace=f"demo{os.getpid()}",
            done_file=os.path.join(tmp, "done"),
            dump_dir=args.dump,
            latent_dim=latent,
            overlap=bool(getattr(args, "overlap", False)),
        )
        request_plan(spec)
        spec.head_range(0)
    except (ValueError, RuntimeError) as exc:  # ConfigError and RoutingError are ValueErrors
        print(f"kvferry demo: error: {exc}", file=sys.stderr)
        return 2
    if args.dump:
        from kvferry.app.demo.dump import dump_payloads

        dump_payloads(spec, args.dump)
    if not args.json:
        shape = (
            f"MLA latent {spec.latent_dim}" if spec.is_mla else f"{spec.kv_heads} KV heads, head_dim {spec.head_dim}"
        )
        print(
            f"kvferry demo: {spec.requests} requests of {spec.min_tokens}-{spec.max_tokens} tokens, "
            f"{model} geometry ({spec.layers} layers, {shape}, "
            f"{spec.dtype}, block {spec.block_size}); sender TP {spec.from_tp} -> receiver TP {spec.to_tp} "
            f"over {spec.connector}",
            flush=True,
        )
    shown = None if args.json else Progress(sys.stderr)
    report = run_demo(spec, shown.update if shown else None, shown.tick if shown else None, mp_context=mp_context)
    if args.json:
        print(json.dumps(report_json(report)))
    else:
        print(_table(report))
    return 0 if report.ok else 1


def report_json(report: DemoReport) -> dict[str, Any]:
    """``--json``'s object (non-finite numbers as null)."""
    finite = lambda v: float(f"{v:.6g}") if math.isfinite(v) else None  # noqa: E731
    return {
        "requests": report.requests,
        "bit_exact": report.bit_exact,
        "outcomes": report.outcomes,
        "bytes": report.bytes,
        "seconds": round(report.seconds, 4),
        "paced": report.paced,
        # total = startup + receiving + checking + shutdown; paced: receiving = transfer + pacing
        "wall_s": {
            **{k.removesuffix("_s"): round(v, 4) for k, v in attrs.asdict(report.wall).items()},
            "pacing": round(report.wall.pacing_s, 4),
        },
        "transfer_ms": {"p50": finite(report.transfer_ms_p50), "p99": finite(report.transfer_ms_p99)},
        "queue_ms": {"p50": finite(report.queue_ms_p50)},
        "check_ms": {"p50": finite(report.check_ms_p50)},
        "transfer_gbps": finite(report.transfer_gbps),
        "memcpy_gbps": finite(report.memcpy_gbps),
        "transfer_vs_memcpy": finite(report.transfer_vs_memcpy),
        "latency_ms": {"p50": finite(report.latency_ms_p50), "p99": finite(report.latency_ms_p99)},
        "errors": list(report.errors),
        "model": report.model,
        "connector": report.connector,
        "from_tp": report.from_tp,
        "to_tp": report.to_tp,
        "routing": list(report.routing),
    }
