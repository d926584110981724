"""A benchmark peer process: sender or receiver side of every cross-process measurement.

Run as ``python -m kvferry.app.bench.worker``; the channel is described in
:mod:`kvferry.app.bench.proc`. Commands are the ``cmd_*`` methods of :class:`Worker`; each
takes JSON-able keyword arguments and returns a JSON-able dict. Receive commands announce
``ready`` right before they start waiting, so the orchestrator starts the sender only once the
receiver waits.

Timestamps are ``time.monotonic()`` seconds (CLOCK_MONOTONIC on Linux: one clock for every
process of the machine, so a sender's and a receiver's stamps can be subtracted). Page faults
are ``getrusage`` minor + major fault deltas of the whole process (all threads).
"""

from __future__ import annotations

import logging
import os
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

import attrs

from kvferry.app.bench.proc import PARENT_ENV
from kvferry.app.bench.worker_kv import GetWaits, KvCommands, cpu_s, faults, memory_kb, reset_peak_rss

__all__ = ["Worker", "main", "end_with_parent", "faults", "memory_kb", "reset_peak_rss"]

logger = logging.getLogger(__name__)


@attrs.define(eq=False)
class Worker(KvCommands):
    """State of one peer: caches, sockets, connectors and managers by name."""

    announce: Callable[[], None] = lambda: None
    caches: dict[str, Any] = attrs.field(factory=dict)
    connectors: dict[str, Any] = attrs.field(factory=dict)
    managers: dict[str, dict[int, Any]] = attrs.field(factory=dict)
    put_stamps: list = attrs.field(factory=list)
    plan_geometries: dict[tuple[str, Any], Any] = attrs.field(factory=dict)
    get_waits: GetWaits = attrs.field(factory=GetWaits)
    kinds: dict[str, str] = attrs.field(factory=dict)
    socket: Any = None
    context: Any = None
    raw_buffer: Any = None
    tcp_listener: Any = None
    tcp: Any = None
    tcp_buffer: Any = None
    bell: Any = None

    # ------------------------------------------------------------------ setup and memory
    def cmd_setup(
        self, name: str, geometry: dict, requests: int, seed: int, huge_pages: bool = False
    ) -> dict[str, Any]:
        """Build cache ``name``; with ``huge_pages`` moved onto huge pages (``huge_pages`` in the
        answer: what was done)."""
        from kvferry.app.bench.model import Geometry
        from kvferry.app.bench.payload import make_paged_cache

        fields = {k: geometry[k] for k in ("layers", "tokens", "heads", "head_dim", "dtype", "block_size")}
        cache = make_paged_cache(Geometry(**fields), requests, seed=seed, huge_pages=huge_pages)
        self.caches[name] = cache
        huge = cache.describe_huge_pages()
        return {"blocks": cache.num_blocks, "huge_pages": huge, **memory_kb()}

    def cmd_rss_reset(self) -> dict[str, Any]:
        return {"reset": reset_peak_rss(), **memory_kb()}

    def cmd_rss_peak(self) -> dict[str, Any]:
        return memory_kb()

    def cmd_cpus(self) -> dict[str, Any]:
        """The CPUs this process may run on (None where the OS has no CPU affinity)."""
        getter = getattr(os, "sched_getaffinity", None)
        return {"cpus": None if getter is None else sorted(getter(0))}

    def cmd_cpu(self) -> dict[str, Any]:
        """CPU seconds of this process so far (every thread: a connector's serving thread too)."""
        return {"cpu_s": cpu_s()}

    def cmd_expected_crc(self, cache: str, request: int, heads: list[int] | None = None) -> dict[str, Any]:
        """crc32 of what kvferry should deliver for ``request`` (optionally a head range);
        ``cache`` may name a view, ``"main:latent"`` (see ``payload.CACHE_VIEWS``)."""
        from kvferry.app.bench.payload import kv_crc, plan_request

        name, _, view = cache.partition(":")
        plan = plan_request(
            self.caches[name],
            request,
            request_id="crc",
            heads=None if heads is None else (heads[0], heads[1]),
            view=view or None,
        )
        keys, values = plan.materialize()
        return {"crc": kv_crc(keys, values)}

    # ------------------------------------------------------------------ PUSH/PULL pair
    def _zmq(self) -> Any:
        import zmq

        if self.context is None:
            self.context = zmq.Context()
        return zmq

    def cmd_push_bind(self, nbytes: int) -> dict[str, Any]:
        """Bind a PUSH socket on loopback (OS-chosen port); hold a touched ``nbytes`` buffer."""
        import torch

        zmq = self._zmq()
        self.socket = self.context.socket(zmq.PUSH)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.bind("tcp://127.0.0.1:0")
        self.raw_buffer = torch.full((nbytes,), 7, dtype=torch.uint8)
        return {"endpoint": self.socket.getsockopt(zmq.LAST_ENDPOINT).decode()}

    def cmd_pull_connect(self, endpoint: str) -> dict[str, Any]:
        zmq = self._zmq()
        self.socket = self.context.socket(zmq.PULL)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.connect(endpoint)
        return {}

    def cmd_raw_send(self) -> dict[str, Any]:
        t_go = time.monotonic()
        self.socket.send(memoryview(self.raw_buffer.numpy()), copy=False)
        return {"t_go": t_go, "t_end": time.monotonic()}

    def cmd_raw_recv(self, timeout_s: float) -> dict[str, Any]:
        from kvferry.core.errors import TransferTimeout

        self.announce()
        c0 = cpu_s()
        if not self.socket.poll(int(timeout_s * 1000)):
            raise TransferTimeout(f"raw zmq: nothing within {timeout_s} s")
        frame = self.socket.recv(copy=False)
        t_done = time.monotonic()
        return {"t_done": t_done, "nbytes": len(frame.buffer), "cpu_s": cpu_s() - c0}

    # ------------------------------------------------------------------ raw TCP stream pair
    def cmd_tcp_listen(self, nbytes: int) -> dict[str, Any]:
        """Listen on loopback TCP (OS-chosen port); hold a touched ``nbytes`` buffer to send."""
        import socket

        import torch

        self.tcp_listener = socket.create_server(("127.0.0.1", 0))
        self.tcp_buffer = torch.full((nbytes,), 7, dtype=torch.uint8)
        host, port = self.tcp_listener.getsockname()[:2]
        return {"host": host, "port": port}

    def cmd_tcp_connect(self, host: str, port: int, nbytes: int, timeout_s: float) -> dict[str, Any]:
        """Connect to a listening peer; allocate and touch the ``nbytes`` buffer every receive reuses."""
        import socket

        import torch

        self.tcp = socket.create_connection((host, port), timeout=timeout_s)
        self.tcp.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.tcp_buffer = torch.zeros(nbytes, dtype=torch.uint8)  # zeros are written: every page touched
        return {}

    def cmd_tcp_accept(self, timeout_s: float) -> dict[str, Any]:
        import socket

        self.tcp_listener.settimeout(timeout_s)
        self.tcp, _ = self.tcp_listener.accept()
        self.tcp.settimeout(timeout_s)
        self.tcp.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.tcp_listener.close()
        self.tcp_listener = None
        return {}

    def cmd_tcp_send(self) -> dict[str, Any]:
        """``sendall`` the held buffer (the kernel's stream limit: no framing, no allocation)."""
        t_go = time.monotonic()
        self.tcp.sendall(memoryview(self.tcp_buffer.numpy()))
        return {"t_go": t_go, "t_end": time.monotonic()}

    def cmd_tcp_recv(self, timeout_s: float) -> dict[str, Any]:
        """``recv_into`` the reused buffer until it is full; the first and last byte must be the sent ones."""
        from kvferry.core.errors import TransferError

        view = memoryview(self.tcp_buffer.numpy())
        total = len(view)
        view[0] = view[total - 1] = 0
        self.tcp.settimeout(timeout_s)
        self.announce()
        c0, got = cpu_s(), 0
        while got < total:
            n = self.tcp.recv_into(view[got:], total - got)
            if n == 0:
                raise TransferError(f"raw tcp: the sender closed after {got} of {total} bytes")
            got += n
        t_done, cpu = time.monotonic(), cpu_s() - c0
        if not view[0] == view[total - 1] == 7:
            raise TransferError("raw tcp: the bytes that arrived are not the ones sent")
        return {"t_done": t_done, "nbytes": got, "cpu_s": cpu}

    # ------------------------------------------------------------------ the wake floor
    def cmd_bell_bind(self) -> dict[str, Any]:
        """Bind a datagram socket in the abstract namespace (no file; the name is this
        process's, so no two peers share it); its name, without the leading NUL, for
        :meth:`cmd_bell_connect`."""
        import socket

        self.bell = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        name = f"kvferry-bench-bell-{os.getpid()}-{id(self):x}"
        self.bell.bind("\0" + name)
        return {"name": name}

    def cmd_bell_connect(self, name: str) -> dict[str, Any]:
        import socket

        self.bell = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.bell.connect("\0" + name)
        return {}

    def cmd_bell_ring(self) -> dict[str, Any]:
        """One datagram to the waiting peer: the least a sender does to hand a request over."""
        t_go = time.monotonic()
        self.bell.send(b"!")
        return {"t_go": t_go, "t_end": time.monotonic()}

    def cmd_bell_wait(self, timeout_s: float) -> dict[str, Any]:
        """Announce, block until the datagram comes, stamp the time: the bare wake of a process
        waiting on the other side (what every kvferry receive pays before its own work)."""
        from kvferry.core.errors import TransferTimeout

        self.bell.settimeout(timeout_s)
        self.announce()
        try:
            self.bell.recv(16)
        except TimeoutError:
            raise TransferTimeout(f"wake floor: no datagram within {timeout_s} s") from None
        return {"t_done": time.monotonic()}

    def cmd_base_send(self, cache: str, request: int) -> dict[str, Any]:
        """The baseline sender: naive extraction, tobytes + join, default (copying) send."""
        from kvferry.app.bench.payload import baseline_encode, baseline_extract

        c = self.caches[cache]
        f0 = faults()
        t_go = time.monotonic()
        keys, values = baseline_extract(c, request)
        blob = baseline_encode(f"base-{request}", keys, values, c.block_ids[request], {"seq_len": c.geometry.tokens})
        t_put = time.monotonic()
        self.socket.send(blob)
        return {"t_go": t_go, "t_put": [t_put], "t_end": time.monotonic(), "faults": faults() - f0, "nbytes": len(blob)}

    def cmd_base_recv(self, timeout_s: float) -> dict[str, Any]:
        """The baseline receiver: sleep-polling (10 ms doubling to 500 ms), frombuffer views."""
        from kvferry.app.bench.payload import baseline_decode, baseline_poll_recv, kv_crc

        f0 = faults()
        blob = baseline_poll_recv(self.socket, time.monotonic() + timeout_s, self.announce)
        keys, values = baseline_decode(blob)
        t_done = time.monotonic()
        crc = kv_crc(keys, values)
        return {"t_done": t_done, "t_have": [t_done], "crc": [crc], "faults": faults() - f0, "nbytes": len(blob)}

    def close(self) -> None:
        for name in list(self.connectors):
            self.cmd_kv_close(name)
        for sock in (self.tcp, self.tcp_listener, self.bell):
            if sock is not None:
                sock.close()
        if self.socket is not None:
            self.socket.close(0)
        if self.context is not None:
            self.context.term()


