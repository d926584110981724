"""Whole pipelines between real processes, through :func:`kvferry.app.demo.command.run_demo`.

A sender stage of ``from_tp`` processes and a receiver stage of ``to_tp`` processes (gloo
groups inside each stage, TP consensus on the receivers) move every request over a real
connector; every receiver rank compares every tensor with the sender's synthetic cache bit for
bit. Geometry is tiny (2 layers, 8 KV heads, head_dim 16, block 16, 8-64 tokens) so that the
cost is the processes, not the bytes.
"""

from __future__ import annotations

import os
import pathlib
import time
from typing import Any

import pytest
from nixl_support import nixl_missing
from stage_worker import make_spec

from kvferry.app.demo.command import DemoReport, run_demo

TOPOLOGIES = [(1, 1), (1, 2), (2, 4), (4, 2), (2, 1), (4, 8)]
CONNECTORS = ["zmq-tcp", "zmq-ipc", "shm"]
#: Routing does not depend on the connector: zmq-tcp runs every topology, zmq-ipc and shm one
#: fan-out and one fan-in (each process costs ~2.5 CPU-seconds of imports). The other cells run
#: with KVFERRY_IT_FULL_MATRIX=1.
FULL_MATRIX = os.environ.get("KVFERRY_IT_FULL_MATRIX") == "1"
DEFAULT_CELLS = {("zmq-tcp", t) for t in TOPOLOGIES} | {(c, t) for c in CONNECTORS for t in ((2, 4), (4, 2))}


#: The nixl connector runs one fan-out and one fan-in where nixl is installed (.ci/run: the vLLM venv).
needs_nixl = pytest.mark.skipif(nixl_missing() is not None, reason=str(nixl_missing()))


def _cells() -> list[Any]:
    out = [
        pytest.param("nixl", from_tp, to_tp, marks=[needs_nixl], id=f"nixl-tp{from_tp}to{to_tp}")
        for from_tp, to_tp in ((2, 4), (4, 2))
    ]
    for connector in CONNECTORS:
        for from_tp, to_tp in TOPOLOGIES:
            marks = (
                []
                if FULL_MATRIX or (connector, (from_tp, to_tp)) in DEFAULT_CELLS
                else [pytest.mark.skip(reason="connector-independent routing; set KVFERRY_IT_FULL_MATRIX=1")]
            )
            out.append(pytest.param(connector, from_tp, to_tp, marks=marks, id=f"{connector}-tp{from_tp}to{to_tp}"))
    return out


def _spec(
    itkit: Any,
    tmp_path: pathlib.Path,
    connector: str,
    from_tp: int,
    to_tp: int,
    requests: int,
    namespace: str,
    **extra: object,
) -> Any:
    return make_spec(
        connector=connector,
        from_tp=from_tp,
        to_tp=to_tp,
        requests=requests,
        base_port=itkit.free_base_port(from_tp),
        store_ports=(itkit.free_port(), itkit.free_port()),
        namespace=namespace,
        done_file=str(tmp_path / "done"),
        **extra,
    )


def _assert_all_exact(report: DemoReport, requests: int) -> None:
    assert report.errors == (), report.errors
    assert report.outcomes == {"received": requests}, report.outcomes
    assert report.requests == requests and report.bit_exact == requests
    assert report.bytes > 0 and report.ok


@pytest.mark.slow
@pytest.mark.timeout(150)
@pytest.mark.parametrize("connector,from_tp,to_tp", _cells())
def test_pipeline_is_bit_exact(
    connector: str,
    from_tp: int,
    to_tp: int,
    tmp_path: pathlib.Path,
    shm_namespace: str,
    itkit: Any,
    warm_mp_context: Any,
) -> None:
    spec = _spec(itkit, tmp_path, connector, from_tp, to_tp, 6, shm_namespace)
    report = run_demo(spec, mp_context=warm_mp_context)
    _assert_all_exact(report, 6)
    receivers = [r for r in report.routing if r.get("role") == "receiver"]
    assert len(receivers) == to_tp  # the report describes every receiver rank's routing
    if connector == "shm":
        assert itkit.shm_entries(shm_namespace) == []


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_acceptance_200_requests_two_senders_four_receivers(
    tmp_path: pathlib.Path, shm_namespace: str, itkit: Any, warm_mp_context: Any
) -> None:
    """The issue's acceptance test: 2 sender processes, 4 receiver processes, 200 requests over
    zmq, zero mismatches and zero hangs (every receive ends before its deadline)."""
    spec = _spec(itkit, tmp_path, "zmq-tcp", 2, 4, 200, shm_namespace, min_tokens=4, max_tokens=48)
    report = run_demo(spec, mp_context=warm_mp_context)
    _assert_all_exact(report, 200)
    assert report.latency_ms_p99 < spec.timeout_s * 1e3  # no request waited out its deadline


