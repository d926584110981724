"""``kvferry bench --engine vllm --serve`` without vLLM: its options, each row's
``--kv-transfer-config``, the Mooncake row proxy's hand-off, the client's command line, a cell
from the client's JSON and the summary table (skipped and failed rows say why)."""

from __future__ import annotations

import argparse
import io
import math
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvferry.app.bench.command import configure, run
from kvferry.app.bench.engine.mooncake_proxy import decode_body, prefill_body
from kvferry.app.bench.engine.serve import (
    MOONCAKE_PREFILL_ID,
    ROWS,
    cell_from_result,
    client_argv,
    kv_config,
    parse_rates,
    parse_serve_rows,
    rate_key,
    render_serve_table,
    ttft_split,
)


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    configure(parser)
    return parser.parse_args(list(argv))


def test_rates() -> None:
    assert parse_rates(None) == (1.0, 4.0, math.inf)
    assert parse_rates("2.5, inf,1,2.5") == (2.5, math.inf, 1.0)
    assert [rate_key(r) for r in parse_rates("1,2.5,inf")] == ["1", "2.5", "inf"]
    for bad in ("x", "0", "-1", "nan"):
        with pytest.raises(ValueError, match="--rates"):
            parse_rates(bad)


def test_rows_in_table_order_and_unknown_named() -> None:
    assert parse_serve_rows(None) == ROWS
    assert parse_serve_rows("kvferry_shm,plain") == ("plain", "kvferry_shm")
    with pytest.raises(ValueError, match="floor"):
        parse_serve_rows("plain,floor")


def test_kv_configs() -> None:
    for row, kind in (("kvferry_shm", "shm"), ("kvferry_zmq", "zmq")):
        cfg = kv_config(row, "kv_consumer", 50000)
        assert cfg["kv_connector"] == "KVFerryConnector" and cfg["kv_role"] == "kv_consumer"
        assert cfg["kv_connector_extra_config"]["connector"] == {"type": kind}
        assert cfg["kv_connector_extra_config"]["base_port"] == 50000
    nixl = kv_config("nixl", "kv_producer", 0)
    assert nixl == {"kv_connector": "NixlConnector", "kv_role": "kv_producer", "kv_buffer_device": "cpu"}
    with pytest.raises(ValueError):
        kv_config("plain", "kv_producer", 0)
    # Mooncake: both sides name the one bootstrap server; the prefill's engine id is the one
    # its proxy hands the decode
    p, d = kv_config("mooncake", "kv_producer", 0, 41000), kv_config("mooncake", "kv_consumer", 0, 41000)
    assert p["engine_id"] == MOONCAKE_PREFILL_ID != d["engine_id"]
    for cfg in (p, d):
        assert cfg["kv_connector"] == "MooncakeConnector"
        assert cfg["kv_connector_extra_config"]["bootstrap_server_address"] == "127.0.0.1:41000"


bodies = st.fixed_dictionaries(
    {"model": st.just("m"), "prompt": st.lists(st.integers(0, 511), min_size=1, max_size=8)},
    optional={
        "max_tokens": st.integers(1, 64),
        "stream": st.booleans(),
        "stream_options": st.just({"include_usage": True}),
        "max_completion_tokens": st.integers(1, 64),
        "kv_transfer_params": st.just({"do_remote_decode": False}),
    },
)


@given(body=bodies, tid=st.text(min_size=1, max_size=20))
@settings(max_examples=50, deadline=None)
def test_the_mooncake_proxy_hands_both_sides_one_transfer_id(body: dict, tid: str) -> None:
    before = {k: v for k, v in body.items()}
    p, d = prefill_body(body, tid), decode_body(body, tid, "engine-p", "http://127.0.0.1:4")
    assert body == before  # the client's request is left as it was
    assert p["kv_transfer_params"] == {"do_remote_decode": True, "transfer_id": tid}
    assert p["max_tokens"] == 1 and p["stream"] is False and "stream_options" not in p
    assert p.get("max_completion_tokens", 1) == 1
    assert d["kv_transfer_params"] == {
        "do_remote_prefill": True,
        "transfer_id": tid,
        "remote_engine_id": "engine-p",
        "remote_bootstrap_addr": "http://127.0.0.1:4",
    }
    # the decode answers the client's own request: everything else as the client sent it
    assert {k: v for k, v in d.items() if k != "kv_transfer_params"} == {
        k: v for k, v in body.items() if k != "kv_transfer_params"
    }
    set_by_proxy = ("kv_transfer_params", "max_tokens", "stream", "stream_options", "max_completion_tokens")
    assert {k: v for k, v in p.items() if k not in set_by_proxy} == {
        k: v for k, v in body.items() if k not in set_by_proxy
    }


def test_client_command_line(tmp_path: Path) -> None:
    args = _args("--engine", "vllm", "--serve", "--num-prompts", "8", "--max-concurrency", "3")
    args.input_len, args.output_len = 256, 16
    argv = client_argv("py", "http://127.0.0.1:9", tmp_path / "m", math.inf, args, tmp_path, "r.json")
    assert argv[:5] == ["py", "-m", "kvferry.app.bench.engine.vllm_cli", "bench", "serve"]

    def value(flag: str) -> str:
        return argv[argv.index(flag) + 1]

    assert value("--base-url") == "http://127.0.0.1:9" and value("--dataset-name") == "random"
    assert value("--random-input-len") == "256" and value("--random-output-len") == "16"
    assert value("--num-prompts") == "8" and value("--max-concurrency") == "3"
    assert value("--request-rate") == "inf" and value("--tokenizer") == str(tmp_path / "m")
    assert value("--percentile-metrics") == "ttft,tpot,itl" and value("--metric-percentiles") == "50,99"
    assert "--ignore-eos" in argv and "--save-result" in argv and value("--result-filename") == "r.json"


