"""The zmq connector: wire protocol (properties), config, and the connector over tcp and ipc."""

from __future__ import annotations

import gc
import os
import shutil
import socket
import tempfile
import threading
import time
from typing import Any

import msgpack
import pytest
import torch
import waits
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvferry.adapters.connectors.zmq.buffers import RecvPool, as_frames
from kvferry.adapters.connectors.zmq.config import ZmqConfig, generate_curve_config
from kvferry.adapters.connectors.zmq.connector import ZmqConnector
from kvferry.adapters.connectors.zmq.inbound import Outcome
from kvferry.adapters.connectors.zmq.protocol import (
    MAX_IPC_PATH_BYTES,
    Rejection,
    Reply,
    Request,
    check_data_frames,
    decode_reply,
    decode_request,
    encode_reply,
    encode_request,
    ipc_path,
    resolve_endpoint,
    tcp_endpoint,
)
from kvferry.adapters.connectors.zmq.stash import LateStash
from kvferry.adapters.connectors.zmq.store import HeldPayloads, PublishFailure
from kvferry.adapters.connectors.zmq.stream import (
    Chunk,
    chunk_count,
    chunk_span,
    decode_incoming,
    encode_chunk,
)
from kvferry.adapters.platform import free_port
from kvferry.core.errors import BindError, ConfigError, PoolFullError
from kvferry.core.ports import BlockingGet, Connector, SenderAware

PROPS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
WAIT = 10.0  # generous deadline for things that should happen at once
DOWN_GRACE_PLUS = 2.0  # past the client's DOWN_GRACE_S (1.5 s)


def eventually(predicate) -> None:
    """:func:`waits.eventually` with this file's deadline."""
    waits.eventually(predicate, "condition not reached in time", WAIT, pause_s=0.002)


def joined(frames) -> bytes:
    return b"".join(bytes(f) for f in frames)


def buffer_address(view: memoryview) -> int:
    import numpy as np

    return np.frombuffer(view, dtype=np.uint8).ctypes.data


# ----------------------------------------------------------------------------- protocol

keys = st.text(min_size=1, max_size=64)
ids = st.integers(min_value=0, max_value=(1 << 63) - 1)


@PROPS
@given(ids, keys, st.sampled_from(["now", "wait"]), st.floats(0, 1e6, allow_nan=False), st.booleans())
def test_request_round_trip(corr_id, key, mode, wait_s, stream):
    request = Request(corr_id, key, mode, wait_s, stream)
    assert decode_request(encode_request(request)) == request


@PROPS
@given(
    ids,
    keys,
    st.one_of(
        st.builds(
            lambda s, c: ("data", (s, c)), st.lists(st.integers(0, 1 << 40), max_size=8), st.integers(0, 1 << 30)
        ),
        st.builds(lambda r: ("miss", r), st.sampled_from(["not_found", "expired", "timeout"])),
        st.builds(lambda r: ("error", r), st.sampled_from(["bad_request", "busy"])),
    ),
)
def test_reply_round_trip(corr_id, key, kind):
    op, extra = kind
    if op == "data":
        reply = Reply("data", corr_id, key, sizes=tuple(extra[0]), chunk=extra[1])
    elif op == "miss":
        reply = Reply("miss", corr_id, key, reason=extra)
    else:
        reply = Reply("error", corr_id, reason=extra, detail="why")
    assert decode_reply(encode_reply(reply)) == reply


@PROPS
@given(st.binary(max_size=256))
def test_decoding_random_bytes_never_raises(raw):
    assert isinstance(decode_request(raw), (Request, Rejection))
    assert isinstance(decode_reply(raw), (Reply, Rejection))
    assert isinstance(decode_incoming(raw), (Reply, Chunk, Rejection))


@PROPS
@given(st.integers(0, 1 << 34), st.integers(1, 1 << 24))
def test_chunk_spans_tile_the_payload_in_order(total, chunk):
    count = chunk_count(total, chunk)
    position = 0
    for seq in range(min(count, 64)):  # the first spans ...
        offset, nbytes = chunk_span(total, chunk, seq)
        assert offset == position and 1 <= nbytes <= chunk
        position += nbytes
    if count > 64:  # ... and the last ones (a count can be huge)
        position = (count - 2) * chunk
        for seq in (count - 2, count - 1):
            offset, nbytes = chunk_span(total, chunk, seq)
            assert offset == position and 1 <= nbytes <= chunk
            position += nbytes
    assert position == total and count == -(-total // chunk)
    for outside in (-1, count):
        with pytest.raises(ConfigError, match="out of range"):
            chunk_span(total, chunk, outside)


@PROPS
@given(ids, st.integers(0, (1 << 63) - 1))
def test_chunk_headers_round_trip_and_are_not_replies(corr_id, seq):
    raw = encode_chunk(corr_id, seq)
    assert decode_incoming(raw) == Chunk(corr_id, seq)
    assert decode_reply(raw).reason == "unknown_op"  # a chunk never reads as a reply
    reply = encode_reply(Reply("miss", corr_id, "k", reason="timeout"))
    assert decode_incoming(reply) == decode_reply(reply)


def test_bad_chunk_headers_are_rejected():
    for fields, reason in (
        ({"v": 2, "id": 1, "seq": 0}, "bad_version"),
        ({"v": 1, "id": -1, "seq": 0}, "bad_reply"),
        ({"v": 1, "id": 1, "seq": "0"}, "bad_reply"),
        ({"v": 1, "id": 1, "seq": True}, "bad_reply"),
    ):
        raw = msgpack.packb({"op": "chunk", **fields})
        assert decode_incoming(raw).reason == reason
    bad_chunk = msgpack.packb({"v": 1, "op": "data", "id": 1, "key": "k", "sizes": [1], "chunk": -4})
    assert decode_reply(bad_chunk).reason == "bad_reply"


control_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(1 << 63), (1 << 64) - 1)
    | st.floats()
    | st.text(max_size=8)
    | st.binary(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=10,
)


@PROPS
@given(
    st.dictionaries(
        st.sampled_from(
            ["v", "op", "id", "key", "mode", "wait_s", "sizes", "reason", "detail", "x", "stream", "chunk", "seq"]
        ),
        control_values,
        max_size=8,
    )
)
def test_decoding_arbitrary_maps_never_raises(obj):
    raw = msgpack.packb(obj, use_bin_type=True)
    request, reply = decode_request(raw), decode_reply(raw)
    assert isinstance(request, (Request, Rejection))
    assert isinstance(reply, (Reply, Rejection))
    assert isinstance(decode_incoming(raw), (Reply, Chunk, Rejection))
    if isinstance(request, Request):
        assert request.mode in ("now", "wait") and request.wait_s >= 0 and request.key


@PROPS
@given(ids, keys, st.integers(0, 200), st.binary(min_size=1, max_size=4))
def test_mutated_requests_never_raise(corr_id, key, position, patch):
    raw = bytearray(encode_request(Request(corr_id, key, "wait", 1.5)))
    position %= len(raw)
    raw[position : position + len(patch)] = patch
    assert isinstance(decode_request(bytes(raw)), (Request, Rejection))


