"""``kvferry bench --engine vllm`` as a user runs it (the vLLM venv's interpreter), small: one
prompt length, one run. Every row is in the JSON (vLLM's own connectors ran where installed;
under CI they must have), every remote row's token equals its reference row's, a kvferry row
loaded the prompt's whole pages (tokens x 2 KiB rounded up to 32-token blocks) and every figure
is positive. No timing is asserted."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from harness import vllm_python

pytestmark = [pytest.mark.slow, pytest.mark.timeout(2400)]

LENGTH = 100  # 4 blocks, the last one partial
ROWS = [
    "local",
    "floor",
    "kvferry_shm",
    "kvferry_zmq",
    "kvferry_shm_sync",
    "kvferry_nixl",
    "example",
    "mooncake",
    "nixl",
    "local_tp2",
    "kvferry_shm_tp2",
]


def _installed(py: str, module: str) -> bool:
    code = f"import importlib.util, sys; sys.exit(importlib.util.find_spec({module!r}) is None)"
    return subprocess.run([py, "-c", code], timeout=120, check=False).returncode == 0


def test_engine_bench_reports_every_row(tmp_path: Path) -> None:
    py = vllm_python()
    out = tmp_path / "bench.json"
    cmd = "import sys; from kvferry.app.cli import main; sys.exit(main(sys.argv[1:]))"
    argv = ["bench", "--engine", "vllm", "--lengths", str(LENGTH), "--runs", "1", "--timeout", "30", "--quiet"]
    argv += ["--json", str(out), "--plot", str(tmp_path / "bench.png")]
    proc = subprocess.run([py, "-c", cmd, *argv], capture_output=True, text=True, timeout=2300, check=False)
    print(proc.stdout)
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout[-3000:]
    report = json.loads(out.read_text())
    rows = report["rows"]
    assert list(rows) == ROWS
    must = bool(os.environ.get("CI"))
    for peer, module in (("mooncake", "mooncake.engine"), ("nixl", "nixl._api"), ("kvferry_nixl", "nixl._api")):
        if must or _installed(py, module):
            assert rows[peer]["status"] == "ok", rows[peer]
        else:
            assert rows[peer]["status"] == "unavailable" and rows[peer]["reason"], rows[peer]
    assert report["failures"] == [] and report["memcpy_gbps"] > 0
    for name, row in rows.items():
        if row["status"] != "ok":
            continue
        cell = row["cells"][str(LENGTH)]
        assert len(cell["ttft_ms"]) == 1 and cell["median_ms"] > 0, (name, cell)
        assert len(cell["tokens"][0]) == 1, (name, cell)
        assert cell["vs_floor"] > 0, (name, cell)
        if name not in ("local", "local_tp2"):
            # a remote decode computes the last prompt token alone over loaded KV (vLLM's own connectors
            # too; a TP 2 decode also with another reduction order): only a near tie may flip
            gap = cell["tie_gap"][0]
            assert cell["identical"] == [True] or (gap is not None and gap <= report["near_tie_nats"]), (name, cell)
        if row["kind"] == "kvferry":
            pages = -(-LENGTH // 32) * 32 * 8 * 2 * 2 * 32 * 2  # the model: 8 layers, K and V, 2 heads of 32, bf16
            assert cell["expected_bytes"] == pages
            # the control: the decode loaded the prompt's pages, not fewer (its own compute needs none)
            assert pages <= cell["kv_bytes"][0] <= pages + 8 * 2 * 4096, (name, cell)
            assert cell["loads_ok"] == [True] and cell["median_gbps"] > 0, (name, cell)
            assert cell["beats_peers"] in (True, False), (name, cell)
            # the load lies inside the decode's generate call: after the request, before its output
            start, load, after = cell["load_start_ms"][0], cell["load_ms"][0], cell["after_load_ms"][0]
            assert start >= 0 and load > 0 and after >= 0, (name, cell)
            assert abs(start + load + after - cell["ttft_ms"][0]) < 0.5, (name, cell)
