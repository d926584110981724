"""``kvferry bench --engine vllm --serve`` as a user runs it (the vLLM venv's interpreter), small:
two rows (the plain server and kvferry shm behind vLLM's toy proxy), 8 prompts, one rate. Every
requested row is in the JSON, every request completed and none failed, every figure is positive.
The control: kvferry's decode loaded each of the 8 prompts (its /metrics), the plain server took
no prompt token from a transfer. No timing is asserted."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from harness import vllm_python

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

PROMPTS = 8
INPUT = 256
OUTPUT = 16
ROWS = ["plain", "kvferry_shm"]


def test_serve_bench_reports_every_requested_row(tmp_path: Path) -> None:
    py = vllm_python()
    out = tmp_path / "serve.json"
    cmd = "import sys; from kvferry.app.cli import main; sys.exit(main(sys.argv[1:]))"
    argv = ["bench", "--engine", "vllm", "--serve", "--rows", ",".join(ROWS), "--rates", "4"]
    argv += ["--num-prompts", str(PROMPTS), "--max-concurrency", "4", "--input-len", str(INPUT)]
    argv += ["--output-len", str(OUTPUT), "--quiet", "--json", str(out), "--plot", str(tmp_path / "serve.png")]
    argv += ["--logs", str(tmp_path / "logs")]
    proc = subprocess.run([py, "-c", cmd, *argv], capture_output=True, text=True, timeout=1700, check=False)
    print(proc.stdout)
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout[-3000:]
    report = json.loads(out.read_text())
    assert report["failures"] == []
    assert list(report["rows"]) == ROWS
    assert report["rate_keys"] == ["4"] and report["load_before"]
    for name, row in report["rows"].items():
        assert row["status"] == "ok", (name, row)
        cell = row["cells"]["4"]
        assert cell["completed"] == PROMPTS and cell["failed"] == 0, (name, cell)
        assert cell["request_throughput"] > 0 and cell["output_throughput"] > 0, (name, cell)
        for metric in ("ttft", "tpot", "itl"):
            for p in (50, 99):
                assert cell[f"{metric}_p{p}_ms"] > 0, (name, metric, p, cell)
            assert cell[f"{metric}_p50_ms"] <= cell[f"{metric}_p99_ms"], (name, metric, cell)
    # the control: the P/D row's decode loaded every prompt (all but the last token of each, at
    # most, from the transfer); the plain server has no decode to ask
    shm = report["rows"]["kvferry_shm"]["cells"]["4"]
    assert shm["loaded"] == PROMPTS and shm["failures"] == 0, shm
    assert PROMPTS * (INPUT - 1) <= shm["external_tokens"] <= PROMPTS * INPUT, shm
    assert "external_tokens" not in report["rows"]["plain"]["cells"]["4"]
