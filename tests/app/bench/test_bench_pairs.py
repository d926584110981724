"""Ratios as interleaved pairs (app/bench/pairs.py): the median of per-pair ratios, their
spread, the verdict met / missed / unsteady, and the alternation itself (local.timed_pairs)."""

from __future__ import annotations

import math
import statistics

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kvferry.app.bench.local import MEMCPY_AHEAD, memcpy_buffers, memcpy_step, placed, timed_pairs
from kvferry.app.bench.model import Target
from kvferry.app.bench.pairs import MAX_SPREAD, paired_ratio, relative_spread, runs_verdict, verdict
from kvferry.core.errors import ConfigError

times = st.floats(1e-6, 10.0)
weather = st.floats(0.2, 5.0)  # how much slower the machine is at one moment
VERDICT = st.sampled_from(["met", "missed", "unsteady", "none"])


@given(st.floats(0.05, 20.0), st.lists(st.tuples(times, weather), min_size=1, max_size=30))
def test_a_pair_cancels_the_weather_of_its_moment(true_ratio: float, moments: list[tuple[float, float]]) -> None:
    # at each moment both the limit and the subject slow down by the same factor
    limit = [t * w for t, w in moments]
    subject = [t * w / true_ratio for t, w in moments]
    paired = paired_ratio(limit, subject)
    assert paired.value == pytest.approx(true_ratio, rel=1e-9)
    assert paired.spread == pytest.approx(0.0, abs=1e-9) and paired.n == len(moments)


def test_sequential_medians_mislead_where_pairs_do_not() -> None:
    # the limit measured while the machine was quiet, the subject (half as fast) once it got busy
    quiet, busy = [1.0, 1.0, 1.0], [3.0, 3.0, 3.0]
    limit, subject = quiet + busy, [2 * x for x in quiet + busy]
    sequential = statistics.median(limit[:3]) / statistics.median(subject[3:])  # the old way
    assert sequential == pytest.approx(1 / 6)
    assert paired_ratio(limit, subject).value == pytest.approx(0.5)


@given(st.lists(st.tuples(times, times), min_size=1, max_size=30), st.integers(1, 16))
def test_the_paired_value_lies_within_its_pairs_and_scales(pairs: list[tuple[float, float]], scale: int) -> None:
    limit, subject = [a for a, _ in pairs], [b for _, b in pairs]
    ratios = [a / b for a, b in pairs]
    one, scaled = paired_ratio(limit, subject), paired_ratio(limit, subject, scale)
    assert min(ratios) * (1 - 1e-9) <= one.low <= one.value <= one.high <= max(ratios) * (1 + 1e-9)
    assert one.value == pytest.approx(statistics.median(ratios), rel=1e-9)
    assert scaled.value == pytest.approx(scale * one.value, rel=1e-9)
    assert scaled.spread == pytest.approx(one.spread, rel=1e-6, abs=1e-12) and one.spread >= 0


def test_paired_ratio_refuses_unpaired_samples_and_skips_empty_pairs() -> None:
    with pytest.raises(ConfigError):
        paired_ratio([1.0, 2.0], [1.0])
    with pytest.raises(ConfigError):
        paired_ratio([], [])
    assert paired_ratio([1.0, 0.0], [2.0, 1.0]).n == 1
    assert math.isnan(paired_ratio([0.0], [1.0]).value)


@given(st.lists(times, min_size=2, max_size=40), st.floats(0.01, 100.0))
def test_relative_spread_is_scale_free_and_zero_for_a_constant(samples: list[float], factor: float) -> None:
    spread = relative_spread(samples)
    assert spread >= 0
    assert relative_spread([x * factor for x in samples]) == pytest.approx(spread, rel=1e-6, abs=1e-12)
    assert relative_spread([samples[0]] * len(samples)) == pytest.approx(0.0, abs=1e-12)
    assert relative_spread(samples[:1]) == 0.0


def test_relative_spread_by_hand() -> None:
    # inclusive quartiles of 1..5: 2 and 4, median 3
    assert relative_spread([5.0, 1.0, 3.0, 2.0, 4.0]) == pytest.approx(2 / 3)


@given(st.floats(0.01, 10.0), st.floats(0.0, 1.0), st.sampled_from([Target(">=", 0.85), Target("<=", 0.5)]))
def test_a_verdict_is_unsteady_above_the_spread_else_the_target_decides(value, spread, target) -> None:
    got = verdict(value, target, spread)
    if spread > MAX_SPREAD:
        assert got == "unsteady"
    else:
        assert got == ("met" if target.met(value) else "missed")
    assert verdict(math.nan, target, 0.0) == "none"
    assert verdict(value, target, math.nan) == "unsteady"  # no spread known: not a steady verdict


