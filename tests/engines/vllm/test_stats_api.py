"""The connector's stats through vLLM's own classes (in the vLLM venv, no engine started)."""

from __future__ import annotations

import subprocess

import pytest
from harness import vllm_python

pytestmark = [pytest.mark.timeout(300)]

CODE = r"""
from prometheus_client import REGISTRY, Counter, Gauge, Histogram
from types import SimpleNamespace
from kvferry.app.vllm import KVFerryConnector

a = KVFerryConnector.build_kv_connector_stats({"requests_loaded": 2, "bytes_loaded": 3_000_000, "load_seconds": 0.05})
b = KVFerryConnector.build_kv_connector_stats({"requests_loaded": 1, "bytes_loaded": 1_000_000, "load_seconds": 0.01,
                                               "failures_timeout": 1})
both = a.aggregate(b)
want = {"requests_loaded": 3, "MB_loaded": 4.0, "avg_load_ms": 20.0, "failures_timeout": 1}
assert both.reduce() == want, both.reduce()
assert not both.is_empty() and KVFerryConnector.build_kv_connector_stats({}).is_empty()
cfg = SimpleNamespace(kv_transfer_config=None)
prom = KVFerryConnector.build_prom_metrics(cfg, {Gauge: Gauge, Counter: Counter, Histogram: Histogram},
                                           ["model_name", "engine"], {0: ["m", "0"]})
prom.observe(both.to_dict(), 0)
get = REGISTRY.get_sample_value
assert get("vllm:kvferry_requests_loaded_total", {"model_name": "m", "engine": "0"}) == 3
assert get("vllm:kvferry_bytes_loaded_total", {"model_name": "m", "engine": "0"}) == 4_000_000
assert get("vllm:kvferry_failures_total", {"model_name": "m", "engine": "0", "kind": "timeout"}) == 1
assert get("vllm:kvferry_failures_total", {"model_name": "m", "engine": "0", "kind": "corrupt"}) == 0

# the pool's gauges (per rank, the later value wins) and its counters (added up)
step1 = KVFerryConnector.build_kv_connector_stats({"pool_bytes_held@0": 4096, "pool_entries_held@0": 2,
                                                   "pool_bytes_held@1": 8192, "threads@0": 2,
                                                   "pool_entries_released": 3})
step2 = KVFerryConnector.build_kv_connector_stats({"pool_bytes_held@0": 1024, "pool_entries_held@0": 1,
                                                   "pool_entries_released": 2, "pool_entries_expired": 1})
pool = step1.aggregate(step2)
assert pool.data["pool_bytes_held@0"] == 1024 and pool.data["pool_bytes_held@1"] == 8192, pool.data
assert pool.data["pool_entries_released"] == 5 and pool.data["pool_entries_expired"] == 1, pool.data
assert pool.reduce() == {"pool_entries_released": 5, "pool_entries_expired": 1, "pool_MB_held": 0.009}, pool.reduce()
zero = KVFerryConnector.build_kv_connector_stats({"pool_bytes_held@0": 0, "threads@0": 2})
assert not zero.is_empty()  # a gauge of 0 is a report: it must reach the endpoint
prom.observe(pool.to_dict(), 0)
labels = {"model_name": "m", "engine": "0"}
assert get("vllm:kvferry_pool_bytes_held", {**labels, "rank": "0"}) == 1024
assert get("vllm:kvferry_pool_bytes_held", {**labels, "rank": "1"}) == 8192
assert get("vllm:kvferry_pool_entries_held", {**labels, "rank": "0"}) == 1
assert get("vllm:kvferry_threads", {**labels, "rank": "0"}) == 2
assert get("vllm:kvferry_pool_entries_released_total", labels) == 5
assert get("vllm:kvferry_pool_entries_expired_total", labels) == 1
prom.observe(zero.to_dict(), 0)
assert get("vllm:kvferry_pool_bytes_held", {**labels, "rank": "0"}) == 0  # back to 0, not added
assert get("vllm:kvferry_pool_entries_released_total", labels) == 5
print("ok")
"""


def test_stats_aggregate_reduce_and_reach_prometheus() -> None:
    out = subprocess.run([vllm_python(), "-c", CODE], capture_output=True, text=True, timeout=240)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]
