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
from kvferry.core.errors import TransferError

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


class _Signalling:
    """A manager whose ``receive`` sets ``done`` when it returns."""

    def __init__(self, inner: Any, done: threading.Event) -> None:
        self._inner, self._done = inner, done

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def receive(self, *args: Any, **kwargs: Any) -> Any:
        result = self._inner.receive(*args, **kwargs)
        self._done.set()
        return result


def test_a_later_ranks_payload_is_received_while_an_earlier_rank_still_waits(tp_2_2) -> None:
    """Items in rank order 0, 1; rank 1's payload is sent first and rank 0's only once rank 1
    has received its own. Received one rank after the other, rank 1 would wait behind rank 0
    and the event below would never be set. What arrived is what each rank must hold."""
    sender, receiver = tp_2_2
    sends, recvs, expected = tp_items("t", 0, 2, 2, Geometry(**GEOMETRY).heads)
    rank1_done = threading.Event()
    receiver.managers["g"][1] = _Signalling(receiver.managers["g"][1], rank1_done)
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
