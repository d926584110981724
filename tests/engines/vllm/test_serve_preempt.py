"""A decode whose KV cache is too small for its loaded requests: vLLM preempts them.

A prefill and a decode ``vllm serve`` (TP 1, ``KVFerryConnector`` over shm) behind vLLM's toy
proxy; the decode has ``--num-gpu-blocks-override`` blocks, a little more than one request of
its ``--max-model-len`` needs, far fewer than a burst of loaded prompts and their outputs. Its
scheduler admits a load while blocks are free (several loads in flight at once, each holding
its prompt's blocks in ``WAITING_FOR_REMOTE_KVS``); once loaded, the requests decode and grow,
and vLLM preempts the newest running one (its blocks freed, back to waiting). vLLM never
preempts a request that waits for its KV (it is not running); a preempted one comes back with
``num_computed_tokens`` 0 and asks the connector again, which offers nothing (the params were
marked used when its load was planned), so it computes its prompt and output so far on the
decode and never reads its transfer's keys again (those were consumed, or would be expired).

Asserted: every stream ends (bounded) with the plain server's token ids (alone or in its own
batch), vLLM counted preemptions on the decode, every request was loaded exactly once and no
load failed, and the prefill's pool holds nothing afterwards.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from harness import free_base_port, prompts, vllm_python
from serve_harness import (
    Served,
    counters_when,
    kvferry_counters,
    make_serve_model,
    not_plain,
    pd_behind_proxy,
    plain_reference,
    serve_kv,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]

TOKENS = 96  # three blocks of output: running requests need new blocks as they decode
LENGTHS = [300 + 20 * i for i in range(8)]  # 10-14 blocks each: 8 of them need ~130 blocks
BLOCKS = 40  # the decode's KV cache: one 1024-token request (32 blocks) and a little more
THRESHOLD = 64
LOAD_TIMEOUT_S = 20
STARTUP_S = 400
PREEMPTIONS = "vllm:num_preemptions_total"


def _kv(role: str, base_port: int) -> dict[str, Any]:
    return serve_kv(role, base_port, THRESHOLD, LOAD_TIMEOUT_S)


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    py = vllm_python()
    root = tmp_path_factory.mktemp("vllm_serve_preempt")
    model = make_serve_model(py, root / "model", 1)
    state: dict[str, Any] = {"py": py, "root": root, "model": model, "timings": {}}
    state["prompts"] = prompts(LENGTHS, seed=21)
    plain = plain_reference(py, model, root, STARTUP_S, [], state["prompts"], TOKENS)
    state["plain"] = plain
    state["timings"]["plain_batch_gaps"] = plain["batch_gaps"]
    assert not plain["metrics"].get(PREEMPTIONS), plain["metrics"]  # the plain server had room for all
    yield state
    print("timings:", state["timings"])


@pytest.fixture(scope="module")
def pd(env: dict[str, Any]) -> Iterator[dict[str, Served]]:
    py, root, model = env["py"], env["root"], env["model"]
    base = free_base_port()
    small = ["--num-gpu-blocks-override", str(BLOCKS), "--max-model-len", "1024"]
    with pd_behind_proxy(
        py,
        model,
        root,
        STARTUP_S,
        {"name": "prefill", "cpu": "1", "kv": _kv("kv_producer", base)},
        {"name": "decode", "cpu": "0", "kv": _kv("kv_consumer", base), "args": small},
    ) as pd:
        yield pd


def test_requests_preempted_after_their_load_complete_with_the_plain_servers_tokens(
    env: dict[str, Any], pd: dict[str, Served]
) -> None:
    prefill, decode, proxy = pd["prefill"], pd["decode"], pd["proxy"]
    burst = env["prompts"]
    p0, d0 = kvferry_counters(prefill), kvferry_counters(decode)
    pre0 = decode.metrics().get(PREEMPTIONS, 0.0)
    with ThreadPoolExecutor(len(burst)) as pool:
        got = list(pool.map(lambda p: proxy.stream(p, TOKENS, timeout_s=600), burst))
    preempted = decode.metrics().get(PREEMPTIONS, 0.0) - pre0
    env["timings"]["preemptions"] = preempted
    wrong, ties = not_plain(env["plain"], list(zip(burst, got)))
    env["timings"]["ties"] = ties
    assert not wrong, f"{len(wrong)} of {len(burst)} streams differ from the plain server's tokens: {wrong}"
    assert len(ties) <= len(burst) // 4, ties
    assert preempted > 0, "the decode preempted nothing: the test did not test preemption"
    n = len(burst)
    loaded = "requests_loaded_total"
    d1, _ = counters_when(decode, lambda c: c.get(loaded, 0) - d0.get(loaded, 0) >= n)
    held = "pool_entries_held"
    p1, _ = counters_when(
        prefill,
        lambda c: (
            c.get("requests_sent_total", 0) - p0.get("requests_sent_total", 0) >= n
            and not any(v for k, v in c.items() if k.startswith(held))
        ),
    )
    dd = {k: v - d0.get(k, 0) for k, v in d1.items() if v != d0.get(k, 0)}
    dp = {k: v - p0.get(k, 0) for k, v in p1.items() if v != p0.get(k, 0)}
    env["timings"].update(decode=dd, prefill=dp)
    assert dp.get("requests_sent_total") == n, dp
    assert dd.get(loaded) == n, dd  # each loaded once: a preempted one does not load again
    assert not any(k.startswith("failures") for k in {**dp, **dd}), (dp, dd)
    assert not any(v for k, v in p1.items() if k.startswith(held)), p1  # the pool is empty
    # every prompt token came from the transfer (vLLM counts a request's first prefill only,
    # not the recompute after its preemption)
    assert dd.get("external_kv_transfer") == sum(len(p) for p in burst), dd
