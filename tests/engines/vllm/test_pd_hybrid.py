"""Two real vLLM instances hand a hybrid model's KV over through kvferry (shared memory): the tiny
random Llama with layers alternating full attention and a 48-token sliding window
(``layer_types``; vLLM's hybrid KV cache manager makes two KV cache groups, on the CPU build
too, since the connector declares ``SupportsHMA``).

The reference is the decode instance computing each prompt itself; the control is a prefill
instance with other weights. The bytes loaded are the full-attention layers' pages of the prompt
and the sliding-window layers' pages inside the window only.
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest
from harness import PROC, Instance, failures, free_base_port, prompts, vllm_python

from kvferry.app.vllm.groups import kept_first_page, prompt_pages

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

# a partial page, the window's edge on a page boundary ((79 - 48 + 1) % 32 == 0), several pages, many
LENGTHS = [45, 79, 100, 257]
TOKENS = 12
WINDOW, BS = 48, 32
PAGE_BYTES = 2 * BS * 2 * 32 * 2  # one block of one layer: 2 KV heads x 32 tokens x K and V of 32, bf16


def _model(py: str, path: Path, seed: int) -> Path:
    if not (path / "config.json").exists():
        cmd = [py, str(PROC), "make-hybrid-model", str(path), str(seed), str(WINDOW)]
        subprocess.run(cmd, check=True, timeout=300, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    return path


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Any:
    py = vllm_python()
    root = tmp_path_factory.mktemp("vllm_hybrid")
    return {
        "py": py,
        "root": root,
        "model_a": _model(py, root / "model_a", 1),
        "model_b": _model(py, root / "model_b", 2),
        "base": free_base_port(),
    }


def _start(env: dict, name: str, model: str, role: str, cpu: str) -> Instance:
    return Instance(
        env["py"],
        {"model": str(env[model]), "kv_role": role, "extra": {"base_port": env["base"], "load_timeout_s": 10}},
        cpu=cpu,
        log=Path(env["root"]) / f"{name}.log",
    )


@pytest.fixture(scope="module")
def decode(env: dict) -> Any:
    inst = _start(env, "decode", "model_a", "kv_consumer", "0")
    yield inst
    inst.close()


@pytest.fixture(scope="module")
def reference(decode: Instance) -> list[list[int]]:
    return [r["tokens"] for r in decode.generate(prompts(LENGTHS, seed=7), max_tokens=TOKENS)]


def _groups(inst: Instance) -> dict:
    inst.send({"op": "groups"})
    return inst.reply(60)


def _hand_off(env: dict, decode: Instance, model: str) -> tuple[list[list[int]], float, dict]:
    prefill = _start(env, f"prefill_{model}", model, "kv_producer", "1")
    try:
        ps = prompts(LENGTHS, seed=7)
        before = decode.metrics()
        out_p = prefill.generate(ps, [{"do_remote_decode": True} for _ in ps], max_tokens=1)
        params = [r["kv_transfer_params"] for r in out_p]
        out_d = decode.generate(ps, params, max_tokens=TOKENS)
        after = decode.metrics()
        loaded = after["vllm:kvferry_bytes_loaded"] - before.get("vllm:kvferry_bytes_loaded", 0)
        assert after["vllm:kvferry_requests_loaded"] - before.get("vllm:kvferry_requests_loaded", 0) == len(ps)
        assert failures(after) == failures(before), decode.kv_log()
        return [r["tokens"] for r in out_d], loaded, _groups(prefill)
    finally:
        prefill.close()


def test_the_decode_runs_two_kv_cache_groups(env: dict, decode: Instance, reference: list[list[int]]) -> None:
    assert _groups(decode)["groups"] == ["full", "sliding_window:48"]


def test_hybrid_hand_off_equals_a_single_instance_moving_the_window_only(
    env: dict, decode: Instance, reference: list[list[int]]
) -> None:
    loads_before = len(_groups(decode)["jobs"])
    tokens, loaded, prefill = _hand_off(env, decode, "model_a")
    assert prefill["groups"] == ["full", "sliding_window:48"]
    assert tokens == reference
    # each save sent group 1 from the first page the window of the prompt's last token reads;
    # each load (all but the last token) left the pages before it as vLLM's null block
    saves = [j["groups"] for j in prefill["jobs"] if j["kind"] == "save"]
    loads = [j["groups"] for j in _groups(decode)["jobs"][loads_before:] if j["kind"] == "load"]
    assert len(saves) == len(loads) == len(LENGTHS)
    for n, save, load in zip(LENGTHS, saves, loads):
        first = kept_first_page(n - 1, BS, WINDOW)
        assert save[0][1] == 0 and len(save[0][2]) == prompt_pages(n, BS)
        assert save[1][1] == first and len(save[1][2]) == prompt_pages(n, BS) - first
        assert load[1][2][:first] == [0] * first and 0 not in load[1][2][first:] and 0 not in load[0][2]
    # written on the decode, of the n - 1 tokens it loads: 2 full-attention layers, every page;
    # 2 sliding-window layers, the window's pages only
    full = sum(prompt_pages(n - 1, BS) for n in LENGTHS)
    window = sum(prompt_pages(n - 1, BS) - kept_first_page(n - 1, BS, WINDOW) for n in LENGTHS)
    assert loaded == (2 * full + 2 * window) * PAGE_BYTES
    assert window < full  # the window really is less than the prompt


def test_a_prefill_with_other_weights_changes_the_tokens(
    env: dict, decode: Instance, reference: list[list[int]]
) -> None:
    tokens, loaded, _ = _hand_off(env, decode, "model_b")
    assert loaded > 0
    assert sum(t != r for t, r in zip(tokens, reference)) >= len(LENGTHS) - 1  # the loaded KV was used
