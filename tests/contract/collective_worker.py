"""One gloo rank of the collective contract: ``python collective_worker.py RANK SIZE STORE_FILE``.

Joins a gloo world through a FileStore (loopback only), then reads scenario names from stdin,
one JSON object per line, and answers each with one JSON line on stdout (no pickle anywhere:
plain JSON both ways). ``{"scenario": "exit"}`` ends it.
"""

from __future__ import annotations

import datetime
import os
import pathlib
import sys

os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path[:0] = [str(pathlib.Path(__file__).resolve().parent), str(pathlib.Path(__file__).resolve().parent.parent)]
from jsonlines import commands, say  # noqa: E402

INIT_TIMEOUT_S = 30


def main() -> None:
    rank, size, store_file = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    from collective_scenarios import Ctx, no_pickle, run_scenario

    from kvferry.adapters.collectives import TorchDistGroup

    store = dist.FileStore(store_file, size)
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=size, timeout=datetime.timedelta(seconds=INIT_TIMEOUT_S)
    )
    ctx = Ctx(rank, size, TorchDistGroup(), lambda ranks: TorchDistGroup.new(ranks, timeout_s=INIT_TIMEOUT_S))
    say({"ready": rank})
    for command in commands(stop_op=None):
        name = command["scenario"]
        if name == "exit":
            break
        with no_pickle():
            result = run_scenario(name, ctx)
        say(result)
    sys.stdout.flush()
    os._exit(0)  # skip process-group teardown: groups abandoned by timeout scenarios may hold work


if __name__ == "__main__":
    main()
