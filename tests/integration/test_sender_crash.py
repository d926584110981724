"""A sender rank killed mid-request (SPEC 9.1, 9.8, 9.10).

A sending stage of 2 processes (``stage_worker.py sender``) feeds one receiver (this process,
TP 2 -> 1: every request needs a key from each sender rank). Sender rank 1 is SIGKILLed at two
points of a request: after it put its key (the payload dies with it), and while the receiver is
parked on it waiting for a key it never put. Each time the receiver returns SENDER_GONE naming
rank 1's key, far before its deadline: over shm the receiver sees the sender's process dead and
nothing on its socket; over zmq and mooncake the connection to it drops (a request in flight
ends at once, one asked while the sender is down after the grace, ``SENDER_DOWN_GRACE_S``). A sender
restarted on the same port serves the next request bit-exact, and nothing is left in /dev/shm
once everything is closed.
"""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import pytest
from mooncake_support import mooncake_missing
from stage_worker import expected_digest, kv_digest, make_spec, sender_caches, spec_to_json

from kvferry.app.wiring import build_manager
from kvferry.core.outcomes import ReceiveKind

#: The deadline of a request whose sender rank dies, which it must end far before (within SLACK_S)
GONE_S = 30.0
#: Slack over a deadline for a loaded machine; far below the 30 s a hang would take.
SLACK_S = 10.0


# zmq-ipc: same connector as tcp; its stale socket file is covered by test_zmq_processes.py.
# mooncake: the receive side nixl shares too (nixl's own process tests run in the vLLM venv).
CONNECTORS = [
    "zmq-tcp",
    "shm",
    pytest.param("mooncake", marks=pytest.mark.skipif(mooncake_missing() is not None, reason=str(mooncake_missing()))),
]


class Stage:
    """Two sender processes and a receiving manager in this process."""

    def __init__(self, workers: Any, spec: Any) -> None:
        self.workers, self.spec = workers, spec
        self.caches = sender_caches(spec)
        self.senders = [self.start(0), self.start(1)]
        self.receiver = build_manager(spec.omni_kv_config("receiver"), tp_rank=0, tp_size=1)
        self.info = {"host": "127.0.0.1", "zmq_port": spec.advertised_port}

    def start(self, rank: int) -> Any:
        worker = self.workers("sender", rank, json.dumps(spec_to_json(self.spec)))
        ready = worker.read()
        assert ready["ready"] == rank and ready["port"] == self.spec.advertised_port + 16 * rank, ready
        return worker

    def send(self, rid: str, ranks: tuple[int, ...] = (0, 1)) -> None:
        for rank in ranks:
            reply = self.senders[rank].ask({"op": "send", "rid": rid})
            assert reply["sent"] == rid and reply["ok"], reply

    def receive(self, rid: str, timeout_s: float | None = None) -> tuple[Any, float]:
        start = time.monotonic()
        result = self.receiver.receive(rid, sender_info=self.info, timeout_s=timeout_s)
        return result, time.monotonic() - start

    def assert_received(self, rid: str) -> None:
        result, _ = self.receive(rid)
        assert result.outcome.kind is ReceiveKind.RECEIVED, result.outcome
        blocks = result.payload["layer_blocks"]
        got = kv_digest(blocks["key_cache"], blocks["value_cache"])
        assert got == expected_digest(self.spec, self.caches, rid, (0, self.spec.kv_heads)), f"{rid} differs"

    @property
    def lost_s(self) -> float:
        """The deadline of a receive whose sender rank dies."""
        return GONE_S

    def assert_lost(self, result: Any, seconds: float, rid: str) -> None:
        outcome = result.outcome
        assert outcome.missing_keys == (f"{rid}_0_0_1_0",), outcome  # rank 1's key, not rank 0's
        assert result.payload is None
        word = "gone" if self.spec.connector == "shm" else "dropped"
        assert outcome.kind is ReceiveKind.SENDER_GONE and word in outcome.detail, outcome
        assert seconds < SLACK_S, f"returned after {seconds:.2f} s, deadline {GONE_S} s"

    def kill(self, rank: int) -> int:
        pid = self.senders[rank].pid
        self.senders[rank].sigkill()
        return pid


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("connector", CONNECTORS)
def test_sender_killed_mid_request_then_restarted(connector: str, workers: Any, itkit: Any, shm_namespace: str) -> None:
    spec = make_spec(
        connector=connector,
        from_tp=2,
        to_tp=1,
        base_port=itkit.free_base_port(2),
        namespace=shm_namespace,
        timeout_s=60.0,
    )
    stage = Stage(workers, spec)
    try:
        stage.send("crash-a")
        stage.assert_received("crash-a")

        # 1. rank 1 put its key, then dies before the receiver pulls it
        stage.send("crash-b")
        dead = stage.kill(1)
        result, seconds = stage.receive("crash-b", stage.lost_s)
        stage.assert_lost(result, seconds, "crash-b")
        stage.senders[1] = stage.start(1)  # same rank, same port
        # the dead owner's segment is gone by then: its resource tracker unlinked it, or the
        # restart reaped it (test_shm_processes.py shows each way on its own)
        assert [n for n in itkit.shm_entries(shm_namespace) if f"-{dead}-" in n] == []
        stage.send("crash-c")
        stage.assert_received("crash-c")

        # 2. the receiver is parked on rank 1 (rank 0's key already taken) when rank 1 dies
        stage.send("crash-d", ranks=(0,))
        box: dict[str, Any] = {}
        waiter = threading.Thread(target=lambda: box.update(r=stage.receive("crash-d", stage.lost_s)), daemon=True)
        waiter.start()
        parked = stage.senders[1].ask({"op": "wait_parked", "n": 1})
        assert parked["reached"], parked
        dead = stage.kill(1)
        waiter.join(stage.lost_s + SLACK_S + 30)
        assert not waiter.is_alive(), "the receiver hung after its sender died"
        stage.assert_lost(*box["r"], "crash-d")
        stage.senders[1] = stage.start(1)
        assert [n for n in itkit.shm_entries(shm_namespace) if f"-{dead}-" in n] == []
        stage.send("crash-e")
        stage.assert_received("crash-e")

        counts = stage.receiver.counters.snapshot()
        assert counts.get("recv.received") == 3, counts
        # a sender gone is an error, not a timeout
        assert counts.get("recv.sender_gone") == 2 == counts.get("errors"), counts
        assert counts.get("timeouts", 0) == 0, counts
        for worker in stage.senders:
            assert worker.finish() == 0, worker.log_tail()
    finally:
        stage.receiver.close()
    assert itkit.shm_entries(shm_namespace) == []
