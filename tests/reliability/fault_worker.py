"""A stage rank in its own process, driven by JSON lines on stdin (one reply line each).

    python fault_worker.py            # then: {"op": "open", ...}, {"op": "send", ...}, ...

Commands (replies are JSON objects on stdout):

- ``open``: ``role``, ``omni`` (an ``omni_kv_config``), ``tp_rank``, ``tp_size``, ``geom``
  (Geometry fields), ``seed``: build the manager (a sender binds at once) -> ``{"ready"}``.
- ``send``: ``rid``, ``block_ids``, ``seq_len`` -> ``{"sent", "ok", "reason"}``.
- ``hang_mid_put``: ``key``, ``nbytes``: reserve pool space, write half of it, reply
  ``{"mid_put"}`` and block (the test kills the process mid-put).
- ``hold``: ``key``, ``port``, ``timeout_s``: take a payload through the receiving connector
  and keep the pool buffer unreleased -> ``{"holding": size}`` (the test kills the process).
- ``health`` -> the manager's health; stdin EOF -> close and exit.

Spawn workers early and ``open`` them later: importing torch is the slow part.
"""

from __future__ import annotations

import os
import sys
import threading
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: jsonlines
from jsonlines import commands, say  # noqa: E402


def _reply(obj: dict[str, Any]) -> None:
    say(obj, default=str)


def main() -> int:
    import torch

    torch.set_num_threads(1)
    from stage_kit import Geometry, sender_cache

    from kvferry.app.wiring import build_manager
    from kvferry.core.policy import RetryPolicy

    _reply({"spawned": True})
    manager = cache = geom = None
    held: list[Any] = []
    for cmd in commands():
        op = cmd["op"]
        if op == "open":
            geom = Geometry(**cmd.get("geom", {}))
            retry = RetryPolicy(**cmd["retry"]) if cmd.get("retry") else RetryPolicy()
            manager = build_manager(
                cmd["omni"], tp_rank=cmd.get("tp_rank", 0), tp_size=cmd.get("tp_size", 1), env={}, retry=retry
            )
            if cmd["role"] == "sender":
                cache = sender_cache(geom, cmd.get("seed", 1), cmd.get("tp_rank", 0), cmd.get("from_tp", 1))
            _reply({"ready": cmd["role"], "pid": __import__("os").getpid()})
        elif op == "send":
            finished = {cmd["rid"]: {"block_ids": cmd["block_ids"], "seq_len": cmd["seq_len"]}}
            outcome = manager.send_requests(finished, cache, geom.block_size, geom.dtype)[0]
            _reply(
                {
                    "sent": cmd["rid"],
                    "ok": outcome.ok,
                    "reason": None if outcome.ok else f"{outcome.reason.value}: {outcome.detail}",
                }
            )
        elif op == "hang_mid_put":
            connector = manager.send_connector()
            reservation = connector.reserve("0", "1", cmd["key"], cmd["nbytes"])
            reservation.buffer[: cmd["nbytes"] // 2].fill_(7)
            held.append(reservation)
            _reply({"mid_put": cmd["key"]})
            threading.Event().wait()  # never commits: killed here
        elif op == "hold":
            connector = manager.recv_connector()
            got = connector.get_blocking(
                "0",
                "1",
                cmd["key"],
                {"source_host": "127.0.0.1", "source_port": cmd["port"]},
                timeout_s=cmd["timeout_s"],
            )
            if got is not None:
                held.append(got[0])  # never released: the process dies holding it
            _reply({"holding": None if got is None else got[1]})
        elif op == "health":
            _reply({"health": manager.health()})
    if manager is not None:
        manager.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
