"""Soak under load: a 2-rank sender stage and a 4-rank receiver stage (gloo), over zmq (tcp) and
shm, for N requests of random lengths, with random early cancellations and a fraction of
requests whose sender rank is made to fail (SPEC 9.4, 9.5, 9.10).

Checked: every request ends in exactly one outcome on every receiver rank; every delivered
tensor is bit-exact; no request is lost without an outcome; no rank keeps KV its TP peers
dropped; RSS of every process and the kvferry files in /dev/shm stay flat after warm-up (within
10%). Requests/s and the p99 receive latency are printed (``-s`` shows them).

Short by default (``KVFERRY_SOAK_REQUESTS``, default 240 requests); e.g.
``KVFERRY_SOAK_REQUESTS=5000 pytest -s -m soak tests/reliability/test_soak.py`` for a long run.
``KVFERRY_SOAK_REPORT=path.json`` also writes the figures as JSON.
"""

from __future__ import annotations

import datetime
import json
import os
import random
import statistics
import time
from typing import Any

import pytest
from fault_kit import SHM_DIR, LineProc, free_base_port
from stage_kit import Geometry, omni_config, request_blocks

pytestmark = [pytest.mark.soak, pytest.mark.slow]

REQUESTS = int(os.environ.get("KVFERRY_SOAK_REQUESTS", "240"))
GEOM = Geometry(layers=4, heads=8, head_dim=16, block_size=16, num_blocks=96, dtype="bfloat16")
DEADLINE_S = 2.0  # receive deadline of every request (a failed sender costs its receivers this)
CANCEL_S = 0.05  # a cancelled request: its receivers give up before the sender puts
LEASE_S = 2.0  # unread payloads (cancelled, not cleaned up) go after this
FAIL_MODES = ("corrupt", "wrong_rid", "truncate")
READ_S = 60.0


