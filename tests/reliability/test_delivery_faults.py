"""Faults between a sender and a receiver, seen through the manager (SPEC 5, 7, 9.4, 9.5).

Real sockets, one process: silent and slow peers, duplicate / late / reordered / replayed
payloads, a full sender pool and a lease that expires while the receiver's request is still
queued. Every receive ends in one typed outcome by its deadline, no payload ever reaches a
request it does not belong to (the request id inside the payload must match), and the next
request works.
"""

from __future__ import annotations

import random
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import zmq
from fault_kit import WAIT_S, eventually, free_base_port
from stage_kit import Geometry, expected_layers, omni_config, received_exactly, request_blocks, sender_cache

from kvferry.adapters.connectors.memory.connector import MemoryConnector
from kvferry.adapters.connectors.zmq.protocol import Reply, decode_request, encode_reply
from kvferry.adapters.torch_frames import encode_bytes
from kvferry.app.wiring import build_manager
from kvferry.core.ids import legacy_key
from kvferry.core.outcomes import ReceiveKind, SendKind, SendReason
from kvferry.core.policy import RetryPolicy

pytestmark = pytest.mark.timeout(120)

GEOM = Geometry()
#: A "prompt" answer on a loaded 2-core machine (seconds); deadlines below are much longer.
PROMPT_S = 3.0
SLACK_S = 3.0


class Link:
    """A TP 1 -> 1 sender manager and receiver manager over one connector config."""

    def __init__(
        self,
        connector: dict[str, Any],
        *,
        recv_timeout: float = 5.0,
        retry: RetryPolicy | None = None,
        shared: Any = None,
    ) -> None:
        self.base = free_base_port()
        extra = {"retry": retry} if retry is not None else {}
        self.sender = build_manager(
            omni_config("sender", connector, recv_timeout=recv_timeout, base_port=self.base),
            env={},
            connector=shared,
            **extra,
        )
        self.receiver = build_manager(
            omni_config("receiver", connector, recv_timeout=recv_timeout, base_port=self.base), env={}, connector=shared
        )
        self.info = {"host": "127.0.0.1", "zmq_port": self.base + 100}
        self.cache = sender_cache(GEOM, 1, 0, 1)
        self.rng = random.Random(5)
        self.sent: dict[str, tuple[list[int], int]] = {}

    def send(self, rid: str, seq_len: int = 24) -> Any:
        blocks = self.sent.get(rid, (request_blocks(GEOM, self.rng, seq_len), seq_len))
        self.sent[rid] = blocks
        finished = {rid: {"block_ids": blocks[0], "seq_len": blocks[1]}}
        return self.sender.send_requests(finished, self.cache, GEOM.block_size, GEOM.dtype)[0]

    def receive(self, rid: str, timeout_s: float | None = None) -> tuple[Any, float]:
        started = time.monotonic()
        result = self.receiver.receive(rid, sender_info=self.info, timeout_s=timeout_s)
        return result, time.monotonic() - started

    def exact(self, result: Any, rid: str) -> bool:
        blocks, seq_len = self.sent[rid]
        return result.ok and received_exactly(
            result.payload, expected_layers(GEOM, {0: self.cache}, blocks, seq_len, 1, 1, 0)
        )

    def close(self) -> None:
        self.receiver.close()
        self.sender.close()


@pytest.fixture
def links() -> Iterator[list[Link]]:
    made: list[Link] = []
    yield made
    for link in made:
        link.close()


def _connector(kind: str, shm_space: Any, **extra: Any) -> tuple[dict[str, Any], Any]:
    if kind == "zmq":
        return {"type": "zmq", **extra}, None
    if kind == "shm":
        return {"type": "shm", "namespace": shm_space.namespace, "runtime_dir": shm_space.base, **extra}, None
    shared = MemoryConnector.from_config(extra)
    return {"type": "memory", **extra}, shared


# ------------------------------------------------------------------------------ fake peers
class FakeRouter:
    """A zmq peer on loopback that reads requests and answers them as its ``answer`` says."""

    def __init__(self, answer: Any) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.linger = 0
        self.port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.answer = answer
        self.requests: list[Any] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        pending: list[tuple[float, bytes, Any]] = []
        while not self.stop.is_set():
            if self.sock.poll(10):
                identity, body = self.sock.recv_multipart()
                request = decode_request(body)
                self.requests.append(request)
                delay, frames = self.answer(request)
                if frames is not None:
                    pending.append((time.monotonic() + delay, identity, frames))
            now = time.monotonic()
            for item in [p for p in pending if p[0] <= now]:
                pending.remove(item)
                self.sock.send_multipart([item[1], *item[2]])
        self.sock.close(0)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(WAIT_S)
        self.ctx.term()


