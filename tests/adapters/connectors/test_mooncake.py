"""The mooncake connector: control messages, config, endpoint resolution, unavailability, and
(when the engine is installed) leases, claims, dead peers and size checks over loopback TCP.

The connector contract itself is run by tests/contract (factory ``mooncake``)."""

from __future__ import annotations

import logging
import socket
import sys
import threading
import time

import msgpack
import pytest
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st
from mooncake_support import mooncake_missing

from kvferry.adapters.connectors.mooncake import wire
from kvferry.adapters.connectors.mooncake.config import MooncakeConfig
from kvferry.adapters.connectors.mooncake.engine import _chunks, unavailable_message
from kvferry.adapters.connectors.mooncake.receive import Endpoint, pin_margin_s, resolve_endpoint
from kvferry.core.control import Rejection
from kvferry.core.errors import (
    BindError,
    ConfigError,
    ConnectorUnavailable,
    LeaseExpired,
    PayloadError,
    SenderUnavailable,
)
from kvferry.core.policy import SENDER_DOWN_GRACE_S
from kvferry.core.tombstones import failure_record

settings.register_profile("kvferry-mooncake", max_examples=80, deadline=None)
PROFILE = settings.get_profile("kvferry-mooncake")

ids = st.integers(0, 2**63 - 1)
keys = st.text(min_size=1, max_size=64)
seconds = st.floats(0, 3600, allow_nan=False)
u64 = st.integers(0, 2**64 - 1)

lookups = st.builds(wire.Lookup, ids, keys, u64, seconds, st.booleans())
found = st.builds(
    lambda i, c, a, s, p, pin: wire.LookupReply(
        i, True, claim=c, addr=a, size=min(s, 2**64 - 1 - a), rpc_port=p, pin_s=pin
    ),
    ids,
    st.integers(1, 2**63 - 1),
    st.integers(1, 2**63),
    u64,
    st.integers(1, 65535),
    seconds,
)
misses = st.builds(
    lambda i, r, s, why: wire.LookupReply(
        i, False, size=s, reason=r, failure=failure_record("put", why) if r == "failed" else None
    ),
    ids,
    st.sampled_from(wire.MISS_REASONS),
    u64,
    st.text(max_size=40),
)
pieces = st.lists(st.tuples(st.integers(1, 2**48), st.integers(1, 2**32)), min_size=1, max_size=40)
in_pieces = st.builds(
    lambda i, c, sp, p, pin: wire.LookupReply(
        i, True, claim=c, addr=sp[0][0], size=sum(n for _, n in sp), rpc_port=p, pin_s=pin, spans=sp
    ),
    ids,
    st.integers(1, 2**63 - 1),
    pieces,
    st.integers(1, 65535),
    seconds,
)
dones = st.builds(wire.Done, ids, keys, ids, st.booleans())
acks = st.builds(wire.Ack, ids)
messages = st.one_of(lookups, found, in_pieces, misses, dones, acks)


# -- control messages --------------------------------------------------------------------------


@PROFILE
@given(messages)
def test_every_message_round_trips(message) -> None:
    assert wire.decode(wire.encode(message)) == message


@PROFILE
@given(st.binary(max_size=300))
def test_random_bytes_decode_to_a_message_or_a_rejection(raw) -> None:
    decoded = wire.decode(raw)  # never raises
    assert isinstance(decoded, (Rejection, wire.Lookup, wire.LookupReply, wire.Done, wire.Ack))


@PROFILE
@given(messages, st.data())
def test_mutated_fields_decode_to_a_rejection_or_the_same_kind(message, data) -> None:
    body = msgpack.unpackb(wire.encode(message), raw=False)
    name = data.draw(st.sampled_from(sorted(body)))
    body[name] = data.draw(
        st.one_of(
            st.none(),
            st.booleans(),
            st.integers(-(2**63), 2**64 - 1),
            st.floats(),
            st.text(max_size=5),
            st.lists(st.integers(-5, 5), max_size=2),
        )
    )
    decoded = wire.decode(msgpack.packb(body))
    if isinstance(decoded, Rejection):
        assert decoded.reason == "bad_request" and decoded.detail
        return
    assert type(decoded) is type(message) or name == "op"


