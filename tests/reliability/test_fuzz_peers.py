"""Hostile peers on a sender's sockets: garbage never stops a sender from serving.

A zmq sender (tcp) and an shm sender's control endpoint (ipc) are hit with thousands of
messages a peer can send: random bytes, mutated and structurally wrong requests, wrong frame
counts, empty frames, oversized frames, raw TCP that is not ZMTP, and a ZMTP frame header
claiming 2**62 bytes. The sender answers (an error reply) or drops each one, its serving thread
stays alive, a payload published before the attack is intact, and a real receiver's get is
served afterwards, bit-exact.
"""

from __future__ import annotations

import math
import random
import socket
import struct
from typing import Any

import msgpack
import pytest
import zmq
from fault_kit import WAIT_S, eventually

from kvferry.adapters.connectors.shm.control import encode as shm_encode
from kvferry.adapters.connectors.zmq.connector import ZmqConnector
from kvferry.adapters.connectors.zmq.protocol import (
    MAX_CONTROL_BYTES,
    Rejection,
    Request,
    decode_reply,
    encode_request,
)
from kvferry.app.registry import create_connector

pytestmark = pytest.mark.timeout(120)

MESSAGES = 3000
VICTIM = b"payload published before the attack" * 100


def _joined(data: Any) -> bytes:
    if hasattr(data, "tensor"):
        try:
            return bytes(data.tensor.numpy())
        finally:
            data.release()
    return b"".join(bytes(f) for f in data)


_VALUES = (
    None,
    True,
    0,
    -1,
    1,
    2**63 - 1,
    2**63,
    2**64 - 1,
    -(2**63),
    1.5,
    math.nan,
    math.inf,
    -0.0,
    1e300,
    "",
    "get",
    "release",
    "ping",
    "now",
    "wait",
    "x" * 5000,
    b"\x00\xff",
    [],
    {},
    [1, [2, [3]]],
    {"a": {"b": 1}},
)
_FIELDS = ("v", "op", "id", "key", "mode", "wait_s", "ticket", "extra")


def _garbage_request(rng: random.Random) -> bytes:
    """One control frame a hostile or broken peer might send (never names a real key)."""
    kind = rng.randrange(6)
    if kind == 0:
        return bytes(rng.getrandbits(8) for _ in range(rng.randrange(0, 64)))
    if kind == 1:  # a valid request, mutated byte-wise
        raw = bytearray(
            encode_request(
                Request(
                    rng.randrange(2**40), f"fuzz-{rng.randrange(99)}", rng.choice(("now", "wait")), rng.random() * 0.05
                )
            )
        )
        for _ in range(rng.randrange(1, 4)):
            raw[rng.randrange(len(raw))] = rng.getrandbits(8)
        return bytes(raw)
    if kind == 2:  # a map with random field values
        fields = {f: rng.choice(_VALUES) for f in rng.sample(_FIELDS, rng.randrange(0, len(_FIELDS)))}
        if isinstance(fields.get("key"), str) and not fields["key"].startswith("x"):
            fields["key"] = "fuzz-" + fields["key"]
        if fields.get("mode") == "wait" and isinstance(fields.get("wait_s"), (int, float)):
            fields["wait_s"] = min(abs(fields["wait_s"]), 0.05) if math.isfinite(fields["wait_s"]) else 0.05
        return msgpack.packb(fields, use_bin_type=True)
    if kind == 3:  # not a map at all
        return msgpack.packb(rng.choice(([1, 2], "get", 7, None, [{"v": 1}])), use_bin_type=True)
    if kind == 4:  # truncated msgpack
        raw = encode_request(Request(1, "fuzz-k", "now", 0.0))
        return raw[: rng.randrange(len(raw))]
    return msgpack.packb(
        {"v": 1, "op": "get", "id": 3, "key": "fuzz-" + "k" * rng.choice((1, 1025, 5000)), "mode": "now"},
        use_bin_type=True,
    )


def _garbage_message(rng: random.Random) -> list[bytes]:
    """Frames of one message: usually one control frame, sometimes none, empty or several."""
    roll = rng.random()
    if roll < 0.75:
        return [_garbage_request(rng)]
    if roll < 0.85:
        return [b""]
    return [_garbage_request(rng) for _ in range(rng.randrange(2, 6))]


def _dealer(ctx: zmq.Context, endpoint: str) -> zmq.Socket:
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    sock.sndtimeo = int(WAIT_S * 1000)
    sock.connect(endpoint)
    return sock


def _drain(sock: zmq.Socket) -> int:
    """Replies waiting on ``sock`` now (read and dropped)."""
    count = 0
    while sock.poll(0):
        sock.recv_multipart()
        count += 1
    return count


def _zmtp_oversized_claim(port: int) -> None:
    """A raw ZMTP 3.0 peer: greeting, READY as a DEALER, then a frame claiming 2**62 bytes."""
    greeting = b"\xff" + b"\x00" * 8 + b"\x7f" + b"\x03\x00" + b"NULL".ljust(20, b"\x00") + b"\x00" + b"\x00" * 31
    props = b"\x0bSocket-Type" + struct.pack(">I", 6) + b"DEALER"
    ready = b"\x05READY" + props
    with socket.create_connection(("127.0.0.1", port), timeout=WAIT_S) as raw:
        raw.sendall(greeting + bytes([0x04, len(ready)]) + ready)
        raw.sendall(b"\x02" + struct.pack(">Q", 2**62) + b"x" * 1024)
        raw.settimeout(WAIT_S)
        try:
            while raw.recv(65536):  # the sender drops the connection (EOF) instead of allocating
                pass
        except (TimeoutError, ConnectionResetError):
            pass


