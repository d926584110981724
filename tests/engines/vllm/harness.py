"""Start and drive vLLM instances (engine_proc.py: the library's instance server,
:mod:`kvferry.app.demo.vllm_instance`, plus the tests' ops) from the test process (no vLLM
imported here)."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from contextlib import contextmanager
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


#: kvferry's nixl connector over UCX's TCP transport on loopback (what the engine tests run)
NIXL_LOOPBACK = {"type": "nixl", "ucx_tls": "tcp,self", "ucx_net_devices": "lo"}


def nixl_or_skip(py: str) -> None:
    """Skip a nixl case when nixl is not installed in ``py`` (the vLLM venv), naming the
    install, unless ``KVFERRY_REQUIRE_NIXL=1`` (as ``.ci/run`` sets: then the case runs and
    fails)."""
    code = "import importlib.util, sys; sys.exit(importlib.util.find_spec('nixl') is None)"
    if subprocess.run([py, "-c", code], timeout=120, check=False).returncode == 0:
        return
    if os.environ.get("KVFERRY_REQUIRE_NIXL") != "1":
        import pytest

        pytest.skip(f"nixl is not installed in {py}: pip install --no-deps nixl-cu12==1.5.1 nixl==1.5.1")


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


#: The tiny random models this session made, by what makes them (interpreter, maker, seed and its
#: arguments), where they lie. A model is a function of those, so a module asking for one made
#: before gets that one (making one takes 10-15 s; a dozen modules ask for the same few).
_MADE: dict[tuple[Any, ...], Path] = {}


def made_once(key: tuple[Any, ...], path: Path, make: Callable[[Path], Path]) -> Path:
    """The model ``key`` names: the one made earlier in this session when it is still there,
    else ``make(path)`` (and remembered)."""
    made = _MADE.get(key)
    if made is not None and (made / "config.json").exists():
        return made
    _MADE[key] = made = make(path)
    return made


def make_model(py: str, path: Path, seed: int) -> Path:
    """The tests' tiny random Llama of ``seed`` (engine_proc.py ``make-model``; :func:`proc_model`)."""
    return proc_model(py, path, "make-model", seed)


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


def start_together(*starts: Callable[[], Instance]) -> list[Instance]:
    """The instances ``starts`` make, started at once (each constructor waits until its instance
    is ready; each instance runs on the cores its own start pins it to, so a P/D pair on cores 0
    and 1 takes the slower start, not both one after the other). All or none: when one fails,
    the others are closed and its error raised (the first in ``starts`` order)."""
    with ThreadPoolExecutor(len(starts)) as pool:
        futures = [pool.submit(start) for start in starts]
        wait(futures)
    started = [f.result() for f in futures if f.exception() is None]
    errors = [f.exception() for f in futures if f.exception() is not None]
    if errors:
        for inst in started:
            inst.close()
        raise errors[0]  # type: ignore[misc]
    return started


def huge_page_mb(pid: int) -> float:
    """MB of anonymous memory on transparent huge pages in process ``pid`` and every process
    under it (a vLLM instance keeps its KV cache in its engine-core child)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # gone meanwhile
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    total_kb, todo = 0, [pid]
    while todo:
        current = todo.pop()
        todo += children.get(current, [])
        try:
            rollup = Path(f"/proc/{current}/smaps_rollup").read_text()
        except OSError:
            continue
        total_kb += sum(int(line.split()[1]) for line in rollup.splitlines() if line.startswith("AnonHugePages:"))
    return total_kb / 1024


def failures(metrics: dict[str, float]) -> float:
    """All of kvferry's failure counters together."""
    return sum(v for k, v in metrics.items() if k.startswith("vllm:kvferry_failures{"))


def assert_loaded_without_failures(decode: Instance, before: dict[str, float], count: int) -> None:
    """``count`` more requests loaded at ``decode`` since ``before`` (its metrics then), and no
    load failed (a recompute would hide a failure behind right tokens)."""
    after = decode.metrics()
    loaded = after["vllm:kvferry_requests_loaded"] - before.get("vllm:kvferry_requests_loaded", 0)
    assert loaded == count, decode.kv_log()
    assert failures(after) == failures(before), decode.kv_log()


def assert_other_kv_changes_tokens(
    prefill: Instance, decode: Instance, prompt_a: list[int], seed: int, tokens: int, before: dict[str, float]
) -> None:
    """The control: a prompt B of prompt A's length, decoded over A's KV, follows A's KV and not
    B's own prompt (its tokens differ from B's alone), and no load failed since ``before``."""
    [b] = prompts([len(prompt_a)], seed=seed)
    [ref_b] = [r["tokens"] for r in decode.generate([b], max_tokens=tokens)]
    [par_a] = [
        r["kv_transfer_params"] for r in prefill.generate([prompt_a], [{"do_remote_decode": True}], max_tokens=1)
    ]
    [over_a] = [r["tokens"] for r in decode.generate([b], [par_a], max_tokens=tokens)]
    assert over_a != ref_b
    assert failures(decode.metrics()) == failures(before), decode.kv_log()


