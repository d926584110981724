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
from collections.abc import Iterator
from typing import Any

import pytest
from conftest import HostWorker, module_net
from mooncake_support import mooncake_missing
from stages import TwoHostStage

from kvferry.app.bench.netns import run_cmd

pytestmark = pytest.mark.timeout(120)

OK_S = 20.0
PROBE_S = 1.5
GEOMETRY = dict(
    from_tp=1,
    to_tp=1,
    kv_heads=4,
    head_dim=32,
    layers=2,
    min_tokens=64,
    max_tokens=64,
    timeout_s=OK_S,
    pool_bytes=8 << 20,
)


@pytest.fixture(scope="module")
def lan() -> Iterator[Any]:
    with module_net("x") as net:
        a, b, c = net.host("a"), net.host("b"), net.host("c")
        net.wire(a, b)
        net.segment([a, b, c])
        yield net, a, b, c


def probe(forks: Any, host: Any, tmp: Any, plan: dict[str, Any]) -> dict[str, Any]:
    worker = HostWorker(forks, host, ["probe", json.dumps(plan)], tmp / f"probe-{host.label}.log")
    try:
        return worker.read(sum(g["timeout"] for g in plan.get("gets", [])) + 30.0)
    finally:
        worker.finish()


def test_a_curve_sender_gives_nothing_to_a_host_that_is_not_a_peer(forks: Any, lan: Any, tmp_path: Any) -> None:
    from kvferry.adapters.connectors.zmq.config import generate_curve_config

    net, a, b, c = lan
    keys = generate_curve_config()
    own = generate_curve_config()  # C's own pair: valid CURVE keys the sender never admitted
    server = {
        "server_public": keys["server_public"],
        "server_secret": keys["server_secret"],
        "client_public": keys["client_public"],
    }
    client = {
        "server_public": keys["server_public"],
        "client_public": keys["client_public"],
        "client_secret": keys["client_secret"],
    }
    host = a.addresses["eth-sw"]
    stage = TwoHostStage(
        forks,
        a,
        b,
        tmp_path,
        bind_host=host,
        connector="zmq-tcp",
        sender_options={"connector": {"curve": server}},
        receiver_options={"connector": {"curve": client}},
        **GEOMETRY,
    )
    try:
        port = stage.spec.advertised_port
        stage.send("curve-0")
        meta = {"source_host": host, "source_port": port}
        key = "omni_0_to_1_kv_cache_curve-0"  # TP 1 -> 1: the legacy key format (SPEC 2.2)
        stolen = {"curve": {**client, "client_public": own["client_public"], "client_secret": own["client_secret"]}}
        got = probe(
            forks,
            c,
            tmp_path,
            {
                "gets": [
                    {"name": "plain", "config": {}, "key": key, "metadata": meta, "timeout": PROBE_S},
                    {"name": "own keys", "config": stolen, "key": key, "metadata": meta, "timeout": PROBE_S},
                ],
                "tcp": [[host, port]],
            },
        )
        assert [g["data"] for g in got["gets"]] == [None, None], got
        assert got["tcp"][0]["connected"], got  # the port is open on the segment, but CURVE guards it
        health = stage.senders[0].ask({"op": "health"})["raw"]
        assert health.get("gets_served") == 0 and health.get("puts") == 1, health
        # B, the configured peer, still gets all of it: C's attempts took nothing
        replies = stage.receive("curve-0", OK_S)
        stage.assert_received(replies, "curve-0")
        # control: the same probe with the admitted key pair (a stolen copy of B's) gets data
        stage.send("curve-1")
        got = probe(
            forks,
            c,
            tmp_path,
            {
                "gets": [
                    {
                        "name": "admitted",
                        "config": {"curve": client},
                        "key": "omni_0_to_1_kv_cache_curve-1",
                        "metadata": meta,
                        "timeout": OK_S,
                    }
                ]
            },
        )
        assert got["gets"][0]["data"] is not None and got["gets"][0]["data"]["size"] > 0, got
        stage.close()
    finally:
        stage.kill()