def test_decode_rejects_wrong_version_unknown_op_and_oversize() -> None:
    good = msgpack.unpackb(wire.encode(wire.Ack(1)))
    for raw, why in (
        (msgpack.packb({**good, "v": 99}), "version"),
        (msgpack.packb({**good, "op": "exec"}), "unknown control op"),
        (b"\x80" * (wire.MAX_MESSAGE_BYTES + 1), "exceeds"),
        (msgpack.packb({"v": 1, "op": "done", "id": 1}), "incomplete"),
    ):
        rejection = wire.decode(raw)
        assert isinstance(rejection, Rejection) and why in rejection.detail


def test_a_payload_in_pieces_lists_them_in_order_and_one_piece_is_sent_as_before() -> None:
    reply = wire.LookupReply(3, True, claim=1, addr=4096, size=30, rpc_port=9, spans=[[4096, 10], [99, 20]])
    assert reply.spans == ((4096, 10), (99, 20)) and wire.decode(wire.encode(reply)) == reply
    # a reply and a lookup without pieces carry no field for them (receivers before spans read them)
    plain = msgpack.unpackb(wire.encode(wire.LookupReply(3, True, claim=1, addr=64, size=8, rpc_port=9)))
    assert "spans" not in plain and "spans_ok" not in msgpack.unpackb(wire.encode(wire.Lookup(1, "k", 8)))
    assert msgpack.unpackb(wire.encode(wire.Lookup(1, "k", 8, spans_ok=True)))["spans_ok"] is True
    for bad in (
        dict(spans=[[4096, 10], [99, 19]]),  # lengths do not add up to the size
        dict(spans=[[64, 10], [99, 20]]),  # the first piece is not at addr
        dict(spans=[[4096, 30], [0, 0]][:1] + [[0, 5]]),  # a piece at address 0
        dict(spans=[[4096, 10], [99, 20, 1]]),  # not a pair
        dict(spans=[[4096, 1]] * (wire.MAX_SPANS + 1)),  # too many
    ):
        with pytest.raises(PayloadError):
            wire.LookupReply(3, True, claim=1, addr=4096, size=30, rpc_port=9, **bad)
    with pytest.raises(PayloadError, match="miss"):
        wire.LookupReply(3, False, reason="not_found", spans=[[4096, 10]])
    # the most pieces a reply may list fit in one control message
    most = [[2**64 - 2**40 + i * 2**20, 2**20] for i in range(wire.MAX_SPANS)]
    big = wire.LookupReply(2**63 - 1, True, claim=2**63 - 1, addr=most[0][0], size=wire.MAX_SPANS * 2**20,
                           rpc_port=65535, pin_s=3600.0, spans=most)  # fmt: skip
    assert len(wire.encode(big)) <= wire.MAX_MESSAGE_BYTES and wire.decode(wire.encode(big)) == big


def test_a_sender_answers_a_payload_in_pieces_with_its_spans_and_frees_it_once() -> None:
    """SenderState: a lookup that does not read pieces is refused before it takes a turn; one
    that does gets the pool region then the spans; on_free runs once, after the lock is
    released, whether the entry is read or its lease passes."""
    from kvferry.adapters.connectors.mooncake.server import SenderState
    from kvferry.core.pool import PoolLedger

    now = [0.0]
    state = SenderState(PoolLedger.create(4096, alignment=64, hold_s=5.0), 1 << 20, 7000, 5.0, lambda: now[0])
    calls: list[str] = []

    def on_free(key: str):
        def call() -> None:
            assert not state.lock.locked()  # outside the lock
            calls.append(key)

        return call

    for key in ("a", "b"):
        with state.held() as ledger:
            region = ledger.reserve(100)
            state.add_pieces(region, [(1 << 30, 500), (1 << 31, 24)], on_free(key))
            ledger.publish(key, region, now_s=0.0, lease_s=10.0, size=624)
    refused = state.answer(wire.Lookup(1, "a", 1 << 20))
    assert refused is not None and (refused.found, refused.reason) == (False, "bad_request")
    assert state.counters["pieces_refused"] == 1
    reply = state.answer(wire.Lookup(2, "a", 1 << 20, spans_ok=True))  # still there: nothing taken
    assert reply is not None and reply.found and reply.size == 624
    assert reply.spans == ((reply.addr, 100), (1 << 30, 500), (1 << 31, 24)) and reply.addr >= 1 << 20
    assert state.answer(wire.Lookup(3, "a", 600, spans_ok=True)).reason == "not_found"  # consumed
    assert state.answer(wire.Lookup(4, "b", 600, spans_ok=True)).reason == "no_room"  # the whole size
    assert calls == []
    state.finish(wire.Done(5, "a", reply.claim, True))
    assert calls == ["a"]
    now[0] = 11.0  # "b" was never read: its lease passes
    state.sweep()
    assert calls == ["a", "b"] and state.ledger.allocator.used_bytes == 0
    state.sweep()
    assert calls == ["a", "b"]  # once