def proc_model(py: str, path: Path, op: str, seed: int, *args: object) -> Path:
    """A tiny random model made by engine_proc.py's ``op`` (``make-model``, ``make-mla-model``,
    ``make-hybrid-model``, ``make-mamba-model``) at ``path``, unless it is there already; or
    the same one this session made elsewhere (:func:`made_once`)."""

    def make(at: Path) -> Path:
        if not (at / "config.json").exists():
            cmd = [py, str(PROC), op, str(at), str(seed), *map(str, args)]
            subprocess.run(cmd, check=True, timeout=300, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        return at

    return made_once((py, op, seed, *map(str, args)), path, make)


def two_models(root: Path, op: str, *args: object) -> dict[str, Any]:
    """The set-up of a P/D test over one of engine_proc's models: the vLLM interpreter, ``root``,
    ``model_a`` (seed 1, both sides) and ``model_b`` (seed 2, the control's prefill), a base port."""
    py = vllm_python()
    return {
        "py": py,
        "root": root,
        "model_a": proc_model(py, root / "model_a", op, 1, *args),
        "model_b": proc_model(py, root / "model_b", op, 2, *args),
        "base": free_base_port(),
    }


def start_on(env: dict[str, Any], name: str, model: str, role: str, cpu: str) -> Instance:
    """An instance of ``env[model]`` in ``role`` on core ``cpu``, logging to ``root/name.log``;
    ``env["engine"]``, where set, adds to its serve config (e.g. ``max_num_batched_tokens``)."""
    cfg = {"model": str(env[model]), "kv_role": role, "extra": {"base_port": env["base"], "load_timeout_s": 10}}
    return Instance(
        env["py"],
        {**cfg, **env.get("engine", {})},
        cpu=cpu,
        log=Path(env["root"]) / f"{name}.log",
    )


@contextmanager
def decode_on(env: dict[str, Any], model: str = "model_a", prefill_model: str = "model_a") -> Iterator[Instance]:
    """The decode instance of ``env[model]`` on core 0, started at once with the prefill the
    module's first :func:`hand_off` of ``prefill_model`` takes (on core 1; kept in ``env`` until
    then). Both closed at the end, the prefill if no hand-off took it."""
    decode, prefill = start_together(
        lambda: start_on(env, "decode", model, "kv_consumer", "0"),
        lambda: start_on(env, f"prefill_{prefill_model}", prefill_model, "kv_producer", "1"),
    )
    env[_READY] = (prefill_model, prefill)
    try:
        yield decode
    finally:
        _, left = env.pop(_READY, (None, None))
        if left is not None:
            left.close()
        decode.close()


#: env key of the prefill decode_on started ahead: (its model, the instance)
_READY = "ready_prefill"


def _prefill_for(env: dict[str, Any], model: str) -> Instance:
    """The prefill decode_on started, if it is of ``model``, else a new one (the one started
    ahead is closed first: both would bind the same ports)."""
    ready_model, ready = env.pop(_READY, (None, None))
    if ready is not None and ready_model == model:
        return ready  # type: ignore[no-any-return]
    if ready is not None:
        ready.close()
    return start_on(env, f"prefill_{model}", model, "kv_producer", "1")


def hand_off(
    env: dict[str, Any], decode: Instance, model: str, lengths: list[int], tokens: int
) -> tuple[list[list[int]], float, dict[str, Any], list[dict[str, Any]]]:
    """Prompts of ``lengths`` (seed 7) prefilled by a prefill of ``env[model]`` (the one
    :func:`decode_on` started, or a new one; closed after) and decoded for ``tokens`` by
    ``decode`` over its KV: every prompt loaded, none failed. The decode's tokens, the bytes it
    loaded, the prefill's cache groups and jobs, the params."""
    prefill = _prefill_for(env, model)
    try:
        ps = prompts(lengths, seed=7)
        before = decode.metrics()
        out_p = prefill.generate(ps, [{"do_remote_decode": True} for _ in ps], max_tokens=1)
        params = [r["kv_transfer_params"] for r in out_p]
        out_d = decode.generate(ps, params, max_tokens=tokens)
        after = decode.metrics()
        loaded = after["vllm:kvferry_bytes_loaded"] - before.get("vllm:kvferry_bytes_loaded", 0)
        assert after["vllm:kvferry_requests_loaded"] - before.get("vllm:kvferry_requests_loaded", 0) == len(ps)
        assert failures(after) == failures(before), decode.kv_log()
        return [r["tokens"] for r in out_d], loaded, cache_groups(prefill), params
    finally:
        prefill.close()


def cache_groups(inst: Instance) -> dict[str, Any]:
    """The instance's KV cache groups and the connector's jobs so far (engine_proc's ``groups`` op)."""
    inst.send({"op": "groups"})
    return inst.reply(60)


def prompts(lengths: list[int], seed: int, vocab: int = 512) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(1, vocab) for _ in range(n)] for n in lengths]
