"""Values and pure arithmetic of ``kvferry bench``: settings, statistics, ratios, targets.

Nothing here measures anything; the measuring modules hand their samples to :class:`Stat` and
the report to :func:`compute_ratios`. Units: times in seconds (``*_ms`` names in milliseconds),
sizes in bytes, throughputs in bytes per second.

Every ratio is a ratio of medians. Throughput ratios are oriented so that larger is better
(``x_vs_y = time(y) / time(x)`` for the same bytes); ``codec_ms``, ``readiness_p50_ms``,
``faults_per_mb_*`` and ``rss_ratio_receiver`` are smaller-is-better quantities.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping
from typing import Any

import attrs

from kvferry.core.errors import ConfigError
from kvferry.core.validate import check_int, check_number

__all__ = [
    "RATIO_NAMES",
    "TARGETS",
    "Target",
    "Geometry",
    "Stat",
    "BenchSettings",
    "compute_ratios",
    "ratio_of",
    "RatioRuns",
    "ratio_runs",
    "combine_stats",
]

#: The ratio names ``bench.json`` carries under ``"ratios"``, in report order.
RATIO_NAMES: tuple[str, ...] = (
    "codec_ms",
    "encode_speedup_vs_baseline",
    "extraction_vs_memcpy",
    "shm_e2e_vs_memcpy",
    "shm_8req_vs_memcpy",
    "shm_e2e_speedup_vs_baseline",
    "zmq_1req_vs_raw",
    "zmq_1req_vs_raw_tcp",
    "zmq_8req_vs_raw",
    "zmq_speedup_vs_baseline",
    "hetero_vs_homo",
    "replicated_vs_homo",
    "mla_vs_homo",
    "readiness_p50_ms",
    "readiness_shm_from_send_call_p50_ms",
    "faults_per_mb_sender",
    "faults_per_mb_receiver",
    "rss_ratio_receiver",
)


@attrs.frozen
class Target:
    """``value {op} bound`` for ``op`` one of ``<``, ``<=``, ``>=``."""

    op: str
    bound: float

    def met(self, value: float) -> bool:
        if not math.isfinite(value):
            return False
        if self.op == "<":
            return value < self.bound
        return value <= self.bound if self.op == "<=" else value >= self.bound

    def __str__(self) -> str:
        return f"{self.op} {self.bound:g}"


#: What the library is expected to reach (reported, never asserted).
TARGETS: Mapping[str, Target] = {
    "codec_ms": Target("<=", 1.0),
    "encode_speedup_vs_baseline": Target(">=", 100.0),
    "extraction_vs_memcpy": Target(">=", 0.9),
    "shm_e2e_vs_memcpy": Target(">=", 0.85),
    "shm_8req_vs_memcpy": Target(">=", 0.85),
    "shm_e2e_speedup_vs_baseline": Target(">=", 25.0),
    "zmq_1req_vs_raw": Target(">=", 0.8),
    "zmq_1req_vs_raw_tcp": Target(">=", 0.8),
    "zmq_8req_vs_raw": Target(">=", 1.4),
    "zmq_speedup_vs_baseline": Target(">=", 5.0),
    "hetero_vs_homo": Target(">=", 0.95),
    # the same bytes as homo_2_2 too (8 one-head payloads, 4 latent payloads)
    "replicated_vs_homo": Target(">=", 0.9),
    "mla_vs_homo": Target(">=", 0.8),
    "readiness_p50_ms": Target("<=", 1.0),
    "readiness_shm_from_send_call_p50_ms": Target("<=", 0.5),
    "faults_per_mb_sender": Target("<", 10.0),
    "faults_per_mb_receiver": Target("<", 10.0),
    "rss_ratio_receiver": Target("<=", 1.5),
}

_ITEMSIZE = {"bfloat16": 2, "float16": 2, "float32": 4, "float64": 8, "int8": 1, "uint8": 1}


@attrs.frozen
class Geometry:
    """One request's KV: ``layers`` x (K, V) x ``[tokens, heads, head_dim]`` of ``dtype``, read
    from a paged cache of ``block_size``-token blocks (``tokens`` need not fill the last block)."""

    layers: int
    tokens: int
    heads: int
    head_dim: int
    dtype: str = "bfloat16"
    block_size: int = 16

    def __attrs_post_init__(self) -> None:
        for name in ("layers", "tokens", "heads", "head_dim", "block_size"):
            check_int(name, getattr(self, name), 1, expected="an integer >= 1")
        if self.dtype not in _ITEMSIZE:
            raise ConfigError(f"dtype must be one of {sorted(_ITEMSIZE)}, got {self.dtype!r}")

    @property
    def itemsize(self) -> int:
        return _ITEMSIZE[self.dtype]

    @property
    def blocks_per_request(self) -> int:
        return -(-self.tokens // self.block_size)

    @property
    def tensor_nbytes(self) -> int:
        """Bytes of one ``[tokens, heads, head_dim]`` tensor."""
        return self.tokens * self.heads * self.head_dim * self.itemsize

    @property
    def nbytes(self) -> int:
        """Tensor bytes of one request (header excluded): ``layers * 2 * tensor_nbytes``."""
        return self.layers * 2 * self.tensor_nbytes

    def describe(self) -> str:
        return (
            f"{self.layers} layers x K,V x [{self.tokens}, {self.heads}, {self.head_dim}] "
            f"{self.dtype} = {self.nbytes / 1e6:.1f} MB per request, "
            f"{self.block_size}-token blocks"
        )

    def to_json(self) -> dict[str, Any]:
        return {**attrs.asdict(self), "nbytes": self.nbytes}


@attrs.frozen
class Stat:
    """Median, min and max of ``n >= 1`` samples (seconds unless ``unit`` says otherwise);
    ``samples`` in measurement order when built by :meth:`of` (for interleaved pairs)."""

    median: float
    min: float
    max: float
    n: int
    unit: str = "s"
    samples: tuple[float, ...] = attrs.field(default=(), eq=False, repr=False)

    @classmethod
    def of(cls, samples: Iterable[float], unit: str = "s") -> Stat:
        values = [float(v) for v in samples]
        if not values:
            raise ConfigError("a statistic needs at least one sample")
        return cls(statistics.median(values), min(values), max(values), len(values), unit, tuple(values))

    def scaled(self, factor: float, unit: str) -> Stat:
        """The same statistic times ``factor`` (``factor > 0`` keeps min <= median <= max)."""
        scaled = tuple(v * factor for v in self.samples)
        return Stat(self.median * factor, self.min * factor, self.max * factor, self.n, unit, scaled)

    def to_json(self) -> dict[str, Any]:
        return {"median": self.median, "min": self.min, "max": self.max, "n": self.n, "unit": self.unit}


@attrs.frozen
class BenchSettings:
    """What one ``kvferry bench`` run measures.

    ``reps`` timed repetitions after ``warmup`` untimed ones (the full run needs ``reps >= 5``);
    ``requests``: requests of the many-request cases; ``readiness_reps``: samples of the small
    request's latency; ``extra_connectors``: optional connectors measured beside shm and zmq;
    ``timeout_s``: the bound on every wait for a peer process; ``runs``: how many times the
    whole measurement repeats in one invocation (fresh peer processes each time);
    ``huge_pages``: the caches and the memcpy limit's buffers are moved onto transparent huge
    pages (:func:`kvferry.adapters.platform.advise_huge_pages`), as kvferry's vLLM connector
    does with vLLM's CPU cache; False: 4 KiB pages, an engine's cache without that advice.
    ``pin_cpus``: the sending stage's peer runs on one half of the CPUs, the receiving stages'
    peers on the other (:mod:`kvferry.app.bench.placement`), as deployed stages run on cores
    of their own; False: where the OS puts them.
    """

    geometry: Geometry
    reps: int = 5
    warmup: int = 1
    requests: int = 8
    readiness_reps: int = 50
    extra_connectors: tuple[str, ...] = attrs.field(default=(), converter=tuple)
    seed: int = 0
    timeout_s: float = 120.0
    runs: int = 1
    huge_pages: bool = True
    pin_cpus: bool = True

    def __attrs_post_init__(self) -> None:
        for name, low in (("reps", 1), ("warmup", 0), ("requests", 1), ("readiness_reps", 1), ("runs", 1)):
            check_int(name, getattr(self, name), low, expected=f"an integer >= {low}")
        check_number("timeout_s", self.timeout_s, above=0.0, expected="> 0")

    @classmethod
    def full(cls, **overrides: Any) -> BenchSettings:
        """The issue's payload: 28 x K,V x [4096, 4, 128] bf16 (235 MB), 5 repetitions."""
        return cls(Geometry(28, 4096, 4, 128), **overrides)

    @classmethod
    def quick(cls, **overrides: Any) -> BenchSettings:
        """A reduced run (about 17 MB per request, 3 repetitions) for a quick look."""
        values = {"reps": 3, "warmup": 1, "readiness_reps": 20, "timeout_s": 60.0, **overrides}
        return cls(Geometry(8, 1024, 4, 128), **values)

    def to_json(self) -> dict[str, Any]:
        return {
            "geometry": self.geometry.to_json(),
            "reps": self.reps,
            "warmup": self.warmup,
            "requests": self.requests,
            "readiness_reps": self.readiness_reps,
            "extra_connectors": list(self.extra_connectors),
            "seed": self.seed,
            "runs": self.runs,
            "huge_pages": self.huge_pages,
            "pin_cpus": self.pin_cpus,
        }