def test_a_sender_bound_to_another_interface_and_the_weak_host_model(forks: Any, lan: Any, tmp_path: Any) -> None:
    net, a, b, c = lan
    wire_addr, lan_addr = a.addresses["to-b"], a.addresses["eth-sw"]
    reach = {"tcp": [[wire_addr, 50151]], "tcp_timeout": PROBE_S}
    stage = TwoHostStage(forks, a, b, tmp_path, bind_host=wire_addr, connector="zmq-tcp", **GEOMETRY)
    try:
        assert not probe(forks, c, tmp_path, reach)["tcp"][0]["connected"]  # no route from the segment
        # anyone on the segment can route A's wire address through A's segment address ...
        run_cmd("ip", "-n", c.name, "route", "replace", f"{wire_addr}/32", "via", lan_addr)
        # ... and Linux delivers it: an address bound on one interface answers on every interface
        assert probe(forks, c, tmp_path, reach)["tcp"][0]["connected"]
        stage.close()
    finally:
        stage.kill()
    # bind_device: the listening socket takes connections through the wire's interface only
    stage = TwoHostStage(
        forks,
        a,
        b,
        tmp_path,
        bind_host=wire_addr,
        connector="zmq-tcp",
        sender_options={"connector": {"bind_device": "to-b"}},
        **GEOMETRY,
    )
    try:
        stage.send("dev-0")
        meta = {"source_host": wire_addr, "source_port": 50151}
        key = "omni_0_to_1_kv_cache_dev-0"
        got = probe(
            forks,
            c,
            tmp_path,
            {
                "gets": [
                    {
                        "name": "c",
                        "config": {},
                        "key": key,
                        "metadata": meta,
                        "timeout": PROBE_S,
                    }
                ],
                **reach,
            },
        )
        assert not got["tcp"][0]["connected"] and got["gets"][0]["data"] is None, got
        stage.assert_received(stage.receive("dev-0", OK_S), "dev-0")  # B, over the wire, gets it all
        stage.close()
    finally:
        stage.kill()
        run_cmd("ip", "-n", c.name, "route", "del", f"{wire_addr}/32", check=False)


def test_what_the_mooncake_engine_exposes(forks: Any, lan: Any, tmp_path: Any) -> None:
    """The control channel binds the address it is given; the engine listens on all interfaces
    by itself, so C (on the segment only) reaches the engine's ports of a sender bound to the
    wire. kvferry cannot change the engine's binds: docs/deploying.md says to firewall them."""
    missing = mooncake_missing()
    if missing is not None:
        pytest.skip(missing)
    net, a, b, c = lan
    wire_addr = a.addresses["to-b"]
    stage = TwoHostStage(
        forks,
        a,
        b,
        tmp_path,
        bind_host=wire_addr,
        connector="mooncake",
        receiver_options={"connector": {"host": b.addresses["to-a"]}},
        **GEOMETRY,
    )
    try:
        stage.send("mc-0")
        stage.assert_received(stage.receive("mc-0", OK_S), "mc-0")
        listening = a.listening()
        control = stage.spec.advertised_port
        assert (wire_addr, control) in listening, listening  # kvferry's own port: the given address
        engine = sorted(port for host, port in listening if host in ("0.0.0.0", "::") and port != control)
        assert engine, listening  # the engine's handshake and data ports: every interface
        got = probe(forks, c, tmp_path, {"tcp": [[a.addresses["eth-sw"], p] for p in engine], "tcp_timeout": PROBE_S})
        assert all(t["connected"] for t in got["tcp"]), got  # reachable from a host that is no peer
        stage.close()
    finally:
        stage.kill()


def test_bind_device_that_does_not_exist_is_a_bind_error(forks: Any, lan: Any, tmp_path: Any) -> None:
    """SO_BINDTODEVICE on a missing interface fails the sender's start, naming host and port;
    the interface that exists binds (control)."""
    net, a, b, c = lan
    said = []
    for device in ("no-such-dev", "to-b"):
        config = {"host": a.addresses["to-b"], "port": 50999, "bind_device": device}
        worker = HostWorker(forks, a, ["bind_check", json.dumps(config)], tmp_path / f"bind-{device}.log")
        try:
            said.append(worker.read())
        finally:
            worker.finish()
    assert "50999" in said[0].get("bind_error", ""), said
    assert said[1] == {"bound": True}, said