def _raw_tcp_garbage(port: int, rng: random.Random) -> None:
    for _ in range(20):
        with socket.create_connection(("127.0.0.1", port), timeout=WAIT_S) as raw:
            raw.sendall(bytes(rng.getrandbits(8) for _ in range(rng.randrange(1, 512))))


def test_zmq_sender_survives_hostile_peers_and_keeps_serving() -> None:
    rng = random.Random(606)
    sender = ZmqConnector({"role": "sender", "port": 0, "max_parked": 64})
    receiver = ZmqConnector({"role": "receiver"})
    ctx = zmq.Context()
    try:
        assert sender.put("0", "1", "victim", VICTIM)[0]
        meta = sender.sender_metadata()
        fuzz = _dealer(ctx, sender.endpoint)
        replies = 0
        for i in range(MESSAGES):
            fuzz.send_multipart(_garbage_message(rng))
            if i % 100 == 99:
                replies += _drain(fuzz)
        # oversized: bigger than any control frame may be; the sender drops that connection
        big = _dealer(ctx, sender.endpoint)
        big.send(b"\x00" * (MAX_CONTROL_BYTES + 1))
        _zmtp_oversized_claim(sender.port)
        _raw_tcp_garbage(sender.port, rng)
        # a well-behaved peer is answered promptly on a fresh connection
        probe = _dealer(ctx, sender.endpoint)
        probe.send(encode_request(Request(77, "fuzz-absent", "now", 0.0)))
        assert probe.poll(int(WAIT_S * 1000)), "the sender stopped answering"
        reply = decode_reply(probe.recv())
        assert not isinstance(reply, Rejection) and (reply.op, reply.reason, reply.corr_id) == ("miss", "not_found", 77)

        def accounted() -> bool:
            stats = sender.health()["sender"]
            return stats["bad_messages"] + stats["requests"] >= MESSAGES + 1  # + the probe

        eventually(accounted, what="every message read")  # none lost, none wedged the loop
        bad = sender.health()["sender"]["bad_messages"]
        assert bad > MESSAGES // 2

        def answered() -> bool:
            nonlocal replies
            replies += _drain(fuzz)
            return replies >= bad

        eventually(answered, what="an error reply for every bad message")
        health = sender.health()
        assert health["ok"] and health["sender"]["loop_failures"] == 0
        # nothing the garbage did touched the published payload, and real gets are served
        got = receiver.get_blocking("0", "1", "victim", meta, timeout_s=WAIT_S)
        assert got is not None and _joined(got[0]) == VICTIM
        assert sender.put("0", "1", "after", b"after the attack")[0]
        got = receiver.get_blocking("0", "1", "after", meta, timeout_s=WAIT_S)
        assert got is not None and _joined(got[0]) == b"after the attack"
        print(
            f"\nzmq sender: {health['sender']['bad_messages']} bad messages, "
            f"{health['sender']['requests']} requests served as misses, still serving"
        )
        for sock in (fuzz, big, probe):
            sock.close()
    finally:
        ctx.destroy(linger=0)
        receiver.close()
        sender.close()


def test_shm_control_endpoint_survives_hostile_peers_and_keeps_serving(shm_space: Any) -> None:
    rng = random.Random(707)
    sender = create_connector(shm_space.config("sender", port=50333))
    receiver = create_connector(shm_space.config("receiver", sender_port=50333))
    ctx = zmq.Context()
    try:
        assert sender.put("0", "1", "victim", VICTIM)[0]
        fuzz = _dealer(ctx, sender.endpoint)
        for i in range(MESSAGES):
            frames = _garbage_message(rng)
            if rng.random() < 0.1:  # shm's own message shapes with hostile values
                frames = [
                    shm_encode(
                        {f: rng.choice(_VALUES) for f in rng.sample(_FIELDS, 4) if f not in ("v", "ticket")}
                        | {"op": rng.choice(("get", "ping", "x"))}
                    )
                ]
            fuzz.send_multipart(frames)
            if i % 100 == 99:
                _drain(fuzz)
        fuzz.send(b"\x00" * (1 << 20))  # over the control message limit
        probe = _dealer(ctx, sender.endpoint)
        probe.send(shm_encode({"op": "ping", "id": 5}))
        assert probe.poll(int(WAIT_S * 1000)), "the shm control thread stopped answering"
        assert msgpack.unpackb(probe.recv())["id"] == 5
        health = eventually(
            lambda: (h := sender.health())["bad_requests"] > MESSAGES // 4 and h, what="bad requests counted"
        )
        assert health["ok"] and health["control_thread"] and health.get("thread_errors", 0) == 0
        got = receiver.get_blocking("0", "1", "victim", timeout_s=WAIT_S)
        assert got is not None and _joined(got[0]) == VICTIM
        assert sender.put("0", "1", "after", b"after the attack")[0]
        got = receiver.get_blocking("0", "1", "after", timeout_s=WAIT_S)
        assert got is not None and _joined(got[0]) == b"after the attack"
        fuzz.close()
        probe.close()
    finally:
        ctx.destroy(linger=0)
        receiver.close()
        sender.close()
