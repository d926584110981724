"""The shm connector's own rules: names, permissions, zero-copy views, endpoints, reaping."""

from __future__ import annotations

import contextlib
import gc
import itertools
import logging
import os
import re
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time

import msgpack
import pytest
import torch
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st
from waits import eventually

from kvferry.adapters.connectors.pool_buffer import wait_for_gc_releases
from kvferry.adapters.connectors.shm.connector import ShmConnector
from kvferry.adapters.connectors.shm.control import (
    BELL_PREFIX,
    ControlClient,
    GetManyRequest,
    GetRequest,
    PingRequest,
    ReleaseRequest,
    bell_address,
    check_grant,
    check_request,
    decode,
    decode_request,
    encode,
    granted_tickets,
)
from kvferry.adapters.connectors.shm.segment import (
    SHM_DIR,
    check_namespace,
    control_endpoint,
    control_paths,
    create_segment,
    discard_segment,
    parse_segment_name,
    pid_alive,
    reap_namespace,
    runtime_dir,
    segment_name,
    sender_gone,
)
from kvferry.adapters.connectors.shm.server import Reader, ReaderRegistry
from kvferry.app.registry import create_connector
from kvferry.core.control import Rejection
from kvferry.core.errors import BindError, ConfigError, ConnectorUnavailable, UnreadableGrant

PORT = 50151
_COUNTER = itertools.count()


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def monotonic(self) -> float:
        return self.now


@pytest.fixture
def space():
    """A private (namespace, runtime base) pair; asserts nothing of it is left afterwards."""
    base = tempfile.mkdtemp(prefix="kvft-", dir="/tmp")
    namespace = f"s{os.getpid()}n{next(_COUNTER)}"
    yield namespace, base
    leftovers = [n for n in os.listdir(SHM_DIR) if n.startswith(f"kvferry-{namespace}-")]
    files = os.listdir(base)
    shutil.rmtree(base, ignore_errors=True)
    for name in leftovers:
        os.unlink(os.path.join(SHM_DIR, name))
    assert leftovers == [] and files == []


def make(space, role: str, **extra) -> ShmConnector:
    namespace, base = space
    config = {"type": "shm", "role": role, "namespace": namespace, "runtime_dir": base, "pool_bytes": 1 << 20, **extra}
    if role == "sender":
        config.setdefault("port", PORT)
    return create_connector(config)


@contextlib.contextmanager
def _client_of_a_hand_sender(space, on_stale=lambda reply: None):
    """A ROUTER standing in for a sender (replies written by hand) and a :class:`ControlClient`
    of it: ``(router, client)``; both closed and the socket file removed afterwards."""
    _, base = space
    endpoint = f"ipc://{base}/t.sock"
    context = zmq.Context()
    router = context.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.bind(endpoint)
    client = ControlClient(context, endpoint, on_stale)
    try:
        yield router, client
    finally:
        client.close()
        router.close(0)
        context.term()
        os.unlink(f"{base}/t.sock")


@contextlib.contextmanager
def _raw_dealer(endpoint: str):
    """A bare DEALER socket on a sender's control endpoint (requests written by hand)."""
    context = zmq.Context()
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    try:
        yield sock
    finally:
        sock.close()
        context.term()


def segments_of(namespace: str) -> list[str]:
    return sorted(n for n in os.listdir(SHM_DIR) if n.startswith(f"kvferry-{namespace}-"))


# ------------------------------------------------------------------------------- naming


@given(
    namespace=st.from_regex(r"[A-Za-z0-9_.]{1,48}", fullmatch=True),
    pid=st.integers(1, 2**22),
    port=st.none() | st.integers(1, 65535),
    token=st.from_regex(r"[0-9a-f]{8}", fullmatch=True),
)
@settings(max_examples=100, deadline=None)
def test_segment_names_round_trip(namespace, pid, port, token) -> None:
    name = segment_name(namespace, pid, port, token)
    assert "kvferry" in name and str(pid) in name and "/" not in name
    assert parse_segment_name(name) == (namespace, pid, "x" if port is None else str(port), token)


@pytest.mark.parametrize("bad", ["", "a-b", "a/b", "x" * 49, None, 3, "sp ace"])
def test_bad_namespaces_are_rejected(bad) -> None:
    with pytest.raises(ConfigError, match="namespace"):
        check_namespace(bad)


def test_endpoint_is_derived_from_namespace_and_port() -> None:
    assert control_endpoint("ns", 50151, "/run/x") == "ipc:///run/x/kvferry-ns/ctl-50151.sock"
    assert runtime_dir("ns", "/run/x") == "/run/x/kvferry-ns"


def test_config_errors_name_the_key(space) -> None:
    for bad, key in (
        ({"role": "both"}, "role"),
        ({"port": 0}, "port"),
        ({"rpc_timeout_s": -1}, "rpc_timeout_s"),
        ({"namespace": "a-b"}, "namespace"),
        ({"pool_bytes": "1"}, "pool_bytes"),
    ):
        with pytest.raises(ConfigError, match=key):
            ShmConnector.from_config({"type": "shm", "role": "sender", **bad})


# -------------------------------------------------------------------------- files, modes


def test_sender_files_are_private_and_removed_on_close(space) -> None:
    namespace, base = space
    sender = make(space, "sender")
    [name] = segments_of(namespace)
    parsed = parse_segment_name(name)
    assert parsed[1] == os.getpid() and parsed[2] == str(PORT)
    assert stat.S_IMODE(os.stat(os.path.join(SHM_DIR, name)).st_mode) == 0o600
    directory = runtime_dir(namespace, base)
    assert stat.S_IMODE(os.stat(directory).st_mode) == 0o700
    assert sorted(os.listdir(directory)) == [f"ctl-{PORT}.pid", f"ctl-{PORT}.sock"]
    assert sender.health()["segment"] == name
    sender.close()
    sender.close()
    assert segments_of(namespace) == [] and not os.path.exists(directory)


def test_sender_dropped_without_close_is_cleaned_by_its_finalizer(space) -> None:
    namespace, _ = space
    sender = make(space, "sender")
    assert segments_of(namespace)
    del sender
    gc.collect()
    assert segments_of(namespace) == []


def test_second_sender_on_a_live_port_fails_loudly_and_leaks_nothing(space) -> None:
    namespace, _ = space
    with make(space, "sender") as first:
        with pytest.raises(ConnectorUnavailable) as info:
            make(space, "sender")
        assert isinstance(info.value.__cause__, BindError) and str(PORT) in str(info.value)
        assert len(segments_of(namespace)) == 1
        assert first.put("0", "1", "k", b"still works")[0]


