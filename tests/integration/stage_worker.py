"""Processes for the integration tests, and the pure helpers both sides share.

Run as a script it is one of two kinds of process, spoken to in JSON lines (stdout), so every
step of a test is synchronised by a message, never by a sleep:

- ``python stage_worker.py receiver RANK WORLD STORE_FILE PLAN_FILE``: one rank of a receiving
  stage. It joins a gloo world (FileStore rendezvous, loopback only), then runs every scenario of
  the plan in order: builds the scenario's TP/SP/CFG groups from its :class:`GroupLayout`,
  builds ``OmniKVTransferManager`` s on them and calls ``receive_multi_kv_cache_distributed``
  for each request, with a CFG collector on the pulling ranks. It reports, per request, whether
  it ended with KV, how long it took and a digest of every KV field it ended with; the test
  compares the digests with what the sender's cache holds.
- ``python stage_worker.py sender RANK SPEC_JSON``: one rank of a sending stage (built by
  :func:`kvferry.app.wiring.build_manager` from the demo's ``omni_kv_config``). Commands on stdin:
  ``{"op": "send", "rid": ...}`` (answered with the send outcome), ``{"op": "wait_parked",
  "n": N}`` (answered once N receivers wait at this sender, or at a deadline) and
  ``{"op": "exit"}`` (closes the manager, exit status 0).

Request geometry (length and blocks) is a deterministic function of the request id and the
spec, and caches come from :func:`kvferry.app.demo.worker.synthetic_cache`, so the test process
and every worker agree on every byte without exchanging tensors.
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import random
import sys
import time
import types
from collections.abc import Callable
from typing import Any

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))  # tests/: jsonlines

from jsonlines import commands, say  # noqa: E402

os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
os.environ.setdefault("OMP_NUM_THREADS", "1")

#: Rendezvous and sub-group creation deadline (seconds).
INIT_TIMEOUT_S = 60.0
#: How long ``wait_parked`` waits for receivers to park before answering anyway (seconds).
PARKED_WAIT_S = 30.0
KV_SUFFIXES = ("past_key_values", "kv_metadata")


# --------------------------------------------------------------------------- pure helpers
def make_spec(**fields: Any) -> Any:
    """A :class:`DemoSpec` with the tests' tiny geometry (2 layers, 8 KV heads, head_dim 16)."""
    from kvferry.app.demo.model import DemoSpec

    base = dict(
        connector="zmq-tcp",
        model="tiny",
        layers=2,
        kv_heads=8,
        head_dim=16,
        dtype="bfloat16",
        block_size=16,
        requests=6,
        min_tokens=8,
        max_tokens=64,
        timeout_s=30.0,
        pool_bytes=8 << 20,
    )
    base.update(fields)
    if isinstance(base.get("store_ports"), list):
        base["store_ports"] = tuple(base["store_ports"])
    return DemoSpec(**base)


def spec_to_json(spec: Any) -> dict[str, Any]:
    import attrs

    return attrs.asdict(spec)


def request_geometry(spec: Any, request_id: str) -> tuple[int, list[int]]:
    """``(seq_len, block_ids)`` of ``request_id``: the same in every process (seeded by the id)."""
    rng = random.Random(f"{spec.seed}/{request_id}")
    seq_len = rng.randint(spec.min_tokens, spec.max_tokens)
    blocks = rng.sample(range(spec.num_blocks), -(-seq_len // spec.block_size))
    return seq_len, blocks


def finished_request(spec: Any, request_id: str) -> dict[str, dict[str, Any]]:
    """The ``finished`` mapping a sender's ``send_requests`` takes for one request."""
    seq_len, blocks = request_geometry(spec, request_id)
    return {request_id: {"block_ids": blocks, "seq_len": seq_len}}


def sender_caches(spec: Any) -> list[Any]:
    """Every sender rank's synthetic paged cache (rank order)."""
    from kvferry.app.demo.worker import synthetic_cache

    return [synthetic_cache(spec, r) for r in range(spec.from_tp)]


def expected_layers(
    spec: Any, caches: list[Any], request_id: str, heads: tuple[int, int]
) -> tuple[list[Any], list[Any]]:
    """Key and value tensors ``[seq_len, hi-lo, head_dim]`` of the model's heads ``heads``."""
    import torch

    from kvferry.app.demo.worker import expected_kv

    seq_len, blocks = request_geometry(spec, request_id)
    per = spec.kv_heads // spec.from_tp
    out: tuple[list[Any], list[Any]] = ([], [])
    for which in (0, 1):
        for layer in range(spec.layers):
            full = torch.cat(
                [expected_kv(caches[s], blocks, seq_len, (0, per), which, layer) for s in range(spec.from_tp)], dim=1
            )
            out[which].append(full[:, heads[0] : heads[1]])
    return out


def tensor_digest(t: Any) -> str:
    """dtype, shape and a hash of the bytes: equal digests mean bit-identical tensors."""
    import torch

    if not isinstance(t, torch.Tensor):
        return f"not a tensor: {type(t).__name__}"
    raw = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    return f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)}:{hashlib.sha256(raw).hexdigest()[:20]}"