def _serve(channel_in: Any, channel_out: Any) -> int:
    import json

    def send(message: dict[str, Any]) -> None:
        channel_out.write((json.dumps(message, separators=(",", ":")) + "\n").encode())
        channel_out.flush()

    worker = Worker()
    try:
        for raw in channel_in:
            try:
                message = json.loads(raw)
                ident, cmd, args = message["id"], message["cmd"], message.get("args") or {}
            except (ValueError, KeyError, TypeError):
                logger.error("bench worker: malformed command line %r", raw[:200])
                return 2
            method = getattr(worker, f"cmd_{cmd}", None)
            if method is None:
                send({"id": ident, "ok": False, "error": f"unknown command {cmd!r}"})
                continue

            def announce(ident: Any = ident) -> None:
                send({"id": ident, "event": "ready"})

            worker.announce = announce
            try:
                result = method(**args)
            except Exception as exc:  # the failure travels back as a value; the trace to stderr
                traceback.print_exc(file=sys.stderr)
                send({"id": ident, "ok": False, "error": f"{type(exc).__name__}: {exc}"})
            else:
                send({"id": ident, "ok": True, "result": result})
    finally:
        worker.close()
    return 0


#: Seconds a worker whose bench died gets to close its connectors before it exits regardless.
GRACE_S = 10.0


