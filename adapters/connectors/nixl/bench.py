"""Measure the nixl connector against a raw NIXL READ of the same bytes on the same agent pair.

``python -m kvferry.adapters.connectors.nixl.bench --nbytes 134217728 --reps 7``

A sender and a receiver connector (each with its own agent) in this process. Per repetition,
interleaved so that load from other processes hits both alike:

- *raw READ*: the receiver's agent READs ``nbytes`` from a region of the sender's registered
  pool into its own pool: one NIXL transfer request, posted and polled to completion (the
  floor for this agent pair and backend);
- *connector*: the payload is written into the sender's pool through ``reserve`` (untimed, what
  extraction does), then the timed part: ``commit`` + ``get_blocking`` (control round trip,
  claim, receiver reserve, the NIXL READ, the claim's end) + ``release``.

Throughput is GB/s (1e9 bytes/s); ``ratio`` is the connector's median time over raw's. The
first repetition of each (it learns the peer agent) is not timed. Prints JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Mapping
from typing import Any

from kvferry.adapters.connectors.mooncake.engine import payload_pattern, throughput_summary
from kvferry.core.errors import TransferError

__all__ = ["bench_pair", "main"]


def bench_pair(nbytes: int, reps: int = 5, *, config: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """``{"nbytes", "raw": summary, "connector": summary, "ratio"}`` (summaries as
    :func:`~kvferry.adapters.connectors.mooncake.engine.throughput_summary`). Raises
    TransferError when a transfer fails or the bytes read differ from the bytes written."""
    from kvferry.adapters.connectors.nixl.connector import NixlConnector

    pool = 2 * nbytes + (1 << 20)
    common = {"host": "127.0.0.1", "pool_bytes": pool, **(config or {})}
    sender = NixlConnector.from_config({**common, "role": "sender", "port": 0})
    receiver = None
    try:
        receiver = NixlConnector.from_config({**common, "role": "receiver"})
        pattern = payload_pattern(nbytes)
        fixed = sender.reserve("0", "1", "bench_raw_0_0_0", nbytes)  # the raw READs' source
        fixed.buffer.copy_(pattern)
        source = int(fixed.buffer.data_ptr())
        peer = f"127.0.0.1:{sender.port}"
        local = receiver._pool
        raw_s: list[float] = []
        conn_s: list[float] = []
        for rep in range(reps + 1):
            start = time.perf_counter()
            if not local.read(peer, 0, source, nbytes):
                raise TransferError(f"raw NIXL READ of {nbytes} bytes from {peer} failed")
            raw = time.perf_counter() - start
            if rep == 0 and not bool((local.tensor[:nbytes] == pattern).all()):
                raise TransferError("raw NIXL READ delivered different bytes")
            key = f"bench_{rep}_0_0_0"
            reservation = sender.reserve("0", "1", key, nbytes)
            reservation.buffer.copy_(pattern)
            start = time.perf_counter()
            ok, _, meta = reservation.commit()
            got = receiver.get_blocking("0", "1", key, meta, timeout_s=60.0) if ok else None
            if got is None:
                raise TransferError(f"nixl connector get failed: {receiver.last_failure(key)}")
            buffer, _ = got
            if rep == 0 and not bool((buffer.tensor == pattern).all()):
                raise TransferError("nixl connector delivered different bytes")
            buffer.release()
            elapsed = time.perf_counter() - start
            if rep:
                raw_s.append(raw)
                conn_s.append(elapsed)
        fixed.abort()
        raw_sum, conn_sum = throughput_summary(nbytes, raw_s), throughput_summary(nbytes, conn_s)
        ratio = sorted(conn_s)[len(conn_s) // 2] / sorted(raw_s)[len(raw_s) // 2]
        return {"nbytes": nbytes, "raw": raw_sum, "connector": conn_sum, "ratio": ratio}
    finally:
        if receiver is not None:
            receiver.close()
        sender.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nbytes", type=int, default=64 << 20)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--ucx-tls", default=None, help="UCX_TLS for this process (e.g. tcp,self)")
    parser.add_argument("--ucx-net-devices", default=None, help="UCX_NET_DEVICES (e.g. lo)")
    args = parser.parse_args(argv)
    cfg = {"ucx_tls": args.ucx_tls, "ucx_net_devices": args.ucx_net_devices}
    out = bench_pair(args.nbytes, args.reps, config=cfg)
    json.dump(out, sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
