"""``kvferry bench --hosts``: kvferry's zmq tcp against plain TCP between two hosts (root only).

The two hosts are network namespaces joined by a veth pair shaped with a token-bucket filter
(``tc qdisc ... tbf rate R``) on both ends: a real network stack on each side, a link of a
known rate between them. For each rate, the same payload (default 235 MB: one 4096-token
Qwen2.5-7B request) goes from host A to host B by plain TCP (``sendall`` / ``recv_into``) and by
kvferry's zmq connector (``reserve`` + ``commit`` on A, ``get_blocking`` on B), repetitions
interleaved (TCP, zmq, TCP, zmq, ...) so both see the same moments of a shared machine,
after one untimed warm-up repetition of each.
Reported per rate: the median wire time of each, its throughput (Gbit/s = 1e9 bit/s) and the
ratio zmq / TCP (target >= 0.9); every repetition is checked by CRC-32 on both ends.
"""

from __future__ import annotations

import json
import os
import pathlib
import statistics
import subprocess
import sys
from collections.abc import Callable
from typing import Any

from kvferry.app.bench.netns import Host, Net, NetError, unavailable_reason

__all__ = ["RATES", "DEFAULT_NBYTES", "WorkerFactory", "run_hosts_bench", "render_hosts"]

RATES = ("1gbit", "10gbit")
DEFAULT_NBYTES = 235_000_000
TCP_PORT, ZMQ_PORT = 40001, 50151
READ_S = 300.0
#: Untimed repetitions first (page faults of fresh buffers and pools, connection start).
WARMUP = 1
WORKER = pathlib.Path(__file__).resolve().with_name("hosts_worker.py")


class _Worker:
    """A ``hosts_worker`` process inside a host; every read has a deadline (select)."""

    def __init__(self, host: Host, kind: str, address: str, port: int, nbytes: int) -> None:
        self.kind = kind
        # run by path, not as kvferry.app.bench.hosts_worker: importing kvferry.app would import
        # torch (seconds per process), which the plain TCP ends do not need
        argv = [sys.executable, str(WORKER), kind, address, str(port), str(nbytes)]
        self.proc = host.popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self.proc.stdin is not None and self.proc.stdout is not None  # both are pipes
        self.stdin, self.stdout = self.proc.stdin, self.proc.stdout

    def read(self, timeout_s: float = READ_S) -> dict[str, Any]:
        import select

        if not select.select([self.stdout], [], [], timeout_s)[0]:
            raise RuntimeError(f"{self.kind}: no answer within {timeout_s} s")
        line = self.stdout.readline()
        if not line:
            raise RuntimeError(f"{self.kind} exited with {self.proc.wait(timeout=READ_S)}")
        return json.loads(line)

    def go(self) -> None:
        self.stdin.write("go\n")
        self.stdin.flush()

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.stdin.write("exit\n")
                self.stdin.close()
            except OSError:
                pass
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=30)


#: ``start(host, kind, address, port, nbytes)`` -> a worker with ``read()``, ``go()``, ``close()``.
WorkerFactory = Callable[[Host, str, str, int, int], Any]


def _one_rate(
    rate: str, nbytes: int, reps: int, progress: Callable[[str], None], start: WorkerFactory
) -> dict[str, Any]:
    with Net("b") as net:
        a, b = net.host("a"), net.host("b")
        wire = net.wire(a, b, rate=rate)
        addr_a, addr_b = a.addresses["to-b"], b.addresses["to-a"]
        workers: list[Any] = []
        try:
            tcp_recv = start(b, "tcp-recv", addr_b, TCP_PORT, nbytes)
            workers.append(tcp_recv)
            tcp_recv.read()
            tcp_send = start(a, "tcp-send", addr_b, TCP_PORT, nbytes)
            zmq_send = start(a, "zmq-send", addr_a, ZMQ_PORT, nbytes)
            zmq_recv = start(b, "zmq-recv", addr_a, ZMQ_PORT, nbytes)
            workers += [tcp_send, zmq_send, zmq_recv]
            for w in (tcp_send, zmq_send, zmq_recv):
                w.read()
            times: dict[str, list[float]] = {"tcp": [], "zmq": []}
            mismatches = 0
            for rep in range(-WARMUP, reps):  # the first repetitions touch the buffers: untimed
                tcp_send.go()
                sent, got = tcp_send.read(), tcp_recv.read()
                tcp_s = got["t_recv"] - sent["t_send"]
                mismatches += sent["crc"] != got["crc"]
                zmq_recv.go()
                zmq_send.go()
                sent, got = zmq_send.read(), zmq_recv.read()
                zmq_s = got["t_recv"] - sent["t_send"]
                mismatches += sent["crc"] != got["crc"] or got["size"] != nbytes
                if rep < 0:
                    continue
                times["tcp"].append(tcp_s)
                times["zmq"].append(zmq_s)
                progress(f"{rate} rep {rep + 1}/{reps}: tcp {times['tcp'][-1]:.3f} s, zmq {times['zmq'][-1]:.3f} s")
            qdisc = wire.qdisc()
        finally:
            for w in reversed(workers):  # senders first: the TCP receiver ends when its peer closes
                w.close()
    tcp, zmq = statistics.median(times["tcp"]), statistics.median(times["zmq"])
    return {
        "rate": rate,
        "nbytes": nbytes,
        "reps": reps,
        "tcp_s": times["tcp"],
        "zmq_s": times["zmq"],
        "tcp_median_s": tcp,
        "zmq_median_s": zmq,
        "tcp_gbit_s": nbytes * 8 / tcp / 1e9,
        "zmq_gbit_s": nbytes * 8 / zmq / 1e9,
        "ratio": tcp / zmq,
        "mismatches": mismatches,
        "qdisc": qdisc,
    }


def run_hosts_bench(
    rates: tuple[str, ...] = RATES,
    nbytes: int = DEFAULT_NBYTES,
    reps: int = 5,
    progress: Callable[[str], None] = lambda line: None,
    start: WorkerFactory | None = None,
) -> dict[str, Any]:
    """Measure every rate; raises NetError when namespaces cannot be made (not root...).

    ``start`` makes the link's end processes (default: ``hosts_worker.py`` run inside the host
    by ``ip netns exec``); tests pass one that forks them from a process that already imported
    torch."""
    reason = unavailable_reason()
    if reason is not None:
        raise NetError(reason)
    rows = [_one_rate(rate, nbytes, reps, progress, start or _Worker) for rate in rates]
    return {"kind": "hosts", "rows": rows, "load_avg": os.getloadavg(), "cpus": os.cpu_count()}


def render_hosts(report: dict[str, Any]) -> str:
    lines = [
        f"kvferry zmq tcp vs plain TCP between two namespace hosts ({report['rows'][0]['nbytes'] / 1e6:.0f} MB, "
        f"medians of {report['rows'][0]['reps']} interleaved reps)",
        f"{'link':>8}  {'TCP s':>7}  {'TCP Gbit/s':>10}  {'zmq s':>7}  {'zmq Gbit/s':>10}  {'zmq/TCP':>7}  {'bad':>3}",
    ]
    for r in report["rows"]:
        lines.append(
            f"{r['rate']:>8}  {r['tcp_median_s']:7.3f}  {r['tcp_gbit_s']:10.2f}  {r['zmq_median_s']:7.3f}  "
            f"{r['zmq_gbit_s']:10.2f}  {r['ratio']:7.2f}  {r['mismatches']:>3}"
        )
    lines.append(f"load average {', '.join(f'{x:.1f}' for x in report['load_avg'])} on {report['cpus']} CPUs")
    return "\n".join(lines)