def end_with_parent(parent: int) -> bool:
    """End this worker when process ``parent`` (the bench driving it) exits, even in the middle
    of a command that blocks: a killed bench would otherwise leave its workers running until the
    command's own timeout. A thread waits on a pidfd of ``parent``; when it exits, SIGTERM goes
    to this process, whose handler raises SystemExit in the main thread (``_serve`` then closes
    the worker's connectors), and after :data:`GRACE_S` the process exits regardless.
    Returns False when nothing can be watched (no ``os.pidfd_open``: not Linux 5.3+); the end of
    stdin still stops the worker after its current command."""
    import select
    import signal
    import threading

    if not hasattr(os, "pidfd_open"):
        return False
    try:
        fd = os.pidfd_open(parent)
    except ProcessLookupError:  # the bench is gone already
        os._exit(1)
    except OSError:
        return False

    def on_term(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, on_term)

    def watch() -> None:
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        poller.poll()  # no timeout: readable exactly when the parent has exited
        logger.error("bench worker %s: the bench (pid %s) exited; stopping", os.getpid(), parent)
        os.kill(os.getpid(), signal.SIGTERM)
        threading.Event().wait(GRACE_S)
        os._exit(1)

    threading.Thread(target=watch, name="kvferry-bench-parent", daemon=True).start()
    return True


def main() -> int:
    """Reserve the real stdout for the channel; anything else printed goes to stderr."""
    channel_out = os.fdopen(os.dup(sys.stdout.fileno()), "wb", buffering=0)
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    parent = os.environ.get(PARENT_ENV, "")
    if parent.isdigit():
        end_with_parent(int(parent))
    threads = os.environ.get("KVFERRY_BENCH_THREADS", "")
    if threads.isdigit() and int(threads) > 0:
        import torch

        torch.set_num_threads(int(threads))
    return _serve(sys.stdin.buffer, channel_out)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
