"""Readiness of a small request over shm between two processes (a measurement, not a test).

    python tests/app/readiness_probe.py [recv|e2e] [--zero-copy] [-n 200]

A sender process (a :class:`KVTransferManager` with an shm sender connector) and a receiver
process (a receiving manager) exchange 1-layer, 16-token bf16 requests, ``n`` timed after 20
warm-up ones; the median, p10 and p90 are printed.

- ``recv``: the payload is published first, then the receiver's ``receive()`` is timed alone
  (wall clock and the receiving thread's CPU time): the receiver side of a request.
- ``e2e``: the receiver waits in ``receive()``; the sender stamps ``t0`` and sends; the
  receiver stamps ``t1`` when ``receive()`` returns (CLOCK_MONOTONIC is one clock for every
  process of the machine): what ``kvferry bench`` calls readiness.

A zero-copy result is released right after the stamp (outside the timed part).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import time
from typing import Any

WARMUP = 20


def _omni(role: str, namespace: str, base_port: int) -> dict[str, Any]:
    raw: dict[str, Any] = {
        "connector_config": {"type": "shm", "namespace": namespace, "pool_bytes": 64 << 20, "zmq_port": base_port},
        "omni_from_stage": 0,
        "omni_to_stage": 1,
        "rank_mapping": {"from_tp": 1, "to_tp": 1},
    }
    if role == "sender":
        raw["need_send_cache"] = True
    else:
        raw.update(stage_id=1, engine_input_source=[0], need_recv_cache=True, recv_timeout=10.0)
    return raw


def _manager(role: str, namespace: str, base_port: int) -> Any:
    import torch

    from kvferry.app.manager import KVTransferManager
    from kvferry.core.config import TransferConfig

    torch.set_num_threads(1)
    return KVTransferManager(TransferConfig.from_omni_kv_config(_omni(role, namespace, base_port)))


def _sender(conn: Any, namespace: str, base_port: int) -> None:
    import torch

    manager = _manager("sender", namespace, base_port)
    manager.start()
    cache = [torch.randn(2, 4, 16, 4, 128).to(torch.bfloat16)]
    conn.send(manager.sender_port())
    try:
        while True:
            rid = conn.recv()
            if rid is None:
                break
            t0 = time.monotonic()
            outcome = manager.send_requests({rid: {"block_ids": [1], "seq_len": 16}}, cache, 16, torch.bfloat16)[0]
            conn.send((outcome.ok, t0))
    finally:
        manager.close()


def _receiver(conn: Any, namespace: str, base_port: int, port: int, mode: str, zero_copy: bool, n: int) -> None:
    manager = _manager("receiver", namespace, base_port)
    info = {"host": "127.0.0.1", "zmq_port": port}
    cpu: list[float] = []
    try:
        for i in range(n + WARMUP):
            conn.recv()
            conn.send("waiting")
            if mode == "recv":
                conn.recv()  # published
            c0, t0 = time.thread_time(), time.monotonic()
            result = manager.receive(f"r{i}", sender_info=info, zero_copy=zero_copy)
            t1, c1 = time.monotonic(), time.thread_time()
            ok = result.ok
            result.release()
            del result
            if i >= WARMUP:
                cpu.append(c1 - c0)
            conn.send((ok, t0, t1))
        conn.send(statistics.median(cpu))
    finally:
        manager.close()


def run(mode: str, zero_copy: bool, n: int) -> dict[str, float]:
    """Run the measurement; returns medians and percentiles in milliseconds."""
    namespace = f"probe{os.getpid()}"
    base_port = 20000 + os.getpid() % 20000
    ctx = mp.get_context("spawn")
    to_sender, sender_end = ctx.Pipe()
    to_receiver, receiver_end = ctx.Pipe()
    sender = ctx.Process(target=_sender, args=(sender_end, namespace, base_port))
    sender.start()
    receiver = None
    samples: list[float] = []
    try:
        if not to_sender.poll(60):
            raise RuntimeError("the sender did not start within 60 s")
        port = to_sender.recv()
        receiver = ctx.Process(target=_receiver, args=(receiver_end, namespace, base_port, port, mode, zero_copy, n))
        receiver.start()
        for i in range(n + WARMUP):
            to_receiver.send("next")
            to_receiver.recv()  # waiting (e2e: about to call receive)
            if mode == "e2e":
                time.sleep(0.002)  # let it park at the sender: this is the measured situation
            to_sender.send(f"r{i}")
            sent_ok, t_send = to_sender.recv()
            if mode == "recv":
                to_receiver.send("published")
            ok, t0, t1 = to_receiver.recv()
            if not (sent_ok and ok):
                raise RuntimeError(f"request r{i} failed (sent {sent_ok}, received {ok})")
            if i >= WARMUP:
                samples.append(t1 - (t0 if mode == "recv" else t_send))
        cpu = to_receiver.recv()
    finally:
        to_sender.send(None)
        sender.join(30)
        if receiver is not None:
            receiver.join(30)
    samples.sort()
    return {
        "median_ms": statistics.median(samples) * 1e3,
        "p10_ms": samples[len(samples) // 10] * 1e3,
        "p90_ms": samples[len(samples) * 9 // 10] * 1e3,
        "receiver_cpu_ms": cpu * 1e3,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("mode", nargs="?", choices=("recv", "e2e"), default="recv")
    parser.add_argument("--zero-copy", action="store_true")
    parser.add_argument("-n", type=int, default=200)
    args = parser.parse_args()
    out = run(args.mode, args.zero_copy, args.n)
    print(
        f"{args.mode} zero_copy={args.zero_copy} n={args.n}: median {out['median_ms']:.3f} ms, "
        f"p10 {out['p10_ms']:.3f}, p90 {out['p90_ms']:.3f}; receiver CPU per receive "
        f"{out['receiver_cpu_ms']:.3f} ms"
    )


if __name__ == "__main__":
    main()
