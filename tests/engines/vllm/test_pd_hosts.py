"""A prefill instance on one host, a decode instance on another: hosts made of network
namespaces (``kvferry.app.bench.netns``) joined by a veth wire, kvferry's zmq connector over it.

Host ``a`` (10.99.1.1) runs the prefill instance, its connector bound to that address (the
extra config's ``host``; never a wildcard); host ``b`` (10.99.1.2) runs the decode instance,
which binds nothing and learns the prefill's address from each request's params. The decode
instance runs with ``kv_load_failure_policy="fail"``, so a load that got nothing ends the
request with ``finish_reason == "error"`` instead of recomputing it quietly.

The reference is the decode instance computing each prompt itself; the pages the decode
instance loaded are compared hash by hash with the prefill's; the control cuts the wire
before the decode's load: the request fails by its deadline, and after the wire is restored
the next request is bit-exact again. Root only (network namespaces): skipped with the reason
elsewhere, failed instead when ``CI`` is set and we are root (as ``tests/hosts``).
"""

from __future__ import annotations

import hashlib
import os
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest
from harness import Instance, failures, make_model, prompts, start_together, vllm_python

from kvferry.adapters.connectors.zmq.client import HEARTBEAT_TIMEOUT_S
from kvferry.app.bench.netns import Host, Net, unavailable_reason

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]

LENGTHS = [33, 96, 200]
TOKENS = 12
LOAD_TIMEOUT_S = 8
PAGE = 4 * 2 * 32 * 64 * 2  # bytes of one block of all layers: 4 layers x 2 heads x 32 x (K+V) 64 x bf16
LOADED = "vllm:kvferry_requests_loaded"


def require_namespaces() -> None:
    reason = unavailable_reason()
    if reason is None:
        return
    if os.environ.get("CI") and os.geteuid() == 0:
        pytest.fail(f"CI runs as root, so the multi-host vLLM test must run: {reason}")
    pytest.skip(reason)


def free_base_port_in(host: Host) -> int:
    """A base port whose rank-0 prefill port (base + 100) is free on ``host``'s address, asked
    of the OS inside the host."""
    code = (
        "import socket, sys\n"
        "for _ in range(50):\n"
        "    s = socket.socket(); s.bind((sys.argv[1], 0)); p = s.getsockname()[1]; s.close()\n"
        "    if p - 100 >= 1024: print(p - 100); break\n"
    )
    done = host.run([sys.executable, "-c", code, host.address])
    assert done.returncode == 0 and done.stdout.strip(), done.stderr
    return int(done.stdout)


@pytest.fixture(scope="module")
def net() -> Iterator[Any]:
    py = vllm_python()
    require_namespaces()
    made = Net("vllm")
    try:
        a, b = made.host("a"), made.host("b")
        wire = made.wire(a, b)
        yield py, made, a, b, wire
    finally:
        made.close()  # kills whatever is still inside; NetError names what could not be removed
    assert made.leftovers() == {}, made.leftovers()


