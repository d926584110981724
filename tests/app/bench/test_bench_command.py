"""``kvferry bench``: pure arithmetic (properties), the baseline's wire format, the peer
channel, the PNG writer, and one tiny end-to-end run through the command line.

Timings are never asserted: only that every figure exists, is finite and that the data
arrived intact.
"""

from __future__ import annotations

import math
import os
import pathlib
import select
import struct
import subprocess
import sys
import zlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvferry.adapters.platform import HUGE_PAGE
from kvferry.adapters.torch_frames import decode_payload, encode_bytes
from kvferry.app.bench.model import RATIO_NAMES, TARGETS, BenchSettings, Geometry, Stat, compute_ratios, ratio_of
from kvferry.app.bench.pairs import quartiles
from kvferry.app.bench.payload import (
    baseline_decode,
    baseline_encode,
    baseline_extract,
    gather_payload_into,
    kv_crc,
    layout_for,
    make_paged_cache,
    payload_crc,
    plan_request,
)
from kvferry.app.bench.plot import Bar, encode_png, render_png
from kvferry.app.bench.proc import Peer, read_lines
from kvferry.app.bench.runner import ratio_bounds
from kvferry.app.bench.scenarios import tp_items
from kvferry.app.cli import main
from kvferry.core.errors import ConfigError, TransferError

positive = st.floats(min_value=1e-9, max_value=1e6, allow_nan=False, allow_infinity=False)


# ------------------------------------------------------------------------------ arithmetic
@given(st.lists(st.floats(min_value=-1e9, max_value=1e9, allow_nan=False), min_size=1, max_size=30))
def test_stat_orders_min_median_max(samples: list[float]) -> None:
    stat = Stat.of(samples)
    assert stat.min <= stat.median <= stat.max and stat.n == len(samples)
    assert (stat.min, stat.max) == (min(samples), max(samples))


def test_stat_needs_a_sample() -> None:
    with pytest.raises(ConfigError):
        Stat.of([])


_INPUTS = (
    "memcpy",
    "raw_zmq",
    "raw_tcp",
    "extraction",
    "kvferry_encode",
    "kvferry_decode",
    "kvferry_codec",
    "baseline_encode",
    "baseline_e2e",
    "shm_e2e_1",
    "shm_e2e_n",
    "zmq_e2e_1",
    "zmq_e2e_n",
    "homo_2_2",
    "hetero_2_4",
    "replicated_2_8",
    "mla_2_4",
    "readiness_shm",
    "readiness_shm_from_call",
    "faults_per_mb_sender",
    "faults_per_mb_receiver",
    "rss_ratio_receiver",
)


@given(st.fixed_dictionaries({name: positive for name in _INPUTS}), st.integers(1, 64))
def test_every_ratio_is_finite_from_positive_medians(medians: dict[str, float], requests: int) -> None:
    ratios = compute_ratios({k: Stat.of([v]) for k, v in medians.items()}, requests)
    assert tuple(ratios) == RATIO_NAMES
    assert all(math.isfinite(v) and v > 0 for v in ratios.values())
    assert ratios["extraction_vs_memcpy"] == pytest.approx(medians["memcpy"] / medians["extraction"])
    assert ratios["zmq_8req_vs_raw"] == pytest.approx(requests * medians["raw_zmq"] / medians["zmq_e2e_n"])
    assert ratios["shm_8req_vs_memcpy"] == pytest.approx(requests * medians["memcpy"] / medians["shm_e2e_n"])
    assert ratios["zmq_1req_vs_raw_tcp"] == pytest.approx(medians["raw_tcp"] / medians["zmq_e2e_1"])
    assert ratios["readiness_shm_from_send_call_p50_ms"] == pytest.approx(medians["readiness_shm_from_call"] * 1e3)
    assert ratios["codec_ms"] == pytest.approx(medians["kvferry_codec"] * 1e3)


