"""``kvferry bench``: measure kvferry against the machine's limits and a naive baseline.

Prints the table, writes the JSON report (``bench.json`` or ``--json FILE``) and a PNG plot
(``bench.png`` or ``--plot FILE``). Exit status: 0 when the run completed (targets are
reported, never enforced), 1 when received data did not match what was sent, 2 for wrong
options (one line on stderr).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from typing import Any, TextIO

from kvferry.app.bench.model import BenchSettings, Geometry
from kvferry.core.errors import ConfigError

__all__ = ["configure", "run", "run_hosts", "settings_from_args", "EXTRA_CONNECTORS"]

#: Connectors ``--connector`` may add beside shm and zmq (which always run).
EXTRA_CONNECTORS = ("mooncake", "nixl")


def configure(parser: argparse.ArgumentParser) -> Callable[[argparse.Namespace], int]:
    """Add ``kvferry bench``'s options to ``parser``; return the runner."""
    add = parser.add_argument
    add("--quick", action="store_true", help="reduced run: 8 layers x [1024, 4, 128] bf16 (17 MB), 3 repetitions")
    add("--json", default="bench.json", metavar="FILE", help="JSON report path (default bench.json)")
    add("--plot", default="bench.png", metavar="FILE", help="PNG plot path (default bench.png)")
    add(
        "--connector",
        action="append",
        default=[],
        metavar="NAME",
        help="also measure this connector beside shm and zmq (mooncake, nixl); repeatable",
    )
    add(
        "--runs",
        type=int,
        default=None,
        help="repeat the whole measurement N times; report every run's ratios and their medians "
        "(default 1; --engine: runs per prompt length, default 5)",
    )
    add("--reps", type=int, default=None, help="timed repetitions per figure (default 5; quick 3)")
    add("--warmup", type=int, default=None, help="untimed warm-up repetitions (default 1)")
    add("--requests", type=int, default=None, help="requests of the many-request cases (default 8)")
    add("--layers", type=int, default=None, help="layers per request (default 28; quick 8)")
    add("--tokens", type=int, default=None, help="tokens per request (default 4096; quick 1024)")
    add("--heads", type=int, default=None, help="KV heads per rank (default 4)")
    add("--head-dim", type=int, default=None, help="head dimension (default 128)")
    add("--block-size", type=int, default=None, help="tokens per cache block (default 16)")
    add("--readiness-reps", type=int, default=None, help="samples of the small request's latency")
    add("--threads", type=int, default=1, help="torch intra-op threads in every process (default 1)")
    add(
        "--no-huge-pages",
        dest="huge_pages",
        action="store_false",
        help="leave the caches and the memcpy buffers on 4 KiB pages (default: moved onto transparent huge "
        "pages, as kvferry's vLLM connector does with vLLM's CPU cache)",
    )
    add(
        "--no-pin",
        dest="pin_cpus",
        action="store_false",
        help="leave the peer processes where the OS puts them (default: the sending stage on one half of the "
        "CPUs, the receiving stages on the other, as deployed stages run on cores of their own)",
    )
    add("--timeout", type=float, default=None, help="seconds to wait for a peer process (default 120)")
    add("--seed", type=int, default=0, help="seed of the synthetic cache (default 0)")
    add("--quiet", action="store_true", help="no progress lines on stderr")
    add(
        "--hosts",
        action="store_true",
        help="root only: zmq tcp vs plain TCP between two network-namespace hosts over tbf-shaped links",
    )
    add(
        "--rates",
        default=None,
        metavar="R1,R2",
        help="--hosts link rates, tc syntax (default 1gbit,10gbit); --serve request rates per second, inf for all at "
        "once (default 1,4,inf)",
    )
    add("--nbytes", type=int, default=None, help="--hosts payload bytes (default 235000000)")
    add(
        "--engine",
        default=None,
        choices=("vllm",),
        help="a decode vLLM instance's time to first token: kvferry vs vLLM's own connectors, recompute and the "
        "prefix-cache floor (needs the vllm extra)",
    )
    add("--lengths", default=None, metavar="N1,N2", help="--engine prompt lengths (default 128,512,1024,2047)")
    add("--rows", default=None, metavar="R1,R2", help="--engine rows to measure (default all)")
    add("--logs", default=None, metavar="DIR", help="--engine: keep the vLLM instances' logs in DIR")
    add(
        "--serve",
        action="store_true",
        help="with --engine vllm: vllm serve prefill/decode servers behind vLLM's toy proxy, driven by vllm bench "
        "serve at each of --rates (rows plain,kvferry_shm,kvferry_zmq,nixl,mooncake)",
    )
    add("--num-prompts", type=int, default=None, help="--serve: requests per rate (default 32)")
    add("--max-concurrency", type=int, default=None, help="--serve: requests in flight at most (default 8)")
    add("--input-len", type=int, default=None, help="--serve: prompt tokens (default 512)")
    add("--output-len", type=int, default=None, help="--serve: output tokens (default 32)")
    add(
        "--proxy",
        default=None,
        metavar="FILE",
        help="--serve: vLLM's toy_proxy_server.py (default: the copy in kvferry's source tree, "
        "tests/engines/vllm/assets/)",
    )
    return run