def test_found_reply_must_name_a_claim_and_a_miss_must_not() -> None:
    with pytest.raises(PayloadError):
        wire.LookupReply(1, True, claim=0, addr=64, rpc_port=5)
    with pytest.raises(PayloadError):
        wire.LookupReply(1, False, claim=3, reason="not_found")
    with pytest.raises(PayloadError):
        wire.LookupReply(1, False, reason="because")


# -- pure helpers ------------------------------------------------------------------------------


@PROFILE
@given(st.integers(1, 10**8), st.integers(0, 2000), st.integers(0, 10**8))
def test_chunks_tile_the_span_in_order(chunk, whole, extra) -> None:
    length = chunk * whole + extra % chunk
    pieces = _chunks(length, chunk)
    assert sum(size for _, size in pieces) == length
    cursor = 0
    for offset, size in pieces:
        assert offset == cursor and 0 < size <= chunk
        cursor += size


@PROFILE
@given(st.floats(1e-3, 1e6, allow_nan=False))
def test_pin_margin_is_positive_and_small(pin_s) -> None:
    margin = pin_margin_s(pin_s)
    assert 0 < margin <= pin_s / 10 and margin <= 1.0


hosts = st.text(alphabet="abc.0123456789", min_size=1, max_size=20)
ports = st.integers(1, 65535)


@PROFILE
@given(hosts, ports, st.none() | st.integers(0, 2**40), st.none() | st.tuples(hosts, ports))
def test_metadata_endpoint_wins_over_the_default(host, port, size, default) -> None:
    meta = {"source_host": host, "source_port": port}
    if size is not None:
        meta["size"] = size
    assert resolve_endpoint(meta, default) == Endpoint(host, port, size)


@PROFILE
@given(st.none() | st.tuples(hosts, ports), st.none() | st.integers(0, 100))
def test_without_an_endpoint_in_metadata_the_default_is_used(default, size) -> None:
    meta = None if size is None else {"size": size}
    got = resolve_endpoint(meta, default)
    if default is None:
        assert got is None
    else:
        assert got == Endpoint(default[0], default[1], size)


def test_a_host_without_a_port_resolves_only_to_the_default_on_that_host() -> None:
    assert resolve_endpoint({"source_host": "h"}, ("h", 9)) == Endpoint("h", 9)
    assert resolve_endpoint({"source_host": "other"}, ("h", 9)) is None
    assert resolve_endpoint({"source_host": "h"}, None) is None


@pytest.mark.parametrize(
    "meta, word",
    [
        ({"source_host": "h", "source_port": 0}, "source_port"),
        ({"source_port": 5}, "source_host"),
        ({"source_host": "h", "source_port": True}, "source_port"),
        ({"source_host": "", "source_port": 5}, "source_host"),
        ({"source_host": "h", "source_port": 5, "size": -1}, "size"),
        ([("source_host", "h")], "mapping"),
    ],
)
def test_bad_metadata_is_a_config_error_naming_the_key(meta, word) -> None:
    with pytest.raises(ConfigError, match=word):
        resolve_endpoint(meta, None)


# -- config -------------------------------------------------------------------------------------


def test_config_defaults_and_unknown_keys() -> None:
    cfg = MooncakeConfig.from_mapping({"type": "mooncake", "something_else": 1})
    assert (cfg.role, cfg.host, cfg.port, cfg.readers, cfg.protocol) == ("sender", "127.0.0.1", 0, 1, "tcp")
    assert (cfg.hold_s, cfg.transfer_timeout_s) == (30.0, 10.0)


@PROFILE
@given(st.floats(0.01, 1000.0, allow_nan=False), st.one_of(st.none(), st.floats(0.01, 1000.0, allow_nan=False)))
def test_a_read_deadline_is_below_the_claims_hold_or_the_config_names_it(hold_s, transfer_s) -> None:
    """A read may last until its deadline; the sender's claim must pin the region longer, so
    ``transfer_timeout_s`` is below ``hold_s``: given, or by default 10 s or half the hold."""
    raw = {"hold_s": hold_s} if transfer_s is None else {"hold_s": hold_s, "transfer_timeout_s": transfer_s}
    if transfer_s is not None and transfer_s >= hold_s:
        with pytest.raises(ConfigError, match="'transfer_timeout_s'.*'hold_s'"):
            MooncakeConfig.from_mapping(raw)
        return
    cfg = MooncakeConfig.from_mapping(raw)
    assert cfg.transfer_timeout_s < cfg.hold_s
    assert cfg.transfer_timeout_s == (min(10.0, hold_s / 2) if transfer_s is None else transfer_s)


