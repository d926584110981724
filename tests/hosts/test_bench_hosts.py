"""``kvferry bench --hosts``: a tiny run end to end (namespace hosts, a shaped wire, plain TCP
and zmq, CRC-checked), and its option errors."""

from __future__ import annotations

import io
import json

import pytest
from conftest import require_namespaces

from kvferry.app.cli import main


def test_bench_hosts_rejects_wrong_options(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--hosts", "--reps", "0"]) == 2
    assert "--reps" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_bench_hosts_tiny_run(tmp_path: pytest.TempPathFactory) -> None:
    require_namespaces()
    from kvferry.app.bench.command import run_hosts

    out, err = io.StringIO(), io.StringIO()
    args = type("Args", (), {})()
    args.rates, args.nbytes, args.reps, args.quiet, args.json = "200mbit", 4_000_000, 2, True, str(tmp_path / "h.json")
    assert run_hosts(args, out, err) == 0, err.getvalue()
    report = json.loads((tmp_path / "h.json").read_text())
    (row,) = report["rows"]
    assert row["rate"] == "200mbit" and row["mismatches"] == 0 and len(row["tcp_s"]) == len(row["zmq_s"]) == 2
    assert all("tbf" in q and "200Mbit" in q for q in row["qdisc"]), row["qdisc"]
    # the link's rate bounds both: 4 MB at 200 Mbit/s take at least 0.16 s (a burst aside)
    assert 0.1 < row["tcp_median_s"] and 0.1 < row["zmq_median_s"], row
    assert row["tcp_gbit_s"] < 0.25 and row["zmq_gbit_s"] < 0.25, row
    assert "200mbit" in out.getvalue()
