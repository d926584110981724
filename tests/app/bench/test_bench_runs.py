"""``kvferry bench --runs N``: per ratio every run's value, the median and each run's verdict.

The arithmetic is checked against an independent median (sort, take the middle); the combined
report against hand-built single-run reports; then one tiny two-run measurement end to end
(timings are never asserted, only structure, consistency and the data checks).
"""

from __future__ import annotations

import math
import pathlib

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvferry.app.bench.model import RATIO_NAMES, TARGETS, Stat, Target, combine_stats, ratio_runs
from kvferry.app.bench.runner import PAIRED_RATIOS
from kvferry.app.bench.runs import combine_reports
from kvferry.core.errors import ConfigError

value = st.one_of(st.floats(min_value=1e-6, max_value=1e6, allow_nan=False), st.just(math.nan))


def _middle(values: list[float]) -> float:
    """The median the slow way: sort, then the middle one or the mean of the middle two."""
    ordered = sorted(values)
    half = len(ordered) // 2
    return ordered[half] if len(ordered) % 2 else (ordered[half - 1] + ordered[half]) / 2


@given(st.lists(value, min_size=1, max_size=9), st.sampled_from([Target(">=", 0.8), Target("<=", 0.5)]))
def test_ratio_runs_median_and_verdicts(values: list[float], target: Target) -> None:
    runs = ratio_runs(values, target)
    finite = [v for v in values if not math.isnan(v)]
    if finite:
        assert runs.median == pytest.approx(_middle(finite))
    else:
        assert math.isnan(runs.median)
    expected = [(not math.isnan(v)) and (v >= target.bound if target.op == ">=" else v <= target.bound) for v in values]
    assert list(runs.met) == expected
    assert runs.met_every_run is all(expected)
    doc = runs.to_json()
    assert doc["values"] == [None if math.isnan(v) else v for v in values] and doc["met"] == expected


def test_one_missed_run_is_not_met_every_run_though_the_median_is() -> None:
    runs = ratio_runs([0.9, 0.7, 0.95], Target(">=", 0.8))
    assert runs.median == 0.9 and runs.met == (True, False, True) and not runs.met_every_run
    assert Target(">=", 0.8).met(runs.median)


def test_ratio_runs_and_combine_stats_need_a_run() -> None:
    with pytest.raises(ConfigError):
        ratio_runs([])
    with pytest.raises(ConfigError):
        combine_stats([])
    with pytest.raises(ConfigError, match="unit"):
        combine_stats([Stat.of([1.0]), Stat.of([1.0], "ratio")])


@given(st.lists(st.lists(st.floats(min_value=1e-6, max_value=1e3), min_size=1, max_size=5), min_size=1, max_size=5))
def test_combine_stats_is_the_median_of_medians_and_the_extremes(samples: list[list[float]]) -> None:
    stats = [Stat.of(s) for s in samples]
    combined = combine_stats(stats)
    assert combined.median == pytest.approx(_middle([_middle(s) for s in samples]))
    assert combined.min == min(min(s) for s in samples) and combined.max == max(max(s) for s in samples)
    assert combined.n == sum(len(s) for s in samples)


def _report(run: int, ratios: dict[str, float | None], *, failures: dict | None = None, checks: dict | None = None):
    return {
        "kvferry_bench": 1,
        "ratios": {n: ratios.get(n) for n in RATIO_NAMES},
        "meets_target": {n: ratios.get(n) is not None and TARGETS[n].met(ratios[n]) for n in RATIO_NAMES},  # type: ignore[arg-type]
        "extra_ratios": {"raw_zmq_vs_raw_tcp": 0.25 * run},
        "figures": {
            "memcpy": {
                "median": 0.01 * run,
                "min": 0.009 * run,
                "max": 0.02 * run,
                "n": 3,
                "unit": "s",
                "nbytes": 10**8,
            }
        },
        "failures": failures or {},
        "data_checks": checks or {"shm e2e": True},
        "machine": {"load_avg_at_start": [float(run)] * 3},
        "paths": {f"path of run {run}": {}},
        "seconds": 10.0,
    }