def _payload_for(rid: str, fill: float) -> bytes:
    import torch

    layer = torch.full((4, 2, 2), fill, dtype=torch.float16)
    return encode_bytes(rid, [layer], [layer], [0], {"seq_len": 4})


def _data_reply(request: Any, payload: bytes) -> list[bytes]:
    return [encode_reply(Reply("data", request.corr_id, request.key, sizes=(len(payload),))), payload]


def _receiver_only(port: int, timeout_s: float) -> Any:
    cfg = omni_config("receiver", {"type": "zmq"}, recv_timeout=timeout_s)
    return build_manager(cfg, env={}), {"host": "127.0.0.1", "zmq_port": port}


@pytest.mark.parametrize("kind", ["zmq_peer_never_answers", "tcp_peer_never_speaks"])
def test_a_peer_that_accepts_and_never_answers_times_out_by_the_deadline(kind: str, links: list) -> None:
    silent = FakeRouter(lambda request: (0.0, None)) if kind.startswith("zmq") else None
    mute = None
    if silent is None:
        mute = socket.socket()
        mute.bind(("127.0.0.1", 0))
        mute.listen()
    port = silent.port if silent else mute.getsockname()[1]
    receiver, info = _receiver_only(port, 1.0)
    try:
        started = time.monotonic()
        result = receiver.receive("r-silent", sender_info=info)
        elapsed = time.monotonic() - started
        assert result.outcome.kind is ReceiveKind.TIMED_OUT, result.outcome
        assert 0.9 <= elapsed <= 1.0 + SLACK_S
        assert result.outcome.missing_keys == (legacy_key(0, 1, "r-silent"),)
        if silent:
            assert [r.key for r in silent.requests] == [legacy_key(0, 1, "r-silent")]  # asked once
        assert receiver.health()["receiver"]["receiver"]["in_flight"] == 0
    finally:
        receiver.close()
        if silent:
            silent.close()
        if mute:
            mute.close()
    link = Link({"type": "zmq"})  # the next request, to a real sender, works
    links.append(link)
    assert link.send("r-next").kind is SendKind.SENT
    result, _ = link.receive("r-next")
    assert link.exact(result, "r-next")


def test_a_slow_peer_delivers_before_the_deadline_and_never_to_the_wrong_request() -> None:
    delays = {"r-fast": 0.2, "r-late": 1.5, "r-next": 0.0}
    payloads = {rid: _payload_for(rid, float(i)) for i, rid in enumerate(delays)}

    def answer(request: Any) -> tuple[float, Any]:
        rid = request.key.rsplit("_", 1)[-1]
        return delays[rid], _data_reply(request, payloads[rid])

    peer = FakeRouter(answer)
    receiver, info = _receiver_only(peer.port, 5.0)
    try:
        fast = receiver.receive("r-fast", sender_info=info)
        assert fast.ok and float(fast.payload["layer_blocks"]["key_cache"][0][0, 0, 0]) == 0.0
        started = time.monotonic()
        late = receiver.receive("r-late", sender_info=info, timeout_s=0.5)
        assert late.outcome.kind is ReceiveKind.TIMED_OUT
        assert time.monotonic() - started <= 0.5 + SLACK_S
        # r-late's data arrives while r-next is being received: it must not answer r-next
        following = receiver.receive("r-next", sender_info=info)
        assert following.ok and following.payload["request_id"] == "r-next"
        assert float(following.payload["layer_blocks"]["key_cache"][0][0, 0, 0]) == 2.0
        stash = receiver.health()["receiver"]["receiver"]
        eventually(lambda: receiver.health()["receiver"]["receiver"]["late_replies"] == 1, what="late reply kept")
        again = receiver.receive("r-late", sender_info=info)  # kept for its own key only
        assert again.ok and again.payload["request_id"] == "r-late", stash
    finally:
        receiver.close()
        peer.close()


