"""``kvferry bench --hosts``: a tiny run end to end (namespace hosts, a shaped wire, plain TCP
and zmq, CRC-checked), and its option errors."""

from __future__ import annotations

import pathlib
from typing import Any

import pytest
from conftest import HostWorker

from kvferry.app.cli import main


def test_bench_hosts_rejects_wrong_options(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--hosts", "--reps", "0"]) == 2
    assert "--reps" in capsys.readouterr().err


class BenchEnd:
    """A bench link end forked by the session's fork server (the ``start`` the bench accepts)."""

    def __init__(self, forks: Any, tmp: pathlib.Path, host: Any, kind: str, address: str, port: int, n: int) -> None:
        args = ["bench", kind, address, port, n]
        self.worker = HostWorker(forks, host, args, tmp / f"bench-{host.label}-{kind}.log")

    def read(self, timeout_s: float = 120.0) -> dict[str, Any]:
        return self.worker.read(timeout_s)

    def go(self) -> None:
        self.worker.stdin.write("go\n")
        self.worker.stdin.flush()

    def close(self) -> None:
        try:
            self.worker.stdin.write("exit\n")  # the bench ends' own word (not a JSON command)
            self.worker.stdin.close()
        except OSError:
            pass
        self.worker.finish()


@pytest.mark.timeout(300)
def test_bench_hosts_tiny_run(forks: Any, tmp_path: pathlib.Path) -> None:
    from kvferry.app.bench.hosts import render_hosts, run_hosts_bench

    report = run_hosts_bench(("200mbit",), 4_000_000, 2, start=lambda *a: BenchEnd(forks, tmp_path, *a))
    (row,) = report["rows"]
    assert row["rate"] == "200mbit" and row["mismatches"] == 0 and len(row["tcp_s"]) == len(row["zmq_s"]) == 2
    assert all("tbf" in q and "200Mbit" in q for q in row["qdisc"]), row["qdisc"]
    # the link's rate bounds both: 4 MB at 200 Mbit/s take at least 0.16 s (a burst aside)
    assert 0.1 < row["tcp_median_s"] and 0.1 < row["zmq_median_s"], row
    assert row["tcp_gbit_s"] < 0.25 and row["zmq_gbit_s"] < 0.25, row
    assert "200mbit" in render_hosts(report)
