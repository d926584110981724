"""Killed processes (SIGKILL: no cleanup runs): the survivor answers by its deadline, releases
everything, serves the next request, and nothing is left in /dev/shm (SPEC 9.1, 9.8, 9.10).

- a sender process killed before its put (the receiver is parked on the key), in the middle of
  a put (pool space reserved, half written, never committed) and after its put (the payload
  dies with it): each time the receiver gets SENDER_GONE long before its deadline (shm: the
  sender's process is seen dead; zmq: the connection drops, at once for a request in flight and
  after the client's grace for one asked while the sender is down), a sender restarted on the
  same port serves the next request bit-exact;
- a receiver process killed while holding an shm pool buffer: the sender's ``put`` reports
  ``pool_full`` promptly while the dead reader pins the space, the hold expires, the space
  comes back and the next request goes through.
"""

from __future__ import annotations

import random
import threading
import time
from typing import Any

import pytest
from fault_kit import WAIT_S, LineProc, eventually, free_base_port
from stage_kit import Geometry, expected_layers, omni_config, received_exactly, request_blocks, sender_cache

from kvferry.app.wiring import build_manager
from kvferry.core.ids import legacy_key
from kvferry.core.outcomes import ReceiveKind, SendKind, SendReason
from kvferry.core.policy import RetryPolicy

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

GEOM = Geometry()
#: The receive deadline of a request whose sender dies: it must end long before (within SLACK_S).
GONE_S = 30.0
SLACK_S = 8.0  # a loaded 2-core machine; far below what a hang would take


def _connector(kind: str, shm_space: Any, **extra: Any) -> dict[str, Any]:
    if kind == "shm":
        return {"type": "shm", "namespace": shm_space.namespace, "runtime_dir": shm_space.base, **extra}
    return {"type": "zmq", **extra}


class Senders:
    """Pre-spawned sender workers (torch imports overlap), opened one at a time on one port."""

    def __init__(self, count: int, tmp_path: Any, connector: dict[str, Any], base: int) -> None:
        self.workers = [LineProc(["fault_worker.py"], tmp_path, f"sender{i}") for i in range(count)]
        self.omni = omni_config("sender", connector, base_port=base)
        self.next = 0
        self.rng = random.Random(11)
        self.cache = sender_cache(GEOM, 1, 0, 1)
        self.requests: dict[str, tuple[list[int], int]] = {}

    def start(self) -> LineProc:
        worker = self.workers[self.next]
        self.next += 1
        assert worker.read(120.0)["spawned"]
        assert worker.ask({"op": "open", "role": "sender", "omni": self.omni, "seed": 1})["ready"] == "sender"
        return worker

    def send(self, worker: LineProc, rid: str) -> None:
        seq_len = self.rng.randrange(8, 40)
        blocks = request_blocks(GEOM, self.rng, seq_len)
        self.requests[rid] = (blocks, seq_len)
        reply = worker.ask({"op": "send", "rid": rid, "block_ids": blocks, "seq_len": seq_len})
        assert reply["ok"], reply

    def exact(self, result: Any, rid: str) -> bool:
        blocks, seq_len = self.requests[rid]
        return result.ok and received_exactly(
            result.payload, expected_layers(GEOM, {0: self.cache}, blocks, seq_len, 1, 1, 0)
        )

    def close(self) -> None:
        for worker in self.workers:
            worker.kill()
            worker.close()


def _parked(worker: LineProc, kind: str) -> int:
    health = worker.ask({"op": "health"})["health"]["sender"]
    return health["sender"]["parked"] if kind == "zmq" else health["parked"]