def ratio_of(numerator: float, denominator: float) -> float:
    """``numerator / denominator``; NaN when either is not a finite positive number."""
    if not (math.isfinite(numerator) and math.isfinite(denominator)) or denominator <= 0:
        return math.nan
    return numerator / denominator


def _median(stats: Mapping[str, Stat], name: str) -> float:
    stat = stats.get(name)
    return stat.median if stat is not None else math.nan


def compute_ratios(stats: Mapping[str, Stat], requests: int) -> dict[str, float]:
    """Every name of :data:`RATIO_NAMES` from the medians in ``stats`` (NaN where missing).

    Keys read (seconds unless noted): ``memcpy``, ``raw_zmq``, ``raw_tcp``, ``extraction``,
    ``kvferry_encode``, ``kvferry_decode``, ``kvferry_codec`` (encode + decode),
    ``baseline_encode``, ``baseline_e2e``, ``shm_e2e_1``, ``shm_e2e_n``, ``zmq_e2e_1``,
    ``zmq_e2e_n`` (``requests`` requests), ``homo_2_2``, ``hetero_2_4``, ``replicated_2_8``,
    ``mla_2_4``, ``readiness_shm``, ``readiness_shm_from_call``; counts
    ``faults_per_mb_sender``/``faults_per_mb_receiver`` and ``rss_ratio_receiver``.
    """
    m = lambda name: _median(stats, name)  # noqa: E731
    codec = m("kvferry_codec")
    if not math.isfinite(codec):
        codec = m("kvferry_encode") + m("kvferry_decode")
    return {
        "codec_ms": codec * 1e3,
        "encode_speedup_vs_baseline": ratio_of(m("baseline_encode"), m("kvferry_encode")),
        "extraction_vs_memcpy": ratio_of(m("memcpy"), m("extraction")),
        "shm_e2e_vs_memcpy": ratio_of(m("memcpy"), m("shm_e2e_1")),
        "shm_8req_vs_memcpy": ratio_of(requests * m("memcpy"), m("shm_e2e_n")),
        "shm_e2e_speedup_vs_baseline": ratio_of(m("baseline_e2e"), m("shm_e2e_1")),
        "zmq_1req_vs_raw": ratio_of(m("raw_zmq"), m("zmq_e2e_1")),
        "zmq_1req_vs_raw_tcp": ratio_of(m("raw_tcp"), m("zmq_e2e_1")),
        "zmq_8req_vs_raw": ratio_of(requests * m("raw_zmq"), m("zmq_e2e_n")),
        "zmq_speedup_vs_baseline": ratio_of(m("baseline_e2e"), m("zmq_e2e_1")),
        "hetero_vs_homo": ratio_of(m("homo_2_2"), m("hetero_2_4")),
        "replicated_vs_homo": ratio_of(m("homo_2_2"), m("replicated_2_8")),
        "mla_vs_homo": ratio_of(m("homo_2_2"), m("mla_2_4")),
        "readiness_p50_ms": m("readiness_shm") * 1e3,
        "readiness_shm_from_send_call_p50_ms": m("readiness_shm_from_call") * 1e3,
        "faults_per_mb_sender": m("faults_per_mb_sender"),
        "faults_per_mb_receiver": m("faults_per_mb_receiver"),
        "rss_ratio_receiver": m("rss_ratio_receiver"),
    }