def test_combined_report_medians_verdicts_and_failures() -> None:
    reports = [
        _report(1, {"extraction_vs_memcpy": 0.9, "hetero_vs_homo": 0.99}),
        _report(2, {"extraction_vs_memcpy": 0.7, "hetero_vs_homo": None}, failures={"raw tcp": "refused"}),
        _report(3, {"extraction_vs_memcpy": 1.1, "hetero_vs_homo": 0.97}, checks={"shm e2e": False}),
    ]
    doc = combine_reports(reports)
    assert [r["run"] for r in doc["runs"]] == [1, 2, 3]
    assert doc["ratios"]["extraction_vs_memcpy"] == 0.9  # median of 0.9, 0.7, 1.1
    assert doc["ratio_runs"]["extraction_vs_memcpy"]["values"] == [0.9, 0.7, 1.1]
    assert doc["ratio_runs"]["extraction_vs_memcpy"]["met"] == [True, False, True]
    assert doc["meets_target"]["extraction_vs_memcpy"] and not doc["met_every_run"]["extraction_vs_memcpy"]
    # a run without a value counts as a miss; the median is of the runs that have one
    assert doc["ratio_runs"]["hetero_vs_homo"]["values"] == [0.99, None, 0.97]
    assert doc["ratios"]["hetero_vs_homo"] == pytest.approx(0.98)
    assert doc["ratio_runs"]["hetero_vs_homo"]["met"] == [True, False, True]
    assert doc["ratios"]["codec_ms"] is None and doc["meets_target"]["codec_ms"] is False
    assert doc["failures"] == {"run 2: raw tcp": "refused"}
    assert doc["data_checks"] == {"shm e2e": False}  # failed in one run: failed
    assert doc["extra_ratios"]["raw_zmq_vs_raw_tcp"] == pytest.approx(0.5)
    memcpy = doc["figures"]["memcpy"]
    assert (memcpy["median"], memcpy["min"], memcpy["max"], memcpy["n"]) == pytest.approx((0.02, 0.009, 0.06, 9))
    assert memcpy["gbps"]["median"] == pytest.approx(10**8 / 0.02 / 1e9)
    assert doc["paths"] == {"path of run 3": {}} and doc["paths_from_run"] == 3
    assert doc["machine"]["load_avg_at_start"] == [1.0] * 3 and doc["seconds"] == 30.0
    with pytest.raises(ConfigError):
        combine_reports([])


def test_a_single_run_keeps_its_figures_and_unprefixed_failures() -> None:
    doc = combine_reports([_report(1, {"extraction_vs_memcpy": 0.9}, failures={"raw tcp": "refused"})])
    assert doc["failures"] == {"raw tcp": "refused"} and len(doc["runs"]) == 1
    assert doc["figures"]["memcpy"]["median"] == 0.01 and doc["figures"]["memcpy"]["n"] == 3


@pytest.mark.slow
@pytest.mark.timeout(480)
def test_tiny_two_runs_report_each_run_and_the_medians(tiny_run: tuple[int, str, dict, pathlib.Path]) -> None:
    code, table, report, _ = tiny_run
    assert code == 0, report["failures"]
    assert report["settings"]["runs"] == 2 and len(report["runs"]) == 2
    for name in RATIO_NAMES:
        values = [run["ratios"][name] for run in report["runs"]]
        assert all(isinstance(v, (int, float)) and math.isfinite(v) for v in values), (name, values)
        assert report["ratio_runs"][name]["values"] == values
        assert report["ratios"][name] == pytest.approx(_middle(values))
        met = [TARGETS[name].met(v) for v in values]
        assert report["ratio_runs"][name]["met"] == met == [run["meets_target"][name] for run in report["runs"]]
        assert report["met_every_run"][name] is all(met)
        assert report["meets_target"][name] is TARGETS[name].met(report["ratios"][name])
    # the ratios against a limit are interleaved pairs: each run's value is its pairs' median
    for run in report["runs"]:
        assert set(run["verdicts"]) == set(RATIO_NAMES)
        assert all(v in ("met", "missed", "unsteady", "none") for v in run["verdicts"].values())
        assert set(run["noise"]) == {"memcpy", "raw_tcp", "homo_2_2", "wake"}
        assert all(v >= 0 for v in run["noise"].values())
        # the small request's floor: the bare wake between the readiness repetitions, and the
        # readiness from the send call counted in such wakes (a path that includes one)
        floor = run["wake_floor"]
        assert floor["p50_ms"] > 0 and floor["spread"] >= 0 and floor["readiness_in_wakes"] > 0
    for name in PAIRED_RATIOS:
        assert report["verdict_runs"][name] == [run["verdicts"][name] for run in report["runs"]]
    last = report["runs"][-1]
    for name, pair in report["pairs"].items():  # the last run's pairs (the report's top level)
        assert pair["n"] == 2 and pair["low"] <= pair["value"] <= pair["high"], name
        assert last["ratios"][name] == pytest.approx(pair["value"]), name
    assert set(report["pairs"]) == {
        "extraction_vs_memcpy",
        "shm_e2e_vs_memcpy",
        "shm_8req_vs_memcpy",
        "zmq_1req_vs_raw_tcp",
        "hetero_vs_homo",
        "replicated_vs_homo",
        "mla_vs_homo",
    }
    assert {p["limit"] for p in report["pairs"].values()} == {"memcpy", "raw_tcp", "homo_2_2"}
    # the TP rows alternate with the homogeneous row: each TP figure has its limit steps beside it
    tp_figures = ("hetero_2_4", "replicated_2_8", "mla_2_4")
    for figure in ("shm_e2e_1", "shm_e2e_n", "zmq_e2e_1", "extraction", *tp_figures):  # every limit step alongside
        assert report["figures"][f"{figure}_limit"]["n"] == 4, figure
    assert "noise (the limits' own spread" in table and "verdict" in table and "paired" not in table
    # the wake floor: measured on its own, and one step before each readiness repetition
    assert report["figures"]["wake"]["n"] == 6 and "limit: a bare wake" in table  # 3 a run
    for figure in ("shm_readiness_e2e", "zmq_readiness_e2e"):
        assert report["figures"][f"{figure}_limit"]["n"] == 6, figure
    assert "wake floor (one datagram to the waiting receiver" in table
    # the kernel's TCP limit sits beside raw zmq, and the zmq path is compared with both
    assert report["figures"]["raw_tcp"]["gbps"]["median"] > 0
    assert "raw tcp" in table and "limit: raw zmq" in table and "each run" in table
    assert report["extra_ratios"]["raw_zmq_vs_raw_tcp"] > 0
    # CPU time of both sides, every path (the load-robust cost beside the wall time)
    for label, path in report["paths"].items():
        assert path["sender_cpu_s"]["median"] > 0, label
        assert path["receiver_cpu_s"] is None or path["receiver_cpu_s"]["median"] >= 0, label
    cpu_ratios = ("hetero_vs_homo_cpu", "zmq_1req_vs_raw_tcp_cpu", "zmq_1req_vs_raw_cpu", "shm_8req_vs_1req_cpu")
    for name in (*cpu_ratios, "extraction_vs_memcpy_cpu", "shm_e2e_vs_memcpy_cpu", "shm_8req_vs_memcpy_cpu"):
        assert report["extra_ratios"][name] > 0, name
    assert "cpu s" in table and "CPU time: memcpy" in table
    assert report["figures"]["memcpy_cpu"]["median"] > 0 and report["figures"]["extraction_cpu"]["median"] > 0


