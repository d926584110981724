"""What a host that is not a configured peer can get from kvferry senders.

Topology: hosts A (sender), B (receiver) and C (an intruder) on one switched segment (a bridge
namespace), plus a point-to-point wire A <-> B (a back-end network C is not on).

- A sender bound to A's segment address with CURVE: B (holding the admitted client key) gets
  the request bit-exact; C asking without CURVE, with its own key pair, or with plain TCP gets
  no payload byte and the sender counts no request from it. Control: C with the admitted key
  (a stolen copy) does get the next request, so the probe can see data when it is allowed to.
- A sender bound to A's wire address: C cannot reach it without a route; with a route through
  A's segment address (anyone on the segment can add one) Linux's weak host model delivers C's
  connection anyway; ``bind_device`` (SO_BINDTODEVICE on the listening socket) closes that.
- The mooncake engine: its control channel binds A's address, but the engine itself listens
  on every interface (it chooses so by itself); C reaches those ports on A's segment address.
"""

from __future__ import annotations

import json
from typing import Any, Iterator

import pytest
from conftest import HostWorker, module_net
from stages import TwoHostStage

pytestmark = pytest.mark.timeout(120)

OK_S = 20.0
PROBE_S = 1.5
GEOMETRY = dict(from_tp=1, to_tp=1, kv_heads=4, head_dim=32, layers=2, min_tokens=64, max_tokens=64,
                timeout_s=OK_S, pool_bytes=8 << 20)


@pytest.fixture(scope="module")
def lan() -> Iterator[Any]:
    with module_net("x") as net:
        a, b, c = net.host("a"), net.host("b"), net.host("c")
        net.wire(a, b)
        net.segment([a, b, c])
        yield net, a, b, c


def probe(zygote: Any, host: Any, tmp: Any, plan: dict[str, Any]) -> dict[str, Any]:
    worker = HostWorker(zygote, host, ["probe", json.dumps(plan)], tmp / f"probe-{host.label}.log")
    try:
        return worker.read(sum(g["timeout"] for g in plan.get("gets", [])) + 30.0)
    finally:
        worker.finish()


def test_a_curve_sender_gives_nothing_to_a_host_that_is_not_a_peer(zygote: Any, lan: Any, tmp_path: Any) -> None:
    from kvferry.adapters.connectors.zmq_config import generate_curve_config

    net, a, b, c = lan
    keys = generate_curve_config()
    own = generate_curve_config()  # C's own pair: valid CURVE keys the sender never admitted
    server = {"server_public": keys["server_public"], "server_secret": keys["server_secret"],
              "client_public": keys["client_public"]}
    client = {"server_public": keys["server_public"], "client_public": keys["client_public"],
              "client_secret": keys["client_secret"]}
    host = a.addresses["eth-sw"]
    stage = TwoHostStage(zygote, a, b, tmp_path, bind_host=host, connector="zmq-tcp",
                         sender_options={"connector": {"curve": server}},
                         receiver_options={"connector": {"curve": client}}, **GEOMETRY)
    try:
        port = stage.spec.advertised_port
        stage.send("curve-0")
        meta = {"source_host": host, "source_port": port}
        key = "omni_0_to_1_kv_cache_curve-0"  # TP 1 -> 1: the legacy key format (SPEC 2.2)
        stolen = {"curve": {**client, "client_public": own["client_public"], "client_secret": own["client_secret"]}}
        got = probe(zygote, c, tmp_path, {
            "gets": [{"name": "plain", "config": {}, "key": key, "metadata": meta, "timeout": PROBE_S},
                     {"name": "own keys", "config": stolen, "key": key, "metadata": meta, "timeout": PROBE_S}],
            "tcp": [[host, port]]})
        print("PROBE", got)
        assert [g["data"] for g in got["gets"]] == [None, None], got
        assert got["tcp"][0]["connected"], got  # the port is open on the segment, but CURVE guards it
        health = stage.senders[0].ask({"op": "health"})["raw"]
        assert health.get("gets_served") == 0 and health.get("puts") == 1, health
        # B, the configured peer, still gets all of it: C's attempts took nothing
        replies = stage.receive("curve-0", OK_S)
        stage.assert_received(replies, "curve-0")
        # control: the same probe with the admitted key pair (a stolen copy of B's) gets data
        stage.send("curve-1")
        got = probe(zygote, c, tmp_path, {"gets": [{"name": "admitted", "config": {"curve": client},
                                                    "key": "omni_0_to_1_kv_cache_curve-1", "metadata": meta,
                                                    "timeout": OK_S}]})
        print("PROBE2", got)
        assert got["gets"][0]["data"] is not None and got["gets"][0]["data"]["size"] > 0, got
        stage.close()
    finally:
        stage.kill()
