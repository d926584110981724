"""A sender's failure records on the connectors that carry them (memory, shm, zmq, mooncake,
nixl): a blocking get of a failed key ends at once with FailedAtSender, also one already
waiting; a get of it, or of another key, never returns the record as data; a payload under the
key is dropped for it. mooncake and nixl run where their engines do (the contract factories
skip, saying why, elsewhere)."""

from __future__ import annotations

import itertools
import os
import shutil
import tempfile
import threading
import time

import msgpack
import pytest
from contract.conftest import mooncake_factory, nixl_factory
from hypothesis import given, settings
from hypothesis import strategies as st

from kvferry.adapters.connectors.mooncake import wire as mooncake_wire
from kvferry.adapters.connectors.zmq.protocol import Reply, decode_reply, encode_reply
from kvferry.app.registry import create_connector
from kvferry.core.control import Rejection
from kvferry.core.errors import FailedAtSender
from kvferry.core.ports import FailureRecords
from kvferry.core.tombstones import failure_record

_COUNTER = itertools.count()
RECORD = failure_record("put", "pool_full after 5 attempts")
WAIT_S = 30.0  # a get's deadline; a failed key must end it far sooner
FAST_S = 2.0


@pytest.fixture(params=["memory", "shm", "zmq", "mooncake", "nixl"])
def pair(request):
    """(sender, receiver, receiver's metadata) of one connector type."""
    if request.param in ("mooncake", "nixl"):
        made = (mooncake_factory if request.param == "mooncake" else nixl_factory)({})
        try:
            yield made.sender, made.receiver, None
        finally:
            made.cleanup()
        return
    if request.param == "zmq":
        sender = create_connector({"type": "zmq", "role": "sender", "host": "127.0.0.1", "port": 0})
        receiver = create_connector({"type": "zmq", "role": "receiver"})
        yield sender, receiver, {"source_host": "127.0.0.1", "source_port": sender.port}
        receiver.close()
        sender.close()
        return
    if request.param == "memory":
        name = f"failrec-{os.getpid()}-{next(_COUNTER)}"
        sender = create_connector({"type": "memory", "shared_name": name, "pool_bytes": 1 << 20})
        receiver = create_connector({"type": "memory", "shared_name": name})
        yield sender, receiver, None
        receiver.close()
        sender.close()
        return
    base = tempfile.mkdtemp(prefix="kvft-", dir="/tmp")
    common = {"type": "shm", "namespace": f"f{os.getpid()}n{next(_COUNTER)}", "runtime_dir": base}
    sender = create_connector({**common, "role": "sender", "port": 50151, "pool_bytes": 1 << 20})
    receiver = create_connector({**common, "role": "receiver", "sender_port": 50151})
    try:
        yield sender, receiver, None
    finally:
        receiver.close()
        sender.close()
        shutil.rmtree(base, ignore_errors=True)


def test_a_failed_key_ends_a_blocking_get_at_once_and_is_never_data(pair) -> None:
    sender, receiver, meta = pair
    assert isinstance(sender, FailureRecords)
    payload = os.urandom(4096)
    assert sender.put("0", "1", "ok_key", payload)[0]
    assert sender.publish_failure("0", "1", "bad_key", RECORD)
    assert receiver.get("0", "1", "bad_key", meta) is None  # not data, not an error: "not there"
    start = time.monotonic()
    with pytest.raises(FailedAtSender) as info:
        receiver.get_blocking("0", "1", "bad_key", meta, timeout_s=WAIT_S)
    assert time.monotonic() - start < FAST_S
    assert (info.value.kind, info.value.reason) == (RECORD.kind, RECORD.reason)
    data, size = receiver.get_blocking("0", "1", "ok_key", meta, timeout_s=WAIT_S)  # the control: a payload key
    assert size == len(payload) and _bytes(data) == payload


def _bytes(data: object) -> bytes:
    """The received payload's bytes: a pool buffer (memory, shm) or zmq's frames."""
    if hasattr(data, "tensor"):
        return data.tensor.numpy().tobytes()  # type: ignore[attr-defined]
    return b"".join(bytes(f) for f in data)  # type: ignore[attr-defined]