def run_hosts(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    """``--hosts``: the two-host link benchmark (:mod:`kvferry.app.bench.hosts`)."""
    from kvferry.app.bench.hosts import DEFAULT_NBYTES, RATES, render_hosts, run_hosts_bench
    from kvferry.app.bench.netns import NetError

    rates = tuple(r.strip() for r in args.rates.split(",") if r.strip()) if args.rates else RATES
    nbytes = DEFAULT_NBYTES if args.nbytes is None else args.nbytes
    reps = 5 if args.reps is None else args.reps
    if nbytes < 1 or reps < 1 or not rates:
        print("kvferry bench: error: --nbytes and --reps must be >= 1 and --rates not empty", file=err)
        return 2

    def progress(line: str) -> None:
        if not args.quiet:
            print(f"  {line}", file=err, flush=True)

    try:
        report = run_hosts_bench(rates, nbytes, reps, progress)
    except (NetError, ValueError) as exc:
        print(f"kvferry bench --hosts: error: {' '.join(str(exc).split())}", file=err)
        return 2
    out.write(render_hosts(report) + "\n")
    try:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=1)
    except OSError as exc:
        print(f"kvferry bench: error: cannot write the report: {exc}", file=err)
        return 2
    print(f"wrote {args.json}", file=out)
    return 1 if any(row["mismatches"] for row in report["rows"]) else 0


def settings_from_args(args: argparse.Namespace) -> BenchSettings:
    """The settings the options ask for; ConfigError names a wrong option."""
    base = BenchSettings.quick() if args.quick else BenchSettings.full()
    g = base.geometry
    geometry = Geometry(
        layers=args.layers or g.layers,
        tokens=args.tokens or g.tokens,
        heads=args.heads or g.heads,
        head_dim=args.head_dim or g.head_dim,
        block_size=args.block_size or g.block_size,
    )
    if geometry.heads % 2:
        raise ConfigError(f"--heads must be even (the TP 2->4 case halves them), got {geometry.heads}")
    extras = []
    for name in args.connector:
        if name in ("shm", "zmq"):
            continue
        if name not in EXTRA_CONNECTORS:
            raise ConfigError(
                f"--connector must be one of {', '.join(('shm', 'zmq', *EXTRA_CONNECTORS))}, got {name!r}"
            )
        if name not in extras:
            extras.append(name)
    if args.threads < 1:
        raise ConfigError(f"--threads must be >= 1, got {args.threads}")
    chosen: dict[str, Any] = {
        "reps": args.reps,
        "warmup": args.warmup,
        "requests": args.requests,
        "readiness_reps": args.readiness_reps,
        "timeout_s": args.timeout,
    }
    overrides = {k: v for k, v in chosen.items() if v is not None}
    return BenchSettings(
        geometry,
        **{
            **_fields(base),
            **overrides,
            "extra_connectors": tuple(extras),
            "seed": args.seed,
            "runs": 1 if args.runs is None else args.runs,
            "huge_pages": args.huge_pages,
            "pin_cpus": args.pin_cpus,
        },
    )


def _fields(settings: BenchSettings) -> dict[str, Any]:
    return {
        "reps": settings.reps,
        "warmup": settings.warmup,
        "requests": settings.requests,
        "readiness_reps": settings.readiness_reps,
        "timeout_s": settings.timeout_s,
    }


def run(args: argparse.Namespace, *, out: TextIO | None = None, err: TextIO | None = None) -> int:
    """Run the benchmark for ``args``; see the module docstring for the exit status."""
    from kvferry.app.bench.plot import write_plot
    from kvferry.app.bench.report import render_bars, render_table, save_report
    from kvferry.app.bench.runner import run_bench

    out = sys.stdout if out is None else out
    err = sys.stderr if err is None else err
    if getattr(args, "hosts", False):
        return run_hosts(args, out, err)
    if getattr(args, "serve", False) and not getattr(args, "engine", None):
        print("kvferry bench: error: --serve needs --engine vllm", file=err)
        return 2
    if getattr(args, "engine", None):
        from kvferry.app.bench.engine.command import run_engine

        return run_engine(args, out, err)
    try:
        settings = settings_from_args(args)
    except ConfigError as exc:
        print(f"kvferry bench: error: {' '.join(str(exc).split())}", file=err)
        return 2

    def progress(line: str) -> None:
        if not args.quiet:
            print(f"  {line}", file=err, flush=True)

    report = run_bench(settings, threads=args.threads, progress=progress)
    out.write(render_table(report))
    out.write("\n" + render_bars(report))
    written, drawer = save_report(report, args.json, args.plot, write_plot, err)
    if not written:
        return 2
    print(f"wrote {args.json} and {args.plot} (drawn by {drawer})", file=out)
    return 1 if not all(report["data_checks"].values()) else 0