def kv_digest(keys: list[Any], values: list[Any]) -> list[str]:
    return [tensor_digest(t) for t in list(keys) + list(values)]


def expected_digest(spec: Any, caches: list[Any], request_id: str, heads: tuple[int, int]) -> list[str]:
    return kv_digest(*expected_layers(spec, caches, request_id, heads))


# ------------------------------------------------------------------------ receiving stage
def _field_report(req: Any) -> dict[str, Any]:
    """Digests of every KV field the request ends with, and the plain CFG fields."""
    fields: dict[str, Any] = {}
    kv = getattr(req, "past_key_values", None)
    if kv is not None:
        fields["past_key_values"] = kv_digest(kv.key_cache, kv.value_cache)
    params = req.sampling_params
    for name, value in sorted(vars(params).items()):
        if value is None or name in ("past_key_values", "kv_metadata", "cfg_kv_request_ids"):
            continue
        if name == "cfg_branch_past_key_values":  # {role: KV}, as the reference sets it
            fields[name] = {role: kv_digest(v.key_cache, v.value_cache) for role, v in sorted(value.items())}
        elif name == "cfg_branch_kv_metadata":
            fields[name] = {role: {"seq_len": v.get("seq_len")} for role, v in sorted(value.items())}
        elif name.endswith("_past_key_values"):
            fields[name] = kv_digest(value.key_cache, value.value_cache)
        elif name.endswith("_kv_metadata"):
            fields[name] = {"seq_len": value.get("seq_len")} if isinstance(value, dict) else repr(value)
        else:
            fields[name] = value if isinstance(value, (str, int, float, bool, list)) else repr(value)
    meta = getattr(req, "kv_metadata", None)
    if isinstance(meta, dict) and meta:
        fields["kv_metadata"] = {"seq_len": meta.get("seq_len")}
    return fields


def _collector(request_id: str, cfg_ids: dict[str, str], manager: Any, target_device: Any) -> dict[str, Any]:
    """CFG companions: receive each branch's request and put it on the sampling params."""
    from kvferry.app.manager import KVCache

    out: dict[str, Any] = {}
    for role, companion in cfg_ids.items():
        data, _ = manager.receive_kv_cache_for_request(companion, target_device)
        if data is None:
            continue
        blocks = data["layer_blocks"]
        out[f"{role}_past_key_values"] = KVCache(list(blocks["key_cache"]), list(blocks["value_cache"]))
        out[f"{role}_kv_metadata"] = data.get("metadata") or {}
    return out


def _make_request(rid: str, sender_port: int, cfg_ids: dict[str, str] | None) -> Any:
    params = types.SimpleNamespace(past_key_values=None, kv_metadata=None, cfg_kv_request_ids=cfg_ids or None)
    return types.SimpleNamespace(
        request_id=rid,
        past_key_values=None,
        kv_metadata=None,
        sampling_params=params,
        kv_sender_info={"host": "127.0.0.1", "zmq_port": sender_port},
    )


def _run_scenario(rank: int, world: Any, scenario: dict[str, Any], group_cache: dict) -> None:
    from kvferry.adapters.collectives import TorchDistGroup, build_parallel_groups
    from kvferry.app.compat.manager import OmniKVTransferManager
    from kvferry.app.manager import StageGroups
    from kvferry.core.config import TransferConfig
    from kvferry.core.roles import GroupLayout

    lay = scenario["layout"]
    layout = GroupLayout(tp_size=lay["tp"], sp_size=lay["sp"], cfg_size=lay["cfg"])
    if layout not in group_cache:  # every rank creates every group, in the same order
        group_cache[layout] = build_parallel_groups(
            layout, rank, world, lambda ranks: TorchDistGroup.new(ranks, timeout_s=INIT_TIMEOUT_S)
        )
    g = group_cache[layout]
    groups = StageGroups(world=world, tp=g.tp, cfg=g.cfg, sp=g.sp)
    _, _, tp_rank = layout.coords(rank)
    spec = make_spec(**scenario["spec"])
    managers: dict[float, Any] = {}
    try:
        for item in scenario["requests"]:
            timeout = float(item["timeout"])
            if timeout not in managers:
                omni = dict(spec.omni_kv_config("receiver"), recv_timeout=timeout)
                managers[timeout] = OmniKVTransferManager(
                    TransferConfig.from_omni_kv_config(omni, os.environ),
                    tp_rank=tp_rank,
                    tp_size=layout.tp_size,
                    groups=groups,
                )
            manager = managers[timeout]
            req = _make_request(item["rid"], item["sender_port"], item.get("cfg"))
            start = time.monotonic()
            ok = manager.receive_multi_kv_cache_distributed(req, cfg_kv_collect_func=_collector)
            seconds = time.monotonic() - start
            outcome = manager.last_receive_outcome
            say(
                {
                    "scenario": scenario["name"],
                    "rank": rank,
                    "rid": item["rid"],
                    "ok": bool(ok),
                    "seconds": seconds,
                    "outcome": outcome.kind.value if outcome is not None else None,
                    "missing": list(outcome.missing_keys) if outcome is not None else [],
                    "fields": _field_report(req),
                }
            )
    finally:
        for manager in managers.values():
            manager.close()


