"""Sender and receiver stages on different hosts, and the network between them failing.

Host A (a network namespace) runs the sending stage: 2 TP ranks, each a process whose
manager was built by ``build_manager`` from the stage's ``omni_kv_config`` and bound to A's
address on the wire (never a wildcard). Host B runs the receiving stage: 4 TP ranks in one
gloo world, each receiving through ``receive_multi_kv_cache_distributed`` (receive, then the
TP consensus) on requests that carry the sender info (SPEC 2.5). 2 -> 4 is a fan-out: sender
rank r slices its heads for receivers 2r and 2r+1. Every received tensor is compared, digest
for digest, with the test process's own copy of the senders' caches.

The wire is then cut (``ip link set DEV down`` on both ends: no RST, no FIN, as a pulled
cable) before, during and after transfers, and host A's processes are SIGKILLed mid-transfer.
Every rank must end each request in a typed outcome by its deadline (plus slack), all ranks
alike (no desync), with pool memory given back; with the wire restored (or the senders
restarted) the next request is bit-exact.

One topology and one pair of stages per connector (module fixtures), so the tests cost a few
seconds each after the stages start. The connectors: zmq over TCP, mooncake (its transfer
engine over TCP) and nixl (UCX over TCP on the veth, each host naming its own device); the
last two skip, saying why, where their packages are missing (.ci/run runs nixl's in the vLLM
venv, which has it).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from conftest import module_net
from mooncake_support import mooncake_missing
from nixl_support import nixl_missing
from stages import SLACK_S, TwoHostStage

pytestmark = pytest.mark.timeout(120)

#: Deadline of a receive that must succeed (seconds); of one that must fail.
OK_S = 20.0
MISS_S = 2.0
#: Geometry: 8 KV heads of 64, 2 layers, 512 tokens: 256 KiB per receiver rank and request.
GEOMETRY = dict(
    from_tp=2,
    to_tp=4,
    kv_heads=8,
    head_dim=64,
    layers=2,
    min_tokens=512,
    max_tokens=512,
    timeout_s=OK_S,
    pool_bytes=32 << 20,
)


@pytest.fixture(scope="module")
def hosts() -> Iterator[Any]:
    with module_net("t") as net:
        a, b = net.host("a"), net.host("b")
        wire = net.wire(a, b)
        yield net, a, b, wire


#: nixl: one READ's deadline in these tests, below the receive deadline of a request that must
#: fail (MISS_S), so that a read the cut wire stalls ends typed within the slack.
NIXL_TRANSFER_S = 1.0
#: nixl: a receiver rank makes its connector (its NIXL agent) at its first receive of each
#: deadline. UCX cannot start an agent while the only device it may use is down (the agent's
#: endpoint to itself goes over it: "Destination is unreachable"), and a connector that failed
#: to start is remembered, not retried (SPEC 7), so the stage receives once with each deadline
#: before any test cuts the wire, as a deployment's first requests do (docs/nixl.md).


#: nixl and mooncake: a payload whose reads the cut wire failed stays readable at its sender
#: until its lease passes (a retry may still read it; its readers' ``Done`` was lost with the
#: wire) and a claim until its hold: both short here, so that ``given_back`` sees them freed
#: within OK_S.
HOLD_S, LEASE_S = 3.0, 8.0


def _nixl_options(device: str) -> dict[str, Any]:
    """A nixl rank's connector keys on a host whose wire is ``device``: UCX over TCP on it."""
    return {
        "ucx_tls": "tcp,self",
        "ucx_net_devices": device,
        "transfer_timeout_s": NIXL_TRANSFER_S,
        "hold_s": HOLD_S,
        "lease_s": LEASE_S,
    }