@pytest.mark.slow
@pytest.mark.timeout(90)  # the run's own deadline is 120 s + twice the receive timeout
def test_a_rank_that_cannot_start_fails_the_run_instead_of_hanging_it(
    tmp_path: pathlib.Path, shm_namespace: str, itkit: Any, warm_mp_context: Any
) -> None:
    """The sender's port is taken, so its connector cannot start and that rank fails; the
    receiver would wait for KV that never comes. The run ends with the sender's error and the
    receiver stopped, well before the receive deadline, and reports nothing received."""
    import socket

    spec = _spec(itkit, tmp_path, "zmq-tcp", 1, 1, 2, shm_namespace, timeout_s=40.0)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as squatter:
        squatter.bind(("127.0.0.1", spec.advertised_port))
        squatter.listen(1)
        started = time.monotonic()
        report = run_demo(spec, mp_context=warm_mp_context, after_error_s=1.0)
        seconds = time.monotonic() - started
    assert not report.ok and report.bit_exact == 0
    assert seconds < spec.timeout_s, seconds  # stopped after the error, not at the receive deadline
    assert any(e.startswith("sender rank 0:") for e in report.errors), report.errors
    assert "received" not in report.outcomes, report.outcomes


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_the_demo_command_runs_and_reports_json(
    capsys: pytest.CaptureFixture[str], tmp_path: pathlib.Path, itkit: Any
) -> None:
    """``kvferry demo --json`` end to end (the README's first command, with a tiny geometry):
    it picks its own ports, runs both stages (fresh interpreters, as a user's run starts them;
    TP 1 -> 2 keeps that to three) and prints one JSON object; exit 0."""
    import glob
    import json
    import tempfile

    from kvferry.app.cli import main

    scratch = os.path.join(tempfile.gettempdir(), "kvferry-demo-*")
    before = set(glob.glob(scratch))
    code = main(
        [
            "demo",
            "--connector",
            "shm",
            "--from-tp",
            "1",
            "--to-tp",
            "2",
            "--requests",
            "4",
            "--layers",
            "2",
            "--kv-heads",
            "4",
            "--head-dim",
            "16",
            "--min-tokens",
            "8",
            "--max-tokens",
            "40",
            "--json",
            "--dump",
            str(tmp_path / "dump"),
        ]
    )
    doc = json.loads(capsys.readouterr().out)
    assert code == 0, doc
    assert doc["requests"] == 4 and doc["bit_exact"] == 4 and doc["outcomes"] == {"received": 4}
    assert doc["bytes"] > 0 and doc["seconds"] > 0 and doc["errors"] == []
    assert any((tmp_path / "dump").iterdir())  # payload files for `kvferry inspect`
    assert set(glob.glob(scratch)) <= before  # the run's scratch folder is gone


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "argv",
    [
        ["--model", "qwen2.5-7b", "--from-tp", "2", "--to-tp", "8"],  # 4 KV heads: each on 2 receivers
        ["--model", "qwen2.5-7b", "--from-tp", "8", "--to-tp", "2"],  # replicated senders, fan-in
        ["--model", "deepseek-v2-lite"],  # MLA latent, TP 2 -> 4
    ],
)
def test_the_demo_moves_real_geometries_bit_exact_across_processes(
    capsys: pytest.CaptureFixture[str], tmp_path: pathlib.Path, argv: list[str], warm_mp_context: Any
) -> None:
    """Replicated heads and MLA latents, one process per rank over shared memory; each receiver
    checks its tensors against the model's per-head (or latent) bits, not the senders' caches.
    The command's own arguments, parsed by its parser; the ranks start from the warm forkserver
    (the spawn path of the command line is run end to end by the test above)."""
    import json

    from kvferry.app.cli import build_parser
    from kvferry.app.demo import command

    parser, _ = build_parser()
    args = parser.parse_args(["demo", "--connector", "shm", *argv, "--layers", "2", "--requests", "3",
                              "--min-tokens", "8", "--max-tokens", "40", "--json",
                              "--dump", str(tmp_path / "dump")])  # fmt: skip
    code = command.run(args, mp_context=warm_mp_context)
    doc = json.loads(capsys.readouterr().out)
    assert code == 0, doc
    assert doc["requests"] == 3 and doc["bit_exact"] == 3 and doc["outcomes"] == {"received": 3}, doc
    receivers = [r for r in doc["routing"] if r["role"] == "receiver"]
    assert all(len(r["keys"]) >= 1 for r in receivers)
