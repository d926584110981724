"""``kvferry demo --engine vllm`` as a user runs it (the vLLM venv's interpreter): two vLLM
instances on a tiny model made on the spot, prompts handed from prefill to decode through
kvferry, token identity against a single instance, KV bytes and load time, time to first token
with remote KV against computing the prompt."""

from __future__ import annotations

import json
import subprocess

import pytest
from harness import vllm_python

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]

LENGTHS = (45, 300)
KV_BYTES_PER_TOKEN = 4 * 2 * 2 * 32 * 2  # the demo's model: layers x (K, V) x KV heads x head dim x bf16


def test_engine_demo_runs_and_reports_each_prompt() -> None:
    py = vllm_python()
    cmd = "import sys; from kvferry.app.cli import main; sys.exit(main(sys.argv[1:]))"
    argv = ["demo", "--engine", "vllm", "--requests", "2", "--min-tokens", str(LENGTHS[0])]
    argv += ["--max-tokens", str(LENGTHS[1]), "--json", "--timeout", "30"]
    proc = subprocess.run([py, "-c", cmd, *argv], capture_output=True, text=True, timeout=1400, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout[-2000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    print(report)
    assert report["ok"] and report["identical"] == 2 and report["failures"] == 0
    for row, n in zip(report["prompts"], LENGTHS):
        assert row["tokens"] == n and row["identical"] is True
        pages = -(-n // 32) * 32  # whole 32-token pages move
        assert pages * KV_BYTES_PER_TOKEN <= row["kv_bytes"] <= pages * KV_BYTES_PER_TOKEN + 4 * 2 * 4096, row
        assert row["load_ms"] > 0 and row["ttft_remote_ms"] > 0 and row["ttft_local_ms"] > 0
        # the timed hand-off's load happened inside its time to first token
        assert 0 <= row["load_start_ms"] <= row["load_end_ms"] <= row["ttft_remote_ms"], row