@pytest.mark.parametrize(
    "key, value",
    [
        ("role", "both"),
        ("port", 70000),
        ("port", -1),
        ("pool_bytes", 0),
        ("readers", 0),
        ("lease_s", 0),
        ("hold_s", float("inf")),
        ("protocol", "udp"),
        ("host", ""),
        ("alignment", 48),
        ("chunk_bytes", 10),
        ("transfer_timeout_s", 0),
        ("shared_engine", "yes"),
        ("readers", True),
    ],
)
def test_bad_config_values_name_the_key(key, value) -> None:
    with pytest.raises(ConfigError, match=key):
        MooncakeConfig.from_mapping({key: value})


# -- unavailability -----------------------------------------------------------------------------


def test_missing_package_fails_at_creation_saying_what_to_install(monkeypatch) -> None:
    from kvferry.adapters.connectors.mooncake.connector import MooncakeConnector

    monkeypatch.setitem(sys.modules, "mooncake", None)  # what Python sees when it is not installed
    monkeypatch.setitem(sys.modules, "mooncake.engine", None)
    config = {"type": "mooncake", "role": "receiver", "pool_bytes": 4096, "shared_engine": False}
    with pytest.raises(ConnectorUnavailable, match=r"pip install 'kvferry\[mooncake\]'"):
        MooncakeConnector.from_config(config)


def test_registry_reports_the_missing_package_at_creation(monkeypatch) -> None:
    from kvferry.app.registry import ConnectorRegistry

    monkeypatch.setitem(sys.modules, "mooncake", None)
    monkeypatch.setitem(sys.modules, "mooncake.engine", None)
    registry = ConnectorRegistry()
    config = {"type": "mooncake", "role": "sender", "pool_bytes": 4096, "shared_engine": False}
    for _ in range(2):  # remembered: the second attempt fails the same way, at once
        with pytest.raises(ConnectorUnavailable, match="pip install"):
            registry.create(config)


def test_missing_system_library_names_the_debian_package() -> None:
    error = ImportError("libibverbs.so.1: cannot open shared object file: No such file or directory")
    assert "apt-get install -y libibverbs1" in unavailable_message(error)
    assert "pip install" in unavailable_message(ModuleNotFoundError("No module named 'mooncake'"))


class FailingEngine:
    def initialize(self, *args: object) -> int:
        return -1


def test_engine_that_fails_to_start_is_connector_unavailable() -> None:
    from kvferry.adapters.connectors.mooncake.connector import MooncakeConnector

    with pytest.raises(ConnectorUnavailable, match="failed to initialise"):
        MooncakeConnector.from_config({"role": "sender", "pool_bytes": 4096}, engine_factory=FailingEngine)


# -- with the engine ----------------------------------------------------------------------------


def _engine_or_skip() -> None:
    missing = mooncake_missing()
    if missing is not None:
        pytest.skip(missing)


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0
        self.lock = threading.Lock()

    def monotonic(self) -> float:
        with self.lock:
            return self.now

    def advance(self, seconds: float) -> None:
        with self.lock:
            self.now += seconds


@pytest.fixture
def make():
    _engine_or_skip()
    from kvferry.adapters.connectors.mooncake.connector import MooncakeConnector

    made = []

    def build(**config):
        config.setdefault("pool_bytes", 1 << 20)
        conn = MooncakeConnector.from_config(config)
        made.append(conn)
        return conn

    yield build
    for conn in reversed(made):
        conn.close()


def test_sender_reports_its_os_chosen_port(make) -> None:
    sender = make(role="sender", port=0)
    assert sender.port > 0 and sender.health()["port"] == sender.port
    ok, size, meta = sender.put("0", "1", "k", b"abc")
    assert ok and meta == {"source_host": "127.0.0.1", "source_port": sender.port, "size": 3}


