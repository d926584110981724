"""Ratios measured as interleaved pairs, and whether they held steady (docs/benchmarks.md).

A ratio against a limit (``shm_e2e_vs_memcpy``: memcpy seconds over a request's seconds) is
measured as pairs: one repetition of the limit, then one of the subject, then the limit again,
... so each pair's two figures are taken moments apart, under the same weather. Pure functions
of the samples:

- :func:`paired_ratio`: each pair's ratio ``scale * limit[i] / subject[i]`` (larger is better
  for a time ratio), their median and their spread;
- :func:`relative_spread`: the interquartile range over the median of samples (0 for fewer
  than 2), the spread of a ratio's pairs and the run's *noise figure* (the limit's own spread);
- :func:`verdict`: ``met`` or ``missed`` against a target, or ``unsteady`` when the pairs
  disagree by more than ``max_spread`` and their interquartile range straddles the target, or
  ``none`` without a value;
- :func:`quartiles`: the inclusive first and third quartiles of samples.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

import attrs

from kvferry.app.bench.model import Target
from kvferry.core.errors import ConfigError

__all__ = [
    "MAX_SPREAD",
    "PairedRatio",
    "paired_ratio",
    "quartiles",
    "relative_spread",
    "verdict",
    "runs_verdict",
    "VERDICTS",
]

#: The largest relative spread (interquartile range over median) of a ratio's pairs that still
#: gets a met/missed verdict; above it the ratio is ``unsteady``.
MAX_SPREAD = 0.15
#: Every verdict a ratio can get.
VERDICTS = ("met", "missed", "unsteady", "none")


def relative_spread(samples: Sequence[float]) -> float:
    """``(q3 - q1) / median`` of ``samples`` (inclusive quartiles); 0 for fewer than 2 samples,
    NaN when the median is not positive."""
    values = [float(v) for v in samples]
    if len(values) < 2:
        return 0.0
    median = statistics.median(values)
    if not median > 0:
        return math.nan
    q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return (q3 - q1) / median


def quartiles(samples: Sequence[float]) -> tuple[float, float]:
    """The inclusive first and third quartiles of ``samples`` (both the one value of a single
    sample; NaN for none)."""
    values = [float(v) for v in samples]
    if not values:
        return math.nan, math.nan
    if len(values) == 1:
        return values[0], values[0]
    q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, q3


@attrs.frozen
class PairedRatio:
    """One ratio from ``n`` interleaved pairs: ``value`` the median of the pairs' ratios,
    ``low``/``high`` their quartiles, ``spread`` :func:`relative_spread` of them."""

    value: float
    low: float
    high: float
    spread: float
    n: int

    def to_json(self) -> dict[str, float | int | None]:
        finite = lambda v: v if math.isfinite(v) else None  # noqa: E731
        return {
            "value": finite(self.value),
            "low": finite(self.low),
            "high": finite(self.high),
            "spread": finite(self.spread),
            "n": self.n,
        }


def paired_ratio(limit: Sequence[float], subject: Sequence[float], scale: float = 1.0) -> PairedRatio:
    """The ratio of pairs ``(limit[i], subject[i])`` (seconds; ``scale`` multiplies every
    ratio, e.g. N requests against one memcpy). ConfigError when the lists differ in length or
    are empty; a pair with a non-positive time is left out (all left out: NaN, n = 0)."""
    if len(limit) != len(subject) or not limit:
        raise ConfigError(f"paired ratio: {len(limit)} limit samples against {len(subject)} subject samples")
    ratios = [scale * a / b for a, b in zip(limit, subject) if a > 0 and b > 0]
    if not ratios:
        return PairedRatio(math.nan, math.nan, math.nan, math.nan, 0)
    if len(ratios) == 1:
        return PairedRatio(ratios[0], ratios[0], ratios[0], 0.0, 1)
    q1, median, q3 = statistics.quantiles(ratios, n=4, method="inclusive")
    return PairedRatio(median, q1, q3, relative_spread(ratios), len(ratios))


def verdict(
    value: float,
    target: Target,
    spread: float,
    max_spread: float = MAX_SPREAD,
    *,
    bounds: tuple[float, float] | None = None,
) -> str:
    """``none`` without a finite value; ``met`` or ``missed`` by ``target`` when ``spread`` is
    at most ``max_spread``. Above it (or when it is not a number): still ``met`` or ``missed``
    when ``bounds``, the interquartile range of what the ratio was computed from, lies wholly on
    one side of the target (the weather could not change the verdict); else ``unsteady``."""
    if not math.isfinite(value):
        return "none"
    if spread <= max_spread:
        return "met" if target.met(value) else "missed"
    if bounds is not None and all(math.isfinite(b) for b in bounds):
        low, high = target.met(bounds[0]), target.met(bounds[1])
        if low == high:
            return "met" if low else "missed"
    return "unsteady"


def runs_verdict(verdicts: Sequence[str]) -> str:
    """One ratio's verdict over several runs: ``missed`` when a steady run missed, else
    ``unsteady`` when a run was unsteady, else ``met`` when every run met (``none`` when no run
    gave a value)."""
    if "missed" in verdicts:
        return "missed"
    if "unsteady" in verdicts:
        return "unsteady"
    if verdicts and all(v == "met" for v in verdicts):
        return "met"
    return "none" if all(v == "none" for v in verdicts) else "missed"