def test_rejections_name_the_problem():
    assert decode_request(b"\xc1").reason == "bad_frame"
    assert decode_request(msgpack.packb([1, 2])).reason == "bad_frame"
    bad_version = msgpack.packb({"v": 9, "op": "get", "id": 4, "key": "k", "mode": "now"})
    assert decode_request(bad_version) == Rejection("bad_version", "protocol version 9", 4)
    unknown = decode_request(msgpack.packb({"v": 1, "op": "put", "id": 5}))
    assert (unknown.reason, unknown.corr_id) == ("unknown_op", 5)
    assert decode_request(b"\x00" * (65 * 1024)).reason == "too_large"
    huge_wait = msgpack.packb({"v": 1, "op": "get", "id": 1, "key": "k", "mode": "wait", "wait_s": float("inf")})
    assert decode_request(huge_wait).reason == "bad_request"


def test_data_frames_must_match_the_header():
    reply = Reply("data", 1, "k", sizes=(3, 0, 2))
    assert check_data_frames(reply, [b"abc", b"", b"xy"]) is None
    assert check_data_frames(reply, [b"abc", b"xy"]).reason == "bad_frames"
    assert check_data_frames(reply, [b"abc", b"x", b"xy"]).reason == "bad_frames"


@PROPS
@given(st.integers(1, 65535), st.integers(1, 65535))
def test_ipc_path_is_one_function_of_dir_and_port(a, b):
    assert ipc_path("/tmp/x", a) == ipc_path("/tmp/x/", a)
    assert (ipc_path("/tmp/x", a) == ipc_path("/tmp/x", b)) == (a == b)
    assert ipc_path("/tmp/x", a).startswith("/tmp/x/kvferry-zmq-")


def test_ipc_path_rejects_bad_input():
    with pytest.raises(ConfigError, match="ipc_dir"):
        ipc_path("/" + "d" * MAX_IPC_PATH_BYTES, 50151)
    with pytest.raises(ConfigError, match="ipc_dir"):
        ipc_path("relative/dir", 50151)
    with pytest.raises(ConfigError, match="port"):
        ipc_path("/tmp", 0)


@PROPS
@given(st.sampled_from(["127.0.0.1", "10.1.2.3", "::1", "node-7"]), st.integers(1, 65535))
def test_put_metadata_and_partial_metadata_resolve_alike(host, port):
    full = {"source_host": host, "source_port": port, "transport": "tcp", "key": "k"}
    partial = {"source_host": host, "source_port": str(port)}
    endpoint = resolve_endpoint(full, None, transport="tcp", ipc_dir="/tmp")
    assert endpoint == tcp_endpoint(host, port)
    assert resolve_endpoint(partial, ("other", 1), transport="tcp", ipc_dir="/tmp") == endpoint
    assert resolve_endpoint(None, (host, port), transport="tcp", ipc_dir="/tmp") == endpoint
    ipc = resolve_endpoint(partial, None, transport="ipc", ipc_dir="/tmp/k")
    assert ipc == "ipc://" + ipc_path("/tmp/k", port)
    assert resolve_endpoint(None, None, transport="tcp", ipc_dir="/tmp") is None


def test_resolve_endpoint_rejects_bad_metadata():
    with pytest.raises(ConfigError, match="source_port"):
        resolve_endpoint({"source_host": "h", "source_port": 70000}, None, transport="tcp", ipc_dir="/tmp")
    with pytest.raises(ConfigError, match="source_host"):
        resolve_endpoint({"source_port": 5}, None, transport="tcp", ipc_dir="/tmp")


# ----------------------------------------------------------------------------- frames


@PROPS
@given(st.lists(st.binary(max_size=64), min_size=1, max_size=5))
def test_frames_concatenate_to_the_payload(chunks):
    frames, sizes = as_frames([bytearray(c) for c in chunks])
    assert joined(frames) == b"".join(chunks)
    assert sizes == tuple(len(c) for c in chunks)


def test_as_frames_accepts_tensors_without_copying():
    tensor = torch.arange(12, dtype=torch.bfloat16).reshape(3, 4)
    flat = torch.arange(10, dtype=torch.uint8)
    frames, sizes = as_frames([b"hdr", tensor, flat])
    assert sizes == (3, 24, 10)
    assert buffer_address(frames[1]) == tensor.data_ptr()
    assert buffer_address(frames[2]) == flat.data_ptr()
    single, _ = as_frames(flat)
    assert bytes(single[0]) == bytes(range(10))
    for bad in ("text", {"a": 1}, None, [b"ok", 3]):
        with pytest.raises(ConfigError):
            as_frames(bad)


# ----------------------------------------------------------------------------- config


def test_config_errors_name_the_key():
    cases = [
        ({"role": "boss"}, "role"),
        ({"role": "sender"}, "port"),
        ({"role": "sender", "port": 70000}, "port"),
        ({"role": "sender", "port": 1, "host": "0.0.0.0"}, "advertise_host"),
        ({"transport": "udp"}, "transport"),
        ({"pool_bytes": 0}, "pool_bytes"),
        ({"lease_s": -1}, "lease_s"),
        ({"readers": 0}, "readers"),
        ({"ipc_dir": "rel"}, "ipc_dir"),
        ({"curve": {"server_public": "short"}}, "server_public"),
        ({"curve": {"bogus": 1}}, "unknown"),
        ({"role": "sender", "port": 1, "bind_device": ""}, "bind_device"),
        ({"role": "sender", "port": 1, "bind_device": "a-name-over-15-chars"}, "bind_device"),
        ({"role": "sender", "port": 1, "bind_device": 3}, "bind_device"),
    ]
    for raw, word in cases:
        with pytest.raises(ConfigError, match=word):
            ZmqConfig.from_mapping(raw)
    keys = generate_curve_config()
    keys["server_public"] = generate_curve_config()["server_public"]
    with pytest.raises(ConfigError, match="server_public"):
        ZmqConfig.from_mapping({"curve": keys})
    cfg = ZmqConfig.from_mapping({"type": "zmq", "sender_zmq_port": "50151", "typo": 1})
    assert cfg.sender_port == 50151 and cfg.ignored_keys == ("typo",)
    assert ZmqConfig.from_mapping({"role": "sender", "port": 1, "bind_device": "lo"}).bind_device == "lo"


# ----------------------------------------------------------------------------- connector


@pytest.fixture
def ipc_dir():
    path = tempfile.mkdtemp(prefix="zq", dir="/tmp")
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(params=["tcp", "ipc"])
def transport(request):
    return request.param


@pytest.fixture
def make(ipc_dir, transport):
    """Build connectors for this transport; every one is closed at teardown."""
    made = []

    def factory(role: str = "sender", **extra):
        cfg = {"role": role, "transport": transport, "ipc_dir": ipc_dir}
        if role == "sender":
            cfg["port"] = 0 if transport == "tcp" else free_port()
        cfg.update(extra)
        conn = ZmqConnector(cfg)
        made.append(conn)
        return conn

    yield factory
    for conn in made:
        conn.close()


