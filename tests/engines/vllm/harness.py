"""Start and drive vLLM instances (engine_proc.py: the library's instance server,
:mod:`kvferry.app.demo.vllm_instance`, plus the tests' ops) from the test process (no vLLM
imported here)."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from interpreters import VLLM, engine_python

from kvferry.adapters.platform import free_base_port as platform_free_base_port
from kvferry.adapters.platform import free_port  # noqa: F401 (the engine tests import it from here)
from kvferry.app.demo.vllm_demo import InstanceProcess, instance_env

HERE = Path(__file__).resolve().parent
PROC = HERE / "engine_proc.py"
ENV_VAR = VLLM.env_var


def vllm_python() -> str:
    """The vLLM venv's interpreter; skip (FAIL under CI) when it is not configured."""
    return engine_python(VLLM)


def run_json(script: str, out: Path, timeout_s: float = 500) -> Any:
    """Run ``script`` (a file beside this one) in the vLLM venv with ``out`` as its argument and
    return the JSON it wrote there; the test fails with its stderr when it fails."""
    proc = subprocess.run(
        [vllm_python(), str(HERE / script), str(out)], capture_output=True, text=True, timeout=timeout_s, check=False
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())


def free_base_port() -> int:
    """A base port whose rank-0 and rank-1 sender ports are free now (the one rule:
    :func:`kvferry.adapters.platform.free_base_port`)."""
    return platform_free_base_port(2)


def make_model(py: str, path: Path, seed: int) -> Path:
    if not (path / "config.json").exists():
        subprocess.run(
            [py, str(PROC), "make-model", str(path), str(seed)],
            check=True,
            timeout=300,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
    return path


class Instance(InstanceProcess):
    """One vLLM process running ``engine_proc.py serve`` (the demo's instance process client,
    :class:`kvferry.app.demo.vllm_demo.InstanceProcess`, plus the tests' requests).

    ``wrap``: argv put before the interpreter, e.g. ``["ip", "netns", "exec", NS]`` to start the
    instance inside a network namespace (``ip netns exec`` execs the command: the process is the
    same pid)."""

    def __init__(
        self,
        py: str,
        cfg: dict[str, Any],
        *,
        cpu: str,
        log: Path,
        timeout_s: float = 300,
        wrap: Sequence[str] = (),
    ) -> None:
        env = instance_env(cpu, force=True, VLLM_LOGGING_LEVEL=os.environ.get("VLLM_LOGGING_LEVEL", "INFO"))
        super().__init__([*wrap, py, str(PROC), "serve", json.dumps(cfg)], env=env, log=log, timeout_s=timeout_s)

    def generate(
        self, prompts: list[list[int]], params: list[Any] | None = None, *, max_tokens: int = 12, timeout_s: float = 300
    ) -> list[dict[str, Any]]:
        self.send(
            {"op": "generate", "prompts": prompts, "params": params or [None] * len(prompts), "max_tokens": max_tokens}
        )
        return self.reply(timeout_s)["results"]

    def metrics(self) -> dict[str, float]:
        """kvferry's counters on this instance's metrics endpoint: ``{name or name{kind}: value}``."""
        return self.call({"op": "metrics"}, 60)["metrics"]

    def settled_metrics(self) -> dict[str, float]:
        """:meth:`metrics` after one more engine step (the instance's ``stats`` op): a
        connector's stats reach vLLM's metrics with the next step's output, so a save that
        finished after the last step (the prefill's background publishing) shows only once the
        engine steps again."""
        return self.call({"op": "stats"}, 300)["stats"]

    def kv_log(self) -> str:
        """The instance's log lines about KV transfers (for assertion messages)."""
        keep = ("KV load failed", "KV Transfer metrics", "kvferry", "kv_transfer_params")
        return "\n".join(line for line in self.tail(1_000_000).splitlines() if any(k in line for k in keep))[-4000:]


def failures(metrics: dict[str, float]) -> float:
    """All of kvferry's failure counters together."""
    return sum(v for k, v in metrics.items() if k.startswith("vllm:kvferry_failures{"))


def prompts(lengths: list[int], seed: int, vocab: int = 512) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(1, vocab) for _ in range(n)] for n in lengths]