@given(
    st.floats(0.01, 10.0),
    st.floats(0.0, 1.0),
    st.floats(0.01, 10.0),
    st.floats(0.01, 10.0),
    st.sampled_from([Target(">=", 0.85), Target("<=", 0.5), Target("<", 10.0)]),
)
def test_a_spread_that_cannot_change_the_verdict_does_not_make_it_unsteady(value, spread, a, b, target) -> None:
    low, high = min(a, b), max(a, b)
    got = verdict(value, target, spread, bounds=(low, high))
    if spread <= MAX_SPREAD:  # steady: the value decides, whatever the bounds
        assert got == ("met" if target.met(value) else "missed")
    elif target.met(low) and target.met(high):  # the whole interquartile range meets it
        assert got == "met"
    elif not target.met(low) and not target.met(high):
        assert got == "missed"
    else:  # the range straddles the target: the weather could decide
        assert got == "unsteady"
    assert verdict(value, target, spread, bounds=(math.nan, high)) in (
        ("met", "missed") if spread <= MAX_SPREAD else ("unsteady",)
    )


def test_a_tiny_fault_count_is_met_however_much_it_spreads() -> None:
    # faults per MB 0.004-0.02 against < 10: a spread of 100 % changes nothing
    assert verdict(0.006, Target("<", 10.0), 1.0) == "unsteady"  # without bounds, as before
    assert verdict(0.006, Target("<", 10.0), 1.0, bounds=(0.004, 0.02)) == "met"
    # and a ratio far under its target is a miss, not weather
    assert verdict(0.5, Target(">=", 0.85), 0.4, bounds=(0.4, 0.7)) == "missed"
    assert verdict(0.8, Target(">=", 0.85), 0.4, bounds=(0.7, 0.95)) == "unsteady"


@given(st.lists(VERDICT, min_size=1, max_size=5))
def test_over_runs_a_steady_miss_wins_then_unsteady_then_met_in_every_run(verdicts: list[str]) -> None:
    got = runs_verdict(verdicts)
    if "missed" in verdicts:
        assert got == "missed"
    elif "unsteady" in verdicts:
        assert got == "unsteady"
    elif all(v == "met" for v in verdicts):
        assert got == "met"
    elif all(v == "none" for v in verdicts):
        assert got == "none"
    else:  # some run met, another gave no value: not met in every run
        assert got == "missed"


def test_timed_pairs_alternate_limit_and_subject() -> None:
    events: list[str] = []

    def limit() -> float:
        events.append("L")
        return 0.5 + len(events)  # its own figure, as a limit step reports it

    limits, subject = timed_pairs(limit, lambda: events.append("S"), reps=3, warmup=1)
    assert "".join(events) == "LS" * 4
    assert limits.samples == (3.5, 5.5, 7.5) and subject.n == 3 and len(subject.samples) == 3


@given(st.integers(1, 3 * 4096), st.integers(0, 4095), st.integers(0, 255))
def test_a_placed_buffer_starts_where_asked_in_a_page_and_is_filled(nbytes: int, offset: int, fill: int) -> None:
    buf = placed(nbytes, offset, fill)
    assert buf.numel() == nbytes and buf.data_ptr() % 4096 == offset
    assert bool((buf == fill).all())


@pytest.mark.parametrize("huge_pages", [False, True])
def test_the_memcpy_limit_copies_between_placed_buffers(huge_pages: bool) -> None:
    """The limit's destination lies MEMCPY_AHEAD bytes past its source within a page, wherever
    the allocator put them (a few lines past stalls glibc's memcpy 2.5-4.5x: 4K aliasing), on
    huge pages or not; a step copies the source's bytes over the destination's."""
    nbytes = 3 << 20
    src, dst = memcpy_buffers(nbytes, huge_pages=huge_pages)
    assert src.numel() == dst.numel() == nbytes
    assert src.data_ptr() % 4096 == 0
    assert (dst.data_ptr() - src.data_ptr()) % 4096 == MEMCPY_AHEAD
    assert not torch.equal(src, dst)  # filled differently: a copy shows
    step = memcpy_step(nbytes, huge_pages)
    assert step() > 0  # (memcpy_step checks its own first copy and raises if it moved nothing)
