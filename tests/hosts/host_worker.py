"""Stage ranks for the multi-host tests, run inside a namespace host (``ip netns exec``).

Spoken to in JSON lines (commands on stdin, replies on stdout), so every step of a test is
synchronised by a message, never by a sleep:

- ``host_worker.py sender RANK SPEC_JSON OPTIONS_JSON``: one rank of the sending stage, built
  by :func:`kvferry.app.wiring.build_manager` from the stage's ``omni_kv_config`` exactly as an
  engine builds it, bound to ``OPTIONS["bind_host"]`` (this host's address). Commands:
  ``send`` (one request; answered with the outcome), ``wait_parked`` (answered once ``n``
  receivers wait here, or at a deadline), ``health`` and ``exit``.
- ``host_worker.py probe PLAN_JSON``: a host that is not a configured peer trying to get a
  sender's payloads (zmq receivers with the plan's configs) and to reach ports (plain TCP); it
  answers once with what it got and exits.
- ``host_worker.py receiver RANK WORLD STORE_FILE SPEC_JSON OPTIONS_JSON``: one rank of the
  receiving stage. It joins a gloo world (FileStore rendezvous; gloo over this host's
  loopback), builds the stage's TP group and an ``OmniKVTransferManager`` on it, and for each
  ``receive`` command calls ``receive_multi_kv_cache_distributed`` (receive, then the TP
  consensus) on a request whose ``kv_sender_info`` names the sender (SPEC 2.5: the receiver's
  only source for it). It answers with the outcome, the time taken, digests of the KV the
  request ends with and its connector's pool state; ``health`` reports the pool state again.

``OPTIONS``: ``bind_host`` (sender), ``connector`` (extra connector-config keys, e.g. a CURVE
``curve`` dict or a mooncake receiver's own ``host``).
"""

from __future__ import annotations

import faulthandler
import json
import os
import pathlib
import signal
import sys
import time
import types
from typing import Any

HERE = pathlib.Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent / "integration"), str(HERE.parent)]

os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
os.environ.setdefault("UCX_LOG_FILE", "/dev/stderr")  # UCX logs to stdout, this worker's protocol channel

from jsonlines import commands, say  # noqa: E402
from stage_worker import kv_digest, make_spec, serve_sender  # noqa: E402

INIT_TIMEOUT_S = 60.0


def omni_config(spec: Any, role: str, options: dict[str, Any]) -> dict[str, Any]:
    """The stage's ``omni_kv_config`` with this host's extra connector keys."""
    omni = spec.omni_kv_config(role)
    omni["connector_config"] = {**omni["connector_config"], **options.get("connector", {})}
    return omni


def pool_state(health: dict[str, Any] | None) -> dict[str, Any]:
    """The numbers of a connector's ``health()`` that say whether memory was given back."""
    if not health:
        return {}
    keys = (
        "held_payloads",
        "held_bytes",
        "reserved_bytes",
        "in_flight",
        "pool_used_bytes",
        "parked",
        "recv_pool_in_use",
        "stash_payloads",
        "stash_bytes",
        "used_bytes",
        "live_regions",
        "reserved",
        "entries",
        "parked_lookups",
        "room",
        "late_reads",
        "pool_bytes",
    )
    out: dict[str, Any] = {}
    for section in (health, health.get("sender") or {}, health.get("receiver") or {}):
        if isinstance(section, dict):
            out.update({k: section[k] for k in keys if k in section and isinstance(section[k], (int, float))})
    return out


# --------------------------------------------------------------------------------- sender
def sender_main(rank: int, spec_json: dict[str, Any], options: dict[str, Any]) -> None:
    import torch

    from kvferry.app.demo.worker import synthetic_cache
    from kvferry.app.wiring import build_manager

    torch.set_num_threads(1)
    spec = make_spec(**spec_json)
    manager = build_manager(
        omni_config(spec, "sender", options),
        tp_rank=rank,
        tp_size=spec.from_tp,
        env=os.environ,
        bind_host=options["bind_host"],
    )
    cache = synthetic_cache(spec, rank)
    health = manager.health().get("sender") or {}
    say(
        {
            "ready": rank,
            "pid": os.getpid(),
            "port": manager.sender_port(),
            "host": health.get("host"),
            "endpoint": health.get("endpoint"),
        }
    )

    def health(_: dict[str, Any]) -> dict[str, Any]:
        h = manager.health().get("sender") or {}
        return {"health": pool_state(h), "raw": {k: v for k, v in h.items() if isinstance(v, (int, str))}}

    serve_sender(manager, spec, cache, rank, {"health": health})


# ------------------------------------------------------------------------------- receiver
def _request(rid: str, info: Any) -> Any:
    params = types.SimpleNamespace(past_key_values=None, kv_metadata=None, cfg_kv_request_ids=None)
    return types.SimpleNamespace(
        request_id=rid, past_key_values=None, kv_metadata=None, sampling_params=params, kv_sender_info=info
    )


