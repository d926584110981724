"""Workers of the connector process tests (mooncake, nixl): a test file run as a script, driven
through JSON lines on its stdin/stdout so that every step is synchronised by a message, never by
a sleep; and the test body both connectors share (a sender killed while a receiver waits)."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from jsonlines import Channel

WAIT_S = 90.0  # deadline of one worker reply; the machine may be shared


class Worker:
    """``script`` run as a worker; replies are read with a deadline (a silent worker fails)."""

    def __init__(self, script: str, role: str, *args: Any) -> None:
        self._log = tempfile.TemporaryFile()  # stderr (engine/agent logs): a file never fills up
        import warm_spawn  # here: workers import this kit too, and never start workers

        self.proc = warm_spawn.popen(
            [script, role, *(json.dumps(a) for a in args)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
        )
        self.channel = Channel(self.proc, f"worker {role}", context=self.stderr)

    def read(self, timeout_s: float = WAIT_S) -> dict:
        """The next reply; a silent or ended worker fails the test (killed, with its stderr)."""
        return self.channel.read(timeout_s)

    def send(self, obj: dict) -> None:
        self.channel.send(obj)

    def health(self) -> dict:
        self.send({"op": "health"})
        return self.read()["health"]

    def stderr(self) -> str:
        self.kill()
        self._log.seek(0)
        return self._log.read().decode(errors="replace")[-3000:]

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.send({"op": "exit"})
                self.proc.wait(30)
            except (BrokenPipeError, subprocess.TimeoutExpired):
                pass  # the kill below ends it
        self.kill()
        self.channel.close(WAIT_S)
        self._log.close()


def workers(script: str, missing: str | None) -> Iterator[Callable[..., Worker]]:
    """Body of a ``workers`` fixture: ``start(role, *args)`` runs ``script`` as a worker; all are
    closed at the end, the last started first. Skips with ``missing`` when it is not None."""
    if missing is not None:
        pytest.skip(missing)
    started: list[Worker] = []

    def start(role: str, *args: Any) -> Worker:
        worker = Worker(script, role, *args)
        started.append(worker)
        return worker

    yield start
    for worker in reversed(started):
        worker.close()


def check_sender_killed_while_waiting(sender: Worker, receiver: Any, endpoint: dict) -> None:
    """``receiver`` waits (60 s) for a key ``sender`` never puts; once the sender holds the
    long-poll it is killed: the get raises SenderUnavailable within 5 s (its connection dropped
    while it was out; ``sender_gone``). A get asked afterwards, of an endpoint this receiver
    reached before, raises too once the endpoint has been unreachable for the grace
    (``SENDER_DOWN_GRACE_S``), not at its 60 s deadline. The control: another receiver, which
    never reached that endpoint, keeps waiting for it (a receiver may start before its sender)
    and gets None at its own short deadline."""
    from kvferry.core.errors import SenderUnavailable
    from kvferry.core.policy import SENDER_DOWN_GRACE_S

    out: dict[str, Any] = {}

    def wait() -> None:
        start = time.monotonic()
        try:
            out["got"] = receiver.get_blocking("0", "1", "never_0_0_0_0", endpoint, timeout_s=60.0)
        except SenderUnavailable as exc:
            out["gone"] = str(exc)
        out["elapsed"] = time.monotonic() - start

    thread = threading.Thread(target=wait)
    thread.start()
    deadline = time.monotonic() + WAIT_S
    while sender.health()["parked_lookups"] != 1:  # until the sender holds the long-poll
        assert time.monotonic() < deadline, "the receiver's lookup never reached the sender"
    killed_at = time.monotonic()
    sender.kill()
    thread.join(30.0)
    assert not thread.is_alive()
    assert "gone" in out, out
    assert time.monotonic() - killed_at < 5.0  # not the 60 s deadline
    assert receiver.last_failure("never_0_0_0_0") == "sender_gone"

    start = time.monotonic()
    with pytest.raises(SenderUnavailable):
        while time.monotonic() - start < 30.0:  # the caller asks again while it gets None
            assert receiver.get_blocking("0", "1", "later_0_0_0_0", endpoint, timeout_s=60.0) is None
    # down since the kill: given up on once the grace has passed since then, not before
    assert SENDER_DOWN_GRACE_S <= time.monotonic() - killed_at < SENDER_DOWN_GRACE_S + 5.0

    fresh = type(receiver).from_config({"role": "receiver", "pool_bytes": 1 << 20})
    try:
        start = time.monotonic()
        got = None
        while time.monotonic() - start < 3.0:  # asked again and again: never given up on
            got = fresh.get_blocking("0", "1", "later_0_0_0_0", endpoint, timeout_s=0.5)
            assert got is None
        assert fresh.last_failure("later_0_0_0_0") == "sender_unavailable"
    finally:
        fresh.close()


def worker_main(mains: dict[str, Callable[..., None]]) -> None:
    """Run as a worker: ``argv[1]`` names the main, the rest are its JSON arguments."""
    role, *rest = sys.argv[1:]
    mains[role](*(json.loads(a) for a in rest))