def test_connector_satisfies_the_ports(make):
    sender = make()
    assert isinstance(sender, Connector)
    assert isinstance(sender, BlockingGet)
    assert isinstance(sender, SenderAware)


def test_round_trip_with_frames_is_bit_exact(make, transport):
    sender, receiver = make(), make("receiver")
    values = torch.randn(64, 8, 16, generator=torch.Generator().manual_seed(3))
    ok, size, meta = sender.put("0", "1", "req_0_0_0_0", [b"header", values, b""])
    assert ok and size == 6 + values.numel() * 4
    assert meta["transport"] == transport and meta["source_port"] == sender.port
    got = receiver.get("0", "1", "req_0_0_0_0", meta)
    assert got is not None
    frames, got_size = got
    assert got_size == size and [f.nbytes for f in frames] == [6, values.numel() * 4, 0]
    assert bytes(frames[0]) == b"header"
    decoded = torch.frombuffer(frames[1], dtype=torch.float32).view(64, 8, 16)
    assert torch.equal(decoded, values)
    lo = buffer_address(frames[1])
    assert lo <= decoded.data_ptr() < lo + frames[1].nbytes  # a view of the zmq frame
    assert receiver.get("0", "1", "req_0_0_0_0", meta) is None  # consumed by its one reader


def test_received_frames_outlive_the_connector(make):
    sender, receiver = make(), make("receiver")
    payload = bytes(range(256)) * 1024
    _, _, meta = sender.put("0", "1", "k", payload)
    frames, _ = receiver.get("0", "1", "k", meta)
    receiver.close()
    sender.close()
    gc.collect()
    assert joined(frames) == payload


def test_partial_metadata_default_sender_and_self(make):
    sender, receiver = make(), make("receiver")
    sender.put("0", "1", "a", b"A")
    sender.put("0", "1", "b", b"B")
    sender.put("0", "1", "c", b"C")
    partial = {"source_host": "127.0.0.1", "source_port": sender.port}
    assert joined(receiver.get("0", "1", "a", partial)[0]) == b"A"
    assert receiver.get("0", "1", "b") is None  # no sender known yet
    assert receiver.health()["unresolved"] == 1
    receiver.update_sender_info("127.0.0.1", sender.port)
    assert joined(receiver.get("0", "1", "b")[0]) == b"B"
    assert joined(sender.get("0", "1", "c")[0]) == b"C"  # a sender's default sender is itself


def test_readers_and_latest_put_wins(make):
    sender, receiver = make(readers=2), make("receiver")
    _, _, meta = sender.put("0", "1", "k", b"old")
    sender.put("0", "1", "k", b"new")
    assert joined(receiver.get("0", "1", "k", meta)[0]) == b"new"
    assert joined(receiver.get("0", "1", "k", meta)[0]) == b"new"
    assert receiver.get("0", "1", "k", meta) is None
    sender.put("0", "1", "one", b"x", readers=1)
    assert receiver.get("0", "1", "one", meta) is not None
    assert receiver.get("0", "1", "one", meta) is None
    assert sender.health()["held_bytes"] == 0


def test_blocking_get_is_woken_by_the_put(make):
    sender, receiver = make(), make("receiver")
    meta = sender.sender_metadata()
    result = {}
    waiter = threading.Thread(
        target=lambda: result.update(got=receiver.get_blocking("0", "1", "late", meta, timeout_s=WAIT))
    )
    started = time.monotonic()
    waiter.start()
    eventually(lambda: sender.health()["sender"]["parked"] == 1)
    sender.put("0", "1", "late", b"arrived")
    waiter.join(WAIT)
    assert not waiter.is_alive()
    assert joined(result["got"][0]) == b"arrived"
    assert time.monotonic() - started < WAIT / 2  # answered on arrival, not at the deadline
    assert sender.health()["sender"]["parked"] == 0


def test_blocking_get_returns_none_at_the_deadline(make):
    sender, receiver = make(), make("receiver")
    started = time.monotonic()
    assert receiver.get_blocking("0", "1", "never", sender.sender_metadata(), timeout_s=0.4) is None
    elapsed = time.monotonic() - started
    assert 0.3 <= elapsed < 3.0
    eventually(lambda: sender.health()["sender"]["wait_timeouts"] == 1)
    assert receiver.get("0", "1", "never", sender.sender_metadata()) is None


def test_expired_payloads_are_dropped(ipc_dir, transport):
    now = [100.0]
    cfg = {
        "role": "sender",
        "transport": transport,
        "ipc_dir": ipc_dir,
        "port": 0 if transport == "tcp" else free_port(),
        "lease_s": 5,
    }
    with ZmqConnector(cfg, clock=lambda: now[0]) as sender:
        _, _, meta = sender.put("0", "1", "k", b"x" * 100)
        assert sender.health()["held_bytes"] == 100
        now[0] += 6
        assert sender.get("0", "1", "k", meta) is None
        health = sender.health()
        assert health["expired"] == 1 and health["held_bytes"] == 0
        assert health["sender"]["misses_expired"] == 1


def test_reservation_is_published_without_a_copy(make):
    sender, receiver = make(pool_bytes=1024), make("receiver")  # regions: 64-byte multiples
    res = sender.reserve("0", "1", "direct", 600)
    assert res.buffer.dtype == torch.uint8 and res.buffer.shape == (600,)
    with pytest.raises(PoolFullError, match="pool_full"):
        sender.reserve("0", "1", "other", 600)
    with pytest.raises(PoolFullError, match="too_large"):
        sender.reserve("0", "1", "other", 1025)
    assert sender.put("0", "1", "small", b"x" * 384)[0]  # reserved bytes count
    assert sender.put("0", "1", "more", b"x")[2]["reason"] == "pool_full"
    res.buffer.copy_(torch.arange(600) % 251)
    ok, size, meta = res.commit()
    assert (ok, size) == (True, 600) and res.commit() == (ok, size, meta)
    res.abort()  # no effect after commit
    got = receiver.get("0", "1", "direct", meta)
    assert bytes(got[0][0]) == bytes(i % 251 for i in range(600))
    aborted = sender.reserve("0", "1", "gone", 500)
    aborted.abort()
    aborted.abort()
    assert not aborted.commit()[0]
    assert sender.health()["sender"]["reserved_bytes"] == 0
    with pytest.raises(ConfigError, match="sender"):
        receiver.reserve("0", "1", "k", 10)


def test_lease_clock_may_be_a_clock_object(ipc_dir):
    class Clock:
        now = 5.0

        def monotonic(self):
            return self.now

    clock = Clock()
    with ZmqConnector({"role": "sender", "port": 0, "lease_s": 2.0, "clock": clock}) as sender:
        sender.put("0", "1", "k", b"x")
        clock.now += 2.0
        assert sender.get("0", "1", "k") is None
        assert sender.health()["expired"] == 1


