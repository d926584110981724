"""Benchmark peer processes: a JSON-lines command channel to a worker in another process.

The orchestrator starts ``python -m kvferry.app.bench.worker`` and writes one JSON object per
line to its stdin: ``{"id": n, "cmd": name, "args": {...}}``. The worker answers on its
stdout (which it reserves for the channel; everything else it prints goes to stderr) with
``{"id": n, "event": "ready"}`` for commands that first announce they are waiting, and then
exactly one ``{"id": n, "ok": true, "result": {...}}`` or ``{"id": n, "ok": false, "error":
text}``. Data only (JSON): nothing on this channel can execute code.

Every wait has a deadline (seconds); a peer that does not answer in time, dies or answers
garbage raises :class:`~kvferry.core.errors.TransferError` (``TransferTimeout`` for a
deadline) with the tail of the worker's stderr.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Collection
from typing import Any

import attrs

from kvferry.core.errors import ConfigError, TransferError, TransferTimeout

__all__ = ["PARENT_ENV", "Peer", "pin", "read_lines", "set_launcher"]

_MAX_LINE = 64 << 20
#: The environment variable naming the bench process that drives a worker: the worker ends
#: when that process does (:func:`kvferry.app.bench.worker.end_with_parent`).
PARENT_ENV = "KVFERRY_BENCH_PARENT"

#: Starts a peer process: ``launcher(argv, **Popen keywords)`` returns a Popen-like object
#: (``stdin``, ``stdout``, ``pid``, ``poll``, ``wait``, ``kill``, ``returncode``).
_launcher: Callable[..., Any] = subprocess.Popen


def pin(pid: int, cpus: Collection[int]) -> None:
    """Restrict process ``pid`` to ``cpus``: every thread it has now (``/proc/{pid}/task``),
    and so every thread it starts later. OSError when the OS refuses."""
    try:
        tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except (OSError, ValueError):
        tids = [pid]
    for tid in tids or [pid]:
        try:
            os.sched_setaffinity(tid, cpus)
        except ProcessLookupError:  # a thread that ended meanwhile
            if tid == pid:
                raise


def set_launcher(launcher: Callable[..., Any] | None) -> Callable[..., Any]:
    """Start peers with ``launcher`` from now on (``None``: ``subprocess.Popen``, a fresh
    interpreter each, the bench's own way); returns the launcher used until now. The test
    suite uses it to fork peers from interpreters that have imported torch already."""
    global _launcher
    previous, _launcher = _launcher, launcher or subprocess.Popen
    return previous


def read_lines(buffer: bytearray, chunk: bytes) -> list[bytes]:
    """Append ``chunk`` to ``buffer`` and cut off every complete line (without the newline)."""
    buffer += chunk
    lines = []
    while True:
        cut = buffer.find(b"\n")
        if cut < 0:
            break
        lines.append(bytes(buffer[:cut]))
        del buffer[: cut + 1]
    if len(buffer) > _MAX_LINE:
        raise TransferError(f"peer sent a line longer than {_MAX_LINE} bytes")
    return lines


@attrs.define(eq=False)
class Peer:
    """One worker process and its command channel. Not thread-safe (one orchestrator)."""

    name: str
    _proc: subprocess.Popen = attrs.field(repr=False)
    _errors: Any = attrs.field(repr=False)
    _buffer: bytearray = attrs.field(factory=bytearray, repr=False)
    _next_id: int = 1
    _pending: dict[int, list[dict[str, Any]]] = attrs.field(factory=dict, repr=False)

    @classmethod
    def start(cls, name: str, *, env: dict[str, str] | None = None, cpus: Collection[int] | None = None) -> Peer:
        """Start a worker (it imports torch: allow a few seconds before its first answer),
        on ``cpus`` when given (:func:`pin`; ConfigError, the worker stopped, when the OS
        refuses)."""
        errors = tempfile.TemporaryFile(prefix="kvferry-bench-")
        proc = _launcher(
            [sys.executable, "-m", "kvferry.app.bench.worker"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=errors,
            env={**os.environ, PARENT_ENV: str(os.getpid()), **(env or {})},
            close_fds=True,
        )
        peer = cls(name, proc, errors)
        if cpus is not None:
            try:
                pin(proc.pid, cpus)
            except OSError as exc:
                peer.close(timeout_s=2.0)
                raise ConfigError(
                    f"bench peer {name!r} cannot be placed on CPUs {sorted(cpus)}: {exc}; run with --no-pin"
                ) from None
        return peer

    @property
    def pid(self) -> int:
        return self._proc.pid

    def stderr_tail(self, limit: int = 2000) -> str:
        try:
            self._errors.seek(0, os.SEEK_END)
            size = self._errors.tell()
            self._errors.seek(max(0, size - limit))
            return self._errors.read().decode("utf-8", "replace").strip()
        except (OSError, ValueError):
            return ""

    def _fail(self, message: str, timeout: bool = False, tail: bool = True) -> TransferError:
        """The error for a peer fault; with ``tail`` (the peer died or hung) the end of its stderr."""
        text = f"bench peer {self.name!r} (pid {self.pid}): {message}"
        ending = self.stderr_tail() if tail else ""
        if ending:
            text += f"; its stderr ends with: {ending[-600:]}"
        return TransferTimeout(text) if timeout else TransferError(text)

    def begin(self, cmd: str, /, **args: Any) -> int:
        """Send a command; return its id (collect the answer with :meth:`result`)."""
        if self._proc.poll() is not None:
            raise self._fail(f"exited with status {self._proc.returncode}")
        ident = self._next_id
        self._next_id += 1
        line = json.dumps({"id": ident, "cmd": cmd, "args": args}, separators=(",", ":")) + "\n"
        stdin = self._proc.stdin
        assert stdin is not None  # a PIPE
        try:
            stdin.write(line.encode())
            stdin.flush()
        except (BrokenPipeError, OSError) as exc:
            raise self._fail(f"could not send {cmd!r}: {exc}") from None
        self._pending[ident] = []
        return ident

    def _pump(self, deadline: float) -> bool:
        """Read what the worker has written until ``deadline``; False when nothing came."""
        fd = self._proc.stdout.fileno()  # type: ignore[union-attr]  # a PIPE
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return False
        ready, _, _ = select.select([fd], [], [], remaining)
        if not ready:
            return False
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            status = self._proc.wait(timeout=5)
            raise self._fail(f"exited with status {status}")
        for raw in read_lines(self._buffer, chunk):
            try:
                message = json.loads(raw)
                ident = message["id"]
            except (ValueError, KeyError, TypeError):
                raise self._fail(f"sent a malformed line {raw[:120]!r}") from None
            self._pending.setdefault(ident, []).append(message)
        return True

    def _take(self, ident: int, want: str, timeout_s: float) -> dict[str, Any]:
        if ident not in self._pending:
            raise ConfigError(f"no command {ident} is pending on peer {self.name!r}")
        deadline = time.monotonic() + timeout_s
        while True:
            queue = self._pending[ident]
            for i, message in enumerate(queue):
                if (want == "event" and "event" in message) or (want == "result" and "ok" in message):
                    del queue[i]
                    return message
                if want == "event" and "ok" in message:  # finished (failed) before announcing
                    return message
            if not self._pump(deadline) and time.monotonic() >= deadline:
                raise self._fail(f"no {want} for command {ident} within {timeout_s:.1f} s", timeout=True)

    def wait_ready(self, ident: int, timeout_s: float) -> None:
        """Block until command ``ident`` announced that it is waiting (or raise its failure)."""
        message = self._take(ident, "event", timeout_s)
        if "ok" in message:
            self._pending.pop(ident, None)
            if not message["ok"]:
                raise self._fail(f"command failed: {message.get('error')}", tail=False)
            raise self._fail("command finished without announcing that it was waiting")

    def result(self, ident: int, timeout_s: float) -> dict[str, Any]:
        """The result of command ``ident``; TransferError with the worker's reason on failure."""
        message = self._take(ident, "result", timeout_s)
        self._pending.pop(ident, None)
        if not message["ok"]:
            raise self._fail(f"command failed: {message.get('error')}", tail=False)
        result = message.get("result")
        return result if isinstance(result, dict) else {"value": result}

    def call(self, cmd: str, wait_s: float, /, **args: Any) -> dict[str, Any]:
        """:meth:`begin` then :meth:`result` within ``wait_s`` seconds."""
        return self.result(self.begin(cmd, **args), wait_s)

    def close(self, timeout_s: float = 10.0) -> None:
        """Ask the worker to exit; kill it if it does not within ``timeout_s``. Idempotent."""
        if self._proc.poll() is None:
            try:
                self._proc.stdin.close()  # type: ignore[union-attr]  # a PIPE: EOF asks it to exit
            except OSError:
                pass  # already gone: the wait below reaps it
            try:
                self._proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait(timeout=timeout_s)
        if self._proc.stdout is not None:
            self._proc.stdout.close()
        self._errors.close()

    def __enter__(self) -> Peer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
