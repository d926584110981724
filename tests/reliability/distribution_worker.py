"""One rank of a 4-process receiving stage on gloo, running distribution scenarios.

    python distribution_worker.py RANK WORLD STORE_PORT TIMEOUT_S SCENARIO[,SCENARIO...]

The test process hosts the TCP store (so a killed leader does not take it down). For each
scenario every rank builds fresh groups (a failed collective leaves a gloo group broken), runs
one request (:func:`distribution_scenarios.run_rank`) and prints one JSON line; ``{"done": rank}`` ends.
"""

from __future__ import annotations

import datetime
import json
import sys


def main(argv: list[str]) -> int:
    rank, world_size, store_port = int(argv[1]), int(argv[2]), int(argv[3])
    timeout_s, scenarios = float(argv[4]), argv[5].split(",")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    from distribution_scenarios import LAYOUT, run_rank

    from kvferry.adapters.collectives import TorchDistGroup, build_parallel_groups
    from kvferry.app.manager import StageGroups

    store = dist.TCPStore("127.0.0.1", store_port, world_size, is_master=False, timeout=datetime.timedelta(seconds=120))
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=120)
    )
    print(json.dumps({"ready": rank}), flush=True)
    for i, scenario in enumerate(scenarios):
        world = TorchDistGroup.new(range(world_size))
        parallel = build_parallel_groups(LAYOUT, rank, world, lambda ranks: TorchDistGroup.new(ranks))
        groups = StageGroups(world=world, tp=parallel.tp, cfg=parallel.cfg, sp=parallel.sp)
        report = run_rank(rank, groups, scenario, f"req-{i}-{scenario}", timeout_s)
        print(json.dumps(report), flush=True)
    print(json.dumps({"done": rank}), flush=True)
    sys.stdout.flush()
    import os

    os._exit(0)  # broken groups may hold gloo threads; nothing else is left to clean up


if __name__ == "__main__":
    raise SystemExit(main(sys.argv))