def test_duplicate_late_reordered_and_replayed_payloads_reach_only_their_request(links: list) -> None:
    link = Link({"type": "zmq"}, recv_timeout=5.0)
    links.append(link)
    order = [f"r{i}" for i in range(8)]
    for rid in random.Random(3).sample(order, len(order)):  # reordered
        assert link.send(rid).kind is SendKind.SENT
    for rid in order:
        result, _ = link.receive(rid)
        assert link.exact(result, rid), rid
    assert link.send("dup").ok and link.send("dup").ok  # duplicate put: latest wins, read once
    first, _ = link.receive("dup")
    assert link.exact(first, "dup")
    second, elapsed = link.receive("dup", timeout_s=0.5)
    assert second.outcome.kind is ReceiveKind.TIMED_OUT and second.payload is None
    late, _ = link.receive("late", timeout_s=0.3)  # asked before it was sent
    assert late.outcome.kind is ReceiveKind.TIMED_OUT
    assert link.send("late").ok and link.send("after").ok
    after, _ = link.receive("after")
    assert link.exact(after, "after")  # the late payload did not answer this request
    late_again, _ = link.receive("late")
    assert link.exact(late_again, "late")
    # replayed / mis-keyed: a payload of another request under this request's key
    connector = link.sender.send_connector()
    connector.put("0", "1", legacy_key(0, 1, "victim"), _payload_for("someone-else", 1.0))
    victim, _ = link.receive("victim")
    assert victim.outcome.kind is ReceiveKind.DECODE_FAILED and victim.payload is None
    assert "someone-else" in victim.outcome.detail and "victim" in victim.outcome.detail
    assert link.receiver.counters.snapshot()["recv.decode_failed"] == 1


@pytest.mark.parametrize("kind", ["zmq", "shm"])
def test_a_full_sender_pool_fails_put_promptly_and_recovers(kind: str, shm_space: Any, links: list) -> None:
    request_bytes = 64 * GEOM.token_bytes  # one request of 64 tokens, TP 1
    connector, _ = _connector(kind, shm_space, pool_bytes=request_bytes * 3 // 2)
    link = Link(connector, retry=RetryPolicy(attempts=3, first_backoff_s=0.05))
    links.append(link)
    assert link.send("first", 64).kind is SendKind.SENT
    started = time.monotonic()
    full = link.send("second", 64)
    assert time.monotonic() - started <= 0.15 + PROMPT_S
    assert full.kind is SendKind.FAILED and full.reason is SendReason.POOL_FULL, full
    assert "pool full" in full.detail or "pool_full" in full.detail, full.detail
    assert full.attempts == 3
    result, _ = link.receive("first")
    assert link.exact(result, "first")
    result.release(wait=True)  # the reader frees the space (a zero-copy result holds it until then)
    assert link.send("second", 64).kind is SendKind.SENT  # recovered
    result, _ = link.receive("second")
    assert link.exact(result, "second")
    assert link.sender.counters.snapshot()["send.failed.pool_full"] == 1


def _expired_at_sender(link: Link, kind: str) -> bool:
    health = link.sender.health()["sender"]  # reading health runs the (lazy) lease expiry
    return health.get("expired" if kind == "zmq" else "expired_unread", 0) >= 1


@pytest.mark.parametrize("kind", ["zmq", "shm", "memory"])
def test_lease_expiry_while_the_receiver_is_queued_is_reported_as_expiry(
    kind: str, shm_space: Any, links: list
) -> None:
    connector, shared = _connector(kind, shm_space, lease_s=0.3)
    link = Link(connector, recv_timeout=10.0, shared=shared)
    links.append(link)
    assert link.send("queued").ok
    eventually(lambda: _expired_at_sender(link, kind), what="the lease passed")
    result, elapsed = link.receive("queued")
    assert result.outcome.kind is ReceiveKind.EXPIRED, result.outcome
    assert elapsed <= PROMPT_S  # at once, not at the 10 s deadline
    assert "lease" in result.outcome.detail and result.payload is None
    snap = link.receiver.counters.snapshot()
    assert snap["recv.expired"] == 1 and snap.get("timeouts", 0) == 0 and snap["errors"] == 1
    if kind == "zmq":
        served = link.sender.health()["sender"]["sender"]
        assert served["requests"] <= 3 and served["held_bytes"] == 0  # asked, told, no spinning
    assert link.send("next").ok  # the next request works
    result, _ = link.receive("next")
    assert link.exact(result, "next")
