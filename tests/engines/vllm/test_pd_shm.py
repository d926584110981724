"""Two real vLLM instances (separate processes) hand KV over through kvferry's default
connector (shared memory), a tiny random Llama made on the spot.

The reference is the decode instance computing each prompt itself (prefix caching off, so it
never reuses loaded blocks); the control is a prefill instance with other weights.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from harness import Instance, failures, free_base_port, make_model, prompts, start_together, vllm_python

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

LENGTHS = [45, 64, 100, 257]  # a partial block, exact blocks, several, one past a block edge
TOKENS = 12
LOAD_TIMEOUT_S = 10


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Any:
    py = vllm_python()
    root = tmp_path_factory.mktemp("vllm_shm")
    state = {
        "py": py,
        "root": root,
        "model_a": make_model(py, root / "model_a", 1),
        "model_b": make_model(py, root / "model_b", 2),
        "base": free_base_port(),
        "timings": {},
    }
    yield state
    print("timings:", state["timings"])


def _extra(env: dict) -> dict:
    return {"base_port": env["base"], "load_timeout_s": LOAD_TIMEOUT_S}


def _start(env: dict, name: str, model: str, role: str, cpu: str, **cfg: Any) -> Instance:
    inst = Instance(
        env["py"],
        {"model": str(env[model]), "kv_role": role, "extra": _extra(env), **cfg},
        cpu=cpu,
        log=Path(env["root"]) / f"{name}.log",
    )
    env["timings"][f"startup_{name}_s"] = round(inst.startup_s, 1)
    return inst


@pytest.fixture(scope="module")
def pair(env: dict) -> Any:
    """The decode and prefill_a, started at once (each on its own core)."""
    d, p = start_together(
        lambda: _start(env, "decode", "model_a", "kv_consumer", "0"),
        lambda: _start(env, "prefill_a", "model_a", "kv_producer", "1"),
    )
    yield d, p
    p.close()  # (a test may have closed it already)
    d.close()


@pytest.fixture(scope="module")
def decode(pair: Any) -> Any:
    return pair[0]


@pytest.fixture(scope="module")
def reference(decode: Instance) -> list[list[int]]:
    ps = prompts(LENGTHS, seed=7)
    return [r["tokens"] for r in decode.generate(ps, max_tokens=TOKENS)]


@pytest.fixture(scope="module")
def prefill_a(pair: Any) -> Any:
    return pair[1]


def _params_of_this_prefill(env: dict, tids: list[str], ps: list[list[int]]) -> list[dict]:
    """What prefill_a's output would hand the decode for prompts ``ps`` under transfer ids
    ``tids`` (made here: the pages may come later, or never)."""
    from kvferry.app.vllm.params import ConnectorSettings, prefill_result

    port = ConnectorSettings.from_extra_config({"base_port": env["base"]}).sender_port(0, 1)
    return [
        prefill_result(
            transfer_id=t,
            host="127.0.0.1",
            port=port,
            num_tokens=len(p),
            block_size=32,
            num_layers=4,
            tp_size=1,
            decode_tp_size=1,
            connector_type="shm",
            engine_id="",
        )
        for t, p in zip(tids, ps)
    ]


def _remote(n: int, **extra: Any) -> list[dict]:
    return [{"do_remote_decode": True, **extra} for _ in range(n)]


def test_decode_tokens_equal_a_single_instance(
    env: dict, decode: Instance, prefill_a: Instance, reference: list[list[int]]
) -> None:
    ps = prompts(LENGTHS, seed=7)
    before = decode.metrics()
    t = time.monotonic()
    out_p = prefill_a.generate(ps, _remote(len(ps)), max_tokens=1)
    params = [r["kv_transfer_params"] for r in out_p]
    for r, n in zip(params, LENGTHS):
        assert r["do_remote_prefill"] is True and r["remote_num_tokens"] == n and r["kvferry_connector"] == "shm"
    out_d = decode.generate(ps, params, max_tokens=TOKENS)
    env["timings"]["pd_identity_s"] = round(time.monotonic() - t, 1)
    assert [r["tokens"] for r in out_d] == reference
    after = decode.metrics()
    # the KV really came over: every prompt's pages were loaded (4 layers x 2 heads x 32 x 64 bf16)
    assert after["vllm:kvferry_requests_loaded"] - before.get("vllm:kvferry_requests_loaded", 0) == len(ps), (
        decode.kv_log()
    )
    assert failures(after) == failures(before), decode.kv_log()  # no load failed (a recompute would hide it)
    pages = sum(-(-n // 32) for n in LENGTHS)
    assert (
        after["vllm:kvferry_bytes_loaded"] - before.get("vllm:kvferry_bytes_loaded", 0) == pages * 4 * 2 * 32 * 64 * 2
    )
    assert prefill_a.settled_metrics()["vllm:kvferry_requests_sent"] >= len(ps)


def test_a_sync_load_runs_the_request_in_the_step_that_loads_it(
    env: dict, decode: Instance, prefill_a: Instance, reference: list[list[int]]
) -> None:
    """A proxy that waited for the prefill asks for a sync load (``load_mode`` in the decode
    request's params): vLLM computes only the last prompt token, in the step that loads the
    rest; the output equals a single instance's."""
    ps = prompts(LENGTHS, seed=7)
    before = decode.metrics()
    out_p = prefill_a.generate(ps, _remote(len(ps)), max_tokens=1)
    params = [{**r["kv_transfer_params"], "load_mode": "sync"} for r in out_p]
    out_d = decode.generate(ps, params, max_tokens=TOKENS)
    assert [r["tokens"] for r in out_d] == reference
    after = decode.metrics()
    assert failures(after) == failures(before), decode.kv_log()
    assert after["vllm:kvferry_requests_loaded"] - before["vllm:kvferry_requests_loaded"] == len(ps)
    pages = sum(-(-(n - 1) // 32) for n in LENGTHS)  # all but the last token's KV came over
    assert after["vllm:kvferry_bytes_loaded"] - before["vllm:kvferry_bytes_loaded"] == pages * 4 * 2 * 32 * 64 * 2


def test_a_sync_load_of_pages_that_never_come_recomputes_at_once(
    env: dict, decode: Instance, prefill_a: Instance, reference: list[list[int]]
) -> None:
    """The prefill is up but never made these pages: a sync load cannot wait for them, so it
    fails within inline_load_s and vLLM recomputes the prompt (the same tokens), long before
    the load timeout an async load would wait out."""
    ps = prompts(LENGTHS[:2], seed=7)
    tids = [f"never-{i}-{env['base']}" for i in range(len(ps))]
    params = [{**p, "load_mode": "sync"} for p in _params_of_this_prefill(env, tids, ps)]
    before = decode.metrics().get("vllm:kvferry_failures{timeout}", 0)
    t = time.monotonic()
    out = decode.generate(ps, params, max_tokens=TOKENS)
    seconds = time.monotonic() - t
    assert [r["tokens"] for r in out] == reference[:2]
    assert decode.metrics()["vllm:kvferry_failures{timeout}"] == before + 2
    assert seconds < LOAD_TIMEOUT_S, seconds  # failed in its step, not at the load timeout


def test_decode_started_before_the_prefill(
    env: dict, decode: Instance, prefill_a: Instance, reference: list[list[int]]
) -> None:
    """A proxy that knows the prefill's address sends both requests at once: the decode waits
    (arrival notification) for pages the prefill has not computed yet."""
    ps = prompts(LENGTHS[:2], seed=7)
    tids = [f"early-{i}-{env['base']}" for i in range(len(ps))]
    params = _params_of_this_prefill(env, tids, ps)
    before = decode.metrics()
    decode.send({"op": "generate", "prompts": ps, "params": params, "max_tokens": TOKENS})
    out_p = prefill_a.generate(ps, [{"do_remote_decode": True, "transfer_id": t} for t in tids], max_tokens=1)
    assert [r["kv_transfer_params"]["transfer_id"] for r in out_p] == tids
    out_d = decode.reply(300)["results"]
    assert [r["tokens"] for r in out_d] == reference[:2]
    after = decode.metrics()
    assert failures(after) == failures(before), decode.kv_log()
    assert after["vllm:kvferry_requests_loaded"] - before["vllm:kvferry_requests_loaded"] == len(ps)


def test_bad_params_name_the_field_and_recompute(decode: Instance, reference: list[list[int]]) -> None:
    ps = prompts(LENGTHS[:1], seed=7)
    before = decode.metrics().get("vllm:kvferry_failures{params}", 0)
    bad = {
        "do_remote_prefill": True,
        "kvferry_version": 1,
        "transfer_id": "x",
        "remote_host": "127.0.0.1",
        "remote_port": "not-a-port",
        "remote_num_tokens": 45,
        "remote_block_size": 32,
        "remote_num_layers": 4,
        "remote_tp_size": 1,
        "decode_tp_size": 1,
        "kvferry_connector": "shm",
    }
    out = decode.generate(ps, [bad], max_tokens=TOKENS)
    assert out[0]["tokens"] == reference[0]
    assert decode.metrics()["vllm:kvferry_failures{params}"] == before + 1
    assert "kv_transfer_params.remote_port" in decode.tail(200_000)


@pytest.fixture(scope="module")
def killed_params(env: dict, decode: Instance, prefill_a: Instance) -> list[dict]:
    """Params of a prefill instance with other weights that was killed after its prefill."""
    prefill_a.close()
    inst = _start(env, "prefill_b", "model_b", "kv_producer", "1")
    ps = prompts(LENGTHS, seed=7)
    try:
        out_d = decode.generate(
            ps, [r["kv_transfer_params"] for r in inst.generate(ps, _remote(len(ps)), max_tokens=1)], max_tokens=TOKENS
        )
        env["control"] = [r["tokens"] for r in out_d]
        out_p = inst.generate(ps[:2], _remote(2), max_tokens=1)
    finally:
        inst.kill()
    return [r["kv_transfer_params"] for r in out_p]


def test_control_prefill_with_other_weights_changes_the_output(
    env: dict, killed_params: list[dict], reference: list[list[int]]
) -> None:
    for got, ref in zip(env["control"], reference):
        assert got != ref


def test_prefill_killed_before_the_load_recomputes(
    env: dict, decode: Instance, killed_params: list[dict], reference: list[list[int]]
) -> None:
    before = decode.metrics()
    t = time.monotonic()
    out = decode.generate(prompts(LENGTHS[:2], seed=7), killed_params, max_tokens=TOKENS)
    env["timings"]["killed_recompute_s"] = round(time.monotonic() - t, 1)
    assert [r["tokens"] for r in out] == reference[:2]
    after = decode.metrics()
    # each load found the prefill's process gone and failed at once (not at load_timeout_s)
    failed = {
        k: after.get(f"vllm:kvferry_failures{{{k}}}", 0) - before.get(f"vllm:kvferry_failures{{{k}}}", 0)
        for k in ("unavailable", "timeout")
    }
    assert failed == {"unavailable": 2, "timeout": 0}, failed


def test_prefill_killed_with_policy_fail_fails_the_request(
    env: dict, decode: Instance, killed_params: list[dict]
) -> None:
    decode.close()  # at most two instances at a time
    inst = _start(env, "decode_fail", "model_a", "kv_consumer", "0", policy="fail")
    try:
        out = inst.generate(prompts(LENGTHS[:1], seed=7), killed_params[:1], max_tokens=TOKENS)
        assert out[0]["finish_reason"] == "error"
        assert len(out[0]["tokens"]) < TOKENS
    finally:
        inst.close()