def test_zero_timeout_asks_nothing(make):
    sender = make()
    sender.put("0", "1", "k", b"x")
    assert sender.get_blocking("0", "1", "k", None, timeout_s=0) is None
    assert sender.health()["sender"]["requests"] == 0
    assert joined(sender.get_blocking("0", "1", "k", None, timeout_s=WAIT)[0]) == b"x"


def test_pool_bounds_fail_put_with_a_reason(make):
    sender, receiver = make(pool_bytes=256, max_payloads=2), make("receiver")
    assert sender.put("0", "1", "a", b"x" * 60)[0]  # takes one 64-byte unit
    ok, size, why = sender.put("0", "1", "b", b"x" * 200)
    assert (ok, size, why["reason"]) == (False, 0, "pool_full")
    assert sender.put("0", "1", "big", b"x" * 257)[2]["reason"] == "too_large"
    assert sender.put("0", "1", "c", b"x" * 10)[0]
    assert sender.put("0", "1", "d", b"x")[2]["reason"] == "pool_full"  # max_payloads
    assert receiver.get("0", "1", "a", sender.sender_metadata()) is not None
    assert sender.put("0", "1", "b", b"x" * 60)[0]  # room again after the read
    assert sender.health()["sender"]["put_failures"] == 3


def test_cleanup_drops_only_that_request(make):
    sender, receiver = make(), make("receiver")
    meta = sender.sender_metadata()
    sender.put("0", "1", "omni_0_to_1_kv_cache_r1", b"1")
    sender.put("0", "1", "r1_0_0_1_0", b"2")
    sender.put("0", "1", "r2_0_0_0_0", b"3")
    sender.cleanup("r1")
    sender.cleanup("r1")
    assert receiver.get("0", "1", "omni_0_to_1_kv_cache_r1", meta) is None
    assert receiver.get("0", "1", "r1_0_0_1_0", meta) is None
    assert joined(receiver.get("0", "1", "r2_0_0_0_0", meta)[0]) == b"3"


def test_roles_and_close(make):
    sender, receiver = make(), make("receiver")
    assert receiver.put("0", "1", "k", b"x")[2]["reason"] == "not_sender"
    assert receiver.endpoint is None and receiver.port is None
    _, _, meta = sender.put("0", "1", "k", b"x")
    sender.close()
    sender.close()
    assert sender.put("0", "1", "k2", b"x")[2]["reason"] == "closed"
    assert sender.health()["ok"] is False
    receiver.close()
    assert receiver.get("0", "1", "k", meta) is None


def test_concurrent_gets_from_many_threads(make):
    sender, receiver = make(), make("receiver")
    meta = sender.sender_metadata()
    payloads = {f"k{i}": bytes([i]) * (1000 + i) for i in range(24)}
    results = {}

    def fetch(key):
        results[key] = receiver.get_blocking("0", "1", key, meta, timeout_s=WAIT)

    threads = [threading.Thread(target=fetch, args=(k,)) for k in payloads]
    for thread in threads:
        thread.start()
    for key, value in payloads.items():
        assert sender.put("0", "1", key, value)[0]
    for thread in threads:
        thread.join(WAIT)
    assert {k: joined(v[0]) for k, v in results.items()} == payloads
    assert receiver.health()["hits"] == len(payloads)


# ----------------------------------------------------------------------------- binding


def listening_addresses(port: int) -> set[str]:
    """Local addresses (hex, as in /proc/net/tcp) of sockets listening on ``port``."""
    found = set()
    with open("/proc/net/tcp") as table:
        for line in list(table)[1:]:
            local, state = line.split()[1], line.split()[3]
            address, hex_port = local.split(":")
            if state == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
                found.add(address)
    return found


def test_binds_loopback_on_the_given_port():
    port = free_port()
    with ZmqConnector({"role": "sender", "port": port}) as sender:
        assert sender.endpoint == f"tcp://127.0.0.1:{port}"
        assert sender.sender_metadata()["source_host"] == "127.0.0.1"
        with socket.create_connection(("127.0.0.1", port), timeout=WAIT):
            pass
        if os.path.exists("/proc/net/tcp"):
            assert listening_addresses(port) == {"0100007F"}  # 127.0.0.1, not 0.0.0.0


def test_port_zero_reports_the_os_choice():
    with ZmqConnector({"role": "sender", "port": 0}) as sender:
        assert sender.endpoint.startswith("tcp://127.0.0.1:")
        assert sender.port > 0 and sender.health()["port"] == sender.port


def test_bind_failure_names_host_and_port():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(BindError, match=rf"127\.0\.0\.1.*{port}"):
            ZmqConnector({"role": "sender", "port": port})


def test_ipc_file_lifecycle(ipc_dir):
    port = free_port()
    path = ipc_path(ipc_dir, port)
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(path)  # a file left behind by a dead process
    stale.close()
    cfg = {"role": "sender", "transport": "ipc", "ipc_dir": ipc_dir, "port": port}
    sender = ZmqConnector(cfg)
    assert sender.endpoint == f"ipc://{path}"
    with pytest.raises(BindError, match=str(port)):
        ZmqConnector(cfg)  # a live owner is never taken over
    sender.close()
    assert not os.path.exists(path)


# ----------------------------------------------------------------------------- robustness


def raw_dealer(ctx, endpoint):
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    sock.rcvtimeo = int(WAIT * 1000)
    sock.connect(endpoint)
    return sock


def test_sender_survives_garbage(make):
    sender, receiver = make(), make("receiver")
    ctx = zmq.Context()
    try:
        sock = raw_dealer(ctx, sender.endpoint)
        cases = [
            ([b"\xc1\xc1"], "bad_frame"),
            ([msgpack.packb([1, 2, 3])], "bad_frame"),
            ([msgpack.packb({"v": 1, "op": "steal", "id": 9})], "unknown_op"),
            ([msgpack.packb({"v": 2, "op": "get", "id": 9, "key": "k", "mode": "now"})], "bad_version"),
            ([b"a", b"b", b"c"], "bad_frames"),
            ([msgpack.packb({"v": 1, "op": "get", "id": 9, "key": "", "mode": "now"})], "bad_request"),
        ]
        for frames, reason in cases:
            sock.send_multipart(frames)
            reply = decode_reply(sock.recv())
            assert (reply.op, reply.reason) == ("error", reason)
        sock.send(b"\x00" * (1 << 20))  # oversized: the sender drops that connection
        sender.put("0", "1", "k", b"still serving")
        assert joined(receiver.get("0", "1", "k", sender.sender_metadata())[0]) == b"still serving"
        assert sender.health()["sender"]["bad_messages"] == len(cases)
        sock.close()
    finally:
        ctx.destroy(linger=0)


