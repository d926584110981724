"""The demo's summary: per-request transfer apart from queueing and verification, its one transfer
figure against memcpy (per request, as the bench's e2e ratio), the wall time's split; and its
progress display (a bar only on a terminal).

The arithmetic is checked against hand-worked timelines and properties (the wall time's parts
add up, its transfer part and the transfer figure agree); tiny real runs (in-process ``memory``
connector, TP 2 -> 4 threads) check the ``--json`` fields, the progress lines a non-terminal
gets, the pacing (from the ranks' stamps: no request sent before every receiver rank verified
the one before), the transfer figure recomputed from those stamps, that ``--overlap`` still
runs, and that a failed run leaves no sender waiting for its turn.
"""

from __future__ import annotations

import io
import json
import math
import statistics

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvferry.app.cli import main
from kvferry.app.demo.progress import Progress
from kvferry.app.demo.timing import RequestStamps, percentile, request_timing, transfer_figure, wall_split

stamp = st.floats(min_value=0, max_value=1e4, allow_nan=False)


def test_a_waiting_receiver_counts_the_whole_put_as_transfer() -> None:
    # receivers wait from t=0; senders call at 1 and 1.5, return at 2 and 2.5; received 3, verified 4
    t = request_timing([1.0, 1.5], [2.0, 2.5], [0.0, 0.5], [3.0, 2.9], [4.0, 3.1])
    assert (t.transfer_s, t.queue_s, t.check_s) == pytest.approx((1.5, 0.0, 1.0))


def test_a_busy_receiver_queues_and_the_queue_is_not_transfer() -> None:
    # put 0 -> 1; the receivers start waiting at 5 (busy before), have it at 5.5, verify until 6
    t = request_timing([0.0], [1.0], [5.0, 4.0], [5.5, 5.2], [6.0, 5.3])
    assert (t.transfer_s, t.queue_s, t.check_s) == pytest.approx((1.0 + 0.5, 4.0, 0.5))


def test_request_timing_refuses_missing_or_mismatched_stamps() -> None:
    with pytest.raises(ValueError):
        request_timing([], [1.0], [0.0], [1.0], [1.0])
    with pytest.raises(ValueError):
        request_timing([0.0], [1.0], [0.0, 0.0], [1.0], [1.0])


@given(
    st.lists(stamp, min_size=1, max_size=4).flatmap(
        lambda starts: st.tuples(
            st.just(starts), st.lists(st.floats(0, 10), min_size=len(starts), max_size=len(starts))
        )
    ),
    st.lists(st.tuples(stamp, st.floats(0, 10), st.floats(0, 10)), min_size=1, max_size=4),
)
def test_request_timing_parts_are_never_negative_and_cover_put_to_received(senders, receivers) -> None:
    starts, spans = senders
    ends = [s + d for s, d in zip(starts, spans)]
    waits = [w for w, _, _ in receivers]
    got = [w + a for w, a, _ in receivers]
    verified = [g + b for g, (_, _, b) in zip(got, receivers)]
    t = request_timing(starts, ends, waits, got, verified)
    assert t.transfer_s >= 0 and t.queue_s >= 0 and t.check_s >= 0
    if max(got) - max(starts) >= t.queue_s:  # the receivers had it after the put began
        assert t.transfer_s + t.queue_s == pytest.approx(max(got) - max(starts))
    assert t.check_s == pytest.approx(max(b for _, _, b in receivers))


@given(stamp, st.floats(0, 100), st.floats(0, 100), st.floats(0, 100), st.lists(st.floats(0, 10), max_size=6))
def test_wall_split_parts_add_up_to_the_wall(launch, up, run, down, checks) -> None:
    ready, last, end = launch + up, launch + up + run, launch + up + run + down
    w = wall_split(launch, ready, last, end, checks)
    parts = (w.startup_s, w.receiving_s, w.checking_s, w.shutdown_s)
    assert all(p >= 0 for p in parts)
    assert sum(parts) == pytest.approx(w.total_s) and w.total_s == pytest.approx(end - launch)
    assert w.startup_s == pytest.approx(up)
    if sum(checks) <= run:
        assert w.checking_s == pytest.approx(sum(checks)) and w.shutdown_s == pytest.approx(down)