def receiver_main(
    rank: int, world_size: int, store_file: str, spec_json: dict[str, Any], options: dict[str, Any]
) -> None:
    import datetime

    import torch
    import torch.distributed as dist

    from kvferry.adapters.collectives import TorchDistGroup, build_parallel_groups
    from kvferry.app.compat.manager import OmniKVTransferManager
    from kvferry.app.manager import StageGroups
    from kvferry.core.config import TransferConfig
    from kvferry.core.roles import GroupLayout

    torch.set_num_threads(1)
    spec = make_spec(**spec_json)
    dist.init_process_group(
        "gloo",
        store=dist.FileStore(store_file, world_size),
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=INIT_TIMEOUT_S),
    )
    world = TorchDistGroup()
    layout = GroupLayout(tp_size=world_size, sp_size=1, cfg_size=1)
    g = build_parallel_groups(layout, rank, world, lambda ranks: TorchDistGroup.new(ranks, timeout_s=INIT_TIMEOUT_S))
    groups = StageGroups(world=world, tp=g.tp, cfg=g.cfg, sp=g.sp)
    managers: dict[float, Any] = {}

    def manager_for(timeout: float) -> Any:
        if timeout not in managers:
            omni = dict(omni_config(spec, "receiver", options), recv_timeout=timeout)
            managers[timeout] = OmniKVTransferManager(
                TransferConfig.from_omni_kv_config(omni, os.environ), tp_rank=rank, tp_size=world_size, groups=groups
            )
        return managers[timeout]

    def pools() -> dict[str, Any]:
        out: dict[str, Any] = {}
        for timeout, m in managers.items():
            out[str(timeout)] = pool_state(m.manager.health().get("receiver"))
        return out

    say({"ready": rank, "pid": os.getpid()})
    try:
        for command in commands():
            op = command["op"]
            if op == "receive":
                manager = manager_for(float(command["timeout"]))
                req = _request(command["rid"], command["info"])
                start = time.monotonic()
                ok = manager.receive_multi_kv_cache_distributed(req)
                seconds = time.monotonic() - start
                outcome = manager.last_receive_outcome
                kv = req.past_key_values
                say(
                    {
                        "rank": rank,
                        "rid": command["rid"],
                        "ok": bool(ok),
                        "seconds": seconds,
                        "outcome": outcome.kind.value if outcome is not None else None,
                        "detail": outcome.detail if outcome is not None else None,
                        "digest": kv_digest(kv.key_cache, kv.value_cache) if kv is not None else None,
                        "pools": pools(),
                    }
                )
            elif op == "health":
                say({"rank": rank, "pools": pools()})
            else:
                say({"error": f"unknown op {op!r}"})
    except BaseException as exc:  # report, then leave at once so peers' collectives fail fast
        say({"error": f"{type(exc).__name__}: {exc}", "rank": rank})
        os._exit(3)
    for m in managers.values():
        m.close()
    say({"closed": rank})
    os._exit(0)  # skip process-group teardown (it would wait for every peer)


# ---------------------------------------------------------------------------------- probe
def _tcp_probe(host: str, port: int, timeout_s: float) -> dict[str, Any]:
    """Connect to ``host:port`` with a plain TCP socket; what it got (at most a greeting)."""
    import socket

    try:
        sock = socket.create_connection((host, port), timeout=timeout_s)
    except OSError as exc:
        return {"connected": False, "error": type(exc).__name__, "errno": exc.errno}
    with sock:
        sock.settimeout(timeout_s)
        try:
            first = sock.recv(4096)
        except OSError:
            first = b""
        return {"connected": True, "first_bytes": len(first)}


def probe_main(plan: dict[str, Any]) -> None:
    """What a host that is not a configured peer can get: zmq receivers with the given configs
    asking for keys (``gets``) and plain TCP connections (``tcp``); one JSON line of results."""
    from kvferry.adapters.connectors.zmq.connector import ZmqConnector

    results: dict[str, Any] = {"gets": [], "tcp": []}
    for attempt in plan.get("gets", []):
        start = time.monotonic()
        with ZmqConnector.from_config({"type": "zmq", "role": "receiver", **attempt["config"]}) as conn:
            got = conn.get_blocking("0", "1", attempt["key"], attempt["metadata"], timeout_s=attempt["timeout"])
            data = None
            if got is not None:
                frames, size = got
                data = {"size": size, "bytes": b"".join(bytes(f) for f in frames).hex()[:64]}
            health = conn.health()
        results["gets"].append(
            {"name": attempt["name"], "data": data, "hits": health["hits"], "seconds": time.monotonic() - start}
        )
    for host, port in plan.get("tcp", []):
        results["tcp"].append({"host": host, "port": port, **_tcp_probe(host, port, plan.get("tcp_timeout", 1.0))})
    say(results)


def bind_check(config: dict[str, Any]) -> None:
    """Start a zmq sender with ``config``; say whether it bound or which BindError it raised."""
    from kvferry.adapters.connectors.zmq.connector import ZmqConnector
    from kvferry.core.errors import BindError

    try:
        ZmqConnector.from_config({"role": "sender", **config}).close()
    except BindError as exc:
        say({"bind_error": str(exc)})
        return
    say({"bound": True})


def main(argv: list[str]) -> None:
    # SIGUSR1 writes every thread's Python stack to stderr (the worker's log): a test whose
    # worker fell silent shows where it waits (HostWorker.stacks)
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    kind = argv[0]
    if kind == "sender":
        sender_main(int(argv[1]), json.loads(argv[2]), json.loads(argv[3]))
    elif kind == "receiver":
        receiver_main(int(argv[1]), int(argv[2]), argv[3], json.loads(argv[4]), json.loads(argv[5]))
    elif kind == "probe":
        probe_main(json.loads(argv[1]))
    elif kind == "bench":  # one end of a ``kvferry bench --hosts`` link
        from kvferry.app.bench.hosts_worker import main as bench_main

        bench_main(argv[1:])
    elif kind == "bind_check":
        bind_check(json.loads(argv[1]))
    else:
        raise SystemExit(f"unknown worker kind {kind!r}")


if __name__ == "__main__":
    main(sys.argv[1:])