@given(
    st.fixed_dictionaries({name: st.lists(positive, min_size=1, max_size=9) for name in _INPUTS}),
    st.integers(1, 16),
)
def test_a_ratios_bounds_hold_its_value_and_follow_its_figures_quartiles(samples: dict, requests: int) -> None:
    stats = {k: Stat.of(v) for k, v in samples.items()}
    ratios = compute_ratios(stats, requests)
    for name in RATIO_NAMES:
        low, high = ratio_bounds(stats, requests, name)
        assert low <= high
        # the medians lie between the quartiles, so the value lies between the bounds
        assert low * (1 - 1e-9) <= ratios[name] <= high * (1 + 1e-9), name
    # by hand: a time ratio is least with the limit at its q1 and the subject at its q3
    q1m, q3m = quartiles(samples["memcpy"])
    q1s, q3s = quartiles(samples["shm_e2e_1"])
    assert ratio_bounds(stats, requests, "shm_e2e_vs_memcpy") == pytest.approx((q1m / q3s, q3m / q1s))
    assert all(math.isnan(b) for b in ratio_bounds({}, requests, "shm_e2e_vs_memcpy"))


def test_missing_figures_give_nan_not_an_error() -> None:
    ratios = compute_ratios({"memcpy": Stat.of([1.0])}, 8)
    assert set(ratios) == set(RATIO_NAMES) and all(math.isnan(v) for v in ratios.values())
    assert math.isnan(ratio_of(1.0, 0.0)) and math.isnan(ratio_of(math.inf, 1.0))


@given(positive)
def test_targets_compare_in_their_direction(value: float) -> None:
    for name, target in TARGETS.items():
        expected = {"<": value < target.bound, "<=": value <= target.bound, ">=": value >= target.bound}[target.op]
        assert target.met(value) is expected, name
    assert not any(t.met(math.nan) for t in TARGETS.values())


def test_settings_validate() -> None:
    assert BenchSettings.full().geometry.nbytes == 28 * 2 * 4096 * 4 * 128 * 2
    assert BenchSettings.full().huge_pages and BenchSettings.full().to_json()["huge_pages"] is True
    with pytest.raises(ConfigError):
        BenchSettings.quick(reps=0)
    with pytest.raises(ConfigError):
        Geometry(0, 16, 4, 128)


# --------------------------------------------------------------------- payloads and baseline
@settings(max_examples=25, deadline=None)
@given(
    layers=st.integers(1, 3),
    tokens=st.integers(1, 40),
    heads=st.sampled_from([2, 4]),
    block=st.sampled_from([1, 4, 16]),
    requests=st.integers(1, 3),
    seed=st.integers(0, 99),
)
def test_kvferry_extraction_equals_the_baseline_gather(
    layers: int, tokens: int, heads: int, block: int, requests: int, seed: int
) -> None:
    cache = make_paged_cache(Geometry(layers, tokens, heads, 8, block_size=block), requests, seed=seed)
    ids = [b for r in cache.block_ids for b in r]
    assert sorted(ids) == sorted(set(ids))  # requests own disjoint blocks
    for r in range(requests):
        plan = plan_request(cache, r, request_id="p")
        layout = layout_for(plan)
        dest = torch.zeros(layout.total_nbytes, dtype=torch.uint8)
        gather_payload_into(plan, layout, dest)
        assert payload_crc(decode_payload(dest)) == kv_crc(*baseline_extract(cache, r))


@settings(max_examples=25, deadline=None)
@given(
    layers=st.integers(1, 3),
    tokens=st.integers(0, 7),
    dtype=st.sampled_from([torch.bfloat16, torch.float32]),
    meta=st.dictionaries(st.text(max_size=4), st.integers(), max_size=3),
)
def test_baseline_writes_the_reference_layout(layers: int, tokens: int, dtype: torch.dtype, meta: dict) -> None:
    gen = torch.Generator().manual_seed(tokens)
    keys = [torch.randn(tokens, 2, 3, generator=gen).to(dtype) for _ in range(layers)]
    values = [torch.randn(tokens, 2, 3, generator=gen).to(dtype) for _ in range(layers)]
    blob = baseline_encode("rid", keys, values, [5, 6], meta)
    assert blob == encode_bytes("rid", keys, values, [5, 6], meta, align=1, version=False)
    got_k, got_v = baseline_decode(blob)
    assert all(torch.equal(a, b) for a, b in zip(got_k + got_v, keys + values))


