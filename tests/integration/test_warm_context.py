"""The multiprocessing context the pipeline tests run their ranks on (``warm_mp_context``):
its processes start with torch and kvferry imported, one thread, and the test process's
environment, and report their exit status as any multiprocessing child does."""

from __future__ import annotations

import os
import sys
from typing import Any

import pytest
import warm_spawn

pytestmark = pytest.mark.timeout(120)
#: Variables the preloading server sets for itself only.
WATCHED = ("OPENBLAS_NUM_THREADS", "PYTHONPATH", warm_spawn.RESTORE_VAR)


def _report(queue: Any, code: int) -> None:
    queue.put(
        {
            "pid": os.getpid(),
            "torch_loaded": "torch" in sys.modules and "kvferry.app.demo.worker" in sys.modules,
            "threads": len(os.listdir("/proc/self/task")),
            "env": {name: os.environ.get(name) for name in WATCHED},
        }
    )
    sys.exit(code)


def test_ranks_start_preloaded_single_threaded_with_the_callers_environment(warm_mp_context: Any) -> None:
    queue = warm_mp_context.Queue()
    procs = [warm_mp_context.Process(target=_report, args=(queue, code)) for code in (0, 3)]
    for proc in procs:
        proc.start()
    reports = [queue.get(timeout=90) for _ in procs]
    for proc in procs:
        proc.join(60)
    assert [proc.exitcode for proc in procs] == [0, 3]
    assert len({r["pid"] for r in reports} | {os.getpid()}) == 3
    ours = {name: os.environ.get(name) for name in WATCHED}
    assert all(r["env"] == ours for r in reports), (reports, ours)
    if os.environ.get(warm_spawn.COLD_VAR):  # plain spawn: a fresh interpreter imports on demand
        return
    assert all(r["torch_loaded"] for r in reports), reports
    # the rank has at most the queue's feeder thread of its own; the server forked with one
    assert all(r["threads"] <= 2 for r in reports), reports
