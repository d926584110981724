"""The same hand-off over kvferry's zmq connector (TCP on loopback) and over its nixl connector
(one-sided NIXL READs, UCX over TCP on loopback, of the prefill's registered KV cache itself:
pages read in place, only headers in its pool), chosen by extra config. The nixl case needs nixl
in the vLLM venv (``.ci/venv-vllm`` installs it); without it the case skips, naming the install,
unless ``KVFERRY_REQUIRE_NIXL=1`` (as ``.ci/run`` sets)."""

from __future__ import annotations

import time
from typing import Any

import pytest
from harness import (
    NIXL_LOOPBACK,
    Instance,
    assert_loaded_without_failures,
    failures,
    free_base_port,
    huge_page_mb,
    make_model,
    nixl_or_skip,
    prompts,
    start_together,
    vllm_python,
)

from kvferry.adapters.platform import THP_ENABLED, thp_mode

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

LENGTHS = [33, 96, 200]
TOKENS = 12


#: kvferry's connector configs of the two cases: zmq, and nixl with UCX over TCP on loopback
CONNECTORS = {"zmq": {"type": "zmq"}, "nixl": NIXL_LOOPBACK}


@pytest.fixture(scope="module", params=sorted(CONNECTORS, reverse=True))
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    py = vllm_python()
    kind = request.param
    if kind == "nixl":
        nixl_or_skip(py)
    root = tmp_path_factory.mktemp(f"vllm_{kind}")
    model = make_model(py, root / "model", 1)
    extra = {"connector": CONNECTORS[kind], "base_port": free_base_port(), "load_timeout_s": 20}
    timings: dict[str, float] = {}
    d, p = start_together(
        lambda: Instance(
            py, {"model": str(model), "kv_role": "kv_consumer", "extra": extra}, cpu="0", log=root / "decode.log"
        ),
        lambda: Instance(
            py, {"model": str(model), "kv_role": "kv_producer", "extra": extra}, cpu="1", log=root / "prefill.log"
        ),
    )
    timings["startup_decode_s"] = round(d.startup_s, 1)
    timings["startup_prefill_s"] = round(p.startup_s, 1)
    yield d, p, timings, kind
    p.close()
    d.close()
    print("timings:", timings)


def test_decode_tokens_equal_a_single_instance(pair: Any) -> None:
    d, p, timings, kind = pair
    ps = prompts(LENGTHS, seed=11)
    reference = [r["tokens"] for r in d.generate(ps, max_tokens=TOKENS)]
    t = time.monotonic()
    out_p = p.generate(ps, [{"do_remote_decode": True} for _ in ps], max_tokens=1)
    params = [r["kv_transfer_params"] for r in out_p]
    assert {r["kvferry_connector"] for r in params} == {kind}
    out_d = d.generate(ps, params, max_tokens=TOKENS)
    timings["pd_identity_s"] = round(time.monotonic() - t, 1)
    assert [r["tokens"] for r in out_d] == reference
    m = d.metrics()
    assert m["vllm:kvferry_requests_loaded"] == len(ps), d.kv_log()
    assert failures(m) == 0, d.kv_log()  # no load failed (a recompute would hide it)
    page_bytes = sum(-(-n // 32) for n in LENGTHS) * 4 * 2 * 32 * 64 * 2
    assert m["vllm:kvferry_bytes_loaded"] == page_bytes
    pm = p.settled_metrics()
    assert pm["vllm:kvferry_requests_sent"] == len(ps)
    # nixl: the decode read every page straight from the prefill's KV cache (in_place, on by
    # default; only each payload's header went through the pool); zmq gathers into its pool.
    # Every entry was read and freed: the prefill's pool holds nothing.
    assert pm.get("vllm:kvferry_bytes_in_place", 0) == (page_bytes if kind == "nixl" else 0), p.kv_log()
    if kind == "nixl":
        assert pm.get("vllm:kvferry_pool_entries_held", -1) == 0, pm


def test_pages_are_consumed_once(pair: Any) -> None:
    """A second decode of the same params finds nothing (consume once) and, by policy,
    recomputes: still the right tokens, and the miss is counted."""
    d, p, _, _ = pair
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


def test_each_instance_holds_its_kv_cache_on_huge_pages(pair: Any) -> None:
    """kvferry's connector collapsed each instance's 1 GiB host KV cache onto huge pages when
    vLLM registered it (``huge_pages`` defaults to collapse). Where the kernel uses huge pages
    only when asked (``madvise``, as here), nothing else in the instance asks for 512 MB of them."""
    if thp_mode() != "madvise":
        pytest.skip(f"{THP_ENABLED} is {thp_mode()!r}: only 'madvise' tells kvferry's huge pages from the kernel's")
    d, p, _, _ = pair
    for instance, name in ((d, "decode"), (p, "prefill")):
        mb = huge_page_mb(instance.proc.pid)
        assert mb >= 512, f"{name}: {mb:.0f} MB on huge pages (its KV cache: 1 GiB)"


def test_a_prefill_killed_after_loads_from_it_fails_the_next_loads_at_once(pair: Any) -> None:
    """The decode has loaded from this prefill before (its connection to it is up). The
    prefill is SIGKILLed with two requests' KV published: the decode's loads of them fail as
    ``unavailable`` within seconds, not at ``load_timeout_s`` (20 s), and both requests
    recompute to the single instance's tokens. zmq: the connection dropped; what waits for that
    sender ends after the client's 1.5 s grace. nixl: a lookup whose connection drops ends at
    once, and one to the sender it reached before ends once it has been unreachable for the same
    grace (``SENDER_DOWN_GRACE_S``). Last in the module: the prefill is gone after."""
    d, p, timings, kind = pair
    ps = prompts(LENGTHS, seed=13)
    reference = [r["tokens"] for r in d.generate(ps, max_tokens=TOKENS)]
    params = [r["kv_transfer_params"] for r in p.generate(ps, [{"do_remote_decode": True} for _ in ps], max_tokens=1)]
    before = d.metrics()  # one load from this prefill first: the decode's connection to it is up
    assert d.generate(ps[:1], params[:1], max_tokens=TOKENS)[0]["tokens"] == reference[0]
    assert_loaded_without_failures(d, before, 1)
    ps, params, reference = ps[1:], params[1:], reference[1:]
    p.kill()
    before = d.metrics()
    t = time.monotonic()
    out = d.generate(ps, params, max_tokens=TOKENS)
    seconds = time.monotonic() - t
    timings["killed_prefill_loads_s"] = round(seconds, 1)
    assert [r["tokens"] for r in out] == reference
    after = d.metrics()
    failed = {
        k: after.get(f"vllm:kvferry_failures{{{k}}}", 0) - before.get(f"vllm:kvferry_failures{{{k}}}", 0)
        for k in ("unavailable", "timeout")
    }
    assert failed == {"unavailable": 2, "timeout": 0}, (failed, d.kv_log())
    assert seconds < 20, seconds  # the loads did not wait out load_timeout_s
