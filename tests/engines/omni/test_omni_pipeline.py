"""vllm-omni 0.30.0's real orchestrator on CPU: AR stage -> diffusion stage, the KV in between.

Each case is one orchestrator (``vllm_omni.entrypoints.omni.Omni``, started by omni_driver.py
under ``KVFERRY_OMNI_PYTHON``) over ``deploy_kvferry_tiny.yaml`` as it is (BAGEL's shape: stage 0
sends KV when the prefill finishes, stage 1 receives it over ``SharedMemoryConnector``), with a
tiny random Llama made on the spot, and several prompts. The diffusion stage's pipeline
(plugin/kvferry_omni_cpu/probe.py) runs one probe token over the KV it received and returns its
logits. The checks, per prompt:

- the KV means the prompt: the logits equal those of the model's own forward over prompt + probe
  (transformers, computed by the driver after the orchestrator closed), within bf16 noise, and
  the argmax is the same;
- it is used: they differ from the probe alone (what the pipeline computes without KV) by far
  more than that noise;
- the probe itself is right: over the KV transformers computes for the prompt it gives the full
  forward's logits (no transfer involved).

Cases (whose ``OmniKVTransferManager`` each stage process builds; ``KVFERRY_OMNI_SENDER`` /
``KVFERRY_OMNI_RECEIVER``): the reference everywhere; kvferry everywhere, with the stage configs
as vllm-omni writes them and with the cache layout named; mixed both ways.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
from interpreters import OMNI, engine_python

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]

HERE = Path(__file__).resolve().parent
DRIVER = HERE / "omni_driver.py"
DEPLOY = HERE / "deploy_kvferry_tiny.yaml"
#: one orchestrator's start (two stage processes, vLLM CPU and the diffusion stage) on a loaded
#: 2-core machine, its requests, its shutdown and the driver's own forwards
RUN_S = 900
#: vllm-omni's default ``recv_timeout`` (seconds): a receiver that waited it out lost the KV silently
RECV_TIMEOUT_S = 30.0
PROMPTS = [
    [3, 17, 29, 41, 55, 67, 80, 91, 100, 120, 130, 140],
    [200, 3, 9, 250, 301, 77, 66, 5, 44],
    [450, 451, 452, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30],
]
#: bf16 noise between vLLM CPU's forward and transformers', as a share of how far the probe moves
#: when it gets the prompt's KV at all (|full - alone|); the reference's misread KV is off by
#: about as much as the KV moves it
NOISE_SHARE = 0.15


def omni_python() -> str:
    """The omni venv's interpreter; skip (fail under CI) when it is not configured."""
    return engine_python(OMNI)


@pytest.fixture(scope="module")
def omni() -> str:
    return omni_python()


