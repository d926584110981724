"""``kvferry bench --runs N``: N whole measurements in one invocation, combined into one report.

Each run is a complete report of :func:`kvferry.app.bench.runner.run_bench`'s single-run form
(fresh peer processes, every figure, every ratio). The combined report keeps the single-run
keys, now over all runs:

- ``ratios``: per ratio the median of the runs' values (:func:`~kvferry.app.bench.model.ratio_runs`),
  ``meets_target`` that median against its target, ``met_every_run`` whether every run met it;
- ``ratio_runs``: per ratio every run's value, the median and each run's verdict;
- ``verdicts``: per ratio met / missed / unsteady over the runs
  (:func:`~kvferry.app.bench.pairs.runs_verdict`), ``verdict_runs`` each run's;
- ``runs``: per run its ratios, extra ratios, verdicts, failures, data checks, load and seconds;
- ``figures``: per figure the median of the runs' medians, the lowest min, the highest max
  (:func:`~kvferry.app.bench.model.combine_stats`); ``extra_ratios`` the medians over runs;
- ``failures``: every run's (prefixed ``run k:`` when there are several runs); ``data_checks``:
  a check passes only when it passed in every run that made it;
- ``paths``, ``notes`` and ``checksum_cost``: the last run's (``paths_from_run`` says which);
  ``machine``: the first run's (each run's load average is in ``runs``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from kvferry.app.bench.model import RATIO_NAMES, TARGETS, Stat, combine_stats, ratio_runs
from kvferry.app.bench.pairs import runs_verdict
from kvferry.core.errors import ConfigError

__all__ = ["combine_reports"]


def _number(value: Any) -> float:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else math.nan


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None


def _gbps(stat: Stat, nbytes: int | None) -> dict[str, float]:
    if stat.unit != "s" or not nbytes or stat.min <= 0:
        return {}
    return {"median": nbytes / stat.median / 1e9, "min": nbytes / stat.max / 1e9, "max": nbytes / stat.min / 1e9}


def _figures(reports: Sequence[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    names: list[str] = []
    for report in reports:
        names += [n for n in report.get("figures", {}) if n not in names]
    out = {}
    for name in names:
        rows = [r["figures"][name] for r in reports if name in r.get("figures", {})]
        stats = [
            Stat(_number(f["median"]), _number(f["min"]), _number(f["max"]), int(f["n"]), f.get("unit", "s"))
            for f in rows
        ]
        stat = combine_stats(stats)
        nbytes = rows[-1].get("nbytes")
        out[name] = {**stat.to_json(), "nbytes": nbytes, "gbps": _gbps(stat, nbytes), "runs": len(rows)}
    return out


def combine_reports(reports: Sequence[dict[str, Any]], *, seconds: float | None = None) -> dict[str, Any]:
    """The report of ``reports`` (single runs of the same settings, in run order)."""
    if not reports:
        raise ConfigError("combining runs needs at least one run")
    last = reports[-1]
    several = len(reports) > 1
    per_ratio = {
        name: ratio_runs([_number(r["ratios"].get(name)) for r in reports], TARGETS[name]) for name in RATIO_NAMES
    }
    extra_names: list[str] = []
    for report in reports:
        extra_names += [n for n in report.get("extra_ratios", {}) if n not in extra_names]
    extra = {
        name: _finite(ratio_runs([_number(r.get("extra_ratios", {}).get(name)) for r in reports]).median)
        for name in extra_names
    }
    failures: dict[str, str] = {}
    checks: dict[str, bool] = {}
    for k, report in enumerate(reports, 1):
        for what, why in report.get("failures", {}).items():
            failures[f"run {k}: {what}" if several else what] = why
        for what, ok in report.get("data_checks", {}).items():
            checks[what] = checks.get(what, True) and bool(ok)
    runs = [
        {
            "run": k,
            "ratios": dict(report["ratios"]),
            "meets_target": dict(report["meets_target"]),
            "verdicts": dict(report.get("verdicts", {})),
            "spreads": dict(report.get("spreads", {})),
            "noise": dict(report.get("noise", {})),
            "wake_floor": dict(report.get("wake_floor") or {}),
            "extra_ratios": dict(report.get("extra_ratios", {})),
            "connector_pairs": dict(report.get("connector_pairs", {})),
            "failures": dict(report.get("failures", {})),
            "data_checks": dict(report.get("data_checks", {})),
            "load_avg_at_start": report.get("machine", {}).get("load_avg_at_start"),
            "seconds": report.get("seconds"),
        }
        for k, report in enumerate(reports, 1)
    ]
    total = sum(_number(r.get("seconds")) for r in reports) if seconds is None else seconds
    return {
        **last,
        "machine": reports[0].get("machine", {}),
        "ratios": {name: _finite(r.median) for name, r in per_ratio.items()},
        "meets_target": {name: TARGETS[name].met(r.median) for name, r in per_ratio.items()},
        "met_every_run": {name: r.met_every_run for name, r in per_ratio.items()},
        "ratio_runs": {name: r.to_json() for name, r in per_ratio.items()},
        "verdicts": {
            name: runs_verdict([r.get("verdicts", {}).get(name, "none") for r in reports]) for name in RATIO_NAMES
        },
        "verdict_runs": {name: [r.get("verdicts", {}).get(name, "none") for r in reports] for name in RATIO_NAMES},
        "runs": runs,
        "connector_pair_runs": {
            name: [r.get("connector_pairs", {}).get(name) for r in reports]
            for name in dict.fromkeys(n for r in reports for n in r.get("connector_pairs", {}))
        },
        "extra_ratios": extra,
        "figures": _figures(reports),
        "failures": failures,
        "data_checks": checks,
        "paths_from_run": len(reports),
        "seconds": round(total, 1) if math.isfinite(total) else None,
    }
