"""The mooncake connector between real processes over TCP on loopback.

The test process drives workers (this file run as a script) through JSON lines on their
stdin/stdout, so every step is synchronised by a message, never by a sleep. Skips when the
optional engine package or its system library (libibverbs) is missing.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

import pytest

if __name__ == "__main__":  # run as a worker: tests/ (jsonlines, process_kit) is not on the path
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import process_kit  # noqa: E402
from jsonlines import commands, say  # noqa: E402
from mooncake_support import mooncake_missing  # noqa: E402

MiB = 1 << 20
BIG = 256 * MiB


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


@pytest.fixture
def workers():
    yield from process_kit.workers(__file__, mooncake_missing())


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
    health = sender.health()
    assert health["delivered"] == 1 and health["used_bytes"] == 0  # read once, then freed


@pytest.mark.slow
def test_sender_killed_while_a_receiver_waits_is_reported_promptly(workers) -> None:
    from kvferry.adapters.connectors.mooncake.connector import MooncakeConnector

    sender = workers("sender", {"role": "sender", "port": 0, "pool_bytes": MiB}, 0)
    endpoint = sender.read()["ready"]
    with MooncakeConnector.from_config({"role": "receiver", "pool_bytes": MiB}) as receiver:
        process_kit.check_sender_killed_while_waiting(sender, receiver, endpoint)


if __name__ == "__main__":
    process_kit.worker_main({"sender": sender_main, "receiver": receiver_main})