RESULT = {
    "completed": 7,
    "failed": 1,
    "num_prompts": 8,
    "duration": 2.0,
    "request_throughput": 3.5,
    "output_throughput": 56.0,
    "p50_ttft_ms": 10.0,
    "p99_ttft_ms": 30.0,
    "mean_ttft_ms": 12.0,
    "p50_tpot_ms": 2.0,
    "p99_tpot_ms": 4.0,
    "p50_itl_ms": 1.5,
    "p99_itl_ms": 9.0,
    "errors": ["", "boom\n  at x", "boom at x", ""],
}


def test_cell_from_the_clients_json() -> None:
    cell = cell_from_result(RESULT)
    assert cell["completed"] == 7 and cell["failed"] == 1 and cell["num_prompts"] == 8
    assert cell["ttft_p50_ms"] == 10.0 and cell["ttft_p99_ms"] == 30.0 and cell["ttft_mean_ms"] == 12.0
    assert cell["tpot_p99_ms"] == 4.0 and cell["itl_p50_ms"] == 1.5
    assert cell["errors"] == ["boom at x"]  # blank ones dropped, the same one once


WHY = "the system library libibverbs1 is missing (Mooncake's engine loads it)"


def test_table_says_why_a_row_did_not_run() -> None:
    report = {
        "model": "m",
        "num_prompts": 8,
        "input_len": 256,
        "output_len": 16,
        "max_concurrency": 4,
        "load_before": "load average 1.00, 1.00, 1.00 (2 cores)",
        "rate_keys": ["4"],
        "rows": {
            "plain": {"label": "plain", "status": "ok", "cells": {"4": cell_from_result(RESULT)}},
            "nixl": {"label": "nixl", "status": "failed", "reason": "decode exited", "cells": {}},
            "mooncake": {"label": "mooncake", "status": "unavailable", "reason": WHY, "cells": {}},
        },
        "failures": ["nixl: decode exited"],
    }
    text = render_serve_table(report)
    assert "FAILED: decode exited" in text and f"UNAVAILABLE: {WHY}" in text
    line = next(x for x in text.splitlines() if x.startswith("plain "))
    assert line.split()[1:5] == ["4", "7", "1", "3.50"]
    assert "FAILED: nixl: decode exited" in text


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["--serve"], "--serve needs --engine vllm"),
        (["--engine", "vllm", "--serve", "--rates", "fast"], "--rates"),
        (["--engine", "vllm", "--serve", "--input-len", "2000", "--output-len", "100"], "--input-len"),
        (["--engine", "vllm", "--serve", "--num-prompts", "0"], "--num-prompts"),
        (["--engine", "vllm", "--serve", "--lengths", "128"], "--input-len"),
        (["--engine", "vllm", "--serve", "--rows", "kvferry_shm", "--proxy", "/nonexistent/p.py"], "--proxy"),
    ],
)
def test_wrong_options_exit_2_naming_the_option(argv: list[str], named: str) -> None:
    err = io.StringIO()
    assert run(_args(*argv), out=io.StringIO(), err=err) == 2
    assert named in err.getvalue(), err.getvalue()


def _hist(e2e: tuple[float, float], ttft: tuple[float, float]) -> dict[str, float]:
    """A histogram reading: (sum s, count) of the e2e latency and the TTFT."""
    return {
        "vllm:e2e_request_latency_seconds_sum": e2e[0],
        "vllm:e2e_request_latency_seconds_count": e2e[1],
        "vllm:time_to_first_token_seconds_sum": ttft[0],
        "vllm:time_to_first_token_seconds_count": ttft[1],
    }


def test_the_mean_ttft_split_by_the_servers_histograms() -> None:
    # decode: 4 requests' TTFT took 0.2 s in all since the last reading (50 ms each); prefill:
    # 4 requests took 0.12 s (30 ms each); the client saw 100 ms: 20 ms were the hops
    decode = (_hist((9.0, 10), (1.0, 10)), _hist((9.5, 14), (1.2, 14)))
    prefill = (_hist((2.0, 7), (1.0, 7)), _hist((2.12, 11), (1.1, 11)))
    got = ttft_split(100.0, decode, prefill)
    assert got == pytest.approx({"server_ttft_ms": 50.0, "prefill_ms": 30.0, "rest_ms": 20.0})
    plain = ttft_split(60.0, decode)  # one server: its TTFT, and the client's rest
    assert plain == pytest.approx({"server_ttft_ms": 50.0, "rest_ms": 10.0})
    idle = ttft_split(60.0, (decode[0], decode[0]), prefill)  # no request counted: no figure
    assert idle["server_ttft_ms"] is None and idle["rest_ms"] is None and idle["prefill_ms"] == pytest.approx(30.0)