@pytest.fixture
def fake_sender():
    """A raw ROUTER on loopback that the test drives by hand."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.linger = 0
    sock.rcvtimeo = int(WAIT * 1000)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    yield sock, {"source_host": "127.0.0.1", "source_port": port}
    ctx.destroy(linger=0)


def test_receiver_handles_silent_and_broken_senders(fake_sender):
    sock, meta = fake_sender
    with ZmqConnector({"role": "receiver", "request_timeout_s": 0.3}) as receiver:
        assert receiver.get("0", "1", "k", meta) is None  # never answered
        identity, body = sock.recv_multipart()
        assert decode_request(body).key == "k"
        for bad in ([b"garbage"], [encode_reply(Reply("data", None, "k", sizes=(3,))), b"abc"]):
            result = {}
            waiter = threading.Thread(
                target=lambda: result.update(got=receiver.get_blocking("0", "1", "k", meta, timeout_s=WAIT))
            )
            waiter.start()
            identity, body = sock.recv_multipart()
            request = decode_request(body)
            wrong_count = [encode_reply(Reply("data", request.corr_id, "k", sizes=(3, 3))), b"abc"]
            sock.send_multipart([identity, *bad])
            sock.send_multipart([identity, *wrong_count])
            waiter.join(WAIT)
            assert result["got"] is None
        assert receiver.health()["receiver"]["bad_replies"] >= 3


def _gave_up_then_waits(receiver, sock, meta, key: str) -> tuple[Any, Any, Any, threading.Thread, dict]:
    """A get of "a" that times out unanswered, then a get of ``key`` waiting in a thread:
    ``(identity, first request, second request, waiter, result)`` as the fake sender saw them."""
    assert receiver.get("0", "1", "a", meta) is None  # gave up
    identity, body = sock.recv_multipart()
    first = decode_request(body)
    result: dict = {}
    waiter = threading.Thread(
        target=lambda: result.update(got=receiver.get_blocking("0", "1", key, meta, timeout_s=WAIT))
    )
    waiter.start()
    identity, body = sock.recv_multipart()
    second = decode_request(body)
    assert second.key == key and second.corr_id != first.corr_id
    return identity, first, second, waiter, result


def test_late_reply_never_answers_another_request(fake_sender):
    sock, meta = fake_sender
    with ZmqConnector({"role": "receiver", "request_timeout_s": 0.3}) as receiver:
        identity, late, current, waiter, result = _gave_up_then_waits(receiver, sock, meta, "b")
        sock.send_multipart([identity, encode_reply(Reply("data", late.corr_id, "a", sizes=(4,))), b"AAAA"])
        sock.send_multipart([identity, encode_reply(Reply("miss", current.corr_id, "b", reason="timeout"))])
        waiter.join(WAIT)
        assert result["got"] is None  # "a"'s late data did not answer "b"
        eventually(lambda: receiver.health()["receiver"]["stash_payloads"] == 1)
        assert joined(receiver.get("0", "1", "a", meta)[0]) == b"AAAA"  # kept for its own key
        assert receiver.health()["receiver"]["late_replies"] == 1


def test_a_late_reply_goes_to_a_newer_get_of_the_same_key_still_waiting(fake_sender):
    """The sender answered a get whose caller had given up while that caller's second get of the
    same key was already on its way: the sender took the key for the first get, so it can only
    park the second one. The late payload answers the waiting get (the stash alone would keep it
    until a third get, and the waiting one would time out)."""
    sock, meta = fake_sender
    with ZmqConnector({"role": "receiver", "request_timeout_s": 0.3}) as receiver:
        # asked again (not in the stash: no reply yet)
        identity, first, second, waiter, result = _gave_up_then_waits(receiver, sock, meta, "a")
        sock.send_multipart([identity, encode_reply(Reply("data", first.corr_id, "a", sizes=(4,))), b"AAAA"])
        waiter.join(WAIT)
        assert not waiter.is_alive() and joined(result["got"][0]) == b"AAAA"
        stats = receiver.health()["receiver"]
        assert stats["late_replies"] == 1 and stats["late_handed_over"] == 1 and stats["stash_payloads"] == 0
        # the sender's own answer to the second get comes later and answers nothing
        sock.send_multipart([identity, encode_reply(Reply("miss", second.corr_id, "a", reason="timeout"))])
        assert receiver.get("0", "1", "a", meta) is None  # nothing kept: the payload went to one get
        identity, body = sock.recv_multipart()
        assert decode_request(body).key == "a"


def test_a_dropped_connection_ends_its_gets_at_once_and_a_sender_back_is_asked_again():
    """A get whose request reached the sender ends the moment the connection drops (its reply
    can no longer come): SenderUnavailable, not None at its deadline. The control: the same
    sender open but silent answers nothing and the get returns None at its deadline. A get for
    the endpoint while it stays down fails after DOWN_GRACE_S; once a sender listens there
    again, gets are answered as before."""
    from kvferry.adapters.connectors.zmq.client import DOWN_GRACE_S
    from kvferry.core.errors import SenderUnavailable

    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.linger = 0
    router.rcvtimeo = int(WAIT * 1000)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    meta = {"source_host": "127.0.0.1", "source_port": port}
    try:
        with ZmqConnector({"role": "receiver"}) as receiver:
            started = time.monotonic()  # the control: connected, asked, never answered
            assert receiver.get_blocking("0", "1", "silent", meta, timeout_s=0.5) is None
            assert 0.4 <= time.monotonic() - started < 3.0
            assert decode_request(router.recv_multipart()[1]).key == "silent"
            box: dict[str, Any] = {}

            def wait_for(key: str) -> None:
                begun = time.monotonic()
                try:
                    box["got"] = receiver.get_blocking("0", "1", key, meta, timeout_s=60.0)
                except SenderUnavailable as exc:
                    box["gone"] = exc
                box["s"] = time.monotonic() - begun

            waiter = threading.Thread(target=wait_for, args=("parked",), daemon=True)
            waiter.start()
            assert decode_request(router.recv_multipart()[1]).key == "parked"  # in flight
            router.close(linger=0)  # the sender's process ends: its socket closes
            waiter.join(WAIT)
            assert not waiter.is_alive() and "got" not in box, box
            assert "dropped" in str(box["gone"]) and box["s"] < WAIT / 2, box
            health = receiver.health()["receiver"]
            assert health["disconnects"] == 1 and health["lost_in_flight"] == 1, health
            box.clear()
            wait_for("while-down")  # the endpoint was up and stays down
            assert "gone" in box and DOWN_GRACE_S * 0.9 <= box["s"] < DOWN_GRACE_S + 3.0, box
            assert receiver.health()["receiver"]["failed_sender_down"] == 1
            with ZmqConnector({"role": "sender", "port": port}) as back:
                back.put("0", "1", "again", b"2")
                assert joined(receiver.get_blocking("0", "1", "again", meta, timeout_s=WAIT)[0]) == b"2"
                assert back.health()["sender"]["requests"] == 1  # nothing stale reached it
            assert receiver.health()["receiver"]["timeouts"] == 1  # the control's, only
    finally:
        ctx.destroy(linger=0)


def test_a_get_waits_for_a_sender_that_never_connected_yet(make):
    """Before an endpoint was ever connected, a get waits (a receiver may start before its
    sender): a sender that binds during the wait answers it."""
    port = free_port()
    meta = {"source_host": "127.0.0.1", "source_port": port}
    receiver = make("receiver")
    box: dict[str, Any] = {}
    waiter = threading.Thread(
        target=lambda: box.update(got=receiver.get_blocking("0", "1", "k", meta, timeout_s=60.0)), daemon=True
    )
    waiter.start()
    eventually(lambda: receiver.health()["receiver"]["in_flight"] == 1)
    waiter.join(DOWN_GRACE_PLUS)
    assert waiter.is_alive()  # still waiting past the grace: this endpoint was never up
    sender = make("sender", port=port)
    sender.put("0", "1", "k", b"late start")
    waiter.join(WAIT)
    assert not waiter.is_alive() and joined(box["got"][0]) == b"late start"


def test_sender_gone_then_back():
    port = free_port()
    meta = {"source_host": "127.0.0.1", "source_port": port}
    with ZmqConnector({"role": "receiver"}) as receiver:
        with ZmqConnector({"role": "sender", "port": port}) as first:
            first.put("0", "1", "one", b"1")
            assert joined(receiver.get("0", "1", "one", meta)[0]) == b"1"
        started = time.monotonic()
        assert receiver.get_blocking("0", "1", "two", meta, timeout_s=0.5) is None
        assert time.monotonic() - started < 3.0
        with ZmqConnector({"role": "sender", "port": port}) as second:
            second.put("0", "1", "two", b"2")
            assert joined(receiver.get_blocking("0", "1", "two", meta, timeout_s=WAIT)[0]) == b"2"
            assert second.health()["sender"]["requests"] == 1  # the stale request never came


# ----------------------------------------------------------------------------- CURVE


def test_curve_admits_only_configured_clients():
    keys = generate_curve_config()
    sender = ZmqConnector({"role": "sender", "port": 0, "curve": keys})
    try:
        sender.put("0", "1", "k", b"secret")
        meta = sender.sender_metadata()
        plain = ZmqConnector({"role": "receiver", "request_timeout_s": 0.5})
        stranger_keys = generate_curve_config()
        stranger = ZmqConnector(
            {
                "role": "receiver",
                "request_timeout_s": 0.5,
                "curve": {
                    "server_public": keys["server_public"],
                    "client_public": stranger_keys["client_public"],
                    "client_secret": stranger_keys["client_secret"],
                },
            }
        )
        trusted = ZmqConnector(
            {"role": "receiver", "curve": {k: keys[k] for k in ("server_public", "client_public", "client_secret")}}
        )
        with plain, stranger, trusted:
            assert plain.get("0", "1", "k", meta) is None
            assert stranger.get("0", "1", "k", meta) is None
            assert sender.health()["sender"]["requests"] == 0
            assert joined(trusted.get("0", "1", "k", meta)[0]) == b"secret"
    finally:
        sender.close()


def test_curve_without_allow_list_admits_any_curve_client():
    keys = generate_curve_config()
    server_only = {k: keys[k] for k in ("server_public", "server_secret")}
    with ZmqConnector({"role": "sender", "port": 0, "curve": server_only}) as sender:
        sender.put("0", "1", "k", b"x")
        with ZmqConnector(
            {"role": "receiver", "curve": {k: keys[k] for k in ("server_public", "client_public", "client_secret")}}
        ) as rx:
            assert joined(rx.get("0", "1", "k", sender.sender_metadata())[0]) == b"x"
    with pytest.raises(ConfigError, match="server_secret"):
        ZmqConnector({"role": "sender", "port": 0, "curve": {"server_public": keys["server_public"]}})
    with ZmqConnector({"role": "sender", "port": 0, "curve": server_only}) as sender:
        sender.put("0", "1", "k", b"x")
        assert sender.get("0", "1", "k") is None  # no client keys: refused at once, not hung
        assert sender.health()["unresolved"] == 1
    with pytest.raises(ConfigError, match="client"):
        ZmqConnector({"role": "receiver", "curve": server_only})


# ----------------------------------------------------------------------------- pools

MiB = 1 << 20
SMALL_CHUNK = 64 * 1024  # the smallest chunk_bytes: streams stay small in tests


class FakeTracker:
    """Stands for a pyzmq MessageTracker: libzmq is done with the bytes once ``done``."""

    def __init__(self) -> None:
        self.done = False

    def wait(self, timeout: float = -1) -> None:
        if not self.done:
            raise zmq.NotDone


def pattern(seed: int, nbytes: int) -> bytes:
    import numpy as np

    return ((np.arange(nbytes) + seed * 31) % 251).astype(np.uint8).tobytes()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(
        st.tuples(st.sampled_from(["put", "serve", "done", "reap"]), st.integers(1, 700), st.integers(0, 9)),
        max_size=40,
    )
)
def test_send_pool_reuses_a_region_only_after_libzmq_is_done(ops):
    """Whatever the order of puts, serves and tracker completions, a payload libzmq may still
    be sending (tracker not done) is never overwritten by a later put."""
    store = HeldPayloads(4096, 64, lambda: 0.0, drain_wait_s=0)
    in_flight: list[tuple[FakeTracker, bytes, memoryview]] = []
    published: dict[str, bytes] = {}
    serial = 0
    for op, size, pick in ops:
        if op == "put":
            serial += 1
            region = store.reserve(size)
            if isinstance(region, PublishFailure):
                assert region.reason == "pool_full"
                continue
            data = pattern(serial, size)
            assert store.write(region, (memoryview(data),))
            key = f"k{pick}"
            assert store.publish(key, region, (size,), readers=1, lease_s=60.0) is None
            published[key] = data
        elif op == "serve" and published:
            key = sorted(published)[pick % len(published)]
            tracker = FakeTracker()
            seen = []

            def send(held, tracker=tracker, seen=seen):
                seen.append(held.whole)
                return [tracker]

            assert store.serve(key, send) == "sent"
            assert bytes(seen[0]) == published[key]
            in_flight.append((tracker, published.pop(key), seen[0]))
        elif op == "done" and in_flight:
            in_flight[pick % len(in_flight)][0].done = True
        elif op == "reap":
            store.reap()
        for tracker, data, view in in_flight:
            if not tracker.done:
                assert bytes(view) == data  # still intact while libzmq may read it
    for tracker, _, _ in in_flight:
        tracker.done = True
    assert store.reap() == 0
    stats = store.stats()
    assert stats["held_bytes"] == sum(len(d) for d in published.values())
    assert stats["in_flight"] == 0 and stats["reserved_bytes"] == 0


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 3000), st.integers(0, 20)), max_size=30))
def test_receive_pool_lends_disjoint_regions_and_gets_them_back_when_dropped(ops):
    pool = RecvPool(8192)
    loans: list[memoryview] = []
    for lend, size, pick in ops:
        if lend:
            loans.append(pool.lend(size))
            if loans[-1] is None:
                loans.pop()
            else:
                assert loans[-1].nbytes == size and not loans[-1].readonly
        elif loans:
            del loans[pick % len(loans)]
        spans = sorted((buffer_address(v), buffer_address(v) + v.nbytes) for v in loans)
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))  # never overlapping
        in_use = pool.stats()["recv_pool_in_use"]
        assert in_use == sum(-(-v.nbytes // 64) * 64 for v in loans)
    loans.clear()  # the last reference: the regions go back at once (no cycles)
    assert pool.stats()["recv_pool_in_use"] == 0
    assert pool.lend(8193) is None and pool.stats()["recv_pool_fallbacks"] >= 1


def test_a_lent_region_stays_taken_while_a_tensor_views_it():
    pool = RecvPool(4096)
    view = pool.lend(1000)
    tensor = torch.frombuffer(view, dtype=torch.uint8)[100:200]
    address = buffer_address(view)
    del view
    assert pool.stats()["recv_pool_in_use"] == 1024  # the tensor still reads it
    assert buffer_address(pool.lend(1000)) != address
    del tensor
    assert buffer_address(pool.lend(1000)) == address  # the same (touched) pages come back


@PROPS
@given(
    st.lists(
        st.tuples(st.sampled_from(["put", "take"]), st.integers(0, 3), st.integers(0, 120), st.floats(0, 5)),
        max_size=40,
    )
)
def test_late_stash_stays_bounded_and_answers_only_its_key(ops):
    stash = LateStash(max_bytes=200, max_age_s=10.0)
    now = 0.0
    for op, key, size, step in ops:
        now += step
        if op == "put":
            stash.put("ep", f"k{key}", Outcome("data", (b"x",), size), now)
            assert stash.nbytes <= 200
        else:
            got = stash.take("ep", f"k{key}", now)
            assert got is None or got.kind == "data"
            assert stash.take("ep", f"k{key}", now) is None  # handed out once
        assert stash.take("other", f"k{key}", now) is None


# ----------------------------------------------------------------------------- streaming


def test_large_payloads_stream_into_the_receive_pool_and_reuse_both_pools(make):
    sender = make(chunk_bytes=SMALL_CHUNK)
    receiver = make("receiver")
    meta = sender.sender_metadata()
    payload = pattern(1, MiB + 123)
    addresses, sent_from = [], []
    for round_ in range(3):
        reservation = sender.reserve("0", "1", f"big{round_}", len(payload))
        sent_from.append(reservation.buffer.data_ptr())
        reservation.buffer.copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
        assert reservation.commit()[0]
        frames, size = receiver.get_blocking("0", "1", f"big{round_}", meta, timeout_s=WAIT)
        assert size == len(payload) and len(frames) == 1 and bytes(frames[0]) == payload
        decoded = torch.frombuffer(frames[0], dtype=torch.uint8)  # a view of the pool region
        assert decoded.data_ptr() == buffer_address(frames[0]) and not frames[0].readonly
        addresses.append(buffer_address(frames[0]))
        del frames, decoded  # the region goes back to the receive pool
        eventually(lambda: sender.health()["sender"]["in_flight"] == 0)  # libzmq is done
    assert len(set(addresses)) == 1 and len(set(sent_from)) == 1  # both pools reused
    stats = sender.health()["sender"]
    assert stats["streams"] == 3
    assert stats["chunks_sent"] == 3 * chunk_count(len(payload), SMALL_CHUNK)
    rx = receiver.health()["receiver"]
    assert rx["streams"] == 3 and rx["recv_pool_hits"] == 3 and rx["recv_pool_in_use"] == 0
    assert rx["stream_aborts"] == 0 and rx["bad_replies"] == 0


def test_small_payloads_and_old_requests_get_one_message(make):
    sender = make(chunk_bytes=SMALL_CHUNK)
    payload = pattern(2, 3 * SMALL_CHUNK)
    sender.put("0", "1", "old", payload)
    ctx = zmq.Context()
    try:
        sock = raw_dealer(ctx, sender.endpoint)
        sock.send(encode_request(Request(5, "old", "now", 0.0)))  # no "stream": one message
        header, *frames = sock.recv_multipart()
        reply = decode_reply(header)
        assert (reply.op, reply.chunk, reply.sizes) == ("data", 0, (len(payload),))
        assert b"".join(frames) == payload
        sock.close()
    finally:
        ctx.destroy(linger=0)
    assert sender.health()["sender"]["streams"] == 0


def test_without_a_receive_pool_streams_arrive_as_chunk_frames(make):
    sender, receiver = make(chunk_bytes=SMALL_CHUNK), make("receiver", recv_pool_bytes=0)
    payload = pattern(3, 5 * SMALL_CHUNK + 7)
    _, _, meta = sender.put("0", "1", "k", payload)
    frames, size = receiver.get("0", "1", "k", meta)
    assert len(frames) == 6 and joined(frames) == payload and size == len(payload)
    assert receiver.health()["receiver"]["recv_pool_fallbacks"] == 1


def test_put_copies_so_the_caller_may_reuse_its_buffers(make):
    sender, receiver = make(), make("receiver")
    data = bytearray(b"before" * 1000)
    tensor = torch.arange(100, dtype=torch.int32)
    _, _, meta = sender.put("0", "1", "k", [data, tensor])
    data[:6] = b"AFTER!"
    tensor.zero_()
    frames, _ = receiver.get("0", "1", "k", meta)
    assert bytes(frames[0]) == b"before" * 1000
    assert torch.equal(torch.frombuffer(bytearray(frames[1]), dtype=torch.int32), torch.arange(100))


def stalled_peer(ctx, sender, key):
    """A DEALER that asks for ``plug`` (which fills its one-message receive queue, unread), then
    for ``key``: libzmq cannot finish sending ``key`` until the peer reads."""
    assert sender.put("0", "1", "plug", b"p" * (256 * 1024))[0]
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    sock.rcvhwm = 1
    sock.rcvbuf = 64 * 1024
    sock.rcvtimeo = int(WAIT * 1000)
    sock.connect(sender.endpoint)
    sock.send(encode_request(Request(1, "plug", "now", 0.0)))
    eventually(lambda: sender.health()["sender"]["served"] == 1)
    eventually(lambda: sender.health()["sender"]["in_flight"] == 0)  # in the peer's queue
    sock.send(encode_request(Request(2, key, "now", 0.0)))
    eventually(lambda: sender.health()["sender"]["served"] == 2)
    return sock


def test_a_served_region_is_held_until_libzmq_is_done_with_it(make):
    """A peer that does not read keeps libzmq sending: the region stays out of the pool (put
    waits drain_wait_s, then pool_full) until the bytes are gone, then it is reused."""
    size = 24 * MiB
    sender = make(pool_bytes=size + size // 2, drain_wait_s=0.2, chunk_bytes=0)
    payload = torch.randint(0, 255, (size,), dtype=torch.uint8, generator=torch.Generator().manual_seed(5))
    assert sender.put("0", "1", "big", payload)[0]
    ctx = zmq.Context()
    try:
        sock = stalled_peer(ctx, sender, "big")
        health = sender.health()["sender"]
        assert health["in_flight"] == 1 and health["held_bytes"] == size  # read, not yet freed
        ok, _, why = sender.put("0", "1", "next", payload)
        assert not ok and why["reason"] == "pool_full"
        assert sender.health()["sender"]["drain_waits"] == 1
        sock.recv_multipart()  # the plug
        header, frame = sock.recv_multipart(copy=False)
        assert decode_reply(header.bytes).sizes == (size,)
        assert torch.equal(torch.frombuffer(frame.buffer, dtype=torch.uint8), payload)  # intact
        eventually(lambda: sender.health()["sender"]["in_flight"] == 0)
        assert sender.put("0", "1", "next", payload)[0]
        sock.close()
    finally:
        ctx.destroy(linger=0)


def test_a_put_waits_for_a_send_in_flight_instead_of_failing(make):
    size = 24 * MiB
    sender = make(pool_bytes=size + size // 2, drain_wait_s=WAIT)
    assert sender.put("0", "1", "big", b"\x01" * size)[0]
    ctx = zmq.Context()
    try:
        sock = stalled_peer(ctx, sender, "big")
        assert sender.health()["sender"]["in_flight"] == 1

        def read_once_the_put_waits():
            eventually(lambda: sender.health()["sender"]["drain_waits"] == 1)
            sock.recv_multipart()
            sock.recv_multipart(copy=False)

        reader = threading.Thread(target=read_once_the_put_waits)
        reader.start()
        assert sender.put("0", "1", "next", b"\x02" * size)[0]  # waited, then got the room
        reader.join(WAIT)
        assert not reader.is_alive()
        sock.close()
    finally:
        ctx.destroy(linger=0)


def streamed_header(corr_id: int, sizes: tuple[int, ...], chunk: int) -> bytes:
    return encode_reply(Reply("data", corr_id, "k", sizes=sizes, chunk=chunk))


@pytest.mark.parametrize("breakage", ["new_reply", "gap", "wrong_size", "extra_frame", "stall"])
def test_receiver_drops_a_broken_stream_and_gives_its_region_back(fake_sender, breakage):
    sock, meta = fake_sender
    with ZmqConnector({"role": "receiver", "stream_idle_s": 0.3}) as receiver:
        result = {}
        waiter = threading.Thread(
            target=lambda: result.update(got=receiver.get_blocking("0", "1", "k", meta, timeout_s=WAIT))
        )
        started = time.monotonic()
        waiter.start()
        identity, body = sock.recv_multipart()
        corr = decode_request(body).corr_id
        assert decode_request(body).stream
        sock.send_multipart([identity, streamed_header(corr, (6, 4), 4)])
        sock.send_multipart([identity, encode_chunk(corr, 0), b"abcd"])
        if breakage == "new_reply":
            other = Reply("miss", corr + 1, "x", reason="timeout")
            sock.send_multipart([identity, encode_reply(other)])
        elif breakage == "gap":
            sock.send_multipart([identity, encode_chunk(corr, 2), b"ij"])
        elif breakage == "wrong_size":
            sock.send_multipart([identity, encode_chunk(corr, 1), b"efghX"])
        elif breakage == "extra_frame":
            sock.send_multipart([identity, encode_chunk(corr, 1), b"efgh", b"more"])
        waiter.join(WAIT)
        assert result["got"] is None and time.monotonic() - started < WAIT / 2
        health = receiver.health()["receiver"]
        assert health["stream_aborts"] == 1 and health["errors"] == 1
        gc.collect()
        assert receiver.health()["receiver"]["recv_pool_in_use"] == 0
        # the next, complete stream from the same sender is delivered
        waiter = threading.Thread(
            target=lambda: result.update(got=receiver.get_blocking("0", "1", "k", meta, timeout_s=WAIT))
        )
        waiter.start()
        identity, body = sock.recv_multipart()
        corr = decode_request(body).corr_id
        sock.send_multipart([identity, streamed_header(corr, (6, 4), 4)])
        for seq, piece in enumerate((b"abcd", b"efgh", b"ij")):
            sock.send_multipart([identity, encode_chunk(corr, seq), piece])
        waiter.join(WAIT)
        assert joined(result["got"][0]) == b"abcdefghij"


def test_a_chunk_without_a_stream_is_a_bad_reply(fake_sender):
    sock, meta = fake_sender
    with ZmqConnector({"role": "receiver"}) as receiver:
        result = {}
        waiter = threading.Thread(
            target=lambda: result.update(got=receiver.get_blocking("0", "1", "k", meta, timeout_s=WAIT))
        )
        waiter.start()
        identity, body = sock.recv_multipart()
        corr = decode_request(body).corr_id
        sock.send_multipart([identity, encode_chunk(corr, 0), b"stray"])  # no header before it
        sock.send_multipart([identity, encode_reply(Reply("data", corr, "k", sizes=(2,))), b"ok"])
        waiter.join(WAIT)
        assert joined(result["got"][0]) == b"ok"  # the stray chunk answered nothing
        assert receiver.health()["receiver"]["bad_replies"] == 1


def test_steady_state_transfers_do_not_page_fault(make):
    """After warm-up, a payload goes through the send pool, the wire and the receive pool
    without touching fresh pages (both sides in this process)."""
    import resource

    sender, receiver = make(chunk_bytes=256 * 1024), make("receiver")
    meta = sender.sender_metadata()
    size = 16 * MiB
    source = torch.full((size,), 7, dtype=torch.uint8)

    def transfer(key):
        reservation = sender.reserve("0", "1", key, size)
        reservation.buffer.copy_(source)
        reservation.commit()
        frames, _ = receiver.get_blocking("0", "1", key, meta, timeout_s=WAIT)
        assert frames[0][size - 1] == 7
        del frames
        eventually(lambda: sender.health()["sender"]["in_flight"] == 0)

    for i in range(3):
        transfer(f"warm{i}")
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for i in range(4):
        transfer(f"k{i}")
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    assert faults / (4 * size / 1e6) < 10, f"{faults} page faults for {4 * size} bytes"


def test_streaming_config_is_validated():
    for raw, word in (
        ({"chunk_bytes": 1000}, "chunk_bytes"),
        ({"prefault": "yes"}, "prefault"),
        ({"recv_hwm": -1}, "recv_hwm"),
        ({"recv_pool_bytes": -5}, "recv_pool_bytes"),
        ({"drain_wait_s": -1}, "drain_wait_s"),
        ({"stream_idle_s": 0}, "stream_idle_s"),
    ):
        with pytest.raises(ConfigError, match=word):
            ZmqConfig.from_mapping(raw)
    cfg = ZmqConfig.from_mapping({"chunk_bytes": 0, "drain_wait_s": 0, "prefault": True})
    assert (cfg.chunk_bytes, cfg.drain_wait_s, cfg.prefault) == (0, 0.0, True)


def test_a_prefaulted_pool_and_chunk_bytes_zero_send_one_message(make):
    sender, receiver = make(pool_bytes=4 * MiB, prefault=True, chunk_bytes=0), make("receiver")
    payload = pattern(4, 3 * MiB)
    _, _, meta = sender.put("0", "1", "k", payload)
    frames, _ = receiver.get("0", "1", "k", meta)
    assert joined(frames) == payload and sender.health()["sender"]["streams"] == 0
