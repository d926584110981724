"""The bench worker's manager receive (``mgr_recv``), in one process over real shm connectors.

A TP group's receiver ranks each receive on their own (processes of their own in a
deployment), so the worker receives several ranks at once: a rank whose payload is published
first is received first, whatever the items' order.
"""

from __future__ import annotations

import itertools
import os
import shutil
import tempfile
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from kvferry.app.bench.model import Geometry
from kvferry.app.bench.scenarios import tp_items
from kvferry.app.bench.worker import Worker
from kvferry.core.errors import TransferError, TransferTimeout

GEOMETRY = {"layers": 2, "tokens": 64, "heads": 4, "head_dim": 128, "dtype": "bfloat16", "block_size": 16}
_SPACES = itertools.count()


@pytest.fixture
def tp_2_2() -> Iterator[tuple[Worker, Worker]]:
    """A sender worker (ranks 0 and 1, a shm connector each) and a receiver worker (ranks 0 and
    1, one shm connector), TP 2 -> 2, managers group ``g``, in a private namespace."""
    base = tempfile.mkdtemp(prefix="kvfbw-", dir="/tmp")
    common = {"type": "shm", "namespace": f"bw{os.getpid()}n{next(_SPACES)}", "runtime_dir": base}
    sender, receiver = Worker(), Worker()
    try:
        sender.cmd_setup("main", GEOMETRY, requests=2, seed=5)
        for name, port in (("s0", 50171), ("s1", 50187)):
            sender.cmd_kv_open(name, {**common, "role": "sender", "port": port, "pool_bytes": 16 << 20})
        receiver.cmd_kv_open("r", {**common, "role": "receiver"})
        sender.cmd_mgr_open("g", "sender", [0, 1], 2, 2, connectors=["s0", "s1"])
        receiver.cmd_mgr_open("g", "receiver", [0, 1], 2, 2, timeout_s=20.0, connectors=["r", "r"])
        yield sender, receiver
    finally:
        for worker in (receiver, sender):
            for name in list(worker.connectors):
                worker.cmd_kv_close(name)
        shutil.rmtree(base, ignore_errors=True)