# --------------------------------------------------------------------- receive, zero copy


def test_received_tensor_is_a_view_into_the_mapped_segment(space) -> None:
    with make(space, "sender") as sender, make(space, "receiver") as receiver:
        data = os.urandom(100_000)
        ok, size, meta = sender.put("0", "1", "req_0_0_0_0", [data[:5], data[5:]])
        assert ok and meta["segment"] in segments_of(space[0])
        buffer, got_size = receiver.get("0", "1", "req_0_0_0_0", meta)
        start, end = receiver.mapped_range(meta["segment"])
        assert start <= buffer.tensor.data_ptr() and buffer.tensor.data_ptr() + got_size <= end
        assert bytes(buffer.tensor.numpy()) == data and got_size == size
        # the sender's pool holds the region until the reader releases it
        assert sender.health()["used_bytes"] > 0
        buffer.release()
        assert sender.health()["used_bytes"] == 0


def test_partial_metadata_and_default_sender(space) -> None:
    with make(space, "sender") as sender, make(space, "receiver") as receiver:
        assert receiver.get("0", "1", "a") is None  # no default sender yet: not found
        assert receiver.health()["miss_no_sender"] == 1
        for key in ("a", "b", "c"):
            assert sender.put("0", "1", key, key.encode())[0]
        got = receiver.get("0", "1", "a", {"source_host": "127.0.0.1", "source_port": PORT})
        assert bytes(got[0].tensor.numpy()) == b"a"
        got[0].release()
        receiver.update_sender_info("127.0.0.1", PORT)
        got = receiver.get("0", "1", "b")
        assert bytes(got[0].tensor.numpy()) == b"b"
        got[0].release()
    with make(space, "receiver", sender_port=PORT) as configured:
        assert configured.health()["sender_endpoint"].endswith(f"ctl-{PORT}.sock")
        with pytest.raises(ConfigError):
            configured.update_sender_info("h", 0)


def test_get_many_asks_once_and_answers_each_key_in_order(space) -> None:
    with make(space, "sender") as sender, make(space, "receiver") as receiver:
        payloads = {key: os.urandom(1000 + 17 * i) for i, key in enumerate(("k0", "k2", "k3"))}
        for key, data in payloads.items():
            assert sender.put("0", "1", key, data)[0]
        meta = {"source_host": "127.0.0.1", "source_port": PORT}
        got = receiver.get_many("0", "1", ["k3", "k1", "k0", "k2"], meta)
        assert got[1] is None  # never put: a miss in its place, the others still served
        for key, one in zip(["k3", "k0", "k2"], (got[0], got[2], got[3])):
            assert one is not None and bytes(one[0].tensor.numpy()) == payloads[key] and one[1] == len(payloads[key])
        health = sender.health()
        assert (health["get_many"], health["grants"], health["miss_not_found"]) == (1, 3, 1)  # one request
        assert receiver.get("0", "1", "k0", meta) is None  # taken by get_many: not handed out twice
        with receiver.batched_releases():
            for one in got:
                if one is not None:
                    one[0].release_soon()
            assert receiver.flush_releases(5.0) and sender.health()["used_bytes"] > 0  # held back...
        assert receiver.flush_releases(5.0) and sender.health()["used_bytes"] == 0  # ...sent at the end
        assert sender.health()["releases"] == 3
    with make(space, "receiver", sender_port=PORT) as lone:  # no sender there: every key a miss, fast
        assert lone.get_many("0", "1", ["a", "b"], {"source_host": "127.0.0.1", "source_port": PORT}) == [None, None]


def test_get_many_and_batched_releases_split_at_the_message_limit(space) -> None:
    from kvferry.adapters.connectors.shm.control import MAX_MANY_KEYS

    n = MAX_MANY_KEYS + 3
    with make(space, "sender", pool_bytes=1 << 22) as sender, make(space, "receiver", sender_port=PORT) as receiver:
        for i in range(n):
            assert sender.put("0", "1", f"k{i}", i.to_bytes(4, "big") * 8)[0]
        got = receiver.get_many("0", "1", [f"k{i}" for i in range(n)])
        assert [bytes(g[0].tensor.numpy()[:4]) for g in got] == [i.to_bytes(4, "big") for i in range(n)]
        assert sender.health()["get_many"] == 2
        with receiver.batched_releases():
            for g in got:
                g[0].release_soon()
        assert receiver.flush_releases(5.0) and sender.health()["used_bytes"] == 0
        assert sender.health()["releases"] == n


class _GatedPool:
    """The sender's pool as its control thread sees it, with ``take`` held at ``gate`` (a
    sender too busy to answer in time, or a receiver stopped past its deadline)."""

    def __init__(self, pool, gate: threading.Event) -> None:
        self._pool, self._gate = pool, gate

    def take(self, *args, **kwargs):
        assert self._gate.wait(30)
        return self._pool.take(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._pool, name)


@contextlib.contextmanager
def _answering_late(space, keys: list[str], rpc_timeout_s: float):
    """A sender holding ``keys`` whose control thread answers once ``gate`` is set, and a
    receiver that gives up on a reply after ``rpc_timeout_s``: ``(sender, receiver, gate)``."""
    with (
        make(space, "sender") as sender,
        make(space, "receiver", sender_port=PORT, rpc_timeout_s=rpc_timeout_s) as receiver,
    ):
        for key in keys:
            assert sender.put("0", "1", key, os.urandom(4096))[0]
        server = sender._sender.server
        gate = threading.Event()
        server.pool = _GatedPool(server.pool, gate)
        yield sender, receiver, gate


def _until_granted(sender: ShmConnector, grants: int) -> None:
    """Poll the sender's health (10 s at most) until it counts ``grants`` grants: its answers
    to the requests the receiver gave up on have left."""
    deadline = time.monotonic() + 10
    while sender.health().get("grants", 0) < grants:
        assert time.monotonic() < deadline, sender.health()
        time.sleep(0.01)


