"""The zmq connector between real processes, over tcp and ipc.

The test process drives workers (this file run as a script) through JSON lines on their
stdin/stdout, so every step is synchronised by a message, never by a sleep.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

import pytest

if __name__ == "__main__":  # run as a worker: tests/ (jsonlines, warm_spawn) is not on the path
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from jsonlines import Channel, commands, say  # noqa: E402

from kvferry.adapters.platform import free_port  # noqa: E402

N_PAYLOADS = 8
WAIT = 30.0


# ----------------------------------------------------------------------------- payloads


def expected_frames(index: int) -> list[Any]:
    """Payload ``index``: a header and two tensors (float32 and bfloat16), deterministic."""
    import torch

    gen = torch.Generator().manual_seed(1000 + index)
    keys = torch.randn(96 + index, 4, 64, generator=gen)
    values = torch.randn(96 + index, 4, 64, generator=gen).to(torch.bfloat16)
    header = json.dumps({"i": index, "shape": list(keys.shape)}).encode()
    return [header, keys, values]


def big_payload(index: int, nbytes: int) -> Any:
    """Streamed payload ``index`` (larger than chunk_bytes): deterministic uint8 tensor."""
    import torch

    gen = torch.Generator().manual_seed(2000 + index)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)


def minor_faults() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def frame_bytes(frames: list[Any]) -> list[bytes]:
    import torch

    out = []
    for frame in frames:
        if isinstance(frame, torch.Tensor):
            frame = frame.contiguous().view(torch.uint8).numpy()
        out.append(bytes(memoryview(frame).cast("B")))
    return out


# ----------------------------------------------------------------------------- workers


def _wait_for(predicate, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    pause = threading.Event()
    while not predicate():
        if time.monotonic() >= deadline:
            return False
        pause.wait(0.002)
    return True


def sender_main(config: dict) -> None:
    """Bind, report metadata, then on each command: ``put`` (after ``parked`` receivers wait)
    or ``exit``."""
    from kvferry.adapters.connectors.zmq.connector import ZmqConnector

    with ZmqConnector(config) as conn:
        say({"ready": conn.sender_metadata()})
        for command in commands():
            if command["op"] == "put_big":
                say(put_big(conn, command["count"], command["nbytes"]))
                continue
            parked = _wait_for(lambda: conn.health()["sender"]["parked"] >= command["parked"], WAIT)
            results = [conn.put("0", "1", f"req{i}_0_0_0_0", expected_frames(i))[0] for i in range(command["count"])]
            say({"put": sum(results), "parked_first": parked})


def put_big(conn: Any, count: int, nbytes: int) -> dict:
    """Reserve, fill and commit ``count`` big payloads one at a time, each once the receiver
    waits for it and the previous one left the pool; page faults counted after the first."""
    faults, ok = 0, 0
    for i in range(count):
        source = big_payload(i, nbytes)
        _wait_for(lambda: conn.health()["sender"]["parked"] >= 1, WAIT)
        before = minor_faults()
        reservation = conn.reserve("0", "1", f"big{i}_0_0_0_0", nbytes)
        reservation.buffer.copy_(source)
        ok += reservation.commit()[0]
        if i:
            faults += minor_faults() - before
        _wait_for(lambda: conn.health()["sender"]["held_payloads"] == 0, WAIT)  # read, sent
    health = conn.health()["sender"]
    per_mb = faults / ((count - 1) * nbytes / 1e6)
    return {"put": ok, "streams": health["streams"], "faults_per_mb": per_mb}


def big_receiver_main(config: dict, metadata: dict, count: int, nbytes: int) -> None:
    """Get ``count`` streamed payloads; report bit-exactness, that each arrived as one view of
    the receive pool (the same region every time) and page faults after the first."""
    import zlib

    import numpy as np

    from kvferry.adapters.connectors.zmq.connector import ZmqConnector

    mismatches, addresses, faults = [], set(), 0
    # the expected checksums first: a 12 MB payload built between two gets would move this
    # process's heap (glibc's thresholds) and count the test's own faults as the connector's
    expected = [zlib.crc32(big_payload(i, nbytes).numpy()) for i in range(count)]
    with ZmqConnector(config) as conn:
        say({"waiting": True})
        for i in range(count):
            before = minor_faults()
            got = conn.get_blocking("0", "1", f"big{i}_0_0_0_0", metadata, timeout_s=WAIT)
            if got is None or len(got[0]) != 1:
                mismatches.append(f"{i}: {'nothing' if got is None else len(got[0])} frames")
                continue
            if i:
                faults += minor_faults() - before
            view = got[0][0]
            if zlib.crc32(view) != expected[i]:
                mismatches.append(f"{i}: bytes differ")
            addresses.add(int(np.frombuffer(view, dtype=np.uint8).ctypes.data))
            del got, view  # the region goes back to the pool
        health = conn.health()["receiver"]
        say(
            {
                "mismatches": mismatches,
                "regions": len(addresses),
                "streams": health["streams"],
                "faults_per_mb": faults / ((count - 1) * nbytes / 1e6),
            }
        )


def receiver_main(config: dict, metadata: dict, count: int) -> None:
    """Get ``count`` payloads with blocking gets; report bit-exactness and zero-copy views."""
    import numpy as np
    import torch

    from kvferry.adapters.connectors.zmq.connector import ZmqConnector

    mismatches, zero_copy = [], True
    with ZmqConnector(config) as conn:
        say({"waiting": True})
        for i in range(count):
            got = conn.get_blocking("0", "1", f"req{i}_0_0_0_0", metadata, timeout_s=WAIT)
            if got is None:
                mismatches.append(f"{i}: nothing")
                continue
            frames, size = got
            if [bytes(f) for f in frames] != frame_bytes(expected_frames(i)):
                mismatches.append(f"{i}: bytes differ")
            view = torch.frombuffer(frames[1], dtype=torch.float32)
            start = np.frombuffer(frames[1], dtype=np.uint8).ctypes.data
            zero_copy &= start <= view.data_ptr() < start + frames[1].nbytes
        say({"mismatches": mismatches, "zero_copy": bool(zero_copy), "hits": conn.health()["hits"]})


# ----------------------------------------------------------------------------- harness


class Worker:
    """A worker process spoken to in JSON lines; every read has a deadline."""

    def __init__(self, *args: str) -> None:
        import warm_spawn  # here: this file also runs as the worker, where tests/ is not on the path

        self.proc = warm_spawn.popen(
            [__file__, *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=os.path.dirname(__file__),
        )
        self.channel = Channel(self.proc, f"worker {self.proc.pid}")

    def read(self, timeout_s: float = WAIT) -> dict:
        return self.channel.read(timeout_s)

    def send(self, obj: dict) -> None:
        self.channel.send(obj)

    def finish(self) -> int:
        if self.proc.poll() is None and not self.proc.stdin.closed:
            try:
                self.send({"op": "exit"})
            except BrokenPipeError:
                pass
        try:
            return self.proc.wait(timeout=WAIT)
        finally:
            self.channel.close(WAIT)

    def kill(self) -> None:
        self.proc.kill()
        self.finish()


@pytest.fixture
def ipc_dir():
    path = tempfile.mkdtemp(prefix="zqp", dir="/tmp")
    yield path
    shutil.rmtree(path, ignore_errors=True)


def sender_config(transport: str, ipc_dir: str, port: int) -> dict:
    return {"role": "sender", "transport": transport, "ipc_dir": ipc_dir, "port": port}


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", ["tcp", "ipc"])
def test_payloads_cross_processes_bit_exact(transport, ipc_dir):
    port = 0 if transport == "tcp" else free_port()
    sender = Worker("sender", json.dumps(sender_config(transport, ipc_dir, port)))
    receiver = None
    try:
        metadata = sender.read()["ready"]
        assert metadata["transport"] == transport
        if transport == "tcp":
            assert metadata["source_host"] == "127.0.0.1" and metadata["source_port"] > 0
        else:
            assert os.path.exists(metadata["ipc_path"])
        rx_config = {"role": "receiver", "transport": transport, "ipc_dir": ipc_dir}
        receiver = Worker("receiver", json.dumps(rx_config), json.dumps(metadata), str(N_PAYLOADS))
        assert receiver.read() == {"waiting": True}
        sender.send({"op": "put", "count": N_PAYLOADS, "parked": 1})
        assert sender.read() == {"put": N_PAYLOADS, "parked_first": True}
        result = receiver.read()
        assert result == {"mismatches": [], "zero_copy": True, "hits": N_PAYLOADS}
        assert receiver.finish() == 0
        assert sender.finish() == 0
        if transport == "ipc":
            assert not os.path.exists(metadata["ipc_path"])  # removed on close
    finally:
        for worker in (receiver, sender):
            if worker is not None and worker.proc.poll() is None:
                worker.kill()


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", ["tcp", "ipc"])
def test_sender_crash_then_restart_on_the_same_endpoint(transport, ipc_dir):
    from kvferry.adapters.connectors.zmq.connector import ZmqConnector
    from kvferry.core.errors import SenderUnavailable

    port = free_port()
    config = sender_config(transport, ipc_dir, port)
    first = Worker("sender", json.dumps(config))
    second = None
    rx_config = {"role": "receiver", "transport": transport, "ipc_dir": ipc_dir}
    try:
        metadata = first.read()["ready"]
        with ZmqConnector(rx_config) as receiver:
            first.send({"op": "put", "count": 1, "parked": 0})
            assert first.read()["put"] == 1
            got = receiver.get_blocking("0", "1", "req0_0_0_0_0", metadata, timeout_s=WAIT)
            assert got is not None and [bytes(f) for f in got[0]] == frame_bytes(expected_frames(0))
            first.kill()  # no close: an ipc socket file stays behind
            started = time.monotonic()
            # the receiver may not have seen the connection drop when it asks: then the request
            # leaves on it and fails at once when the drop is seen (lost in flight); else it
            # waits, the sender down within the grace, until its 1 s deadline (a timeout).
            # Both are the connector's word, and both end well before the grace
            try:
                assert receiver.get_blocking("0", "1", "req1_0_0_0_0", metadata, timeout_s=1.0) is None
                lost = False
            except SenderUnavailable:
                lost = True
            assert time.monotonic() - started < 5.0
            second = Worker("sender", json.dumps(config))
            assert second.read()["ready"] == metadata  # same endpoint, stale file replaced
            second.send({"op": "put", "count": 2, "parked": 0})
            assert second.read()["put"] == 2
            got = receiver.get_blocking("0", "1", "req1_0_0_0_0", metadata, timeout_s=WAIT)
            assert got is not None and [bytes(f) for f in got[0]] == frame_bytes(expected_frames(1))
            health = receiver.health()
            counts = (health["timeouts"], health["receiver"]["lost_in_flight"])
            assert counts == ((0, 1) if lost else (1, 0)), health
        assert second.finish() == 0
    finally:
        for worker in (second, first):
            if worker is not None and worker.proc.poll() is None:
                worker.kill()


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", ["tcp", "ipc"])
def test_big_payloads_stream_between_processes_into_reused_pools(transport, ipc_dir):
    """Payloads larger than chunk_bytes are streamed: bit-exact, one view of the receiver's
    pool (the same region each time), and after the first one neither side page-faults."""
    count, nbytes = 4, 12 << 20
    port = 0 if transport == "tcp" else free_port()
    config = {**sender_config(transport, ipc_dir, port), "chunk_bytes": 1 << 20}
    sender = Worker("sender", json.dumps(config))
    receiver = None
    try:
        metadata = sender.read()["ready"]
        rx_config = {"role": "receiver", "transport": transport, "ipc_dir": ipc_dir}
        receiver = Worker("big", json.dumps(rx_config), json.dumps(metadata), str(count), str(nbytes))
        assert receiver.read() == {"waiting": True}
        sender.send({"op": "put_big", "count": count, "nbytes": nbytes})
        sent = sender.read(timeout_s=WAIT * 2)
        got = receiver.read()
        assert (sent["put"], sent["streams"]) == (count, count)
        assert (got["mismatches"], got["regions"], got["streams"]) == ([], 1, count)
        assert sent["faults_per_mb"] < 10 and got["faults_per_mb"] < 10, (sent, got)
        assert receiver.finish() == 0
        assert sender.finish() == 0
    finally:
        for worker in (receiver, sender):
            if worker is not None and worker.proc.poll() is None:
                worker.kill()


if __name__ == "__main__":
    role, raw_config = sys.argv[1], json.loads(sys.argv[2])
    if role == "sender":
        sender_main(raw_config)
    elif role == "big":
        big_receiver_main(raw_config, json.loads(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]))
    else:
        receiver_main(raw_config, json.loads(sys.argv[3]), int(sys.argv[4]))