def _receive_in_background(receiver: Worker, items: list[dict], timeout_s: float) -> tuple[threading.Thread, dict]:
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["result"] = receiver.cmd_mgr_recv("g", items, timeout_s, sender={"host": "127.0.0.1", "port": 50171})
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            out["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


class _Hooked:
    """A manager whose ``receive`` waits for ``gate`` before it starts (a rank still starting)
    and sets ``done`` when it returns (each when given)."""

    def __init__(self, inner: Any, *, gate: threading.Event | None = None, done: threading.Event | None = None) -> None:
        self._inner, self._gate, self._done = inner, gate, done

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def receive(self, *args: Any, **kwargs: Any) -> Any:
        if self._gate is not None:
            assert self._gate.wait(20.0)
        result = self._inner.receive(*args, **kwargs)
        if self._done is not None:
            self._done.set()
        return result


def test_a_later_ranks_payload_is_received_while_an_earlier_rank_still_waits(tp_2_2) -> None:
    """Items in rank order 0, 1; rank 1's payload is sent first and rank 0's only once rank 1
    has received its own. Received one rank after the other, rank 1 would wait behind rank 0
    and the event below would never be set. What arrived is what each rank must hold."""
    sender, receiver = tp_2_2
    sends, recvs, expected = tp_items("t", 0, 2, 2, Geometry(**GEOMETRY).heads)
    rank1_done = threading.Event()
    receiver.managers["g"][1] = _Hooked(receiver.managers["g"][1], done=rank1_done)
    thread, out = _receive_in_background(receiver, recvs, 20.0)
    sender.cmd_mgr_send("g", "main", [s for s in sends if s["rank"] == 1])
    received_first = rank1_done.wait(15.0)
    sender.cmd_mgr_send("g", "main", [s for s in sends if s["rank"] == 0])
    thread.join(30.0)
    assert received_first, "rank 1 was not received while rank 0 waited"
    assert "error" not in out, out.get("error")
    result = out["result"]
    want = [sender.cmd_expected_crc(c, r, heads=None if h is None else list(h))["crc"] for c, r, h in expected]
    assert result["crc"] == want
    assert result["t_have"][1] < result["t_have"][0] <= result["t_done"]
    # control: the two ranks hold different requests, so a swap would not pass
    assert want[0] != want[1]


def test_a_rank_that_gets_nothing_fails_the_command_after_the_others_are_released(tp_2_2) -> None:
    """Rank 0's payload never comes: the command raises TransferError naming rank 0 within
    its deadline, and rank 1's payload, received meanwhile, is handed back to its pool."""
    sender, receiver = tp_2_2
    sends, recvs, _ = tp_items("u", 0, 2, 2, Geometry(**GEOMETRY).heads)
    thread, out = _receive_in_background(receiver, recvs, 2.0)
    sender.cmd_mgr_send("g", "main", [s for s in sends if s["rank"] == 1])
    thread.join(30.0)
    assert not thread.is_alive()
    assert isinstance(out.get("error"), TransferError)
    assert "rank 0" in str(out["error"])
    health = sender.connectors["s1"].health()
    assert health["released"] == 1 and health["live_regions"] == 0, health


def _receive_with_rank_held(tp: tuple[Worker, Worker], tag: str, rank: int) -> tuple[Any, ...]:
    """Start receiving request ``tag`` on both ranks with rank ``rank`` held before it asks its
    connector until ``gate`` is set; the command's announcement (the channel's, in a worker
    process) sets ``announced``. Returns ``(sends, expected, gate, announced, thread, out)``."""
    _, receiver = tp
    sends, recvs, expected = tp_items(tag, 0, 2, 2, Geometry(**GEOMETRY).heads)
    gate, announced = threading.Event(), threading.Event()
    receiver.announce = announced.set  # type: ignore[method-assign]
    receiver.managers["g"][rank] = _Hooked(receiver.managers["g"][rank], gate=gate)
    thread, out = _receive_in_background(receiver, recvs, 20.0)
    return sends, expected, gate, announced, thread, out


def test_the_receive_announces_only_once_every_rank_asks_for_its_payload(tp_2_2) -> None:
    """Rank 0 is held before it asks its connector: the command must not announce that it
    waits (the sender would start against a rank not waiting yet) until rank 0 asks; then it
    announces, and both ranks receive what was sent to them."""
    sender, _ = tp_2_2
    sends, expected, gate, announced, thread, out = _receive_with_rank_held(tp_2_2, "v", 0)
    early = announced.wait(0.5)
    gate.set()
    assert announced.wait(10.0), "no announcement after every rank asked"
    assert not early, "announced while rank 0 had not asked for its payload"
    sender.cmd_mgr_send("g", "main", sends)
    thread.join(30.0)
    assert "error" not in out, out.get("error")
    result = out["result"]
    want = [sender.cmd_expected_crc(c, r, heads=None if h is None else list(h))["crc"] for c, r, h in expected]
    assert result["crc"] == want
    assert result["ranks_not_waiting"] == 0
    assert result["announce_wait_s"] >= 0.5


def test_a_rank_that_never_asks_delays_the_announcement_by_a_bound_and_is_reported(tp_2_2, monkeypatch) -> None:
    """A rank whose receive never reaches its connector within ANNOUNCE_WAIT_S: the command
    announces anyway at that bound and says how many ranks were not waiting."""
    from kvferry.app.bench import worker_kv

    monkeypatch.setattr(worker_kv, "ANNOUNCE_WAIT_S", 0.3)
    sender, _ = tp_2_2
    sends, _, gate, announced, thread, out = _receive_with_rank_held(tp_2_2, "w", 1)
    assert announced.wait(10.0)
    gate.set()
    sender.cmd_mgr_send("g", "main", sends)
    thread.join(30.0)
    assert "error" not in out, out.get("error")
    assert out["result"]["ranks_not_waiting"] == 1
    assert 0.3 <= out["result"]["announce_wait_s"] < 10.0


def test_get_waits_counts_each_thread_once_a_round() -> None:
    from kvferry.app.bench.worker_kv import GetWaits

    waits = GetWaits()
    waits.entered()
    waits.entered()  # the same thread again: still one
    assert waits.count() == 1
    other = threading.Thread(target=waits.entered)
    other.start()
    other.join(10.0)
    assert waits.wait(2, 10.0) and waits.count() == 2
    waits.reset()
    assert waits.count() == 0 and not waits.wait(1, 0.0)
    waits.entered()  # a new round counts this thread again
    assert waits.count() == 1


def test_the_wake_floors_bell_wakes_the_waiting_peer_and_a_silent_one_times_out() -> None:
    """The small request's floor (figure ``wake``): the receiver announces, then blocks until
    the sender's one datagram comes; with nothing rung the wait ends at its timeout, typed."""
    sender, receiver, other = Worker(), Worker(), Worker()
    announced = threading.Event()
    receiver.announce = announced.set
    out: dict[str, Any] = {}
    try:
        name = receiver.cmd_bell_bind()["name"]
        assert other.cmd_bell_bind()["name"] != name  # two peers never share a bell
        sender.cmd_bell_connect(name)
        waiter = threading.Thread(target=lambda: out.update(receiver.cmd_bell_wait(20.0)), daemon=True)
        waiter.start()
        assert announced.wait(20.0)
        assert "t_done" not in out  # announced, still waiting: nothing was rung yet
        sent = sender.cmd_bell_ring()
        waiter.join(20.0)
        assert not waiter.is_alive() and sent["t_go"] <= out["t_done"]
        with pytest.raises(TransferTimeout):  # the control: nobody rings
            receiver.cmd_bell_wait(0.05)
    finally:
        for worker in (sender, receiver, other):
            worker.close()