@pytest.mark.parametrize("many", [True, False], ids=["get_many", "get"])
def test_grants_that_come_after_the_receiver_gave_up_are_released(space, many) -> None:
    """A reply past the receiver's deadline still grants tickets at the sender: the receiver
    releases every one of them when it reads that reply (its next request on the socket), or
    the sender would keep those regions for as long as the receiver's process lives."""
    keys = [f"k{i}" for i in range(4)]
    with _answering_late(space, keys, 0.2) as (sender, receiver, gate):
        if many:
            assert receiver.get_many("0", "1", keys) == [None] * 4  # gave up after rpc_timeout_s
        else:
            assert receiver.get("0", "1", keys[0]) is None
        assert receiver.counters["miss_no_reply"] == 1
        gate.set()  # the sender answers now: every asked key granted, to nobody waiting
        granted = len(keys) if many else 1
        _until_granted(sender, granted)
        assert sender.health()["used_bytes"] > 0 and sender.health()["entries"] == len(keys)
        assert receiver.get("0", "1", "absent") is None  # the same socket: reads the late reply first
        assert receiver.counters["stale_grants_released"] == granted
        assert receiver.flush_releases(5.0)
        health = sender.health()
        assert health["releases"] == granted
        assert health["entries"] == len(keys) - granted  # the late grants' regions are free again
        if not many:
            assert receiver.get("0", "1", keys[1]) is not None  # the keys nobody took are still there


def test_a_put_answers_the_get_parked_on_its_key_itself(space) -> None:
    """A receiver already waiting for a key has its grant sent by the put itself, before the put
    returns: the control thread need not be scheduled, nor get the GIL from a busy caller, first.
    A get that comes after the put is answered by the control thread, as before (the control)."""
    with make(space, "sender") as sender, make(space, "receiver", sender_port=PORT) as receiver:
        got: dict[str, object] = {}
        waiter = threading.Thread(target=lambda: got.update(v=receiver.get_blocking("0", "1", "k", timeout_s=20)))
        waiter.start()
        eventually(lambda: sender.health()["parked"] == 1, "the get parked at the sender")
        assert sender.put("0", "1", "k", b"parked")[0]
        health = sender.health()  # read as the put returns, without waiting for anything
        assert (health["grants"], health["grants_direct"], health["parked"]) == (1, 1, 0)
        waiter.join(20)
        buffer, size = got["v"]
        assert bytes(buffer.tensor.numpy()) == b"parked" and size == 6
        buffer.release()
        assert sender.put("0", "1", "later", b"asked after")[0]
        buffer, _ = receiver.get_blocking("0", "1", "later", timeout_s=20)
        assert bytes(buffer.tensor.numpy()) == b"asked after"
        buffer.release()
        health = sender.health()
        assert (health["grants"], health["grants_direct"]) == (2, 1)


def test_puts_and_gets_racing_on_one_socket_lose_no_request(space) -> None:
    """Puts from several threads answer parked gets on the control socket while the control
    thread receives others' requests on it: every get is answered. A send from a put's thread
    can take the signal the control thread sleeps on while a request is queued; the put then
    wakes it. Without that wake-up this test failed one run in two (a get left unanswered until
    its deadline). Each receiver thread asks for its keys in an order of its own, some before
    their put and some after."""
    keys = [f"k{i}" for i in range(1200)]
    with make(space, "sender", pool_bytes=8 << 20) as sender, make(space, "receiver", sender_port=PORT) as receiver:
        results: dict[str, bytes | None] = {}

        def read(mine: list[str]) -> None:
            for key in mine:
                got = receiver.get_blocking("0", "1", key, timeout_s=10)
                results[key] = None if got is None else bytes(got[0].tensor.numpy())
                if got is not None:
                    got[0].release()

        def put(mine: list[str]) -> None:
            for key in mine:
                assert sender.put("0", "1", key, key.encode() * 64)[0]

        readers = [threading.Thread(target=read, args=(keys[i::3][::-1] if i % 2 else keys[i::3],)) for i in range(3)]
        writers = [threading.Thread(target=put, args=(keys[i::2],)) for i in range(2)]
        for t in readers + writers:
            t.start()
        for t in readers + writers:
            t.join(60)
        assert results == {key: key.encode() * 64 for key in keys}
        health = sender.health()
        assert health["grants"] == len(keys) and health.get("thread_errors", 0) == 0


def test_absent_sender_is_a_fast_miss(space) -> None:
    with make(space, "receiver", sender_port=PORT) as receiver:
        start = time.monotonic()
        assert receiver.get("0", "1", "k") is None
        assert receiver.get_blocking("0", "1", "k", timeout_s=0.2) is None
        assert time.monotonic() - start < 1.5
        assert receiver.health()["miss_sender_absent"] == 1


def test_receiver_cannot_put_or_reserve(space) -> None:
    with make(space, "receiver") as receiver:
        ok, size, info = receiver.put("0", "1", "k", b"x")
        assert (ok, size, info["reason"]) == (False, 0, "error")
        with pytest.raises(ConfigError):
            receiver.reserve("0", "1", "k", 10)


def test_a_sender_reads_its_own_pool(space) -> None:
    with make(space, "sender") as sender:
        assert sender.put("0", "1", "k", b"local")[0]
        buffer, size = sender.get("0", "1", "k")
        assert bytes(buffer.tensor.numpy()) == b"local" and size == 5
        buffer.release()


def test_receiver_follows_a_restarted_sender(space) -> None:
    with make(space, "receiver", sender_port=PORT) as receiver:
        for round_ in range(2):
            with make(space, "sender") as sender:
                assert sender.put("0", "1", "k", bytes([round_]) * 10)[0]
                buffer, _ = receiver.get_blocking("0", "1", "k", timeout_s=5.0)
                assert bytes(buffer.tensor.numpy()) == bytes([round_]) * 10
                buffer.release()
                # one mapping per sender: the restarted sender's segment replaced the old one
                assert receiver.health()["mapped_segments"] == 1


def test_a_live_reader_keeps_its_bytes_past_hold(space) -> None:
    """Zero-copy safety: a reader of a live process holding a buffer past hold_s keeps it; the
    region is never handed out again while it holds it, whatever the churn."""
    clock = FakeClock()
    with (
        make(space, "sender", clock=clock, lease_s=5.0, hold_s=2.0) as sender,
        make(space, "receiver", sender_port=PORT) as receiver,
    ):
        data = os.urandom(600 * 1024)
        assert sender.put("0", "1", "k", data)[0]
        buffer, _ = receiver.get("0", "1", "k")
        view = buffer.tensor[100:]  # what a decoded KV tensor is: a view of the pool buffer
        clock.now += 60.0  # far past hold_s and the lease
        health = sender.health()
        assert health["used_bytes"] > 0 and health["overdue"] == 1 and health["held_overdue"] == 1
        assert health.get("expired_unreleased", 0) == 0
        for i in range(5):  # no room while it is held: pool_full, never its region
            ok, _, info = sender.put("0", "1", f"churn{i}", os.urandom(600 * 1024))
            assert not ok and info["reason"] == "pool_full"
        assert bytes(view.numpy()) == data[100:]
        assert sender.health()["held_overdue"] == 1  # reported once
        buffer.release()
        assert sender.health()["used_bytes"] == 0 and sender.health()["overdue"] == 0
        assert sender.put("0", "1", "fresh", os.urandom(600 * 1024))[0]