def test_bind_failure_names_host_and_port(make) -> None:
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    try:
        with pytest.raises(BindError, match=f"127.0.0.1:{port}"):
            make(role="sender", port=port)
    finally:
        taken.close()


def test_put_on_a_receiver_is_a_typed_failure(make) -> None:
    receiver = make(role="receiver")
    ok, size, info = receiver.put("0", "1", "k", b"x")
    assert (ok, size, info["reason"]) == (False, 0, "error")


def test_get_without_any_sender_is_none_with_reason(make) -> None:
    receiver = make(role="receiver")
    assert receiver.get("0", "1", "k") is None
    assert receiver.last_failure("k") == "no_sender"


def test_expired_lease_is_reported_as_such(make) -> None:
    clock = FakeClock()
    sender = make(role="sender", lease_s=5.0, clock=clock)
    receiver = make(role="receiver", clock=clock)
    receiver.update_sender_info("127.0.0.1", sender.port)
    assert sender.put("0", "1", "late", b"z" * 1000)[0]
    clock.advance(5.0)
    assert receiver.get("0", "1", "late") is None
    assert receiver.last_failure("late") == "expired"
    health = sender.health()
    assert health["expired_unread"] == 1 and health["used_bytes"] == 0
    start = time.monotonic()
    with pytest.raises(LeaseExpired):  # a blocking get hears it at once: waiting cannot help
        receiver.get_blocking("0", "1", "late", timeout_s=30.0)
    assert time.monotonic() - start < 2.0
    assert sender.put("0", "1", "fresh", b"y" * 100)[0]  # the control: a live key is read
    data, size = receiver.get_blocking("0", "1", "fresh", timeout_s=30.0)
    assert size == 100
    data.release()


def _raw_lookup(port: int, key: str) -> wire.LookupReply:
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    sock.connect(f"tcp://127.0.0.1:{port}")
    try:
        sock.send(wire.encode(wire.Lookup(7, key, 1 << 30, 0.0)))
        assert sock.poll(5000), "no reply from the sender"
        reply = wire.decode(sock.recv())
        assert isinstance(reply, wire.LookupReply)
        return reply
    finally:
        sock.close()


def test_a_claim_never_finished_is_revoked_after_hold_s(make) -> None:
    clock = FakeClock()
    sender = make(role="sender", hold_s=3.0, lease_s=100.0, clock=clock)
    assert sender.put("0", "1", "stuck", b"q" * 5000)[0]
    reply = _raw_lookup(sender.port, "stuck")  # a reader that claims and vanishes
    assert reply.found and reply.size == 5000 and reply.pin_s == 3.0
    assert sender.health()["used_bytes"] > 0
    clock.advance(3.0)
    assert sender.put("0", "1", "next", b"n")[0]  # every put sweeps first
    health = sender.health()
    assert health["revoked_claims"] == 1 and health["live_regions"] == 1  # only "next" is held
    assert _raw_lookup(sender.port, "stuck").reason == "not_found"  # consumed, never re-served


def test_malformed_control_messages_are_counted_and_ignored(make) -> None:
    sender = make(role="sender")
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    sock.connect(f"tcp://127.0.0.1:{sender.port}")
    try:
        sock.send(b"\xc1garbage")
        sock.send_multipart([b"two", b"frames"])
        sock.send(wire.encode(wire.Lookup(1, "nothing", 10, 0.0)))
        assert sock.poll(5000)
        assert wire.decode(sock.recv()) == wire.LookupReply(1, False, reason="not_found")
    finally:
        sock.close()
    assert sender.health()["bad_requests"] == 2


def test_a_payload_larger_than_the_receivers_room_is_not_consumed(make) -> None:
    sender = make(role="sender", pool_bytes=1 << 20)
    small = make(role="receiver", pool_bytes=64 * 1024)
    large = make(role="receiver", pool_bytes=1 << 20)
    ok, _, meta = sender.put("0", "1", "wide", bytes(range(256)) * 1024)
    assert ok
    assert small.get("0", "1", "wide", meta) is None and small.last_failure("wide") == "no_room"
    got = large.get("0", "1", "wide", meta)
    assert got is not None and bytes(got[0].tensor.numpy()) == bytes(range(256)) * 1024
    got[0].release()


