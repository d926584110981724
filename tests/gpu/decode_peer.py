"""The decode side of a two-process move (test_gpu_pages.py, test_gpu_cache_writers.py), in
its own process: ``python decode_peer.py JSON`` loads the request through kvferry's decode worker
into caches of the given layout and device, checks every layer's tokens against the seeded
source, and prints one JSON line: ``{"errors", "equal", "seconds", "nbytes"}``."""

from __future__ import annotations

import json
import sys


def main(arg: str) -> None:
    import torch
    from page_moves import load, tokens_equal

    cfg = json.loads(arg)
    dtype = getattr(torch, cfg["dtype"])
    d, dst, seconds, errors = load(
        cfg["connector"],
        cfg["base_port"],
        cfg["layout"],
        cfg["params"],
        cfg["block_ids"],
        block_size=cfg["block_size"],
        num_blocks=cfg["num_blocks"],
        dtype=dtype,
        device=cfg["device"],
        fp8=cfg.get("fp8"),
    )
    try:
        equal = tokens_equal(cfg["layout"], dst, cfg["block_ids"], cfg["num_tokens"], cfg["seed"], dtype)
        [record] = d.recent_loads
        out = {"errors": sorted(errors), "equal": equal, "seconds": seconds, "nbytes": record.nbytes}
    finally:
        d.close()
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
