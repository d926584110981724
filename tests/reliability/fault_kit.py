"""Helpers of the reliability suite (imported by name: ``conftest`` is ambiguous across test
directories): loopback ports, bounded waits, private shm namespaces, line-speaking processes.
"""

from __future__ import annotations

import itertools
import os
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from waits import WAIT_S, eventually  # noqa: F401 (re-exported to the tests)

from kvferry.adapters.platform import free_base_port, free_port  # noqa: F401 (re-exported to the tests)

HERE = Path(__file__).resolve().parent
SHM_DIR = "/dev/shm"
_COUNTER = itertools.count()


def shm_entries(namespace: str) -> list[str]:
    """Files of ``namespace`` in /dev/shm."""
    return sorted(n for n in os.listdir(SHM_DIR) if n.startswith(f"kvferry-{namespace}-"))


class ShmSpace:
    """A private shm namespace and runtime directory."""

    def __init__(self) -> None:
        self.base = tempfile.mkdtemp(prefix="kvfr-", dir="/tmp")
        self.namespace = f"r{os.getpid()}n{next(_COUNTER)}"

    def config(self, role: str, **extra: Any) -> dict[str, Any]:
        cfg = {
            "type": "shm",
            "role": role,
            "namespace": self.namespace,
            "runtime_dir": self.base,
            "pool_bytes": 1 << 20,
            **extra,
        }
        return cfg

    def leftovers(self) -> tuple[list[str], list[str]]:
        files = []
        for root, _, names in os.walk(self.base):
            files.extend(os.path.join(root, n) for n in names)
        return shm_entries(self.namespace), files


class LineProc:
    """A child process speaking JSON lines on stdout (and taking them on stdin) over a
    :class:`jsonlines.Channel`: every read has a deadline, so a silent or dead child fails the
    test instead of hanging it. stderr goes to a log file that failures quote.
    """

    def __init__(self, args: list[str], log_dir: str | Path, name: str, env: dict[str, str] | None = None) -> None:
        self.name = name
        self.log_path = Path(log_dir) / f"{name}.log"
        self._log = open(self.log_path, "wb")
        import warm_spawn  # here, not at the top: worker processes import this module too
        from jsonlines import Channel

        self.proc = warm_spawn.popen(
            list(args),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
            cwd=str(HERE),
            env={**os.environ, **(env or {})},
        )
        # the child's libraries may print to stdout too: only JSON objects are answers
        self.channel = Channel(self.proc, name, context=lambda: f"log:\n{self.log()}", json_only=True)

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")[-3000:]

    def read(self, timeout_s: float = 60.0) -> dict[str, Any]:
        """The next JSON line; fails (with the child's log) on EOF or after ``timeout_s``."""
        return self.channel.read(timeout_s)

    def send(self, message: dict[str, Any]) -> None:
        self.channel.send(message)

    def ask(self, message: dict[str, Any], timeout_s: float = 60.0) -> dict[str, Any]:
        return self.channel.ask(message, timeout_s)

    def kill(self) -> None:
        """SIGKILL (no cleanup of any kind runs in the child) and reap."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=WAIT_S)

    def close(self, timeout_s: float = WAIT_S) -> None:
        """Ask politely (stdin EOF), then kill; always reaps."""
        try:
            if self.proc.stdin and not self.proc.stdin.closed:
                self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=WAIT_S)
        self._log.close()