@given(
    stamp,
    st.floats(0, 100),
    st.lists(st.tuples(st.floats(0, 10), st.floats(0, 10), st.floats(0, 1)), max_size=8),
    st.floats(0, 100),
)
def test_a_paced_wall_is_startup_transfers_checking_pacing_and_shutdown(launch, up, requests, down) -> None:
    """One request after the other: each its transfer, its verification's tail and a hand-off;
    the five parts are never negative, add up to the wall, and transfers are the sum."""
    ready = launch + up
    last = ready + sum(t + c + g for t, c, g in requests)
    end = last + down
    transfers, tails = [t for t, _, _ in requests], [c for _, c, _ in requests]
    w = wall_split(launch, ready, last, end, tails, transfers)
    parts = (w.startup_s, w.transfer_s, w.checking_s, w.pacing_s, w.shutdown_s)
    assert all(p >= -1e-9 for p in parts)
    assert sum(parts) == pytest.approx(w.total_s, abs=1e-6) and w.total_s == pytest.approx(end - launch)
    assert w.receiving_s == pytest.approx(w.transfer_s + w.pacing_s)
    assert w.transfer_s == pytest.approx(sum(transfers), abs=1e-6)
    assert w.checking_s == pytest.approx(sum(tails), abs=1e-6)
    assert w.pacing_s == pytest.approx(sum(g for _, _, g in requests), abs=1e-6)


@given(stamp, st.floats(0, 10), st.floats(0, 10), st.lists(st.floats(0, 10), max_size=6), st.lists(st.floats(0, 10)))
def test_the_wall_split_clamps_transfers_that_do_not_fit(launch, up, run, checks, transfers) -> None:
    w = wall_split(launch, launch + up, launch + up + run, launch + up + run, checks, transfers)
    assert 0 <= w.transfer_s <= w.receiving_s + 1e-9 and w.pacing_s >= -1e-9
    assert w.startup_s + w.receiving_s + w.checking_s + w.shutdown_s == pytest.approx(w.total_s, abs=1e-6)


@given(st.lists(st.tuples(st.integers(1, 10**10), st.floats(1e-3, 10)), min_size=1, max_size=20), st.floats(0.1, 50))
def test_the_walls_transfer_part_and_the_transfer_figure_agree(requests, memcpy_gbps) -> None:
    """The wall's transfers are the very times the figure is the median over: all bytes over
    them (a mean of the requests' rates weighted by their times) lies among those rates, as
    does the figure; so neither contradicts the other."""
    sizes, times = [b for b, _ in requests], [t for _, t in requests]
    w = wall_split(0.0, 1.0, 1.0 + sum(times) + 1.0, 1.0 + sum(times) + 1.0, [0.5], times)
    assert w.transfer_s == pytest.approx(sum(times))
    figure = transfer_figure(sizes, times, memcpy_gbps)
    rates = [b / t / 1e9 for b, t in requests]
    overall = sum(sizes) / w.transfer_s / 1e9
    assert min(rates) * (1 - 1e-9) <= overall <= max(rates) * (1 + 1e-9)
    assert min(rates) * (1 - 1e-9) <= figure.gbps <= max(rates) * (1 + 1e-9)
    if len(set(rates)) == 1:  # requests alike: the two are one figure
        assert overall == pytest.approx(figure.gbps)


def test_a_requests_stamps_give_its_window_and_timing() -> None:
    # paced: senders let through at 10 (calls at 10.0 and 10.2, back at 10.5 and 10.6); the
    # receivers have waited since 9 (verified the one before), hold it at 10.8 and 11.0
    s = RequestStamps("r", 100, (10.0, 10.2), (10.5, 10.6), (9.0, 9.1), (10.8, 11.0), (11.5, 11.2))
    assert s.window == (10.0, 11.5)
    t = s.timing()
    assert (t.transfer_s, t.queue_s, t.check_s, t.tail_s) == pytest.approx((0.8, 0.0, 0.7, 0.5))


def test_the_transfer_figure_is_per_request_not_bytes_over_summed_or_wall_time() -> None:
    # three requests of 1, 2 and 4 GB in 1, 1 and 2 s; memcpy 4 GB/s: a request's memcpy takes
    # 0.25, 0.5 and 1 s, so its ratios are 0.25, 0.5 and 0.5 and their median 0.5
    figure = transfer_figure([10**9, 2 * 10**9, 4 * 10**9], [1.0, 1.0, 2.0], 4.0)
    assert figure.gbps == pytest.approx(2.0) and figure.vs_memcpy == pytest.approx(0.5)
    assert figure.gbps != pytest.approx(7 / 4)  # all bytes over the summed times: the old figure


@given(
    st.lists(st.tuples(st.integers(1, 10**10), st.floats(1e-4, 100)), min_size=1, max_size=20),
    st.floats(0.01, 100),
)
def test_the_transfer_figure_is_the_median_of_the_bench_style_ratios(requests, memcpy_gbps) -> None:
    sizes, times = [b for b, _ in requests], [t for _, t in requests]
    figure = transfer_figure(sizes, times, memcpy_gbps)
    # the bench's e2e ratio of one request: memcpy seconds of its bytes over its seconds
    ratios = [(b / (memcpy_gbps * 1e9)) / t for b, t in requests]
    assert figure.vs_memcpy == pytest.approx(statistics.median(ratios), rel=1e-9)
    assert figure.vs_memcpy == pytest.approx(figure.gbps / memcpy_gbps, rel=1e-9)
    assert min(ratios) * (1 - 1e-9) <= figure.vs_memcpy <= max(ratios) * (1 + 1e-9)