def test_a_connector_against_its_own_limit_is_reported_per_run_as_interleaved_pairs() -> None:
    """nixl's get against the raw NIXL READ of the same bytes (issue: >= 0.8 in every run):
    each run's value is the median of the per-pair ratios (limit / subject, pair by pair, not
    a ratio of medians), with its quartiles, spread and verdict; the combined report keeps
    every run's, and the table prints them."""
    from kvferry.app.bench.model import BenchSettings, Geometry
    from kvferry.app.bench.paths import RunState
    from kvferry.app.bench.report import connector_pair_lines
    from kvferry.app.bench.runner import _connector_pairs

    def run_with(raw: list[float], get: list[float]) -> dict:
        run = RunState(BenchSettings(Geometry(1, 16, 1, 8)), 1, lambda _m: None)
        run.record("nixl_raw_read", Stat.of(raw), 10**8)
        run.record("nixl_pair_get", Stat.of(get), 10**8)
        return _connector_pairs(run)["nixl_get_vs_raw_read"]

    # pair ratios 0.5, 0.9, 0.952, 0.96, 1.0: the median pair's 0.1 / 0.105 (the medians' ratio
    # would be 0.096 / 0.1)
    one = run_with([0.05, 0.09, 0.1, 0.096, 0.2], [0.1, 0.1, 0.105, 0.1, 0.2])
    assert one["value"] == pytest.approx(0.1 / 0.105) and one["target"] == ">= 0.8"
    assert one["limit"] == "nixl_raw_read"
    assert one["low"] == pytest.approx(0.9) and one["high"] == pytest.approx(0.96) and one["n"] == 5
    assert one["verdict"] == "met"
    slow = run_with([0.07, 0.07, 0.07], [0.1, 0.1, 0.1])
    assert slow["value"] == pytest.approx(0.7) and slow["verdict"] == "missed"
    unmeasured = RunState(BenchSettings(Geometry(1, 16, 1, 8)), 1, lambda _m: None)
    assert _connector_pairs(unmeasured) == {}  # not measured: nothing
    reports = [_report(1, {}), _report(2, {})]
    reports[0]["connector_pairs"] = {"nixl_get_vs_raw_read": one}
    reports[1]["connector_pairs"] = {"nixl_get_vs_raw_read": slow}
    doc = combine_reports(reports)
    assert doc["connector_pair_runs"]["nixl_get_vs_raw_read"] == [one, slow]
    assert [r["connector_pairs"]["nixl_get_vs_raw_read"]["verdict"] for r in doc["runs"]] == ["met", "missed"]
    line = next(x for x in connector_pair_lines(doc) if x.startswith("nixl_get_vs_raw_read"))
    assert ">= 0.8" in line and "met" in line and "missed" in line and "0.952" in line
    single = {**reports[0], "runs": [doc["runs"][0]]}
    line = next(x for x in connector_pair_lines(single) if x.startswith("nixl_get_vs_raw_read"))
    assert "0.9-0.96" in line and line.rstrip().endswith("met")