def test_tp_items_route_every_head_once() -> None:
    sends, recvs, expected = tp_items("t", 0, 2, 4, 4)
    assert [s["rank"] for s in sends] == [0, 1] and [r["rank"] for r in recvs] == [0, 1, 2, 3]
    assert list(expected) == [("main", 0, (0, 2)), ("main", 0, (2, 4)), ("main", 1, (0, 2)), ("main", 1, (2, 4))]
    assert [e[1:] for e in tp_items("t", 0, 2, 2, 4)[2]] == [(0, None), (1, None)]
    # replicated heads: 4 KV heads (each sender rank holds 2, the "half" cache) on 8 ranks
    _, recvs, expected = tp_items("t", 0, 2, 8, 2, num_kv_heads=4, cache="half")
    assert len(recvs) == 8
    assert list(expected) == [("half", t // 4, ((t // 2) % 2, (t // 2) % 2 + 1)) for t in range(8)]
    # an MLA latent: whole, one sender per receiver
    assert list(tp_items("t", 0, 2, 4, 4, num_kv_heads=1, cache="main:latent")[2]) == [
        ("main:latent", t // 2, None) for t in range(4)
    ]


# ------------------------------------------------------------------------------ channel, PNG
@given(st.lists(st.binary(max_size=20).filter(lambda b: b"\n" not in b), max_size=6), st.integers(1, 7))
def test_read_lines_reassembles_any_chunking(lines: list[bytes], step: int) -> None:
    stream = b"".join(line + b"\n" for line in lines)
    buffer, got = bytearray(), []
    for i in range(0, len(stream), step):
        got += read_lines(buffer, stream[i : i + step])
    assert got == lines and buffer == bytearray()


def test_peer_reports_failures_as_values() -> None:
    with Peer.start("probe") as peer:
        assert peer.call("rss_peak", 30)["hwm_kb"] > 0
        with pytest.raises(TransferError, match="unknown command"):
            peer.call("no_such_command", 30)
        with pytest.raises(TransferError, match="TypeError"):
            peer.call("rss_peak", 30, unexpected=1)
        assert peer.call("rss_reset", 30)["rss_kb"] > 0  # the channel is still in step


def test_no_huge_pages_leaves_the_caches_on_small_pages() -> None:
    import argparse

    from kvferry.app.bench.command import configure, settings_from_args

    parser = argparse.ArgumentParser()
    configure(parser)
    assert settings_from_args(parser.parse_args(["--quick"])).huge_pages is True
    assert settings_from_args(parser.parse_args(["--quick", "--no-huge-pages"])).huge_pages is False
    assert settings_from_args(parser.parse_args(["--quick"])).pin_cpus is True
    assert settings_from_args(parser.parse_args(["--quick", "--no-pin"])).pin_cpus is False


def test_a_cache_on_huge_pages_holds_the_same_bytes() -> None:
    """The bench's cache moved onto huge pages is the same cache (same seed, same bytes, same
    block ids) with what was done attached, each layer from a 2 MiB boundary in whole 2 MiB
    pages of its own; without the option nothing is attached and the layers are plain."""
    g = Geometry(2, 2048, 4, 128)  # 4.3 MB a layer: whole 2 MiB pages fit
    plain = make_paged_cache(g, 2, seed=4)
    huge = make_paged_cache(g, 2, seed=4, huge_pages=True)
    assert plain.huge_pages is None and huge.huge_pages is not None and plain.describe_huge_pages() is None
    assert huge.block_ids == plain.block_ids
    assert all(torch.equal(a.view(torch.int16), b.view(torch.int16)) for a, b in zip(plain.layers, huge.layers))
    for layer in huge.layers:
        start, end = layer.data_ptr(), layer.data_ptr() + layer.nbytes
        storage = layer.untyped_storage()
        assert start % HUGE_PAGE == 0  # from a boundary ...
        whole_end = -(-end // HUGE_PAGE) * HUGE_PAGE  # ... to the end of its last page, all its own
        assert storage.data_ptr() <= start and whole_end <= storage.data_ptr() + storage.nbytes()
    assert len({t.untyped_storage().data_ptr() for t in huge.layers}) == len(huge.layers)
    assert huge.huge_pages.total == sum(t.untyped_storage().nbytes() for t in huge.layers)
    line = huge.describe_huge_pages()
    assert line is not None and line.startswith(f"layers of {sum(t.nbytes for t in huge.layers) >> 20} MB")
    assert "MB on huge pages" in line


#: A bench in miniature: one worker, blocked in a command (accept, 120 s), its pid printed.
_ORPHANING_BENCH = """
import sys
from kvferry.app.bench.proc import Peer
peer = Peer.start("orphan")
peer.call("tcp_listen", 120, nbytes=16)
peer.begin("tcp_accept", timeout_s=120)
print(peer.pid, flush=True)
sys.stdin.read()
"""


@pytest.mark.skipif(not hasattr(os, "pidfd_open"), reason="needs os.pidfd_open (Linux 5.3+)")
def test_a_worker_ends_when_its_bench_is_killed_in_the_middle_of_a_command() -> None:
    """A bench killed outright while its worker blocks in a 120 s command: the worker exits
    within seconds instead of living on until the command's timeout."""
    bench = subprocess.Popen([sys.executable, "-c", _ORPHANING_BENCH], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert bench.stdout is not None
        assert select.select([bench.stdout], [], [], 120)[0], "the bench did not start its worker"
        worker = int(bench.stdout.readline())
        exited = os.pidfd_open(worker)
        try:
            assert not select.select([exited], [], [], 0)[0]  # alive, blocked in accept
            bench.kill()
            bench.wait(30)
            assert select.select([exited], [], [], 60)[0], f"worker {worker} outlived its bench by 60 s"
        finally:
            os.close(exited)
    finally:
        bench.kill()
        bench.wait(30)


def _png_chunks(data: bytes) -> dict[bytes, bytes]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, chunks = 8, {}
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos : pos + 4])
        kind, body = data[pos + 4 : pos + 8], data[pos + 8 : pos + 8 + length]
        (crc,) = struct.unpack(">I", data[pos + 8 + length : pos + 12 + length])
        assert crc == zlib.crc32(kind + body) & 0xFFFFFFFF
        chunks[kind] = chunks.get(kind, b"") + body
        pos += 12 + length
    return chunks


@given(st.integers(1, 40), st.integers(1, 40))
def test_png_encoder_round_trips_pixels(width: int, height: int) -> None:
    pixels = bytes((i * 7) % 256 for i in range(width * height * 3))
    chunks = _png_chunks(encode_png(width, height, pixels))
    assert struct.unpack(">IIBBBBB", chunks[b"IHDR"]) == (width, height, 8, 2, 0, 0, 0)
    raw = zlib.decompress(chunks[b"IDAT"])
    rows = [raw[y * (1 + 3 * width) : (y + 1) * (1 + 3 * width)] for y in range(height)]
    assert all(r[0] == 0 for r in rows) and b"".join(r[1:] for r in rows) == pixels


def test_builtin_chart_draws_bars() -> None:
    data = render_png([Bar("memcpy", 10.0, "limit"), Bar("kvferry x", 5.0, "kvferry")], "title 1.5")
    width, height = struct.unpack(">II", _png_chunks(data)[b"IHDR"][:8])
    assert width > 500 and height > 100


# ------------------------------------------------------------------------ end to end (tiny)
@pytest.mark.slow
@pytest.mark.timeout(480)
def test_tiny_run_reports_every_ratio_as_a_finite_number(tiny_run: tuple[int, str, dict, pathlib.Path]) -> None:
    code, table, report, _ = tiny_run
    assert code == 0, report["failures"]
    assert report["failures"] == {}
    assert set(report["ratios"]) == set(RATIO_NAMES)
    not_finite = {k: v for k, v in report["ratios"].items() if not isinstance(v, (int, float)) or not math.isfinite(v)}
    assert not_finite == {}
    assert report["data_checks"] and all(report["data_checks"].values())
    for name in (
        "memcpy",
        "raw_zmq",
        "raw_tcp",
        "baseline_e2e",
        "shm_e2e_1",
        "zmq_e2e_n",
        "hetero_2_4",
        "replicated_2_8",
        "mla_2_4",
        "shm_e2e_1_copy",
        "zmq_e2e_1_copy",
    ):
        fig = report["figures"][name]
        # 2 repetitions in each of the 2 runs
        assert fig["n"] == 4 and fig["runs"] == 2 and fig["min"] <= fig["median"] <= fig["max"]
    # the copying receive is measured beside the default (zero-copy) one, not in the headline
    for name in ("shm_copying_e2e_vs_memcpy", "readiness_shm_copying_p50_ms", "rss_ratio_receiver_copying"):
        assert math.isfinite(report["extra_ratios"][name]), name
    assert report["notes"]["rss_ratio_receiver_path"].startswith("kvferry")
    assert report["notes"]["rss_ratio_receiver_copying_path"].startswith("copying receive:")
    assert report["settings"]["geometry"]["nbytes"] == 2 * 2 * 256 * 4 * 128 * 2
    # the sender's cache was put on huge pages where whole 2 MiB pages fit (here none: 1.3 MB a
    # layer), and the report says what was done
    assert report["settings"]["huge_pages"] is True
    assert "MB on huge pages" in report["notes"]["cache_huge_pages"]
    assert "sender's cache: " in table
    for key in ("cpu_model", "cores", "memory_gb", "torch", "pyzmq"):
        assert report["machine"][key]
    assert all(name in table for name in RATIO_NAMES)
    # where the peers ran: each reports the CPUs the kernel lets it use
    placement = report["machine"]["placement"]
    assert f"placement: {placement['line']}" in table
    assert report["settings"]["pin_cpus"] is True
    allowed = sorted(os.sched_getaffinity(0))
    peers = placement["peers"]
    assert "sender" in peers and any(name.startswith("receiver") for name in peers)
    if len(allowed) >= 2:
        assert placement["pinned"] and set(placement["sender"]).isdisjoint(placement["receiver"])
        for name, cpus in peers.items():
            assert cpus == placement["sender" if name == "sender" else "receiver"], name
    else:
        assert not placement["pinned"] and all(cpus == allowed for cpus in peers.values())


@pytest.mark.slow
@pytest.mark.timeout(480)
def test_tiny_run_writes_a_png(tiny_run: tuple[int, str, dict, pathlib.Path]) -> None:
    chunks = _png_chunks(tiny_run[3].read_bytes())
    assert b"IHDR" in chunks and b"IEND" in chunks


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--connector", "nope"], "--connector must be one of"),
        (["--heads", "3"], "--heads must be even"),
        (["--reps", "0"], "reps must be an integer >= 1"),
        (["--runs", "0"], "runs must be an integer >= 1"),
    ],
)
def test_wrong_options_exit_2_with_one_line(capsys: pytest.CaptureFixture[str], argv: list[str], message: str) -> None:
    assert main(["bench", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_a_report_is_saved_or_the_reason_it_cannot_be_is_said(tmp_path: pathlib.Path) -> None:
    import io
    import json

    from kvferry.app.bench.report import save_report

    drawn: list[str] = []
    err = io.StringIO()
    ok = save_report({"x": float("nan")}, str(tmp_path / "r.json"), "p.png", lambda r, p: drawn.append(p) or "pen", err)
    assert ok == (True, "pen") and drawn == ["p.png"] and err.getvalue() == ""
    assert json.loads((tmp_path / "r.json").read_text()) == {"x": None}  # strict JSON
    missing = str(tmp_path / "no-such-dir" / "r.json")
    assert save_report({}, missing, "p.png", lambda r, p: drawn.append(p), err) == (False, None)
    assert drawn == ["p.png"]  # nothing drawn after the JSON failed
    assert err.getvalue().startswith("kvferry bench: error: cannot write the report: ")