def test_the_transfer_figure_without_data_is_nan_and_lists_must_agree() -> None:
    assert math.isnan(transfer_figure([], [], 3.0).vs_memcpy)
    assert math.isnan(transfer_figure([5], [1.0], math.nan).vs_memcpy)
    assert math.isnan(transfer_figure([5], [0.0], 3.0).gbps)  # no time: left out
    with pytest.raises(ValueError):
        transfer_figure([1, 2], [1.0], 3.0)


def test_percentile_is_nearest_rank() -> None:
    assert percentile([5.0, 1.0, 3.0], 50) == 3.0 and percentile([1.0, 2.0], 99) == 2.0
    assert math.isnan(percentile([], 50))


# ---------------------------------------------------------------------------------- progress
class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_progress_off_a_terminal_writes_a_line_every_few_seconds_without_carriage_returns() -> None:
    out, clock = io.StringIO(), _Clock()
    shown = Progress(out, interval_s=5.0, clock=clock)
    assert shown.tty is False  # a StringIO is no terminal
    shown.update(0, 10)  # the stages start: nothing yet
    clock.now += 4.0
    shown.tick()  # 4 s: too soon for a line
    for n in range(1, 10):  # from 5 s one request a second: lines at 5 s and 10 s
        clock.now += 1.0
        shown.update(n, 10)
    clock.now += 4.0
    shown.tick()  # 7 s after the last line: a line though nothing completed
    clock.now += 1.0
    shown.update(10, 10)
    shown.tick()
    text = out.getvalue()
    assert "\r" not in text
    assert text.splitlines() == [
        "  progress: 1/10 requests received, 5.0 s",
        "  progress: 6/10 requests received, 10.0 s",
        "  progress: 9/10 requests received, 17.0 s",
        "  progress: 10/10 requests received, 18.0 s",
    ]


def test_progress_on_a_terminal_redraws_one_bar() -> None:
    out = io.StringIO()
    shown = Progress(out, tty=True, width=4)
    shown.update(1, 2)
    shown.update(2, 2)
    assert out.getvalue() == "\r  [##..] 1/2 requests\r  [####] 2/2 requests\n"