def test_announced_size_must_match_the_senders(make, caplog) -> None:
    sender = make(role="sender")
    receiver = make(role="receiver")
    ok, _, meta = sender.put("0", "1", "sized", b"1234")
    assert ok
    with caplog.at_level(logging.WARNING, logger="kvferry"):
        assert receiver.get("0", "1", "sized", {**meta, "size": 5}) is None
    assert receiver.last_failure("sized") == "size_mismatch"
    assert [r.getMessage() for r in caplog.records if "announces" in r.getMessage()] == [
        "mooncake get 'sized': sender announces 4 bytes, put said 5"
    ]
    assert receiver.health()["room"] == 1 << 20  # nothing kept for the refused payload
    # the refused claim gave its reader slot back: a get that names the right size still reads it
    got = receiver.get("0", "1", "sized", meta)
    assert got is not None and bytes(got[0].tensor.numpy()) == b"1234"
    got[0].release()
    assert sender.health()["read_failed"] == 1


def test_two_readers_each_get_their_copy_then_it_is_freed(make) -> None:
    sender = make(role="sender", readers=2)
    first, second = make(role="receiver"), make(role="receiver")
    ok, _, meta = sender.put("0", "1", "shared", b"s" * 4096)
    assert ok
    a = first.get("0", "1", "shared", meta)
    b = second.get("0", "1", "shared", meta)
    assert a is not None and b is not None
    assert a[0].tensor.data_ptr() != b[0].tensor.data_ptr()
    assert first.get("0", "1", "shared", meta) is None
    assert sender.health()["used_bytes"] == 0  # both reads done: the sender region is free
    a[0].release()
    b[0].release()
    assert first.health()["room"] == 1 << 20


def test_a_long_poll_that_ends_without_the_key_is_a_timeout(make) -> None:
    sender = make(role="sender")
    receiver = make(role="receiver")
    receiver.update_sender_info("127.0.0.1", sender.port)
    assert receiver.get_blocking("0", "1", "absent", timeout_s=0.2) is None
    assert receiver.last_failure("absent") == "timeout"
    assert receiver.get("0", "1", "absent") is None
    assert receiver.last_failure("absent") == "not_found"


def test_a_sender_never_reached_is_asked_again_until_the_deadline(make) -> None:
    """A receiver may start before its sender: a blocking get of an endpoint it never reached
    asks again while it cannot connect, and returns None at its deadline, not sooner (an early
    None reads as the deadline passing); a plain get misses at once."""
    sender = make(role="sender")
    receiver = make(role="receiver")
    port = sender.port
    sender.close()
    where = {"source_host": "127.0.0.1", "source_port": port}
    start = time.monotonic()
    assert receiver.get_blocking("0", "1", "k", where, timeout_s=1.0) is None
    assert 1.0 <= time.monotonic() - start < 3.0
    assert receiver.last_failure("k") == "sender_unavailable"
    assert receiver.health()["miss_sender_unavailable"] == 1  # one miss: the get's, however many asks
    start = time.monotonic()
    assert receiver.get("0", "1", "k", where) is None
    assert time.monotonic() - start < 1.0 and receiver.last_failure("k") == "sender_unavailable"


def _wait_established(port: int, timeout_s: float = 10.0) -> None:
    """Until a TCP connection to 127.0.0.1:``port`` is established (this process's
    ``/proc/net/tcp``: local port ``port``, state 01)."""
    deadline = time.monotonic() + timeout_s
    pause = threading.Event()
    while True:
        with open("/proc/net/tcp") as f:
            rows = [line.split() for line in f.readlines()[1:]]
        if any(int(r[1].split(":")[1], 16) == port and r[3] == "01" for r in rows):
            return
        assert time.monotonic() < deadline, f"no connection to port {port} within {timeout_s} s"
        pause.wait(0.01)


def test_a_sender_restarted_on_the_same_port_serves_the_next_get_bit_exact(make) -> None:
    """A receiver's pooled control channel lost its connection while idle (the sender died) and
    ZMQ reconnected it to the sender restarted on the same port. The drop is history: the next
    get reads the new payload, and no claim is lost to it (before, the get answered
    sender_unavailable after the new sender had claimed the payload for it, and every retry
    then found the key consumed: "not_found" until the deadline)."""
    first = make(role="sender", port=0)
    receiver = make(role="receiver")
    ok, _, meta = first.put("0", "1", "before", b"b" * 4096)
    got = receiver.get("0", "1", "before", meta)
    assert ok and got is not None
    got[0].release()
    port = first.port
    first.close()  # the receiver's channel to it stays in the receiver's pool
    second = make(role="sender", port=port)
    payload = bytes(range(256)) * 64
    ok, _, meta = second.put("0", "1", "after", payload)
    assert ok
    _wait_established(port)  # ZMQ has reconnected the idle channel to the new sender
    tries = []
    for _ in range(2):  # a connection still down when the get starts fails before sending; a retry reads
        got = receiver.get_blocking("0", "1", "after", meta, timeout_s=10.0)
        tries.append(receiver.last_failure("after"))
        if got is not None:
            break
    assert got is not None, tries
    assert bytes(got[0].tensor.numpy()) == payload
    got[0].release()
    assert set(tries[:-1]) <= {"sender_unavailable"}, tries
    health = second.health()
    assert (health["claims"], health["delivered"], health["used_bytes"]) == (1, 1, 0), health


