"""Start stage workers inside namespace hosts in milliseconds instead of seconds.

Importing torch takes seconds per process (7 s on a loaded 2-core machine), and a two-host
stage has six ranks. So one process, the zygote, imports torch, zmq and kvferry once and
then forks every worker: the child enters the host's network namespace (``setns``, what
``ip netns exec`` does), takes the pipes the test sent it as stdin/stdout/stderr and runs
``host_worker.main``. Its sockets live in the host's network stack, ``ip netns pids`` lists
it, and SIGKILL ends it like any process. The zygote ignores SIGCHLD, so children are reaped
by the kernel and never linger as zombies.

Protocol on the zygote's unix socket: the test sends one JSON message ``{"ns": NAME,
"argv": [...]}`` with three file descriptors (stdin, stdout, stderr) attached; the zygote
answers ``{"pid": PID}`` (or ``{"error": ...}``). Closing the socket ends the zygote.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import threading
from typing import Any

HERE = pathlib.Path(__file__).resolve().parent
CLONE_NEWNET = 0x40000000
#: How long the test waits for the zygote to start and to answer (seconds).
START_S = 120.0
ANSWER_S = 30.0


def _setns(name: str) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/run/netns/{name}", os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns into {name}: {os.strerror(err)}")
    finally:
        os.close(fd)


def _child(ns: str, argv: list[str], fds: list[int]) -> None:
    """In the forked child: enter the namespace, take the pipes, run the worker; never returns."""
    code = 1
    try:
        _setns(ns)
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        sys.stdin = open(0, closefd=False)
        sys.stdout = open(1, "w", buffering=1, closefd=False)
        sys.stderr = open(2, "w", buffering=1, closefd=False)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        import host_worker

        sys.argv = ["host_worker.py", *argv]
        host_worker.main(argv)
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def serve(sock: socket.socket) -> None:
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # children are reaped by the kernel
    sock.sendall(b'{"ready": true}\n')
    while True:
        try:
            msg, fds, _, _ = socket.recv_fds(sock, 65536, 3)
        except OSError:
            return
        if not msg:
            return
        try:
            request = json.loads(msg)
            pid = os.fork()
        except Exception as exc:
            for fd in fds:
                os.close(fd)
            sock.sendall(json.dumps({"error": f"{type(exc).__name__}: {exc}"}).encode() + b"\n")
            continue
        if pid == 0:
            sock.close()
            _child(request["ns"], request["argv"], fds)
        for fd in fds:
            os.close(fd)
        sock.sendall(json.dumps({"pid": pid}).encode() + b"\n")


class Zygote:
    """The test's end: :meth:`spawn` forks a worker inside a namespace; :meth:`close` ends the
    zygote (its running children are the hosts' to kill)."""

    def __init__(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(
            [sys.executable, str(pathlib.Path(__file__)), str(theirs.fileno())],
            pass_fds=[theirs.fileno()],
            cwd=str(HERE),
            env=env,
        )
        theirs.close()
        self.sock = ours
        self.sock.settimeout(START_S)
        self._lock = threading.Lock()
        try:
            ready = json.loads(self.sock.recv(65536) or b"{}")
        except (OSError, ValueError) as exc:
            self.close()
            raise RuntimeError(f"the zygote did not start: {exc}") from exc
        if not ready.get("ready"):
            self.close()
            raise RuntimeError("the zygote did not start")
        self.sock.settimeout(ANSWER_S)

    def spawn(self, ns: str, argv: list[str], stdin: int, stdout: int, stderr: int) -> int:
        """Fork ``host_worker.main(argv)`` inside namespace ``ns`` with these three fds; its pid."""
        with self._lock:
            socket.send_fds(self.sock, [json.dumps({"ns": ns, "argv": argv}).encode()], [stdin, stdout, stderr])
            answer: dict[str, Any] = json.loads(self.sock.recv(65536))
        if "pid" not in answer:
            raise RuntimeError(f"the zygote could not fork: {answer}")
        return int(answer["pid"])

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()
        try:
            self.proc.wait(timeout=ANSWER_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=ANSWER_S)


if __name__ == "__main__":
    sys.path.insert(0, str(HERE))
    conn = socket.socket(fileno=int(sys.argv[1]))
    import host_worker  # noqa: F401  (torch, zmq, kvferry: imported once, inherited by every fork)

    host_worker.preload()
    serve(conn)