# ------------------------------------------------------------------------ a tiny real run
TINY = ["--connector", "memory", "--preset", "tiny", "--requests", "4", "--min-tokens", "8", "--max-tokens", "40"]


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_demo_json_reports_transfer_apart_from_queueing_and_checking(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", *TINY, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["bit_exact"] == 4 and doc["errors"] == []
    wall = doc["wall_s"]
    assert set(wall) == {"total", "startup", "receiving", "checking", "shutdown", "transfer", "pacing"}
    assert all(v >= 0 for v in wall.values()) and wall["startup"] > 0 and wall["checking"] > 0
    parts = wall["startup"] + wall["receiving"] + wall["checking"] + wall["shutdown"]
    assert parts == pytest.approx(wall["total"], abs=1e-3) and wall["total"] == pytest.approx(doc["seconds"], abs=1e-3)
    assert wall["transfer"] + wall["pacing"] == pytest.approx(wall["receiving"], abs=1e-3)
    assert 0 < doc["transfer_ms"]["p50"] <= doc["transfer_ms"]["p99"]
    # paced (the default): nothing queued, and the transfers are a part of receiving
    assert doc["paced"] is True and doc["queue_ms"]["p50"] == 0 and doc["check_ms"]["p50"] > 0
    assert 0 < wall["transfer"] <= wall["receiving"]
    assert doc["memcpy_gbps"] > 0 and doc["transfer_gbps"] > 0
    assert doc["transfer_vs_memcpy"] == pytest.approx(doc["transfer_gbps"] / doc["memcpy_gbps"], rel=1e-3)
    assert "throughput_gbps" not in doc  # bytes over the wall time is not a transfer rate


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_demo_table_and_progress_off_a_terminal(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", *TINY]) == 0
    captured = capsys.readouterr()
    assert "\r" not in captured.err
    assert (
        captured.err.splitlines()[-1] == "  progress: 4/4 requests received, " + captured.err.rsplit(", ", 1)[1].strip()
    )
    for label in ("transfer ", "x a memcpy", "verification", "start-up", "transfers", "checking", "pacing"):
        assert label in captured.out, label
    assert "one request at a time" in captured.out and "queueing" not in captured.out
    assert "transfer rate" not in captured.out  # one transfer figure, not a second rate beside it
    assert captured.out.count("GB/s, memcpy") == 1 and captured.out.count("GB/s") == 2
    assert "PASS" in captured.out


def _tiny_spec(**extra: object) -> object:
    from kvferry.adapters.platform import free_base_port
    from kvferry.app.demo.model import DemoSpec

    return DemoSpec(
        connector="memory", from_tp=2, to_tp=4, model="tiny", layers=2, kv_heads=8, head_dim=16, requests=6,
        min_tokens=8, max_tokens=40, base_port=free_base_port(2), timeout_s=30.0, **extra,
    )  # fmt: skip


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_paced_run_sends_each_request_after_the_previous_one_was_verified() -> None:
    """Paced (the default), read from the ranks' own stamps: no sender rank calls send for
    request 0 before every rank of both stages was ready, nor for request ``i`` before every
    receiver rank verified request ``i - 1``; nothing queues. The transfer figure, recomputed
    here from the stamps (per request: the memcpy time of its bytes at the run's memcpy rate
    over send call -> every receiver rank holding it; the median), is the report's, and the
    wall time's transfers are those times summed."""
    from kvferry.app.demo.command import run_demo

    report = run_demo(_tiny_spec())
    assert report.ok and report.paced and len(report.stamps) == 6 and math.isfinite(report.t_ready)
    first = report.stamps[0]
    assert min(first.put_start) >= report.t_ready
    for before, after in zip(report.stamps, report.stamps[1:]):
        assert len(before.verified) == 4 and len(after.put_start) == 2
        assert min(after.put_start) >= max(before.verified)  # every receiver rank verified the one before
    assert [s.window for s in report.stamps] == list(report.windows)
    for (_, end), (start, _) in zip(report.windows, report.windows[1:]):
        assert start >= end
    # the figure from the raw stamps, without the timing module
    for s in report.stamps:
        assert max(s.waits) <= max(s.put_end)  # every receiver waiting before the put ended: no queue
    transfers = [max(s.received) - max(s.put_start) for s in report.stamps]
    memcpy_s = [s.nbytes / (report.memcpy_gbps * 1e9) for s in report.stamps]
    assert report.queue_ms_p50 == 0 and all(t > 0 for t in transfers)
    assert sum(s.nbytes for s in report.stamps) == report.bytes
    assert report.transfer_vs_memcpy == pytest.approx(
        statistics.median(m / t for m, t in zip(memcpy_s, transfers)), rel=1e-9
    )
    assert report.transfer_gbps == pytest.approx(
        statistics.median(s.nbytes / t / 1e9 for s, t in zip(report.stamps, transfers)), rel=1e-9
    )
    assert report.wall.transfer_s == pytest.approx(sum(transfers), rel=1e-9)
    assert report.transfer_ms_p50 == pytest.approx(percentile(transfers, 50) * 1e3, rel=1e-9)
    assert report.transfer_ms_p99 == pytest.approx(percentile(transfers, 99) * 1e3, rel=1e-9)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_the_overlap_option_still_runs_and_says_it_is_under_contention(capsys: pytest.CaptureFixture[str]) -> None:
    from kvferry.app.demo.command import run_demo

    overlapping = run_demo(_tiny_spec(overlap=True))
    assert overlapping.ok and not overlapping.paced and overlapping.wall.transfer_s == 0
    assert len(overlapping.stamps) == 6 and overlapping.queue_ms_p50 >= 0
    assert main(["demo", *TINY, "--overlap"]) == 0
    out = capsys.readouterr().out
    assert "UNDER CONTENTION (--overlap)" in out and "queueing" in out and "receiving" in out
    assert "not the bench's shm_e2e_vs_memcpy" in out and "transfers" not in out and "PASS" in out
    assert main(["demo", *TINY, "--overlap", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["paced"] is False and doc["wall_s"]["transfer"] == 0 and doc["bit_exact"] == 4


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the ranks' raise, on purpose
def test_a_failed_run_leaves_no_sender_waiting_for_its_turn(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every receiver rank fails while verifying the first request, so the turn of the second
    never comes: the run stops, says why, and every sender has ended (let through and told to
    send nothing more) long before its own gate timeout (the receive deadline and 30 s)."""
    import threading
    import time

    from kvferry.app.demo import worker
    from kvferry.app.demo.command import run_demo

    def broken(*args: object, **kwargs: object) -> object:
        raise RuntimeError("verification broke on purpose")

    monkeypatch.setattr(worker, "expected_kv", broken)
    started = time.monotonic()
    report = run_demo(_tiny_spec(), after_error_s=5.0)
    assert time.monotonic() - started < 25.0
    assert not report.ok and report.bit_exact == 0
    assert report.errors and all(e.startswith("receiver rank") for e in report.errors), report.errors
    assert all("broke on purpose" in e for e in report.errors)
    senders = [t for t in threading.enumerate() if t.name.startswith("kvferry-demo-sender-")]
    assert not senders, senders
