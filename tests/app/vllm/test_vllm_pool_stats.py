"""What a rank reports of its pool and threads with each step's stats (records.PoolWatch,
PageWorker.take_stats): the prefill's pool held (bytes, regions, entries) as gauges per rank,
entries released (read) and expired (lease ran out) as counts since the last report."""

from __future__ import annotations

import itertools
import threading

from hypothesis import given
from hypothesis import strategies as st
from page_kit import caches, memory_params, wait_for

from kvferry.app.vllm.params import ConnectorSettings, parse_decode_params
from kvferry.app.vllm.records import POOL_GAUGES, THREADS_GAUGE, PoolWatch, gauge_key, split_gauge_key
from kvferry.app.vllm.worker import LoadJob, PageWorker, SaveJob

BS, HEADS, HEAD, LAYERS, BLOCKS = 32, 4, 32, 3, 16
_names = itertools.count()


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


def _caches(seed: int | None) -> dict:
    return caches(LAYERS, BLOCKS, HEADS, BS, HEAD, seed)


def _source(tid: str) -> object:
    return parse_decode_params(
        memory_params(
            tokens=70, block_size=BS, layers=LAYERS, prefill_tp=1, decode_tp=1, engine_id="e", transfer_id=tid
        )
    )


# -------------------------------------------------------------------------------- PoolWatch
def test_gauge_keys_round_trip_and_counters_are_not_gauges() -> None:
    assert split_gauge_key(gauge_key("pool_bytes_held", 3)) == ("pool_bytes_held", 3)
    assert split_gauge_key("requests_sent") is None
    assert split_gauge_key("failures_timeout") is None
    assert split_gauge_key("x@") is None and split_gauge_key("@1") is None


def test_a_decode_rank_reports_its_threads_only() -> None:
    assert PoolWatch(1).report(None, 4) == {"threads@1": 4.0}


def test_the_pools_values_are_gauges_and_its_counters_counts_since_the_last_report() -> None:
    w = PoolWatch(0)
    pool = {"used_bytes": 4096, "live_regions": 2, "entries": 2, "readable": 1, "released": 5, "expired_unread": 1}
    assert w.report(pool, 2) == {
        "threads@0": 2.0,
        "pool_bytes_held@0": 4096.0,
        "pool_regions_held@0": 2.0,
        "pool_entries_held@0": 2.0,
        "pool_entries_unread@0": 1.0,
        "pool_entries_released": 5.0,
        "pool_entries_expired": 1.0,
    }
    # nothing happened: the gauges again, no counts
    assert w.report(pool, 2) == {
        "threads@0": 2.0,
        "pool_bytes_held@0": 4096.0,
        "pool_regions_held@0": 2.0,
        "pool_entries_held@0": 2.0,
        "pool_entries_unread@0": 1.0,
    }
    later = {"used_bytes": 0, "live_regions": 0, "entries": 0, "released": 6}
    later.update(expired_unread=1, expired_unreleased=1)
    got = w.report(later, 2)
    assert got["pool_entries_released"] == 1 and got["pool_entries_expired"] == 1 and got["pool_bytes_held@0"] == 0


@given(st.lists(st.tuples(st.integers(0, 50), st.integers(0, 50)), max_size=20))
def test_the_counts_reported_add_up_to_the_pools_totals(steps: list[tuple[int, int]]) -> None:
    w = PoolWatch(0)
    released = expired = 0
    sums = {"pool_entries_released": 0.0, "pool_entries_expired": 0.0}
    for r, e in steps:
        released, expired = released + r, expired + e
        out = w.report({"released": released, "expired_unread": expired}, 1)
        for k in sums:
            sums[k] += out.get(k, 0.0)
            assert out.get(k, 1.0) > 0  # a zero count is left out
    assert sums == {"pool_entries_released": released, "pool_entries_expired": expired}


# ------------------------------------------------------------------------- a prefill's pool
def _prefill(name: str, clock: _Clock) -> PageWorker:
    settings = ConnectorSettings.from_extra_config(
        {"connector": {"type": "memory", "shared_name": name, "clock": clock}, "lease_s": 5.0, "load_timeout_s": 2.0}
    )
    return PageWorker(settings, tp_rank=0, tp_size=1, total_kv_heads=HEADS, producer=True, consumer=False)


def _save(p: PageWorker, req: str, tid: str) -> None:
    p.begin_step([SaveJob(req, tid, (1, 2, 3), 70, 1)])
    p.end_step()
    wait_for(lambda: p.finished({req})[0] == {req})


def _held(stats: dict[str, float]) -> tuple[float, float, float]:
    return stats["pool_bytes_held@0"], stats["pool_regions_held@0"], stats["pool_entries_held@0"]


def test_a_prefills_pool_reports_what_it_holds_then_what_it_released_and_expired() -> None:
    name = f"vllm-pool-stats-{next(_names)}"
    clock = _Clock()
    p = _prefill(name, clock)
    p.register(_caches(1))
    d = PageWorker(p.settings, tp_rank=0, tp_size=1, total_kv_heads=HEADS, producer=False, consumer=True)
    d.register(_caches(None))
    try:
        first = p.take_stats()
        assert first.keys() == {gauge_key(g, 0) for g in (*POOL_GAUGES, THREADS_GAUGE)}, first
        assert _held(first) == (0, 0, 0) and first["threads@0"] >= 1
        _save(p, "r", "t")
        saved = p.take_stats()
        # one entry (and region) per layer, the bytes the saves put
        assert saved["requests_sent"] == 1
        assert _held(saved) == (saved["bytes_sent"], LAYERS, LAYERS), saved
        assert saved["pool_entries_unread@0"] == LAYERS  # nobody asked for them yet
        assert "pool_entries_released" not in saved and "pool_entries_expired" not in saved
        # the decode reads every layer: each entry freed by its release, counted once
        d.start_loads([LoadJob("r", _source("t"), (4, 5, 6), 0)])
        wait_for(lambda: "r" in d.finished(set())[1])
        read = p.take_stats()
        assert _held(read) == (0, 0, 0) and read["pool_entries_released"] == LAYERS, read
        assert read["pool_entries_unread@0"] == 0
        assert "pool_entries_expired" not in read
        # a save nobody reads: held until the lease runs out, then freed and counted expired
        _save(p, "r2", "t2")
        assert _held(p.take_stats())[2] == LAYERS
        clock.now += 4.0  # within the lease of 5 s: still held
        assert _held(p.take_stats())[2] == LAYERS
        clock.now += 2.0
        gone = p.take_stats()
        assert _held(gone) == (0, 0, 0) and gone["pool_entries_expired"] == LAYERS, gone
        assert gone["pool_entries_unread@0"] == 0
        assert "pool_entries_released" not in gone
        ds = d.take_stats()  # the decode rank: its load and threads, no pool
        assert ds["requests_loaded"] == 1 and not any(k.startswith("pool_") for k in ds), ds
    finally:
        d.close()
        p.close()
    assert "pool_bytes_held@0" not in p.take_stats()  # closed: nothing more to report


def test_threads_counts_kvferrys_threads_of_the_process() -> None:
    name = f"vllm-pool-stats-{next(_names)}"
    p = _prefill(name, _Clock())
    before = p.take_stats()["threads@0"]
    p.register(_caches(1))  # starts the save thread
    try:
        assert p.take_stats()["threads@0"] == before + 1
    finally:
        p.close()
    wait_for(lambda: sum(t.name.startswith("kvferry") for t in threading.enumerate()) == before)