@pytest.mark.parametrize("kind", ["zmq", "shm"])
def test_sender_killed_before_during_and_after_a_put(kind: str, shm_space: Any, tmp_path: Any) -> None:
    base = free_base_port()
    connector = _connector(kind, shm_space)
    senders = Senders(4, tmp_path, connector, base)
    receiver = build_manager(omni_config("receiver", connector, recv_timeout=GONE_S, base_port=base), env={})
    info = {"host": "127.0.0.1", "zmq_port": base + 100}

    def receive(rid: str) -> tuple[Any, float]:
        started = time.monotonic()
        result = receiver.receive(rid, sender_info=info)
        return result, time.monotonic() - started

    def assert_missed(result: Any, elapsed: float, rid: str) -> None:
        # shm: the receiver sees the sender's process dead and nothing on its socket; zmq: the
        # connection to it dropped. Either way it ends long before the deadline, as an error
        assert result.outcome.kind is ReceiveKind.SENDER_GONE, result.outcome
        assert result.outcome.missing_keys == (legacy_key(0, 1, rid),)
        assert result.payload is None and elapsed < SLACK_S, f"{rid}: {elapsed:.2f} s, deadline {GONE_S} s"

    def next_request_works(worker: LineProc, rid: str) -> None:
        senders.send(worker, rid)
        result, _ = receive(rid)
        assert senders.exact(result, rid), result.outcome

    try:
        # 1. killed before its put, while the receiver is parked on the key
        sender = senders.start()
        box: dict[str, Any] = {}
        waiter = threading.Thread(target=lambda: box.update(got=receive("r-before")), daemon=True)
        waiter.start()
        eventually(lambda: _parked(sender, kind) >= 1, what="the receiver parked at the sender")
        sender.kill()
        waiter.join(GONE_S + SLACK_S)
        assert not waiter.is_alive(), "the receive outlived its deadline"
        assert_missed(*box["got"], "r-before")
        sender = senders.start()
        next_request_works(sender, "r-1")
        # 2. killed in the middle of a put: space reserved, half written, never published
        assert sender.ask({"op": "hang_mid_put", "key": legacy_key(0, 1, "r-during"), "nbytes": 4096})["mid_put"]
        sender.kill()
        assert_missed(*receive("r-during"), "r-during")
        sender = senders.start()
        next_request_works(sender, "r-2")
        # 3. killed after its put: the payload dies with the process
        senders.send(sender, "r-after")
        sender.kill()
        assert_missed(*receive("r-after"), "r-after")
        sender = senders.start()
        next_request_works(sender, "r-3")
        counters = receiver.counters.snapshot()
        assert counters["recv.received"] == 3
        # a sender gone is an error, not a timeout
        assert counters["recv.sender_gone"] == 3 == counters["errors"] and counters.get("timeouts", 0) == 0
        if kind == "zmq":
            health = receiver.health()["receiver"]["receiver"]
            assert health["in_flight"] == 0
            # the parked get was in flight when its connection dropped; the two asked after a
            # kill were either sent before the drop was seen or waited the grace
            assert health["lost_in_flight"] >= 1 and health["lost_in_flight"] + health["failed_sender_down"] == 3
        sender.close()
    finally:
        receiver.close()
        senders.close()


def test_receiver_killed_while_holding_shm_pool_buffers(shm_space: Any, tmp_path: Any) -> None:
    base = free_base_port()
    request_tokens = 64
    pool = request_tokens * GEOM.token_bytes * 3 // 2  # room for one request at a time
    connector = _connector("shm", shm_space, pool_bytes=pool, hold_s=1.0)
    reader = LineProc(["fault_worker.py"], tmp_path, "reader")
    sender = build_manager(
        omni_config("sender", connector, base_port=base), env={}, retry=RetryPolicy(attempts=2, first_backoff_s=0.05)
    )
    rng = random.Random(2)
    cache = sender_cache(GEOM, 1, 0, 1)
    sent: dict[str, tuple[list[int], int]] = {}

    def send(rid: str) -> Any:
        sent[rid] = (request_blocks(GEOM, rng, request_tokens), request_tokens)
        finished = {rid: {"block_ids": sent[rid][0], "seq_len": request_tokens}}
        return sender.send_requests(finished, cache, GEOM.block_size, GEOM.dtype)[0]

    receiver = None
    try:
        assert send("held").kind is SendKind.SENT
        assert reader.read(120.0)["spawned"]
        omni = omni_config("receiver", connector, base_port=base)
        assert reader.ask({"op": "open", "role": "receiver", "omni": omni})["ready"] == "receiver"
        reply = reader.ask({"op": "hold", "key": legacy_key(0, 1, "held"), "port": base + 100, "timeout_s": WAIT_S})
        assert reply["holding"] and reply["holding"] > 0
        reader.kill()  # dies holding its ticket: nobody will ever release it
        started = time.monotonic()
        blocked = send("next")  # the dead reader pins the pool: typed, prompt
        assert blocked.kind is SendKind.FAILED and blocked.reason is SendReason.POOL_FULL, blocked
        assert time.monotonic() - started <= 1.0 + SLACK_S
        health = eventually(
            lambda: (h := sender.health()["sender"]).get("expired_unreleased", 0) >= 1 and h,
            what="the dead reader's hold expired",
        )
        assert send("next").kind is SendKind.SENT  # the space came back
        receiver = build_manager(omni_config("receiver", connector, base_port=base), env={})
        result = receiver.receive("next", sender_info={"host": "127.0.0.1", "zmq_port": base + 100})
        blocks, seq_len = sent["next"]
        assert result.ok and received_exactly(
            result.payload, expected_layers(GEOM, {0: cache}, blocks, seq_len, 1, 1, 0)
        )
        assert health["ok"] and health["control_thread"]
    finally:
        if receiver is not None:
            receiver.close()
        sender.close()
        reader.kill()
        reader.close()