def _plan(rng: random.Random) -> list[dict[str, Any]]:
    plan = []
    no_put = {REQUESTS // 3, 2 * REQUESTS // 3 + 1}  # a sender rank that never puts: one per connector
    for i in range(REQUESTS):
        seq_len = rng.randint(8, 512)
        item = {
            "rid": f"soak-{i:05d}",
            "conn": "zmq" if i % 2 == 0 else "shm",
            "seq_len": seq_len,
            "blocks": request_blocks(GEOM, rng, seq_len),
            "fate": "normal",
            "fail_rank": None,
            "fail": None,
        }
        roll = rng.random()
        if i in no_put:
            item.update(fate="fail", fail_rank=rng.randrange(2), fail="no_put")
        elif i >= 4 and roll < 0.08:
            item.update(fate="cancel", cleanup=rng.random() < 0.5)
        elif i >= 4 and roll < 0.16:
            item.update(fate="fail", fail_rank=rng.randrange(2), fail=rng.choice(FAIL_MODES))
        plan.append(item)
    return plan


def _shm_bytes(namespace: str) -> tuple[int, int]:
    names = [n for n in os.listdir(SHM_DIR) if n.startswith(f"kvferry-{namespace}-")]
    return len(names), sum(os.stat(os.path.join(SHM_DIR, n)).st_size for n in names)


def _expected(item: dict[str, Any], rank: int) -> tuple[str, bool]:
    """(outcome kind, kept) a receiver rank must report for ``item``."""
    if item["fate"] == "cancel":
        return "timed_out", False
    if item["fate"] == "fail":
        mine = rank // 2 == item["fail_rank"]  # fan-out 2 -> 4: sender s feeds receivers 2s, 2s+1
        return ("timed_out" if item["fail"] == "no_put" else "decode_failed") if mine else "received", False
    return "received", True


@pytest.mark.timeout(900)
def test_soak_two_senders_four_receivers_over_zmq_and_shm(shm_space: Any, tmp_path: Any) -> None:
    import torch.distributed as dist

    rng = random.Random(20241129)
    plan = _plan(rng)
    store = dist.TCPStore(
        "127.0.0.1", 0, 4, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=120)
    )
    zmq_base, shm_base = free_base_port(2), free_base_port(2)
    conns = {
        "zmq": ({"type": "zmq", "pool_bytes": 64 << 20, "lease_s": LEASE_S}, zmq_base),
        "shm": (
            {
                "type": "shm",
                "namespace": shm_space.namespace,
                "runtime_dir": shm_space.base,
                "pool_bytes": 16 << 20,
                "lease_s": LEASE_S,
            },
            shm_base,
        ),
    }
    setup = {
        "geom": {
            "layers": GEOM.layers,
            "heads": GEOM.heads,
            "head_dim": GEOM.head_dim,
            "block_size": GEOM.block_size,
            "num_blocks": GEOM.num_blocks,
            "dtype": GEOM.dtype,
        },
        "seed": 3,
        "store_port": store.port,
        "senders": {
            n: omni_config("sender", c, from_tp=2, to_tp=4, recv_timeout=DEADLINE_S, base_port=b)
            for n, (c, b) in conns.items()
        },
        "receivers": {
            n: omni_config("receiver", c, from_tp=2, to_tp=4, recv_timeout=DEADLINE_S, base_port=b)
            for n, (c, b) in conns.items()
        },
        "info": {n: {"host": "127.0.0.1", "zmq_port": b + 100} for n, (_, b) in conns.items()},
    }
    spec = json.dumps(setup)
    senders = [LineProc(["soak_worker.py", "sender", str(r), spec], tmp_path, f"sender{r}") for r in range(2)]
    receivers = [LineProc(["soak_worker.py", "receiver", str(r), spec], tmp_path, f"receiver{r}") for r in range(4)]
    procs = senders + receivers
    rss: dict[str, list[int]] = {p.name: [] for p in procs}
    outcomes: dict[str, dict[int, dict[str, Any]]] = {}
    faults = {"cancel": 0, "cancel_cleanup": 0, **{m: 0 for m in (*FAIL_MODES, "no_put")}}
    shm_usage: list[tuple[int, int]] = []
    closed: list[dict[str, Any]] = []
    try:
        for p in procs:
            assert "ready" in p.read(180.0), p.name
        started = time.monotonic()

        def read(p: LineProc) -> dict[str, Any]:
            reply = p.read(READ_S)
            rss[p.name].append(reply["rss_kib"])
            return reply

        def send_all(item: dict[str, Any]) -> None:
            for rank, p in enumerate(senders):
                fail = item["fail"] if rank == item["fail_rank"] else None
                p.send(
                    {
                        "op": "send",
                        "rid": item["rid"],
                        "conn": item["conn"],
                        "blocks": item["blocks"],
                        "seq_len": item["seq_len"],
                        "fail": fail,
                    }
                )

        def recv_all(item: dict[str, Any], timeout_s: float) -> None:
            for p in receivers:
                p.send(
                    {
                        "op": "recv",
                        "rid": item["rid"],
                        "conn": item["conn"],
                        "blocks": item["blocks"],
                        "seq_len": item["seq_len"],
                        "timeout_s": timeout_s,
                    }
                )

        for index, item in enumerate(plan):
            if item["fate"] == "cancel":  # the receivers give up first; the senders put anyway
                faults["cancel"] += 1
                recv_all(item, CANCEL_S)
                replies = [read(p) for p in receivers]
                send_all(item)
                for p in senders:
                    assert read(p)["ok"], item
                if item["cleanup"]:  # the engine's abort reaches the senders; else the lease ends it
                    faults["cancel_cleanup"] += 1
                    for p in senders:
                        p.send({"op": "cancel", "rid": item["rid"], "conn": item["conn"]})
                    for p in senders:
                        read(p)
            else:
                if item["fail"]:
                    faults[item["fail"]] += 1
                send_all(item)
                recv_all(item, DEADLINE_S)
                for rank, p in enumerate(senders):
                    assert read(p)["ok"] == (rank != item["fail_rank"]), item
                replies = [read(p) for p in receivers]
            outcomes[item["rid"]] = {r["rank"]: r for r in replies}
            if index in (REQUESTS // 4, REQUESTS - 1):
                shm_usage.append(_shm_bytes(shm_space.namespace))
        seconds = time.monotonic() - started
        for p in receivers:  # receivers first: senders keep serving until every reader is done
            p.proc.stdin.close()
            closed.append(p.read(READ_S))
    finally:
        for p in receivers + senders:
            p.close()
        del store

    # ---- every request: exactly one outcome per rank, as expected; delivered KV is bit-exact
    lost = [item["rid"] for item in plan if sorted(outcomes.get(item["rid"], {})) != [0, 1, 2, 3]]
    assert lost == []
    wrong = []
    for item in plan:
        for rank, rep in outcomes[item["rid"]].items():
            kind, kept = _expected(item, rank)
            if rep["kind"] != kind or rep["kept"] != kept or (kept and not rep["exact"]):
                wrong.append((item["rid"], item["fate"], item["fail"], rank, rep))
    assert wrong == [], wrong[:5]
    delivered = sum(rep["exact"] for per in outcomes.values() for rep in per.values())
    # ---- counters agree: one counted outcome per receive (plus consensus drops)
    counted = sum(
        sum(
            v
            for k, v in c.items()
            if k.count(".") == 1 and k.startswith("recv.") and k not in ("recv.bytes", "recv.dropped_by_consensus")
        )
        for rep in closed
        for c in rep["counters"].values()
    )
    assert counted == 4 * REQUESTS
    # ---- memory flat after warm-up
    warm = REQUESTS // 4
    growth = {}
    for name, series in rss.items():
        per_request = len(series) / REQUESTS
        base = max(series[int(warm * 0.8 * per_request) : int(warm * per_request) + 1])
        final = max(series[-max(1, int(REQUESTS * 0.1 * per_request)) :])
        growth[name] = (base, final)
    assert all(final <= base * 1.10 for base, final in growth.values()), growth
    assert shm_usage[0] == shm_usage[-1], shm_usage  # same segments, same bytes
    latencies = sorted(rep["seconds"] for per in outcomes.values() for rep in per.values() if rep["exact"])
    p99 = latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))]
    injected = sum(faults.values()) - faults["cancel_cleanup"]
    report = {
        "requests": REQUESTS,
        "receiver_ranks": 4,
        "sender_ranks": 2,
        "connectors": ["zmq-tcp", "shm"],
        "seconds": round(seconds, 1),
        "requests_per_s": round(REQUESTS / seconds, 1),
        "p50_receive_ms": round(statistics.median(latencies) * 1e3, 2),
        "p99_receive_ms": round(p99 * 1e3, 2),
        "delivered_bit_exact": delivered,
        "faults_injected": injected,
        "faults": faults,
        "lost": len(lost),
        "rss_kib_warm_final": growth,
        "shm_files_bytes": shm_usage,
    }
    print("\nsoak:", json.dumps(report))
    if os.environ.get("KVFERRY_SOAK_REPORT"):
        with open(os.environ["KVFERRY_SOAK_REPORT"], "w") as f:
            json.dump(report, f, indent=1)