@pytest.fixture(scope="module")
def pair(net: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    py, _, a, b, wire = net
    root = tmp_path_factory.mktemp("vllm_hosts")
    model = make_model(py, root / "model", 1)
    base = free_base_port_in(a)
    connector = {"type": "zmq"}
    p_extra = {"connector": connector, "base_port": base, "host": a.address, "load_timeout_s": LOAD_TIMEOUT_S}
    d_extra = {"connector": connector, "base_port": base, "load_timeout_s": LOAD_TIMEOUT_S}
    timings: dict[str, float] = {}
    started: list[Instance] = []
    try:
        d, p = start_together(
            lambda: Instance(
                py,
                {"model": str(model), "kv_role": "kv_consumer", "extra": d_extra, "policy": "fail"},
                cpu="0",
                log=root / "decode.log",
                wrap=b.argv([]),
            ),
            lambda: Instance(
                py,
                {"model": str(model), "kv_role": "kv_producer", "extra": p_extra},
                cpu="1",
                log=root / "prefill.log",
                wrap=a.argv([]),
            ),
        )
        started += [d, p]
        timings.update(startup_decode_s=round(d.startup_s, 1), startup_prefill_s=round(p.startup_s, 1))
        yield {"d": d, "p": p, "a": a, "b": b, "wire": wire, "base": base, "timings": timings}
    finally:
        wire.restore()  # a failed test may have left it cut: the instances exit over nothing, but be tidy
        for inst in reversed(started):
            inst.close()
        for inst in started:
            assert inst.proc.poll() is not None, f"instance {inst.proc.pid} still running"
        print("timings:", timings)


def _pages(inst: Instance, blocks: int, transfer_id: str | None = None) -> list[list[str]]:
    msg: dict[str, Any] = {"op": "pages", "blocks": blocks}
    if transfer_id is not None:
        msg["transfer_id"] = transfer_id
    inst.send(msg)
    [rank] = inst.reply(120)["ranks"]
    return rank["hashes"]


def _hand_off(pair: dict, prompt: list[int]) -> tuple[dict, dict]:
    """Prefill ``prompt`` on host a, decode it on host b: (the prefill's params, the decode's result)."""
    [out_p] = pair["p"].generate([prompt], [{"do_remote_decode": True}], max_tokens=1)
    params = out_p["kv_transfer_params"]
    [out_d] = pair["d"].generate([prompt], [params], max_tokens=TOKENS)
    return params, out_d


def test_prefill_binds_its_host_address_only(pair: dict) -> None:
    """The prefill's kvferry port listens on a's address, not on a wildcard; b listens on none."""
    port = pair["base"] + 100
    on_a = pair["a"].listening()
    assert (pair["a"].address, port) in on_a, on_a
    assert not {("0.0.0.0", port), ("::", port)} & on_a, on_a
    assert not [s for s in pair["b"].listening() if s[1] == port]


def test_decode_on_another_host_equals_a_single_instance(pair: dict) -> None:
    d, p = pair["d"], pair["p"]
    ps = prompts(LENGTHS, seed=11)
    reference = [r["tokens"] for r in d.generate(ps, max_tokens=TOKENS)]
    before = d.metrics()
    t = time.monotonic()
    for prompt, ref in zip(ps, reference):
        params, out_d = _hand_off(pair, prompt)
        assert params["kvferry_connector"] == "zmq" and params["remote_host"] == pair["a"].address, params
        assert out_d["finish_reason"] == "length" and out_d["tokens"] == ref, d.kv_log()
        # the pages b loaded are a's, bit for bit (the full blocks: b recomputes the last token)
        full = (len(prompt) - 1) // 32
        loaded = _pages(d, full)
        sent = _pages(p, full, params["transfer_id"])
        zero = hashlib.sha256(bytes(full * 2 * 32 * 64 * 2)).hexdigest()
        assert all(zero not in row for row in sent)
        assert loaded == sent
    pair["timings"]["pd_across_hosts_s"] = round(time.monotonic() - t, 1)
    after = d.metrics()
    assert after[LOADED] - before.get(LOADED, 0) == len(ps), d.kv_log()
    assert failures(after) == failures(before), d.kv_log()
    assert after["vllm:kvferry_bytes_loaded"] - before.get("vllm:kvferry_bytes_loaded", 0) == (
        sum(-(-n // 32) for n in LENGTHS) * PAGE
    )
    assert p.settled_metrics()["vllm:kvferry_requests_sent"] >= len(ps)


def test_wire_cut_before_the_load_fails_the_request_then_heals(pair: dict) -> None:
    """Control: with the wire cut after the prefill, the decode gets nothing and (policy
    "fail") ends the request with an error by its deadline: at it, or sooner when zmq's
    heartbeat declares the silent connection dead (the load's request went out on it, so its
    reply cannot come); restored, the next hand-off is bit-exact again."""
    d, p, wire = pair["d"], pair["p"], pair["wire"]
    ps = prompts([96, 64], seed=13)
    reference = [r["tokens"] for r in d.generate(ps, max_tokens=TOKENS)]
    [out_p] = p.generate(ps[:1], [{"do_remote_decode": True}], max_tokens=1)
    before = d.metrics()
    wire.cut()
    try:
        t = time.monotonic()
        [out_d] = d.generate(ps[:1], [out_p["kv_transfer_params"]], max_tokens=TOKENS, timeout_s=120)
        waited = time.monotonic() - t
    finally:
        wire.restore()
    pair["timings"]["cut_load_s"] = round(waited, 1)
    assert out_d["finish_reason"] == "error" and len(out_d["tokens"]) < TOKENS, out_d
    assert min(LOAD_TIMEOUT_S, HEARTBEAT_TIMEOUT_S) * 0.9 <= waited <= LOAD_TIMEOUT_S * 4 + 30, waited
    cut = d.metrics()
    assert cut.get(LOADED, 0) == before.get(LOADED, 0), d.kv_log()
    assert failures(cut) == failures(before) + 1, d.kv_log()
    # healed: the next request crosses the wire again, bit-exact
    params, out_d = _hand_off(pair, ps[1])
    assert out_d["finish_reason"] == "length" and out_d["tokens"] == reference[1], d.kv_log()
    healed = d.metrics()
    assert healed[LOADED] == cut.get(LOADED, 0) + 1, d.kv_log()
    assert failures(healed) == failures(cut), d.kv_log()
