"""One rank of the soak pipeline (a sender stage of 2, a receiver stage of 4), in its own process.

    python soak_worker.py ROLE RANK SETUP_JSON

Each rank opens one manager per connector named in the setup (zmq over tcp, shm), as an
engine would (``build_manager`` from an ``omni_kv_config``). Receiver ranks form a gloo group
(the coordinator hosts the store) and receive through :class:`Distributor` (pure TP 2 -> 4:
every rank pulls its own shard, then the TP group agrees). Commands arrive as JSON lines; every
reply carries the process's RSS (KiB).

Sender: ``{"op": "send", "rid", "conn", "blocks", "seq_len", "fail"}`` where ``fail`` is None
or how this rank fails the request: ``corrupt`` (garbage bytes), ``wrong_rid`` (another
request's valid payload), ``truncate`` (half a payload), ``no_put`` (puts nothing);
``{"op": "cancel", "rid", "conn"}`` drops what the rank still holds for the request.
Receiver: ``{"op": "recv", "rid", "conn", "blocks", "seq_len", "timeout_s"}`` -> the outcome
kind, whether the TP group kept the KV, whether every tensor is bit-exact, the seconds taken.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: jsonlines
from jsonlines import commands, say  # noqa: E402


def _rss_kib() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") // 1024


def _reply(obj: dict[str, Any]) -> None:
    say(obj, rss_kib=_rss_kib())


class _Request:
    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.past_key_values: Any = None
        self.kv_metadata: Any = None


def _sender(rank: int, setup: dict[str, Any]) -> None:
    import torch
    from stage_kit import Geometry, sender_cache

    from kvferry.adapters.torch_frames import encode_bytes
    from kvferry.app.wiring import build_manager
    from kvferry.core.policy import RetryPolicy

    geom = Geometry(**setup["geom"])
    managers = {
        name: build_manager(
            omni, tp_rank=rank, tp_size=2, env={}, retry=RetryPolicy(attempts=200, first_backoff_s=0.01, factor=1.0)
        )
        for name, omni in setup["senders"].items()
    }
    cache = sender_cache(geom, setup["seed"], rank, 2)
    _reply({"ready": "sender", "rank": rank})
    for cmd in commands():
        manager = managers[cmd["conn"]]
        if cmd["op"] == "cancel":
            manager.send_connector().cleanup(cmd["rid"])
            _reply({"cancelled": cmd["rid"]})
            continue
        rid, fail = cmd["rid"], cmd.get("fail")
        if fail is None:
            finished = {rid: {"block_ids": cmd["blocks"], "seq_len": cmd["seq_len"]}}
            outcome = manager.send_requests(finished, cache, geom.block_size, geom.dtype)[0]
            _reply({"sent": rid, "ok": outcome.ok, "detail": "" if outcome.ok else outcome.detail})
            continue
        connector = manager.send_connector()
        layer = torch.zeros(4, 2, 2, dtype=torch.float16)
        for job in manager.send_path().jobs(rid):
            bad = {
                "corrupt": b"\x00\x00\x00\x20" + os.urandom(64),
                "wrong_rid": encode_bytes("other-" + rid, [layer], [layer], [0], {}),
                "truncate": encode_bytes(rid, [layer], [layer], [0], {})[:-9],
            }.get(fail)
            if bad is not None:
                connector.put("0", "1", job.key, bad)
        _reply({"sent": rid, "ok": False, "detail": f"injected {fail}"})
    for manager in managers.values():
        manager.close()


def _receiver(rank: int, setup: dict[str, Any]) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    from stage_kit import Geometry, expected_layers, received_exactly, sender_cache

    from kvferry.adapters.collectives import TorchDistGroup
    from kvferry.app.distribute import Distributor
    from kvferry.app.manager import KVCache, StageGroups
    from kvferry.app.wiring import build_manager

    store = dist.TCPStore("127.0.0.1", setup["store_port"], 4, is_master=False, timeout=datetime.timedelta(seconds=120))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=4, timeout=datetime.timedelta(seconds=120))
    world = TorchDistGroup()
    groups = StageGroups(world=world, tp=world)
    geom = Geometry(**setup["geom"])
    caches = {s: sender_cache(geom, setup["seed"], s, 2) for s in (0, 1)}
    managers = {
        name: build_manager(omni, tp_rank=rank, tp_size=4, groups=groups, env={})
        for name, omni in setup["receivers"].items()
    }
    _reply({"ready": "receiver", "rank": rank})
    for cmd in commands():
        manager = managers[cmd["conn"]]
        distributor = Distributor(
            groups, 2, 4, timeout_s=cmd["timeout_s"] + 20, kv_factory=KVCache, on_drop=manager.record_consensus_drop
        )
        box: dict[str, Any] = {}

        def receive(req: Any) -> bool:
            result = manager.receive(req.request_id, sender_info=setup["info"][cmd["conn"]], timeout_s=cmd["timeout_s"])
            box["result"] = result
            return manager.apply_to_request(req, result.payload) if result.ok else False

        req = _Request(cmd["rid"])
        started = time.monotonic()
        kept = distributor.run(req, receive, active=True)
        seconds = time.monotonic() - started
        result = box["result"]
        exact = False
        if kept:
            kv = req.past_key_values
            payload = {"layer_blocks": {"key_cache": kv.key_cache, "value_cache": kv.value_cache}}
            exact = received_exactly(payload, expected_layers(geom, caches, cmd["blocks"], cmd["seq_len"], 2, 4, rank))
        req.past_key_values = None
        _reply(
            {
                "rid": cmd["rid"],
                "rank": rank,
                "kind": result.outcome.kind.value,
                "kept": kept,
                "exact": exact,
                "seconds": result.outcome.seconds,
                "total_seconds": seconds,
            }
        )
    counters = {name: m.counters.snapshot() for name, m in managers.items()}
    for manager in managers.values():
        manager.close()
    _reply({"closed": rank, "counters": counters})
    os._exit(0)  # gloo threads need no orderly shutdown here


def main(argv: list[str]) -> int:
    role, rank, setup = argv[1], int(argv[2]), json.loads(argv[3])
    if role == "sender":
        _sender(rank, setup)
    else:
        _receiver(rank, setup)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv))