def test_an_idle_channel_to_a_sender_that_died_fails_promptly(make) -> None:
    """The other side of the rule above: a sender this receiver reached, gone for good, ends a
    blocking get with SenderUnavailable, not at the deadline, and claims nothing anywhere. It
    ends once the sender has been unreachable for the grace, or at once where the channel sees
    the connection drop only after the lookup went out on it (both documented in
    ``get_blocking``: which one depends on when the socket's monitor reports the close; CI saw
    the second, 0.7 ms after the call, on a loaded host)."""
    sender = make(role="sender", port=0)
    receiver = make(role="receiver")
    ok, _, meta = sender.put("0", "1", "once", b"o" * 512)
    got = receiver.get("0", "1", "once", meta)
    assert ok and got is not None
    got[0].release()
    sender.close()
    start = time.monotonic()
    with pytest.raises(SenderUnavailable, match="unreachable"):
        receiver.get_blocking("0", "1", "gone", meta, timeout_s=10.0)
    assert time.monotonic() - start < SENDER_DOWN_GRACE_S + 2.0  # deadline: 10 s
    assert receiver.last_failure("gone") == "sender_gone"
    assert receiver.health()["room"] == 1 << 20  # the failed get holds no room of the receiver's pool


def test_pool_buffer_release_is_idempotent_and_returns_the_room(make) -> None:
    sender = make(role="sender")
    receiver = make(role="receiver")
    ok, _, meta = sender.put("0", "1", "r", b"r" * 10_000)
    got = receiver.get("0", "1", "r", meta)
    assert ok and got is not None
    buffer, size = got
    assert size == 10_000 and buffer.tensor.dtype.itemsize == 1 and buffer.tensor.dim() == 1
    assert receiver.health()["room"] < 1 << 20
    with buffer:
        pass
    buffer.release()
    assert receiver.health()["room"] == 1 << 20


def test_bench_raw_transfer_reports_throughput() -> None:
    _engine_or_skip()
    from kvferry.adapters.connectors.mooncake.engine import bench_raw_transfer

    result = bench_raw_transfer(1 << 20, reps=2)
    assert result["nbytes"] == 1 << 20 and len(result["seconds"]) == 2
    assert result["best_gbps"] >= result["median_gbps"] > 0


# -- get_many: one exchange for several keys -----------------------------------------------------


def test_get_many_reads_what_is_there_and_leaves_the_rest(make) -> None:
    sender = make(role="sender", pool_bytes=1 << 20)
    receiver = make(role="receiver", pool_bytes=1 << 20)
    blobs = {f"layer_{i}": bytes([i]) * (1000 + 37 * i) for i in range(6)}
    metas = [sender.put("0", "1", k, v)[2] for k, v in blobs.items()]
    keys = ["layer_3", "absent", *blobs]
    got = receiver.get_many("0", "1", keys, metas[0])
    assert got[1] is None and receiver.last_failure("absent") == "not_found"
    # the second layer_3 found it consumed (one reader): only the first was claimed
    assert [k for k, g in zip(keys, got) if g is None] == ["absent", "layer_3"]
    for key, one in zip([keys[0], *keys[2:]], [got[0], *got[2:]]):
        if one is not None:
            assert one[1] == len(blobs[key]) and bytes(one[0].tensor.numpy()) == blobs[key], key
    assert sender.health()["used_bytes"] == 0 and sender.health()["delivered"] == len(blobs)
    for one in got:
        if one is not None:
            one[0].release()
    assert receiver.health()["room"] == 1 << 20
    assert receiver.get_many("0", "1", list(blobs), metas[0]) == [None] * len(blobs)  # consumed