@attrs.frozen
class RatioRuns:
    """One ratio over several runs: every run's value (NaN where that run produced none), the
    median of the finite values (NaN when there are none) and whether each run met ``target``."""

    values: tuple[float, ...]
    median: float
    met: tuple[bool, ...]

    @property
    def met_every_run(self) -> bool:
        return bool(self.met) and all(self.met)

    def to_json(self) -> dict[str, Any]:
        finite = lambda v: v if math.isfinite(v) else None  # noqa: E731
        return {
            "values": [finite(v) for v in self.values],
            "median": finite(self.median),
            "met": list(self.met),
            "met_every_run": self.met_every_run,
        }


def ratio_runs(values: Iterable[float], target: Target | None = None) -> RatioRuns:
    """Every run's ``values`` of one ratio, their median (finite values only) and, against
    ``target``, each run's verdict (a run without a finite value did not meet it)."""
    runs = tuple(float(v) for v in values)
    if not runs:
        raise ConfigError("a ratio over runs needs at least one run")
    finite = [v for v in runs if math.isfinite(v)]
    median = statistics.median(finite) if finite else math.nan
    met = tuple(target.met(v) for v in runs) if target is not None else ()
    return RatioRuns(runs, median, met)


def combine_stats(stats: Iterable[Stat]) -> Stat:
    """One figure over several runs: the median of the runs' medians, the lowest min, the
    highest max and every sample counted (all in the same unit)."""
    runs = list(stats)
    if not runs:
        raise ConfigError("combining a figure needs at least one run")
    units = {s.unit for s in runs}
    if len(units) != 1:
        raise ConfigError(f"a figure's runs disagree on its unit: {sorted(units)}")
    return Stat(
        statistics.median(s.median for s in runs),
        min(s.min for s in runs),
        max(s.max for s in runs),
        sum(s.n for s in runs),
        runs[0].unit,
    )
