"""The mooncake connector between real processes over TCP on loopback.

The test process drives workers (this file run as a script) through JSON lines on their
stdin/stdout, so every step is synchronised by a message, never by a sleep. Skips when the
optional engine package or its system library (libibverbs) is missing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

import pytest

if __name__ == "__main__":  # run as a worker: tests/ (jsonlines, warm_spawn) is not on the path
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from jsonlines import Channel, commands, say  # noqa: E402

MiB = 1 << 20
BIG = 256 * MiB
WAIT_S = 90.0  # deadline of one worker reply; the machine may be shared


def pattern(nbytes: int) -> Any:
    """``nbytes`` deterministic bytes in which every 8-byte word differs (catches misplaced
    or repeated chunks, not only flipped bits)."""
    import torch

    words = torch.arange(nbytes // 8, dtype=torch.int64) * 0x9E3779B97F4A7C15 + 12345
    return words.view(torch.uint8)


# ----------------------------------------------------------------------------- workers


def sender_main(config: dict, nbytes: int) -> None:
    """Put one payload of ``nbytes`` (0: none), report metadata, then answer ``health`` or
    ``exit`` commands."""
    from kvferry.adapters.connectors.mooncake.connector import MooncakeConnector

    with MooncakeConnector.from_config(config) as conn:
        meta = {"source_host": "127.0.0.1", "source_port": conn.port}
        if nbytes:
            ok, size, meta = conn.put("0", "1", "req_0_0_0_0", pattern(nbytes))
            if not ok:
                say({"error": meta})
                return
        say({"ready": meta})
        for command in commands(stop_op=None):
            if command["op"] == "health":
                say({"health": conn.health()})
            else:
                break


def receiver_main(config: dict, meta: dict) -> None:
    """Get the payload, compare it with the pattern bit for bit, report."""
    import torch

    from kvferry.adapters.connectors.mooncake.connector import MooncakeConnector

    with MooncakeConnector.from_config(config) as conn:
        start = time.perf_counter()
        got = conn.get_blocking("0", "1", "req_0_0_0_0", meta, timeout_s=60.0)
        seconds = time.perf_counter() - start
        if got is None:
            say({"error": conn.last_failure("req_0_0_0_0")})
            return
        buffer, size = got
        equal = size == meta["size"] and torch.equal(buffer.tensor, pattern(meta["size"]))
        buffer.release()
        say({"size": size, "equal": bool(equal), "seconds": seconds, "health": conn.health()})


class Worker:
    """This file run as a worker; replies are read with a deadline (a silent worker fails)."""

    def __init__(self, role: str, *args: Any) -> None:
        self._log = tempfile.TemporaryFile()  # stderr (engine logs): a file never fills up
        import warm_spawn  # here: this file also runs as the worker, where tests/ is not on the path

        self.proc = warm_spawn.popen(
            [__file__, role, *(json.dumps(a) for a in args)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
        )
        self.channel = Channel(self.proc, f"worker {self.proc.args[2]}", context=self.stderr)

    def read(self, timeout_s: float = WAIT_S) -> dict:
        """The next reply; a silent or ended worker fails the test (killed, with its stderr)."""
        return self.channel.read(timeout_s)

    def send(self, obj: dict) -> None:
        self.channel.send(obj)

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


@pytest.fixture
def workers():
    try:
        import mooncake.engine  # noqa: F401
    except (ImportError, OSError) as exc:
        pytest.skip(f"mooncake transfer engine unavailable: {exc}")
    started: list[Worker] = []

    def start(role: str, *args: Any) -> Worker:
        worker = Worker(role, *args)
        started.append(worker)
        return worker

    yield start
    for worker in reversed(started):
        worker.close()


# ----------------------------------------------------------------------------- tests


@pytest.mark.slow
def test_256_mib_request_moves_bit_exact_between_processes(workers) -> None:
    sender = workers("sender", {"role": "sender", "port": 0, "pool_bytes": BIG + MiB}, BIG)
    meta = sender.read()["ready"]
    assert meta["size"] == BIG and meta["source_port"] > 0
    receiver = workers("receiver", {"role": "receiver", "pool_bytes": BIG + MiB}, meta)
    result = receiver.read()
    assert result.get("equal") is True, result
    assert result["size"] == BIG and result["health"]["hits"] == 1
    sender.send({"op": "health"})
    health = sender.read()["health"]
    assert health["delivered"] == 1 and health["used_bytes"] == 0  # read once, then freed


@pytest.mark.slow
def test_sender_killed_while_a_receiver_waits_is_reported_promptly(workers) -> None:
    from kvferry.adapters.connectors.mooncake.connector import MooncakeConnector

    sender = workers("sender", {"role": "sender", "port": 0, "pool_bytes": MiB}, 0)
    endpoint = sender.read()["ready"]
    out: dict[str, Any] = {}
    with MooncakeConnector.from_config({"role": "receiver", "pool_bytes": MiB}) as receiver:

        def wait() -> None:
            start = time.monotonic()
            out["got"] = receiver.get_blocking("0", "1", "never_0_0_0_0", endpoint, timeout_s=60.0)
            out["elapsed"] = time.monotonic() - start

        thread = threading.Thread(target=wait)
        thread.start()
        deadline = time.monotonic() + WAIT_S
        while True:  # until the sender holds the receiver's long-poll
            sender.send({"op": "health"})
            if sender.read()["health"]["parked_lookups"] == 1:
                break
            assert time.monotonic() < deadline, "the receiver's lookup never reached the sender"
        killed_at = time.monotonic()
        sender.kill()
        thread.join(30.0)
        assert not thread.is_alive()
        assert out["got"] is None
        assert time.monotonic() - killed_at < 5.0  # not the 60 s deadline
        assert receiver.last_failure("never_0_0_0_0") == "sender_unavailable"


if __name__ == "__main__":
    role, *rest = sys.argv[1:]
    parsed = [json.loads(a) for a in rest]
    if role == "sender":
        sender_main(*parsed)
    else:
        receiver_main(*parsed)
