"""One end of a ``kvferry bench --hosts`` link, run inside a namespace host.

``python .../kvferry/app/bench/hosts_worker.py KIND ADDRESS PORT NBYTES`` (run by path: the
plain TCP ends then import nothing of kvferry), KIND one of
``tcp-send``, ``tcp-recv``, ``zmq-send``, ``zmq-recv``. It says ``{"ready": ...}`` on stdout,
then does one repetition per ``go`` line on stdin and answers with a JSON line; ``exit`` (or
end of input) ends it.

Both kinds move the same ``NBYTES`` payload one way over the link and report the monotonic
clock (one clock for every namespace of the machine) at their end of the transfer, so the
orchestrator's ``t_recv - t_send`` is the wire time of that repetition:

- plain TCP: the sender writes the payload with ``sendall`` from one buffer, the receiver reads
  it with ``recv_into`` into one preallocated buffer and answers one byte, so repetitions do not
  overlap. ``t_send`` is taken just before ``sendall``, ``t_recv`` after the last byte arrived.
- kvferry zmq tcp: the sender's payload already sits in its pool (``reserve`` + fill, as the
  manager's extraction writes it), ``t_send`` is taken just before ``commit``; the receiver is
  parked in ``get_blocking`` (the sender waits for that before committing) and takes
  ``t_recv`` when the payload is in its hands (one view of its receive pool).

Each answer carries a CRC-32 of the bytes sent or received (computed outside the clock).
"""

from __future__ import annotations

import json
import socket
import sys
import threading
import time
import zlib
from typing import Any

__all__ = ["main"]

#: Deadline for one repetition's peer (seconds).
PEER_S = 120.0


def _say(obj: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def _commands() -> Any:
    for line in sys.stdin:
        command = line.strip()
        if command in ("", "exit"):
            return
        yield command


def _pattern(nbytes: int, rep: int) -> bytearray:
    """A payload that differs per repetition (so a stale buffer cannot pass the CRC check)."""
    block = bytes((i * 131 + rep * 7) & 0xFF for i in range(4096))
    data = bytearray(block * (nbytes // len(block) + 1))[:nbytes]
    return data


def tcp_send(address: str, port: int, nbytes: int) -> None:
    sock = socket.create_connection((address, port), timeout=PEER_S)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    _say({"ready": "tcp-send"})
    ack = bytearray(1)
    for rep, _ in enumerate(_commands()):
        data = _pattern(nbytes, rep)
        crc = zlib.crc32(data)
        t_send = time.monotonic()
        sock.sendall(data)
        if sock.recv_into(ack, 1) != 1:
            raise SystemExit("tcp-send: the receiver closed the connection")
        _say({"rep": rep, "t_send": t_send, "crc": crc})
    sock.close()


def tcp_recv(address: str, port: int, nbytes: int) -> None:
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind((address, port))
    server.listen(1)
    server.settimeout(PEER_S)
    _say({"ready": "tcp-recv"})
    conn, _ = server.accept()
    conn.settimeout(PEER_S)
    buf = bytearray(nbytes)
    view = memoryview(buf)
    rep = 0
    while True:
        got = 0
        while got < nbytes:
            n = conn.recv_into(view[got:], nbytes - got)
            if n == 0:
                conn.close()
                server.close()
                return
            got += n
        t_recv = time.monotonic()
        conn.sendall(b"k")
        _say({"rep": rep, "t_recv": t_recv, "crc": zlib.crc32(buf)})
        rep += 1


def _wait_until(predicate: Any, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    pause = threading.Event()
    while not predicate():
        if time.monotonic() >= deadline:
            return False
        pause.wait(0.001)
    return True


def zmq_send(address: str, port: int, nbytes: int) -> None:
    import torch

    from kvferry.adapters.connectors.zmq.connector import ZmqConnector

    config = {"role": "sender", "host": address, "port": port, "pool_bytes": nbytes + (16 << 20), "prefault": True}
    with ZmqConnector.from_config(config) as conn:
        _say({"ready": "zmq-send"})
        for rep, _ in enumerate(_commands()):
            data = _pattern(nbytes, rep)
            if not _wait_until(lambda: conn.health()["sender"]["parked"] >= 1, PEER_S):
                raise SystemExit("zmq-send: no receiver waited")
            reservation = conn.reserve("0", "1", f"bench-{rep}", nbytes)
            reservation.buffer.copy_(torch.frombuffer(data, dtype=torch.uint8))
            crc = zlib.crc32(data)
            t_send = time.monotonic()
            ok = reservation.commit()[0]
            sent = _wait_until(lambda: conn.health()["sender"]["held_payloads"] == 0, PEER_S)
            _say({"rep": rep, "t_send": t_send, "crc": crc, "ok": bool(ok and sent)})


def zmq_recv(address: str, port: int, nbytes: int) -> None:
    from kvferry.adapters.connectors.zmq.connector import ZmqConnector

    meta = {"source_host": address, "source_port": port}
    with ZmqConnector.from_config({"role": "receiver", "recv_pool_bytes": nbytes + (16 << 20)}) as conn:
        _say({"ready": "zmq-recv"})
        for rep, _ in enumerate(_commands()):
            got = conn.get_blocking("0", "1", f"bench-{rep}", meta, timeout_s=PEER_S)
            t_recv = time.monotonic()
            if got is None:
                _say({"rep": rep, "t_recv": t_recv, "crc": None, "size": 0})
                continue
            frames, size = got
            crc = 0
            for frame in frames:
                crc = zlib.crc32(frame, crc)
            _say({"rep": rep, "t_recv": t_recv, "crc": crc, "size": size})
            del got, frames


def main(argv: list[str]) -> None:
    kind, address, port, nbytes = argv[0], argv[1], int(argv[2]), int(argv[3])
    run = {"tcp-send": tcp_send, "tcp-recv": tcp_recv, "zmq-send": zmq_send, "zmq-recv": zmq_recv}.get(kind)
    if run is None:
        raise SystemExit(f"unknown kind {kind!r}")
    run(address, port, nbytes)


if __name__ == "__main__":
    main(sys.argv[1:])