def test_a_get_already_waiting_hears_of_the_failure_at_once(pair) -> None:
    sender, receiver, meta = pair
    outcome: dict[str, object] = {}
    started = threading.Event()

    def waiter() -> None:
        started.set()
        t0 = time.monotonic()
        try:
            outcome["got"] = receiver.get_blocking("0", "1", "late_key", meta, timeout_s=WAIT_S)
        except FailedAtSender as exc:
            outcome["error"] = exc
        outcome["seconds"] = time.monotonic() - t0

    thread = threading.Thread(target=waiter)
    thread.start()
    assert started.wait(5)
    # the get is parked at the sender (shm, zmq: wait until it says so) or waits on the pool (memory)
    deadline = time.monotonic() + 5
    while _parked(sender) == 0 and time.monotonic() < deadline:
        threading.Event().wait(0.01)
    assert _parked(sender) in (None, 1)
    assert sender.publish_failure("0", "1", "late_key", RECORD)
    thread.join(WAIT_S + 5)
    assert isinstance(outcome.get("error"), FailedAtSender), outcome
    assert outcome["seconds"] < FAST_S, outcome


def test_a_payload_under_a_failed_key_is_dropped_and_its_space_freed(pair) -> None:
    sender, receiver, meta = pair
    assert sender.put("0", "1", "k", os.urandom(8192))[0]
    held = _held(sender)
    assert held > 0
    assert sender.publish_failure("0", "1", "k", RECORD)
    assert _held(sender) == 0
    with pytest.raises(FailedAtSender):
        receiver.get_blocking("0", "1", "k", meta, timeout_s=WAIT_S)
    assert sender.put("0", "1", "k", b"x" * 64)[0]  # a later payload under the key is read as usual
    data, size = receiver.get_blocking("0", "1", "k", meta, timeout_s=WAIT_S)
    assert size == 64


def _held(sender: object) -> int:
    health = sender.health()  # type: ignore[attr-defined]
    return int(health.get("used_bytes", health.get("held_bytes", -1)))


def _parked(sender: object) -> int | None:
    """Gets parked at the sender now (None: this connector does not say)."""
    health = sender.health()  # type: ignore[attr-defined]
    value = health.get("parked", health.get("parked_lookups", health.get("sender", {}).get("parked")))
    return None if value is None else int(value)


@given(kind=st.from_regex(r"[a-z][a-z0-9_]{0,31}", fullmatch=True), reason=st.text(max_size=300))
@settings(max_examples=100, deadline=None)
def test_a_zmq_failed_miss_round_trips_and_needs_its_record(kind: str, reason: str) -> None:
    record = failure_record(kind, reason)
    reply = Reply("miss", 7, "k", reason="failed", failure=record)
    assert decode_reply(encode_reply(reply)) == reply
    body = msgpack.unpackb(encode_reply(reply))
    for bad in (None, {"kind": kind}, {"kind": kind, "reason": 3}, "put: why"):
        mutated = {**body, "failure": bad}
        assert isinstance(decode_reply(msgpack.packb(mutated)), Rejection)
    plain = Reply("miss", 7, "k", reason="not_found")  # an ordinary miss carries no record
    assert decode_reply(encode_reply(plain)) == plain and "failure" not in msgpack.unpackb(encode_reply(plain))


@given(kind=st.from_regex(r"[a-z][a-z0-9_]{0,31}", fullmatch=True), reason=st.text(max_size=300))
@settings(max_examples=100, deadline=None)
def test_a_mooncake_failed_miss_round_trips_and_needs_its_record(kind: str, reason: str) -> None:
    """The mooncake/nixl control wire: a ``failed`` miss carries its record both ways; one
    without a readable record, or a record on any other reply, is a rejection."""
    record = failure_record(kind, reason)
    reply = mooncake_wire.LookupReply(7, False, reason="failed", failure=record)
    assert mooncake_wire.decode(mooncake_wire.encode(reply)) == reply
    body = msgpack.unpackb(mooncake_wire.encode(reply))
    for bad in (None, {"kind": kind}, {"kind": kind, "reason": 3}, "put: why"):
        assert isinstance(mooncake_wire.decode(msgpack.packb({**body, "failure": bad})), Rejection)
    other = mooncake_wire.LookupReply(7, False, reason="not_found")
    other_body = msgpack.unpackb(mooncake_wire.encode(other))
    assert "failure" not in other_body  # an ordinary miss is as it was on the wire
    assert isinstance(mooncake_wire.decode(msgpack.packb({**other_body, "failure": body["failure"]})), Rejection)