@pytest.fixture(scope="module", params=["zmq-tcp", "mooncake", "nixl"])
def stage(
    request: pytest.FixtureRequest, forks: Any, hosts: Any, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Any]:
    net, a, b, wire = hosts
    receiver_options: dict[str, Any] = {}
    sender_options: dict[str, Any] = {}
    if request.param == "mooncake":
        missing = mooncake_missing()
        if missing:
            pytest.skip(missing)
        # the receiver's engine announces its own host's address (its own config, not the sender's)
        receiver_options = {"connector": {"host": b.addresses["to-a"]}}
        sender_options = {"connector": {"hold_s": HOLD_S, "lease_s": LEASE_S}}
    if request.param == "nixl":
        missing = nixl_missing()
        if missing:
            pytest.skip(missing)
        sender_options = {"connector": _nixl_options("to-b")}
        receiver_options = {"connector": _nixl_options("to-a")}
    tmp = tmp_path_factory.mktemp(f"stage-{request.param}")
    st = TwoHostStage(
        forks,
        a,
        b,
        tmp,
        bind_host=a.addresses["to-b"],
        connector=request.param,
        sender_options=sender_options,
        receiver_options=receiver_options,
        **GEOMETRY,
    )
    st.wire, st.connector = wire, request.param
    try:
        if request.param == "nixl":
            st.assert_none_received(st.receive("nixl-agents", MISS_S), MISS_S, kinds=("timed_out",))
        yield st
        st.close()
    finally:
        st.kill()


def test_two_sender_ranks_on_a_feed_four_receiver_ranks_on_b(stage: Any) -> None:
    listening = stage.a.listening()
    for ready in stage.ready:  # bound to A's address on the wire, at the SPEC 2.3 port, never a wildcard
        assert (stage.bind_host, ready["port"]) in listening, (ready, listening)
        assert not {("0.0.0.0", ready["port"]), ("::", ready["port"])} & listening, listening
    for rid in ("x-0", "x-1"):
        stage.send(rid)
        replies = stage.receive(rid, OK_S)
        stage.assert_received(replies, rid)
    # control: the digests depend on the data (another request, another rank's heads differ)
    assert stage.expected("x-0", 0) != stage.expected("x-1", 0)
    assert stage.expected("x-0", 0) != stage.expected("x-0", 1)


# ------------------------------------------------------------------------------ partitions
#: A slow wire for the "during" tests: 1 MiB a request takes about 1 s at 8 Mbit/s, so a cut
#: a few milliseconds after the puts lands mid-transfer.
SLOW = "8mbit"


#: A sender's health numbers that are 0 once it holds nothing: zmq's, then mooncake's.
SENDER_HOLDS = (
    "held_payloads",
    "reserved_bytes",
    "in_flight",
    "pool_used_bytes",
    "used_bytes",
    "live_regions",
    "reserved",
    "entries",
)


def given_back(stage: Any, timeout_s: float = OK_S) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Wait until no sender holds, reserves or still sends a payload and no receiver pool has a
    region lent out; AssertionError (with the numbers) past ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    pause = threading.Event()
    while True:
        senders, receivers = stage.sender_health(), stage.receiver_pools()
        busy = [h for h in senders if any(h.get(k) for k in SENDER_HOLDS)]
        lent = [
            p
            for r in receivers
            for p in r.values()
            if p.get("recv_pool_in_use") or p.get("room", 0) < p.get("pool_bytes", 0)
        ]
        if not busy and not lent:
            return senders, receivers
        assert time.monotonic() < deadline, f"not given back: senders {senders}, receivers {receivers}"
        pause.wait(0.05)


#: What a rank ends as when the wire is cut under its get: ``timed_out`` at its deadline, or
#: ``sender_gone`` when its control connection's heartbeat expired with the get out on it (zmq
#: 5 s, mooncake and nixl 3 s): a silent wire and a dead sender look the same from here.
CUT = ("timed_out", "sender_gone")


def test_wire_cut_before_a_transfer(stage: Any) -> None:
    stage.wire.cut()
    try:
        stage.send("before-0")  # a put is local: it succeeds while the wire is down
        replies = stage.receive("before-0", MISS_S)
        stage.assert_none_received(replies, MISS_S, kinds=CUT)
    finally:
        stage.wire.restore()
    stage.assert_received(stage.receive("before-0", OK_S), "before-0")  # the senders kept it
    stage.send("before-1")
    stage.assert_received(stage.receive("before-1", OK_S), "before-1")
    given_back(stage)