def receiver_main(rank: int, world_size: int, store_file: str, plan: list[dict[str, Any]]) -> None:
    import datetime

    import torch
    import torch.distributed as dist

    from kvferry.adapters.collectives import TorchDistGroup

    torch.set_num_threads(1)
    store = dist.FileStore(store_file, world_size)
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=INIT_TIMEOUT_S)
    )
    world = TorchDistGroup()
    say({"ready": rank, "pid": os.getpid()})
    groups: dict = {}
    try:
        for scenario in plan:
            _run_scenario(rank, world, scenario, groups)
    except BaseException as exc:  # report, then leave at once so peers' collectives fail fast
        say({"error": f"{type(exc).__name__}: {exc}", "rank": rank})
        sys.stdout.flush()
        os._exit(3)
    say({"done": rank})
    os._exit(0)  # skip process-group teardown (it would wait for every peer)


# --------------------------------------------------------------------------- sending stage
def _wait_until(predicate: Callable[[], bool], timeout_s: float) -> bool:
    import threading

    deadline = time.monotonic() + timeout_s
    pause = threading.Event()
    while not predicate():
        if time.monotonic() >= deadline:
            return False
        pause.wait(0.005)
    return True


def _parked(manager: Any) -> int:
    health = manager.health().get("sender") or {}
    inner = health.get("sender") if isinstance(health.get("sender"), dict) else {}
    # zmq and shm count parked gets; the mooncake sender counts parked lookups
    return int(health.get("parked") or inner.get("parked") or health.get("parked_lookups") or 0)


def sender_main(rank: int, spec_json: dict[str, Any]) -> None:
    import torch

    from kvferry.app.wiring import build_manager

    torch.set_num_threads(1)
    spec = make_spec(**spec_json)
    manager = build_manager(spec.omni_kv_config("sender"), tp_rank=rank, tp_size=spec.from_tp, env=os.environ)
    from kvferry.app.demo.worker import synthetic_cache

    cache = synthetic_cache(spec, rank)
    say({"ready": rank, "pid": os.getpid(), "port": manager.sender_port()})
    serve_sender(manager, spec, cache, rank)


def serve_sender(
    manager: Any,
    spec: Any,
    cache: Any,
    rank: int,
    extra_ops: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] | None = None,
) -> None:
    """Answer the sender commands on stdin (``send``, ``wait_parked``, ``exit``, plus
    ``extra_ops``: op -> command -> reply) until ``exit`` or end of input; then close."""
    try:
        for command in commands():
            op = command["op"]
            if op == "send":
                outcome = manager.send_requests(
                    finished_request(spec, command["rid"]), cache, spec.block_size, spec.dtype
                )[0]
                say(
                    {
                        "sent": command["rid"],
                        "ok": outcome.ok,
                        "keys": list(outcome.keys),
                        "reason": None if outcome.ok else f"{outcome.reason.value}: {outcome.detail}",
                    }
                )
            elif op == "wait_parked":
                reached = _wait_until(lambda: _parked(manager) >= command["n"], PARKED_WAIT_S)
                say({"parked": _parked(manager), "reached": reached})
            elif extra_ops and op in extra_ops:
                say(extra_ops[op](command))
            else:
                say({"error": f"unknown op {op!r}"})
    finally:
        manager.close()
    say({"closed": rank})


if __name__ == "__main__":
    kind = sys.argv[1]
    if kind == "receiver":
        with open(sys.argv[5], encoding="utf-8") as plan_file:
            receiver_main(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], json.load(plan_file))
    elif kind == "sender":
        sender_main(int(sys.argv[2]), json.loads(sys.argv[3]))
    else:
        raise SystemExit(f"unknown worker kind {kind!r}")