HOLDER = """
import json, sys
from kvferry.app.registry import create_connector
namespace, base, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
receiver = create_connector({"type": "shm", "role": "receiver", "namespace": namespace,
                             "runtime_dir": base, "sender_port": port})
buffer, size = receiver.get_blocking("0", "1", "k", timeout_s=30.0)
print(json.dumps({"holding": size}), flush=True)
sys.stdin.readline()  # hold until killed
"""


def test_a_killed_reader_loses_its_hold(space) -> None:
    namespace, base = space
    clock = FakeClock()
    with make(space, "sender", clock=clock, lease_s=5.0, hold_s=2.0) as sender:
        assert sender.put("0", "1", "k", b"z" * 1000)[0]
        reader = subprocess.Popen(
            [sys.executable, "-c", HOLDER, namespace, base, str(PORT)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert '"holding": 1000' in reader.stdout.readline()
            clock.now += 2.0
            assert sender.health()["used_bytes"] > 0  # alive: past hold_s, still held
            reader.kill()  # not reaped yet: a zombie is gone too
            health = eventually(
                lambda: (h := sender.health())["used_bytes"] == 0 and h, "the killed reader's region was reclaimed"
            )
            assert health["expired_unreleased"] == 1 and health["overdue"] == 0
        finally:
            reader.kill()
            reader.wait(timeout=30)
        assert sender.put("0", "1", "k2", b"fresh")[0]


def test_a_get_that_names_no_reader_is_revoked_at_hold(space) -> None:
    """A receiver that does not say its pid (an older one) is presumed dead at hold_s."""
    clock = FakeClock()
    with make(space, "sender", clock=clock, lease_s=5.0, hold_s=2.0) as sender:
        assert sender.put("0", "1", "k", b"z" * 1000)[0]
        with _raw_dealer(sender.endpoint) as sock:
            sock.send(encode({"op": "get", "id": 1, "key": "k"}))
            assert sock.poll(5000)
            grant = decode(sock.recv())
            assert grant["ok"] and sender.health()["used_bytes"] > 0
            clock.now += 2.0
            assert sender.health()["used_bytes"] == 0 and sender.health()["expired_unreleased"] == 1
            sock.send(encode({"op": "release", "ticket": grant["ticket"], "id": 2}))  # late: harmless
            assert sock.poll(5000) and decode(sock.recv())["released"] is False


def test_release_soon_and_dropped_buffers_reach_the_sender(space) -> None:
    with make(space, "sender") as sender, make(space, "receiver", sender_port=PORT) as receiver:
        for key in ("a", "b"):
            assert sender.put("0", "1", key, key.encode() * 100)[0]
        first, _ = receiver.get("0", "1", "a")
        assert first.tied_to_views
        first.release_soon()  # does not wait for the sender...
        first.release_soon()  # ...and is idempotent
        assert receiver.flush_releases(5.0)  # ...but has reached it once a ping came back
        assert sender.health()["entries"] == 1
        second, _ = receiver.get("0", "1", "b")
        view = second.tensor[10:20].view(torch.int16)
        del second
        gc.collect()
        assert receiver.flush_releases(5.0) and sender.health()["used_bytes"] > 0  # a view lives
        assert bytes(view.numpy()) == b"b" * 10
        del view
        assert wait_for_gc_releases(10.0) and receiver.flush_releases(5.0)
        assert sender.health()["used_bytes"] == 0
        assert sender.health()["releases"] == 2


def test_buffers_dropped_after_the_receiver_closed_are_counted_not_logged_each(space, caplog) -> None:
    """A receiver closed while it still holds buffers (a process exiting): each buffer dropped
    afterwards cannot reach the sender. That is counted (``release_unsent``), with no warning
    line per buffer; a buffer dropped while the receiver is open still reaches the sender."""
    with make(space, "sender") as sender:
        receiver = make(space, "receiver", sender_port=PORT)
        for i in range(20):
            assert sender.put("0", "1", f"k{i}", b"x" * 100)[0]
        held = [receiver.get("0", "1", f"k{i}")[0] for i in range(20)]
        held.pop().release_soon()  # the control: open, so it reaches the sender
        assert receiver.flush_releases(5.0) and sender.health()["releases"] == 1
        receiver.close()
        with caplog.at_level(logging.WARNING, logger="kvferry"):
            for buffer in held:
                buffer.release_soon()
        assert receiver.health()["release_unsent"] == 19
        assert [r for r in caplog.records if "could not be sent" in r.getMessage()] == []
        assert sender.health()["releases"] == 1


def test_a_release_for_another_segment_is_ignored(space) -> None:
    """A restarted sender at the same endpoint never frees a ticket its predecessor granted."""
    with make(space, "sender") as sender:
        assert sender.put("0", "1", "k", b"v")[0]
        with _raw_dealer(sender.endpoint) as sock:
            sock.send(encode({"op": "get", "id": 1, "key": "k", "pid": os.getpid()}))
            assert sock.poll(5000)
            grant = decode(sock.recv())
            sock.send(encode({"op": "release", "ticket": grant["ticket"], "seg": "kvferry-x-1-x-0", "id": 2}))
            assert sock.poll(5000) and decode(sock.recv())["released"] is False
            assert sender.health()["releases_foreign"] == 1 and sender.health()["used_bytes"] > 0
            sock.send(encode({"op": "release", "ticket": grant["ticket"], "seg": grant["seg"], "id": 3}))
            assert sock.poll(5000) and decode(sock.recv())["released"] is True


def test_reader_liveness_follows_the_process() -> None:
    assert Reader.watch(os.getpid()).alive()
    assert not Reader.watch(_dead_pid()).alive()
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.readline()"], stdin=subprocess.PIPE)
    try:
        reader = Reader.watch(child.pid)
        assert reader.alive()
        child.kill()  # a zombie until waited for: gone all the same
        eventually(lambda: not reader.alive(), "the killed child is seen gone")
        assert not reader.alive()  # stays gone (its pid may be reused by a new process)
    finally:
        child.kill()
        child.wait(timeout=30)
    registry = ReaderRegistry(sweep_at=2)
    assert registry.holder(None) is None and registry.holder(True) is None and registry.holder(-1) is None
    me = registry.holder(os.getpid())
    assert registry.holder(os.getpid()) is me and me.alive()
    registry.holder(_dead_pid())
    registry.holder(_dead_pid())  # the third reader sweeps the gone ones
    assert len(registry) <= 2
    registry.close()


# ------------------------------------------------------------------------ control channel


@given(st.binary(max_size=200))
@settings(max_examples=200, deadline=None)
def test_decoding_garbage_never_raises(frame) -> None:
    message = decode(frame)
    if message is not None:
        check_request(message)
        check_grant(message)
    request = decode_request(frame)
    assert isinstance(request, (Rejection, GetRequest, GetManyRequest, PingRequest, ReleaseRequest))


@given(pid=st.integers(1, 2**22), nonce=st.binary(min_size=8, max_size=8))
def test_every_bell_a_receiver_makes_is_one_a_sender_accepts(pid, nonce) -> None:
    """The receiver's bell address (``bell_address``) always passes the sender's check: kvferry's
    prefix, within a unix socket address."""
    bell = bell_address(pid, nonce)
    assert check_request({"op": "get", "id": 1, "key": "k", "bell": bell, "token": b"t" * 16}) is None
    assert bell.startswith(BELL_PREFIX) and len(bell) <= 107


def test_requests_decode_to_typed_values_and_bad_ones_to_rejections() -> None:
    assert decode_request(encode({"op": "get", "id": 3, "key": "k", "wait_s": 0.5, "pid": 9})) == GetRequest(
        3, "k", 0.5, 9
    )
    assert decode_request(encode({"op": "get_many", "id": 4, "keys": ["a", "b"]})) == GetManyRequest(4, ("a", "b"))
    assert decode_request(encode({"op": "ping", "id": 5})) == PingRequest(5)
    assert decode_request(encode({"op": "release", "ticket": 7, "seg": "s"})) == ReleaseRequest((7,), "s")
    assert decode_request(encode({"op": "release", "tickets": [1, 2], "id": 6})) == ReleaseRequest((1, 2), None, 6)
    bad = decode_request(encode({"op": "get", "id": 8, "key": "k", "wait_s": -1}))
    assert bad == Rejection("bad_request", "wait_s must be a number of seconds >= 0", 8)
    bell, token = BELL_PREFIX + b"9-ab", b"t" * 16
    rung = {"op": "get", "id": 9, "key": "k", "wait_s": 1, "bell": bell, "token": token}
    assert decode_request(encode(rung)) == GetRequest(9, "k", 1.0, None, bell, token)
    for wrong in (
        {"bell": b"\0elsewhere"},  # not kvferry's: a sender never sends to another program's socket
        {"bell": "text"},
        {"bell": BELL_PREFIX + b"x" * 100},  # longer than a unix socket address
        {"token": b"short"},
        {"token": None},
    ):
        rejected = decode_request(encode({**rung, **wrong}))
        assert isinstance(rejected, Rejection) and rejected.corr_id == 9, wrong
    assert isinstance(decode_request(encode({"op": "get", "id": 9, "key": "k", "bell": bell})), Rejection)
    assert decode_request(b"not msgpack") == Rejection("bad_request", "not a control message")
    assert decode_request(encode({"op": "exec", "id": 2})).corr_id == 2


def test_late_grants_on_several_idle_sockets_are_all_released_by_later_requests(space) -> None:
    """Two gets that gave up together leave late replies on two sockets; the sockets that owe a
    reply are used first, so two later requests, one after the other, read and release both
    (taking the most recent idle socket every time would read one of them, twice asked)."""
    keys = ["a", "b"]
    with _answering_late(space, keys, 0.3) as (sender, receiver, gate):
        both = threading.Barrier(2, timeout=10)
        got: list = []

        def get(key: str) -> None:
            both.wait()  # both requests out together: each on a socket of its own
            got.append(receiver.get("0", "1", key))

        threads = [threading.Thread(target=get, args=(k,)) for k in keys]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=10)
        assert got == [None, None]  # both gave up
        gate.set()
        _until_granted(sender, 2)
        for _ in keys:
            assert receiver.get("0", "1", "absent") is None
        assert receiver.counters["stale_grants_released"] == 2
        assert receiver.flush_releases(5.0)
        assert sender.health()["entries"] == 0 and sender.health()["used_bytes"] == 0


def test_a_reply_already_there_is_taken_even_past_the_deadline(space) -> None:
    """A process stopped past its deadline (SIGSTOP, a long pause) takes the reply that came
    meanwhile instead of leaving its grant to no one; with nothing there it gives up at once."""
    with _client_of_a_hand_sender(space) as (router, client):
        sock = client._checkout()
        assert sock is not None
        try:
            past = time.monotonic() - 1.0
            assert not client._wait(sock, zmq.POLLIN, past)  # nothing there: no wait
            sock.send(b"hello")
            identity, _ = router.recv_multipart()
            router.send_multipart([identity, b"reply"])
            assert sock.poll(5000) == zmq.POLLIN  # it arrived
            assert client._wait(sock, zmq.POLLIN, past)  # taken although the deadline is behind
        finally:
            client._checkin(sock)


@pytest.mark.parametrize("bells", [True, False], ids=["bell", "socket"])
def test_a_get_is_answered_on_its_bell_and_other_requests_on_the_socket(space, bells) -> None:
    """A receiver's get names its reply bell: the grant comes as a datagram (the sender counts
    it), a parked get's too; a ping and a get_many are answered on the socket. A client without
    bells (the control: an older receiver) gets the same replies, all on the socket."""
    with make(space, "sender") as sender:
        context = zmq.Context()
        client = ControlClient(context, sender.endpoint, lambda reply: None, bells=bells)
        try:
            assert sender.put("0", "1", "now", b"x" * 64)[0]
            now = client.request({"op": "get", "key": "now", "wait_s": 1.0}, 10)
            assert now is not None and now["ok"] and now["size"] == 64 and "token" not in now
            got: dict[str, object] = {}
            waiter = threading.Thread(
                target=lambda: got.update(r=client.request({"op": "get", "key": "later", "wait_s": 20}, 30))
            )
            waiter.start()
            eventually(lambda: sender.health()["parked"] == 1, "the get parked at the sender")
            assert sender.put("0", "1", "later", b"y" * 32)[0]
            waiter.join(30)
            assert got["r"]["ok"] and got["r"]["size"] == 32
            assert client.request({"op": "ping"}, 10)["ok"]
            assert sender.put("0", "1", "third", b"w" * 8)[0]
            many = client.request({"op": "get_many", "keys": ["third", "absent"]}, 10)
            assert [g["ok"] for g in many["grants"]] == [True, False]
            health = sender.health()
            assert health["grants"] == 3
            assert health.get("replies_bell", 0) == (2 if bells else 0)
            assert health.get("bell_undeliverable", 0) == 0 and client.foreign_datagrams == 0
        finally:
            client.close()
            context.term()


def test_a_bell_nobody_listens_on_falls_back_to_the_socket(space) -> None:
    """A get whose bell cannot be reached (its process closed it, or lives in another network
    namespace) is answered on the socket, and the sender counts the failed datagram."""
    with make(space, "sender") as sender:
        assert sender.put("0", "1", "k", b"z" * 16)[0]
        with _raw_dealer(sender.endpoint) as sock:
            bell = BELL_PREFIX + f"{os.getpid()}-nobody{next(_COUNTER)}".encode()
            sock.send(encode({"op": "get", "id": 1, "key": "k", "wait_s": 1, "bell": bell, "token": b"t" * 16}))
            assert sock.poll(10_000)
            reply = decode(sock.recv())
        assert reply["id"] == 1 and reply["ok"] and reply["size"] == 16
        health = sender.health()
        assert (health["bell_undeliverable"], health.get("replies_bell", 0)) == (1, 0)


def test_a_datagram_without_the_token_is_not_taken_for_a_reply(space) -> None:
    """Anyone on the host can send to a bell's address: a reply that lacks the token the get
    carried is dropped and counted; the sender's real reply, on the bell or on the socket, is
    the one the request returns."""
    with (
        _client_of_a_hand_sender(space) as (router, client),
        socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as out,
    ):
        for via_bell in (True, False):
            got: dict[str, object] = {}
            asker = threading.Thread(
                target=lambda: got.update(r=client.request({"op": "get", "key": "k", "wait_s": 5}, 20))
            )
            asker.start()
            assert router.poll(10_000)
            identity, frame = router.recv_multipart()
            request = decode(frame)
            forged = {"id": request["id"], "ok": True, "seg": "evil", "seg_bytes": 8, "off": 0, "size": 8, "ticket": 1}
            out.sendto(encode({**forged, "token": b"guessed-wrong-16"}), request["bell"])
            out.sendto(encode(forged), request["bell"])  # no token at all
            real = {**forged, "seg": "real", "ticket": 2}
            if via_bell:
                out.sendto(encode({**real, "token": request["token"]}), request["bell"])
            else:
                router.send_multipart([identity, encode(real)])
            asker.join(20)
            assert got["r"]["seg"] == "real" and got["r"]["ticket"] == 2
        assert client.foreign_datagrams == 4


def test_a_socket_that_owes_a_late_reply_asks_without_its_bell(space) -> None:
    """A get that gave up leaves its socket owing a reply. The next get on that socket names no
    bell, so its answer comes on the socket after the late one (one pipe, in order) and the late
    grant is read and released first; on the bell, the new answer could overtake it (it did, one
    run in three, in test_grants_that_come_after_the_receiver_gave_up_are_released). Once the
    late reply is read, gets name the bell again."""
    stale: list[dict] = []
    with _client_of_a_hand_sender(space, stale.append) as (router, client):

        def ask(key: str, timeout_s: float) -> tuple[dict, threading.Thread, dict]:
            got: dict[str, object] = {}
            asker = threading.Thread(target=lambda: got.update(r=client.request({"op": "get", "key": key}, timeout_s)))
            asker.start()
            assert router.poll(10_000)
            identity, frame = router.recv_multipart()
            return {**decode(frame), "identity": identity}, asker, got

        first, asker, got = ask("slow", 0.2)
        assert "bell" in first
        asker.join(10)
        assert got["r"] is None  # gave up: the socket owes the reply to request 1
        second, asker, got = ask("next", 10)
        assert "bell" not in second and "token" not in second
        for request, key in ((first, "slow"), (second, "next")):  # the late reply first, as sent
            reply = {"id": request["id"], "ok": False, "reason": "not_found", "key": key}
            router.send_multipart([request["identity"], encode(reply)])
        asker.join(10)
        assert got["r"]["key"] == "next" and [r["key"] for r in stale] == ["slow"]
        third, asker, got = ask("then", 10)
        assert "bell" in third  # nothing owed any more
        router.send_multipart([third["identity"], encode({"id": third["id"], "ok": False, "reason": "x"})])
        asker.join(10)
        assert got["r"]["reason"] == "x"


def _bells_of(pid: int) -> list[bytes]:
    """The reply bells process ``pid`` has bound, as anyone on the host can list them."""
    prefix = "@" + BELL_PREFIX[1:].decode() + f"{pid}-"
    with open("/proc/net/unix") as table:
        names = [line.split()[-1] for line in table.readlines()[1:] if len(line.split()) > 7]
    return [b"\0" + n[1:].encode() for n in names if n.startswith(prefix)]


def test_a_forged_grant_on_a_receivers_bell_is_dropped_and_counted(space) -> None:
    """A local process that finds a waiting receiver's bell (abstract sockets are listed in
    /proc/net/unix) and sends it a grant of its own: the receive returns the sender's real
    bytes, and the receiver's health counts the dropped datagram."""
    with make(space, "sender") as sender, make(space, "receiver", sender_port=PORT) as receiver:
        got: dict[str, object] = {}
        waiter = threading.Thread(target=lambda: got.update(v=receiver.get_blocking("0", "1", "k", timeout_s=20)))
        waiter.start()
        eventually(lambda: sender.health()["parked"] == 1, "the get parked at the sender")
        (bell,) = _bells_of(os.getpid())
        forged = {"v": 1, "id": 1, "ok": True, "seg": sender._sender.segment.name, "seg_bytes": 1 << 20}
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as out:
            out.sendto(msgpack.packb({**forged, "off": 0, "size": 4, "ticket": 99}), bell)
        eventually(lambda: receiver.health().get("foreign_datagrams") == 1, "the forged datagram dropped")
        assert sender.put("0", "1", "k", b"the real bytes")[0]
        waiter.join(20)
        buffer, size = got["v"]
        assert bytes(buffer.tensor.numpy()) == b"the real bytes" and size == 14
        buffer.release()


def test_a_buffer_holds_its_mapping_and_a_grant_on_an_unmapped_segment_is_refused(space) -> None:
    """A received buffer views the segment without a view of its own in between: it reads the
    sender's bytes and keeps the mapping while it lives, even once the receiver dropped the
    segment (a sender that restarted). A grant that then names the dropped segment is refused
    and counted, its ticket given back, instead of a view of memory no longer mapped."""
    with make(space, "sender") as sender, make(space, "receiver", sender_port=PORT) as receiver:
        assert sender.put("0", "1", "a", b"first bytes")[0] and sender.put("0", "1", "b", b"second")[0]
        buffer, size = receiver.get("0", "1", "a")
        (segment,) = receiver._segments.values()
        start, stop = segment.address_range
        assert size == 11 and start <= buffer.tensor.data_ptr() < stop
        assert not segment.unmap()  # the buffer holds the mapping: it stays until the buffer goes
        assert bytes(buffer.tensor.numpy()) == b"first bytes"
        assert receiver.get("0", "1", "b") is None
        assert receiver.health()["bad_grants"] == 1
        buffer.release()
        ledger = sender._sender.pool.ledger
        eventually(lambda: ledger.stats()["live_regions"] == 0, "both regions given back")


def test_a_blocking_get_granted_a_segment_it_cannot_map_fails_at_once(space) -> None:
    """A receiver whose shm directory is not the sender's (another host's /dev/shm, a container
    that does not share it) is granted a segment it cannot map: a blocking get raises
    UnreadableGrant naming the setting to change instead of answering None (its caller would
    ask again until its deadline for a key the grant drained); the grant is counted and given
    back. A non-blocking get (``get``, ``get_many``) answers None as before, and the next
    blocking get of such a key raises at once instead of waiting for a key that cannot come
    (the vLLM loader asks ``get_many`` first). A receiver on the sender's directory reads the
    same sender's next key (the payloads were readable: the directory made the difference)."""
    elsewhere = tempfile.mkdtemp(prefix="kvft-shm-", dir="/tmp")
    try:
        with make(space, "sender") as sender, make(space, "receiver", sender_port=PORT, shm_dir=elsewhere) as far:
            for key, data in (("k", b"first"), ("j", b"second"), ("h", b"fourth"), ("i", b"third")):
                assert sender.put("0", "1", key, data)[0]
            with pytest.raises(UnreadableGrant, match=r"'k'.*shm_dir \(" + re.escape(elsewhere)):
                far.get_blocking("0", "1", "k", timeout_s=60)
            assert far.get("0", "1", "j") is None
            assert far.get_many("0", "1", ["h", "absent"]) == [None, None]
            assert far.health()["bad_grants"] == 3
            for key in ("j", "h"):  # each raises once, at once (a 60 s wait without the record)
                with pytest.raises(UnreadableGrant, match=f"'{key}'"):
                    far.get_blocking("0", "1", key, timeout_s=60)
            ledger = sender._sender.pool.ledger
            eventually(lambda: ledger.stats()["live_regions"] == 1, "the unreadable grants given back")
            with make(space, "receiver", sender_port=PORT) as near:
                buffer, size = near.get_blocking("0", "1", "i", timeout_s=60)
                assert bytes(buffer.tensor.numpy()) == b"third" and size == 5
                buffer.release()
    finally:
        shutil.rmtree(elsewhere)


def test_granted_tickets_are_read_off_either_kind_of_reply() -> None:
    grant = {"ok": True, "seg": "s", "seg_bytes": 64, "off": 0, "size": 8, "ticket": 7}
    assert granted_tickets({"id": 1, **grant}) == [(7, "s")]
    miss = {"ok": False, "reason": "not_found"}
    many = {"id": 2, "ok": True, "grants": [grant, miss, {**grant, "ticket": 9, "seg": None}, "junk"]}
    assert granted_tickets(many) == [(7, "s"), (9, None)]
    assert granted_tickets({"id": 3, **miss}) == []
    assert granted_tickets({"id": 4, "ok": True, "health": {}}) == []  # a ping's answer grants nothing
    assert granted_tickets({"id": 5, "ok": True, "ticket": True}) == []  # not an integer ticket
    assert granted_tickets({"id": 6, "ok": False, "grants": [grant]}) == []


def test_control_rejects_bad_requests_and_keeps_serving(space) -> None:
    with make(space, "sender") as sender:
        with _raw_dealer(sender.endpoint) as sock:
            sock.send(b"\xc1garbage")
            sock.send(msgpack.packb({"v": 1, "op": "get", "id": 7, "key": 5}))
            sock.send(msgpack.packb({"v": 1, "op": "explode", "id": 8}))
            sock.send(encode({"op": "get_many", "id": 10, "keys": []}))
            sock.send(encode({"op": "get_many", "id": 11, "keys": ["a", 3]}))
            sock.send(encode({"op": "get_many", "id": 12, "keys": ["k"] * 257}))
            sock.send(encode({"op": "release", "id": 13, "tickets": [1, -2]}))
            sock.send(encode({"op": "ping", "id": 9}))
            replies = []
            while len(replies) < 7 and sock.poll(5000):
                replies.append(decode(sock.recv()))
        assert [(r["id"], r["ok"], r.get("reason")) for r in replies] == [
            (7, False, "bad_request"),
            (8, False, "bad_request"),
            (10, False, "bad_request"),
            (11, False, "bad_request"),
            (12, False, "bad_request"),
            (13, False, "bad_request"),
            (9, True, None),
        ]
        assert sender.health()["bad_requests"] == 7 and sender.health()["control_thread"]


# ------------------------------------------------------------------------------- reaping


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait(timeout=30)
    assert not pid_alive(child.pid)
    return child.pid


def test_a_sender_is_gone_only_with_a_dead_owner_and_nobody_listening(space) -> None:
    namespace, base = space
    path, pidfile = control_paths(namespace, str(PORT), base)
    with make(space, "sender") as sender:
        assert sender.endpoint == f"ipc://{path}"
        assert not sender_gone(path)  # a live owner
        live = open(pidfile).read()
    assert not sender_gone(path)  # closed cleanly: no owner file (a sender not started yet looks so)
    directory = os.path.dirname(path)
    os.makedirs(directory, mode=0o700, exist_ok=True)
    try:
        with open(pidfile, "w") as handle:  # the owner file a SIGKILLed sender leaves
            handle.write(live.replace(live.split()[0], str(_dead_pid()), 1))
        assert sender_gone(path)  # no socket file either
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(path)
        listener.listen(1)
        # a dead pid but someone listens there (a pid of another pid namespace): not gone
        assert not sender_gone(path)
        listener.close()  # the socket file stays, nobody accepts on it: gone
        assert sender_gone(path)
    finally:
        for leftover in (path, pidfile):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(leftover)
        with contextlib.suppress(OSError):
            os.rmdir(directory)


def test_sender_start_survives_a_peer_removing_the_empty_directory(space, monkeypatch) -> None:
    """A peer that reaps or closes removes the namespace's directory when it is empty; when that
    lands between this sender's makedirs and its owner file, the sender retries instead of failing
    (a sender of a TP 4 stage once failed to start this way)."""
    from kvferry.adapters.connectors.shm import segment as segment_module

    namespace, base = space
    real_makedirs = os.makedirs
    removed = []

    def makedirs_then_peer_removes(path, mode=0o777, exist_ok=False):
        real_makedirs(path, mode=mode, exist_ok=exist_ok)
        if len(removed) < 2 and path == runtime_dir(namespace, base):
            os.rmdir(path)  # what the peer's rmdir does, twice in a row
            removed.append(path)

    monkeypatch.setattr(segment_module.os, "makedirs", makedirs_then_peer_removes)
    with make(space, "sender") as sender:
        assert len(removed) == 2  # the race happened, and the sender still started
        assert os.path.exists(os.path.join(runtime_dir(namespace, base), f"ctl-{PORT}.pid"))
        assert sender.put("0", "1", "k", b"v")[0]


def test_a_peer_reaping_as_the_owner_file_appears_leaves_the_claim(space, monkeypatch) -> None:
    """A peer that starts at the same moment reaps the namespace (owner files of dead pids go).
    It may look right when this sender's owner file first exists: the file must already name
    the live owner then, or the reaper removes it as stale, then the emptied directory, and the
    control socket cannot bind (seen once in the soak test)."""
    from kvferry.adapters.connectors.shm import segment as segment_module

    namespace, base = space
    pidfile = os.path.join(runtime_dir(namespace, base), f"ctl-{PORT}.pid")
    reaped: list[list[str]] = []

    def then_peer_reaps(real):
        def call(*args, **kwargs):
            out = real(*args, **kwargs)
            if not reaped and os.path.exists(pidfile):
                reaped.append(reap_namespace(namespace, base))  # what a peer's start does
            return out

        return call

    for name in ("open", "link", "rename", "replace"):
        monkeypatch.setattr(segment_module.os, name, then_peer_reaps(getattr(os, name)))
    with make(space, "sender") as sender:
        assert reaped == [[]]  # the peer looked while the owner file was new, and took nothing
        with open(pidfile, encoding="ascii") as owner:
            assert owner.readline().strip() == str(os.getpid())
        assert sender.put("0", "1", "k", b"v")[0]


def test_a_segment_in_dev_shm_is_watched_until_discarded_and_one_elsewhere_is_not(space) -> None:
    namespace, _ = space
    watched = create_segment(namespace, None, 1 << 16)
    try:
        assert watched.tracked and os.path.exists(watched.path)
    finally:
        assert discard_segment(watched)
        watched.unmap()
    assert not watched.tracked and not os.path.exists(watched.path)
    assert not discard_segment(watched)  # twice: nothing left to remove, nothing to take back
    # the tracker unlinks by POSIX shm name, which only names files in /dev/shm
    elsewhere = tempfile.mkdtemp(prefix="kvft-shm-", dir="/tmp")
    try:
        plain = create_segment(namespace, None, 1 << 16, shm_dir=elsewhere)
        assert not plain.tracked and os.path.dirname(plain.path) == elsewhere
        assert discard_segment(plain)
        plain.unmap()
    finally:
        shutil.rmtree(elsewhere)


def test_reaper_removes_only_dead_owners_files(space) -> None:
    namespace, base = space
    dead = _dead_pid()
    stale = os.path.join(SHM_DIR, segment_name(namespace, dead, 7, "deadbeef"))
    other_ns = os.path.join(SHM_DIR, segment_name(namespace + "x", dead, 7, "deadbeef"))
    directory = runtime_dir(namespace, base)
    os.makedirs(directory, mode=0o700)
    draft = os.path.join(directory, f"ctl-7.pid.{dead}.1.new")  # its writer died mid-claim
    for path in (stale, other_ns, os.path.join(directory, "ctl-7.sock"), draft):
        open(path, "wb").close()
    with open(os.path.join(directory, "ctl-7.pid"), "w") as owner:
        owner.write(f"{dead}\n")
    try:
        with make(space, "sender") as live:
            assert not os.path.exists(stale)  # the sender's start reaped it
            assert os.path.exists(other_ns)  # another namespace is not ours to touch
            assert sorted(os.listdir(directory)) == [f"ctl-{PORT}.pid", f"ctl-{PORT}.sock"]
            assert reap_namespace(namespace, base) == []  # the live sender's files stay
            assert live.put("0", "1", "k", b"v")[0]
    finally:
        os.unlink(other_ns)


def test_a_reservations_host_bytes_are_its_buffers_bytes(space) -> None:
    """The header goes into a reservation through ``host_bytes`` (no numpy view of the
    buffer): every region's memoryview is exactly its buffer's bytes, in both directions, and
    a payload written through it is what the receiver gets."""
    with make(space, "sender") as sender, make(space, "receiver", sender_port=PORT) as receiver:
        for size, fill in ((100, 1), (4096, 2), (7, 3)):
            reservation = sender.reserve("0", "1", f"k{size}", size)
            host, buffer = reservation.host_bytes, reservation.buffer
            assert host is not None and len(host) == buffer.numel() == size
            host[:] = bytes([fill]) * size  # written through the view: the tensor sees it
            assert bytes(buffer.numpy()) == bytes([fill]) * size
            buffer[-1] = 9  # written through the tensor: the view sees it
            assert host[-1] == 9
            assert reservation.commit()[0]
            got = receiver.get_blocking("0", "1", f"k{size}", timeout_s=10.0)
            assert got is not None and bytes(got[0].tensor.numpy()) == bytes([fill]) * (size - 1) + b"\t"
            got[0].release()