def test_get_many_gives_back_what_found_no_room_and_a_later_get_reads_it(make) -> None:
    sender = make(role="sender", pool_bytes=1 << 20)
    receiver = make(role="receiver", pool_bytes=96 * 1024)
    first, second = b"a" * (60 * 1024), b"b" * (60 * 1024)
    meta = sender.put("0", "1", "first", first)[2]
    sender.put("0", "1", "second", second)
    got = receiver.get_many("0", "1", ["first", "second"], meta)
    assert got[0] is not None and bytes(got[0][0].tensor.numpy()) == first
    assert got[1] is None and receiver.last_failure("second") == "no_room"
    got[0][0].release()
    again = receiver.get("0", "1", "second", meta)  # its reader slot came back to the sender
    assert again is not None and bytes(again[0].tensor.numpy()) == second
    again[0].release()


def test_get_many_of_a_failed_key_is_none_and_its_blocking_get_raises(make) -> None:
    from kvferry.core.errors import FailedAtSender
    from kvferry.core.tombstones import SenderFailure

    sender = make(role="sender")
    receiver = make(role="receiver")
    meta = sender.put("0", "1", "fine", b"ok")[2]
    assert sender.publish_failure("0", "1", "doomed", SenderFailure("put", "no room on the prefill"))
    got = receiver.get_many("0", "1", ["doomed", "fine"], meta)
    assert got[0] is None and receiver.last_failure("doomed") == "failed"
    assert got[1] is not None and bytes(got[1][0].tensor.numpy()) == b"ok"
    got[1][0].release()
    with pytest.raises(FailedAtSender):
        receiver.get_blocking("0", "1", "doomed", meta, timeout_s=5.0)


def test_get_many_from_a_closed_sender_is_prompt_and_typed(make) -> None:
    sender = make(role="sender")
    receiver = make(role="receiver")
    meta = {"source_host": "127.0.0.1", "source_port": sender.port}
    sender.close()
    start = time.monotonic()
    assert receiver.get_many("0", "1", ["a", "b", "c"], meta) == [None, None, None]
    assert time.monotonic() - start < 2.0
    assert {receiver.last_failure(k) for k in "abc"} == {"sender_unavailable"}


def test_a_channel_matches_pipelined_replies_by_id_in_any_order() -> None:
    """lookup_many / done_many: every message goes out before any answer is awaited, and each
    answer is matched by its id whatever the order the sender replies in; a reply to an
    abandoned earlier request is ignored. The sender here is a bare ROUTER answering in reverse."""
    import zmq

    from kvferry.adapters.connectors.mooncake import wire
    from kvferry.adapters.connectors.mooncake.client import PeerChannel

    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.linger = 0
    port = router.bind_to_random_port("tcp://127.0.0.1")
    channel = PeerChannel(ctx, "127.0.0.1", port)
    answered: list[list[int]] = []

    def serve(count: int, kind: str) -> None:
        got = []
        for _ in range(count):
            assert router.poll(5000), "the channel sent fewer messages than asked"
            identity, raw = router.recv_multipart()
            got.append((identity, wire.decode(raw)))
        answered.append([m.id for _, m in got])
        stale = wire.Ack(got[0][1].id + 10**9) if kind == "done" else None  # no request of this channel's
        if stale is not None:
            router.send_multipart([got[0][0], wire.encode(stale)])
        for identity, m in reversed(got):  # all of them were out before the first answer
            if kind == "lookup":
                size = len(m.key)
                reply = wire.LookupReply(m.id, True, claim=m.id, addr=4096, size=size, rpc_port=1, pin_s=5.0)
            else:
                reply = wire.Ack(m.id)
            router.send_multipart([identity, wire.encode(reply)])

    try:
        t = threading.Thread(target=serve, args=(3, "lookup"))
        t.start()
        replies = channel.lookup_many(["a", "bb", "ccc"], room=1 << 20, grace_s=5.0)
        t.join(10)
        assert [r.size for r in replies] == [1, 2, 3]  # each key its own reply, though answered in reverse
        assert [r.claim for r in replies] == answered[0]
        t = threading.Thread(target=serve, args=(2, "done"))
        t.start()
        acks = channel.done_many([("a", 1, True), ("bb", 2, False)], grace_s=5.0)
        t.join(10)
        assert [a.id for a in acks] == answered[1] and all(isinstance(a, wire.Ack) for a in acks)
        assert channel.lookup_many([], room=1, grace_s=1.0) == []
    finally:
        channel.close()
        router.close()
        ctx.term()
