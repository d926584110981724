"""Measure the mooncake connector against the transfer engine's own throughput, in one run.

``python -m kvferry.adapters.connectors.mooncake.bench --nbytes 235000000 --reps 7``

- *raw*: :func:`~.engine.bench_raw_transfer`, batched writes between two registered
  pools of two engines in this process (the engine's ceiling here);
- *connector, put*: a sender and a receiver connector (each with its own engine) in this
  process; one rep is ``put`` of a CPU tensor (one copy into the sender pool) + ``get`` (control
  round trip, reserve, engine read, claim end) + ``release``;
- *connector, reserve*: the same, but the payload is written in place through
  :meth:`~.connector.MooncakeConnector.reserve` (what extraction does) and is not timed, so the
  rep is the transfer path alone: commit + get + release.

Reps of the three are interleaved (raw, put, reserve, raw, ...) so that load from other
processes on a shared machine hits all of them alike. Throughput is GB/s (1e9 bytes/s);
the medians and their ratios to raw are printed as JSON (and written to ``--json``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from typing import Any

from kvferry.adapters.connectors.mooncake.engine import (
    EnginePool,
    bench_raw_transfer,
    payload_pattern,
    throughput_summary,
)

__all__ = ["bench_raw_transfer", "bench_connector", "compare", "main"]


def _pair(nbytes: int, host: str, protocol: str) -> tuple[Any, Any]:
    from kvferry.adapters.connectors.mooncake.connector import MooncakeConnector

    common = {"host": host, "protocol": protocol, "pool_bytes": nbytes + (1 << 20), "shared_engine": False}
    sender = MooncakeConnector.from_config({**common, "role": "sender", "port": 0})
    receiver = MooncakeConnector.from_config({**common, "role": "receiver"})
    receiver.update_sender_info(host, sender.port)
    return sender, receiver


def _one_rep(sender: Any, receiver: Any, data: Any, key: str, in_place: bool) -> float:
    """Seconds for one payload from the sender's hands to a released receiver buffer."""
    if in_place:
        reservation = sender.reserve("0", "1", key, int(data.numel()))
        reservation.buffer.copy_(data)  # the producer's own write: not timed
        start = time.perf_counter()
        ok, _, meta = reservation.commit()
    else:
        start = time.perf_counter()
        ok, _, meta = sender.put("0", "1", key, data)
    if not ok:
        raise RuntimeError(f"put failed: {meta}")
    got = receiver.get("0", "1", key, meta)
    if got is None:
        raise RuntimeError(f"get failed: {receiver.last_failure(key)}")
    got[0].release()
    return time.perf_counter() - start


def bench_connector(
    nbytes: int, reps: int = 5, *, in_place: bool = False, host: str = "127.0.0.1", protocol: str = "tcp"
) -> dict[str, Any]:
    """Connector throughput for ``nbytes`` payloads, ``reps`` timed reps after one warm-up."""
    sender, receiver = _pair(nbytes, host, protocol)
    try:
        data = payload_pattern(nbytes)
        _one_rep(sender, receiver, data, "warmup", in_place)
        seconds = [_one_rep(sender, receiver, data, f"rep{i}", in_place) for i in range(reps)]
        return throughput_summary(nbytes, seconds)
    finally:
        receiver.close()
        sender.close()


def compare(nbytes: int, reps: int = 5, *, host: str = "127.0.0.1", protocol: str = "tcp") -> dict[str, Any]:
    """Interleaved reps of raw engine writes, connector put+get and connector reserve+get."""
    raw_src = EnginePool.create(host=host, pool_bytes=nbytes, protocol=protocol, shared=False)
    raw_dst = EnginePool.create(host=host, pool_bytes=nbytes, protocol=protocol, shared=False)
    sender, receiver = _pair(nbytes, host, protocol)
    data = payload_pattern(nbytes)
    raw_src.tensor.copy_(data)
    peer = f"{host}:{raw_dst.rpc_port}"

    def raw() -> float:
        start = time.perf_counter()
        if not raw_src.write(peer, 0, raw_dst.base, nbytes):
            raise RuntimeError(f"raw write to {peer} failed")
        return time.perf_counter() - start

    runs: dict[str, Callable[[int], float]] = {
        "raw_write": lambda i: raw(),
        "connector_put": lambda i: _one_rep(sender, receiver, data, f"p{i}", False),
        "connector_reserve": lambda i: _one_rep(sender, receiver, data, f"r{i}", True),
    }
    try:
        for run in runs.values():
            run(-1)  # warm-up: handshakes, first touch
        seconds: dict[str, list[float]] = {name: [] for name in runs}
        for i in range(reps):
            for name, run in runs.items():
                seconds[name].append(run(i))
        if not bool((raw_src.tensor == raw_dst.tensor).all()):
            raise RuntimeError("raw write delivered different bytes")
    finally:
        receiver.close()
        sender.close()
        raw_src.close()
        raw_dst.close()
    out: dict[str, Any] = {"nbytes": nbytes, "reps": reps, "protocol": protocol}
    for name, values in seconds.items():
        out[name] = throughput_summary(nbytes, values)
    raw_median = out["raw_write"]["median_gbps"]
    for name in ("connector_put", "connector_reserve"):
        out[name]["ratio_to_raw"] = out[name]["median_gbps"] / raw_median
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nbytes", type=int, default=235_000_000)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--protocol", default="tcp", choices=("tcp", "rdma"))
    parser.add_argument("--json", help="also write the result to this file")
    args = parser.parse_args(argv)
    result = compare(args.nbytes, args.reps, host=args.host, protocol=args.protocol)
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        with open(args.json, "w") as handle:
            handle.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