@pytest.fixture(scope="module")
def model_dir(omni: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("omni") / "tiny-llama"
    subprocess.run([omni, str(DRIVER), "make-model", str(path)], check=True, timeout=600, capture_output=True)
    return path


@pytest.fixture(scope="module")
def machine(omni: str) -> dict[str, Any]:
    """What the AR stage's vLLM CPU runs here: its attention kernel (ISA) for this model."""
    out = subprocess.run([omni, str(DRIVER), "isa"], check=True, timeout=300, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


class Cases:
    """Runs each case's orchestrator once (one alive at a time), on first use."""

    def __init__(self, omni: str, model_dir: Path, work: Path) -> None:
        self.omni, self.model_dir, self.work = omni, model_dir, work
        self.results: dict[str, dict[str, Any]] = {}

    def run(self, name: str, sender: str, receiver: str, layout: str = "") -> dict[str, Any]:
        if name in self.results:
            return self.results[name]
        out = self.work / f"{name}.json"
        spec = {
            "model": str(self.model_dir),
            "deploy": str(DEPLOY),
            "prompts": PROMPTS,
            "env": {"KVFERRY_OMNI_SENDER": sender, "KVFERRY_OMNI_RECEIVER": receiver, "KVFERRY_OMNI_KV_LAYOUT": layout},
            "out": str(out),
        }
        spec_path = self.work / f"{name}.spec.json"
        spec_path.write_text(json.dumps(spec))
        log = self.work / f"{name}.log"
        env = {k: v for k, v in os.environ.items() if k not in ("VLLM_PLUGINS", "LOCAL_RANK")}
        env.update({"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_HOST_IP": "127.0.0.1"})
        with open(log, "wb") as f:
            proc = subprocess.Popen(
                [self.omni, str(DRIVER), "run", str(spec_path)],
                stdout=f,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
            try:
                rc = proc.wait(timeout=RUN_S)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, 9)
                proc.wait(timeout=60)
                rc = None
            finally:
                if proc.poll() is None:
                    os.killpg(proc.pid, 9)
        tail = log.read_bytes()[-4000:].decode(errors="replace")
        assert rc == 0, f"case {name}: driver exited {rc}; log {log}:\n{tail}"
        result = json.loads(out.read_text())
        result["log"] = str(log)
        self.results[name] = result
        return result


@pytest.fixture(scope="module")
def cases(omni: str, model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Cases:
    return Cases(omni, model_dir, tmp_path_factory.mktemp("cases"))


def _dist(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


def _argmax(a: list[float]) -> int:
    return max(range(len(a)), key=a.__getitem__)


def probes(result: dict[str, Any]) -> list[dict[str, Any]]:
    """The diffusion stage's probe per prompt, in prompt order (request ids start with the index)."""
    final = [o for o in result["outputs"] if o["stage_id"] == 1]
    assert len(final) == len(PROMPTS), result["outputs"]
    final.sort(key=lambda o: int(o["request_id"].split("_", 1)[0]))
    for o in final:
        assert o["error"] is None and o["probe"] is not None, o
    return [o["probe"] for o in final]


def check_kv_means_prompt(result: dict[str, Any]) -> list[float]:
    """Every prompt's KV came, is the prompt's, and is used; returns the distances to the full forward."""
    exp = result["expected"]
    distances = []
    for i, (prompt, probe) in enumerate(zip(PROMPTS, probes(result), strict=True)):
        moved = _dist(exp["full"][i], exp["alone"])
        assert probe["kv"] and probe["seq_len"] == len(prompt), probe
        assert all(s[0] == len(prompt) for s in probe["shapes"]), probe["shapes"]
        off = _dist(probe["logits"], exp["full"][i])
        assert off < NOISE_SHARE * moved, f"prompt {i}: {off} from the model's own forward (KV moves it {moved})"
        assert _argmax(probe["logits"]) == _argmax(exp["full"][i]), f"prompt {i}"
        assert _dist(probe["logits"], exp["alone"]) > (1 - NOISE_SHARE) * moved, f"prompt {i}: KV not used"
        distances.append(off)
    return distances


def check_refused_fast(result: dict[str, Any]) -> None:
    """No KV reached the pipeline, and the diffusion stage learned it without waiting out recv_timeout."""
    exp = result["expected"]
    for probe in probes(result):
        assert not probe["kv"], probe
        assert _dist(probe["logits"], exp["alone"]) < 1e-3
    assert result["generate_s"] < RECV_TIMEOUT_S / 2, result["generate_s"]


def test_probe_over_the_models_own_kv_is_its_forward(cases: Cases) -> None:
    """The check itself: the probe over transformers' own KV for each prompt is the full forward."""
    result = cases.run("reference", "reference", "reference")
    exp = result["expected"]
    for i in range(len(PROMPTS)):
        moved = _dist(exp["full"][i], exp["alone"])
        assert _dist(exp["probe_own_kv"][i], exp["full"][i]) < 0.05 * moved, i


def test_reference_everywhere_moves_kv_that_misreads_vllm_cpu_pages(cases: Cases) -> None:
    """vllm-omni's own manager in both stages: KV for every prompt arrives (it moves the probe),
    but it is not the prompt's: the reference reads vLLM CPU pages as FlashAttention's packed
    layout (issue 22). Asserted, so that a reference that reads them right shows up here."""
    result = cases.run("reference", "reference", "reference")
    exp = result["expected"]
    for i, probe in enumerate(probes(result)):
        moved = _dist(exp["full"][i], exp["alone"])
        assert probe["kv"] and probe["seq_len"] == len(PROMPTS[i]), probe
        assert _dist(probe["logits"], exp["alone"]) > NOISE_SHARE * moved, f"prompt {i}: KV not used"
        assert _dist(probe["logits"], exp["full"][i]) > NOISE_SHARE * moved, f"prompt {i}: the reference read it right"


def test_kvferry_everywhere_with_layout_named(cases: Cases, machine: dict[str, Any]) -> None:
    """kvferry's manager in both stages, ``kv_layout: vllm_cpu:<the AR stage's kernel>`` in stage
    0's omni_kv_config: the diffusion stage gets the prompt's KV (vec kernel), or, for a kernel
    whose whole-cache order kvferry does not decode (amx), a refusal it learns of at once."""
    result = cases.run("kvferry-named", "kvferry", "kvferry", f"vllm_cpu:{machine['isa']}")
    if machine["isa"] == "vec":
        check_kv_means_prompt(result)
    else:
        check_refused_fast(result)


def test_kvferry_everywhere_configs_as_vllm_omni_writes_them(cases: Cases, machine: dict[str, Any]) -> None:
    """kvferry's manager in both stages, the stage configs and the deploy yaml as vllm-omni writes
    them (connector ``SharedMemoryConnector``, no layout named): ``from_vllm_config`` takes the
    layout from the engine (vLLM CPU, its kernel), so the diffusion stage gets the prompt's KV
    (vec kernel); for a kernel whose whole-cache order the manager does not decode (amx), a
    refusal it learns of without waiting out recv_timeout. Nothing is lost in silence."""
    result = cases.run("kvferry-as-is", "kvferry", "kvferry")
    if machine["isa"] == "vec":
        check_kv_means_prompt(result)
    else:
        check_refused_fast(result)


def test_mixed_reference_sender_kvferry_receiver(cases: Cases) -> None:
    """vllm-omni's manager sends, kvferry's receives, one deploy yaml: kvferry's receiver hands the
    pipeline exactly what the reference's receiver hands it (the same logits, bit for bit)."""
    ref = probes(cases.run("reference", "reference", "reference"))
    mixed = probes(cases.run("mixed-ref-to-kvf", "reference", "kvferry"))
    for a, b in zip(ref, mixed, strict=True):
        assert b["kv"] and b["shapes"] == a["shapes"]
        assert b["logits"] == a["logits"]


def test_mixed_kvferry_sender_reference_receiver(cases: Cases, machine: dict[str, Any]) -> None:
    """kvferry's manager sends (layout named), vllm-omni's receives: the reference's receiver gets
    the prompt's KV (vec kernel); for another kernel, kvferry's refusal reaches it inside
    recv_timeout as an all-absent payload (no KV, no wait)."""
    result = cases.run("mixed-kvf-to-ref", "kvferry", "reference", f"vllm_cpu:{machine['isa']}")
    if machine["isa"] == "vec":
        check_kv_means_prompt(result)
    else:
        check_refused_fast(result)
