"""The one JSON-lines channel between a test and a child process: commands on the child's stdin,
answers on its stdout, one JSON object a line, so every step of a multi-process test is
synchronised by a message, never by a sleep.

Child side: :func:`commands` (the commands on stdin, until ``{"op": "exit"}`` or the end of
input) and :func:`say` (one answer, flushed at once).

Parent side: :class:`Channel` over a child process's pipes (text mode). A thread moves the
child's stdout lines into a queue (no line stuck in a buffer a poll cannot see), so every read
has a deadline: silence or the child's end fails the test with an AssertionError that names the
child and quotes what ``context`` gives (its log), instead of stalling the suite.

Stdlib only: the engine venvs' interpreters import it too.
"""

from __future__ import annotations

import contextlib
import json
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import IO, Any

#: Deadline of one read when the caller gives none (seconds; a shared, loaded machine).
READ_S = 60.0


# ---------------------------------------------------------------------------- child side
def say(
    obj: Any = None,
    *,
    stream: IO[str] | None = None,
    default: Callable[[Any], Any] | None = None,
    **fields: Any,
) -> None:
    """Write one answer (``obj``, a dict with ``fields`` added, or any JSON value) as a line on
    ``stream`` (stdout) and flush it; ``default``: as ``json.dumps``'s, for values JSON has no
    form for."""
    out = sys.stdout if stream is None else stream
    answer = {**(obj or {}), **fields} if fields or obj is None else obj
    out.write(json.dumps(answer, default=default) + "\n")
    out.flush()


def commands(stdin: IO[str] | None = None, stop_op: str | None = "exit") -> Iterator[dict[str, Any]]:
    """The commands on ``stdin`` (sys.stdin), one a line; ends at the end of input or at the
    first command whose ``op`` is ``stop_op`` (not yielded; None: yield every command)."""
    for line in sys.stdin if stdin is None else stdin:
        if not line.strip():
            continue
        command = json.loads(line)
        if stop_op is not None and command.get("op") == stop_op:
            return
        yield command


# --------------------------------------------------------------------------- parent side
class ChannelSilent(AssertionError):
    """The child said nothing within the read's deadline."""


class ChannelEnded(AssertionError):
    """The child's stdout ended before the answer."""


class Channel:
    """The test's end of a child's JSON lines: :meth:`send`, :meth:`read` (with a deadline),
    :meth:`ask` (both). ``proc``: the child (``subprocess.Popen`` or ``warm_spawn``'s process:
    ``stdin``, ``stdout``, ``pid``, ``wait``), started with text pipes. ``context``: what a
    failure quotes (the child's log). ``json_only``: lines that are not a JSON object (a
    library printing to stdout) are passed over. Every object read is kept in :attr:`said`."""

    def __init__(
        self,
        proc: Any,
        name: str,
        *,
        context: Callable[[], str] = lambda: "",
        json_only: bool = False,
    ) -> None:
        self.proc, self.name, self.context, self.json_only = proc, name, context, json_only
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.said: list[dict[str, Any]] = []
        self._reader = threading.Thread(target=self._pump, name=f"{name}-stdout", daemon=True)
        self._reader.start()

    def _pump(self) -> None:
        try:
            for line in self.proc.stdout:
                self.lines.put(line)
        except (OSError, ValueError):  # the pipe was closed under us at teardown
            pass
        finally:
            self.lines.put(None)

    def _line(self, deadline: float, timeout_s: float) -> str | None:
        try:
            return self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            raise ChannelSilent(f"{self.name} said nothing within {timeout_s} s\n{self.context()}") from None

    def read(self, timeout_s: float = READ_S) -> dict[str, Any]:
        """The child's next JSON object; :class:`ChannelSilent` after ``timeout_s``,
        :class:`ChannelEnded` (with its exit status) when its output ends first."""
        deadline = time.monotonic() + timeout_s
        while True:
            line = self._line(deadline, timeout_s)
            if line is None:
                self.lines.put(None)  # later reads see the end too
                raise ChannelEnded(f"{self.name} ended (exit status {self._status()})\n{self.context()}")
            if self.json_only and not line.startswith("{"):
                continue
            said: dict[str, Any] = json.loads(line)
            self.said.append(said)
            return said

    def rest(self, timeout_s: float = READ_S) -> list[dict[str, Any]]:
        """Every object the child says until its output ends (within ``timeout_s``)."""
        deadline, out = time.monotonic() + timeout_s, []
        while (line := self._line(deadline, timeout_s)) is not None:
            if not (self.json_only and not line.startswith("{")):
                out.append(json.loads(line))
        self.lines.put(None)
        self.said.extend(out)
        return out

    def send(self, obj: dict[str, Any]) -> None:
        self.proc.stdin.write(json.dumps(obj) + "\n")
        self.proc.stdin.flush()

    def ask(self, obj: dict[str, Any], timeout_s: float = READ_S) -> dict[str, Any]:
        self.send(obj)
        return self.read(timeout_s)

    def close_input(self) -> None:
        """Close the child's stdin (its end of input); quietly if it is gone."""
        with contextlib.suppress(BrokenPipeError, OSError, ValueError):
            if self.proc.stdin is not None and not self.proc.stdin.closed:
                self.proc.stdin.close()

    def close(self, join_s: float = READ_S) -> None:
        """Close both pipes (the reader thread ends with the child's output)."""
        self.close_input()
        self._reader.join(join_s)
        with contextlib.suppress(OSError, ValueError):
            self.proc.stdout.close()

    def _status(self) -> int | str:
        try:
            return int(self.proc.wait(timeout=READ_S))
        except subprocess.TimeoutExpired:
            return f"none: still running after {READ_S} s"
