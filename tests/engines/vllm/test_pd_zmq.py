"""The same hand-off over kvferry's zmq connector (TCP on loopback), chosen by extra config."""

from __future__ import annotations

import time
from typing import Any

import pytest
from harness import Instance, failures, free_base_port, make_model, prompts, vllm_python

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

LENGTHS = [33, 96, 200]
TOKENS = 12


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Any:
    py = vllm_python()
    root = tmp_path_factory.mktemp("vllm_zmq")
    model = make_model(py, root / "model", 1)
    extra = {"connector": {"type": "zmq"}, "base_port": free_base_port(), "load_timeout_s": 20}
    timings: dict[str, float] = {}
    d = Instance(py, {"model": str(model), "kv_role": "kv_consumer", "extra": extra}, cpu="0", log=root / "decode.log")
    timings["startup_decode_s"] = round(d.startup_s, 1)
    try:
        p = Instance(
            py, {"model": str(model), "kv_role": "kv_producer", "extra": extra}, cpu="1", log=root / "prefill.log"
        )
    except BaseException:
        d.close()
        raise
    timings["startup_prefill_s"] = round(p.startup_s, 1)
    yield d, p, timings
    p.close()
    d.close()
    print("timings:", timings)


def test_zmq_decode_tokens_equal_a_single_instance(pair: Any) -> None:
    d, p, timings = pair
    ps = prompts(LENGTHS, seed=11)
    reference = [r["tokens"] for r in d.generate(ps, max_tokens=TOKENS)]
    t = time.monotonic()
    out_p = p.generate(ps, [{"do_remote_decode": True} for _ in ps], max_tokens=1)
    params = [r["kv_transfer_params"] for r in out_p]
    assert {r["kvferry_connector"] for r in params} == {"zmq"}
    out_d = d.generate(ps, params, max_tokens=TOKENS)
    timings["pd_identity_s"] = round(time.monotonic() - t, 1)
    assert [r["tokens"] for r in out_d] == reference
    m = d.metrics()
    assert m["vllm:kvferry_requests_loaded"] == len(ps), d.kv_log()
    assert failures(m) == 0, d.kv_log()  # no load failed (a recompute would hide it)
    assert m["vllm:kvferry_bytes_loaded"] == sum(-(-n // 32) for n in LENGTHS) * 4 * 2 * 32 * 64 * 2
    assert p.settled_metrics()["vllm:kvferry_requests_sent"] == len(ps)


def test_zmq_pages_are_consumed_once(pair: Any) -> None:
    """A second decode of the same params finds nothing (consume once) and, by policy,
    recomputes: still the right tokens, and the miss is counted."""
    d, p, _ = pair
    ps = prompts(LENGTHS[:1], seed=12)
    reference = [r["tokens"] for r in d.generate(ps, max_tokens=TOKENS)]
    params = [r["kv_transfer_params"] for r in p.generate(ps, [{"do_remote_decode": True}], max_tokens=1)]
    assert [r["tokens"] for r in d.generate(ps, params, max_tokens=TOKENS)] == reference
    before = d.metrics()
    assert [
        r["tokens"] for r in d.generate(ps, [dict(params[0], do_remote_prefill=True)], max_tokens=TOKENS)
    ] == reference
    after = d.metrics()
    assert after["vllm:kvferry_requests_loaded"] == before["vllm:kvferry_requests_loaded"]
    assert failures(after) == failures(before) + 1
