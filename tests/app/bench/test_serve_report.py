"""``kvferry bench --engine vllm --serve`` without vLLM: its options, each row's
``--kv-transfer-config``, the client's command line, a cell from the client's JSON and the
summary table (skipped and failed rows say why)."""

from __future__ import annotations

import argparse
import io
import math
from pathlib import Path

import pytest

from kvferry.app.bench.command import configure, run
from kvferry.app.bench.engine.serve import (
    MOONCAKE_PROXY,
    ROWS,
    cell_from_result,
    client_argv,
    kv_config,
    parse_rates,
    parse_serve_rows,
    rate_key,
    render_serve_table,
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
            "mooncake": {"label": "mooncake", "status": "unavailable", "reason": MOONCAKE_PROXY, "cells": {}},
        },
        "failures": ["nixl: decode exited"],
    }
    text = render_serve_table(report)
    assert "FAILED: decode exited" in text and f"UNAVAILABLE: {MOONCAKE_PROXY}" in text
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