def test_wire_cut_after_a_transfer(stage: Any) -> None:
    stage.send("after-0")
    replies = stage.receive("after-0", OK_S)
    stage.wire.cut()
    try:
        stage.assert_received(replies, "after-0")
        given_back(stage)  # nothing of a finished transfer needs the wire to be given back
        stage.send("after-1")
        stage.assert_none_received(stage.receive("after-1", MISS_S), MISS_S, kinds=CUT)
    finally:
        stage.wire.restore()
    stage.assert_received(stage.receive("after-1", OK_S), "after-1")
    given_back(stage)


def assert_no_claim_lost(stage: Any) -> None:
    """mooncake: every claim the senders handed out was finished by a read (none orphaned by a
    reply the receiver dropped: that payload would stay consumed, its retries "not_found")."""
    if stage.connector == "mooncake":
        for sender in stage.senders:
            raw = sender.ask({"op": "health"})["raw"]
            assert raw["claims"] == raw["delivered"] > 0 and raw["read_failed"] == 0, raw


def test_wire_cut_during_a_transfer(stage: Any) -> None:
    stage.wire.shape(SLOW)
    try:
        started = stage.start_receive("during-0", MISS_S)
        for sender in stage.senders:  # each sender rank feeds two receiver ranks
            assert sender.ask({"op": "wait_parked", "n": 2})["reached"]
        for sender in stage.senders:
            sender.send({"op": "send", "rid": "during-0"})
        for sender in stage.senders:
            assert sender.read()["ok"]
        stage.wire.cut()  # the parked receivers are being served: bytes are on the wire
        # every connector's read ends by the deadline (mooncake's and nixl's plus the control
        # grace): no rank waits for the wire
        replies = stage.finish_receive(started, MISS_S)
        stage.assert_none_received(replies, MISS_S)
        assert any(r["outcome"] == "timed_out" for r in replies), replies  # it was cut mid-way
        if stage.connector == "mooncake":  # a read the engine could not end is still polled
            late = [p.get("late_reads", 0) for r in stage.receiver_pools() for p in r.values()]
            assert sum(late) >= 1, late
    finally:
        stage.wire.restore()
        stage.wire.shape(None)
    # the same receiving processes (never restarted): their channels reconnected by themselves;
    # a late read ends once the wire is back and gives its pool space back (given_back)
    stage.send("during-1")
    stage.assert_received(stage.receive("during-1", OK_S), "during-1")
    given_back(stage)


def test_sender_host_killed_mid_transfer(stage: Any) -> None:
    stage.wire.shape(SLOW)
    try:
        started = stage.start_receive("killed-0", MISS_S)
        for sender in stage.senders:
            assert sender.ask({"op": "wait_parked", "n": 2})["reached"]
        for sender in stage.senders:
            sender.send({"op": "send", "rid": "killed-0"})
        for sender in stage.senders:
            assert sender.read()["ok"]
        killed = stage.a.kill_all()  # every process of host A, SIGKILL
        assert sorted(killed) == sorted(w.pid for w in stage.senders), killed
        # bytes the kernel already held for the wire may still arrive: all ranks have the
        # request bit-exact, or none has it, in a typed outcome, by the deadline
        stage.assert_agreed(stage.finish_receive(started, MISS_S), "killed-0", MISS_S)
    finally:
        stage.wire.shape(None)
    for worker in stage.senders:
        assert worker.wait_gone(SLACK_S)
        worker.close_pipes()
    assert stage.a.pids() == []
    stage.start_senders()  # the same ranks, on the same ports
    # the receiving stage is not restarted: its ranks (mooncake: their engines and their
    # control channels, which reconnect to the new senders) read the next request bit-exact
    stage.send("killed-1")
    stage.assert_received(stage.receive("killed-1", OK_S), "killed-1")
    given_back(stage)
    assert_no_claim_lost(stage)
