"""Fixtures of the multi-host tests: hosts are network namespaces (see :mod:`netns`).

Root only. Without root, or where the kernel refuses a namespace, every test here is skipped
with the reason, except when the environment variable ``CI`` is set and we are root: CI runs
as root and must run these tests for real, so there a refusal is a failure, not a skip.

``net``: a function-scoped :class:`netns.Net`; module-scoped topologies are built by the test
modules with :func:`module_net`. Either way the net is torn down on every path and the test
fails when a namespace, a veth or a process was left behind.

``HostWorker``: a ``host_worker.py`` process inside a host, spoken to in JSON lines; every
read has a deadline, so a hang fails the test (naming the worker) instead of stalling the
suite.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import pathlib
import queue
import subprocess
import sys
import threading
from collections.abc import Iterator
from typing import Any

import pytest

HERE = pathlib.Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

import netns_enter  # noqa: E402
import warm_spawn  # noqa: E402

from kvferry.app.bench.netns import Net, unavailable_reason  # noqa: E402

#: Deadline of one read from a worker when nothing else bounds it (seconds; a shared machine).
READ_S = 60.0
WORKER = HERE / "host_worker.py"
#: What ``host_worker.py`` sets for itself unless the environment says otherwise.
WORKER_ENV = {"GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1", "MC_LOG_LEVEL": "ERROR"}

_REASON: list[str | None] = []


def require_namespaces() -> None:
    """Skip (or, under CI as root, fail) when network namespaces cannot be made here."""
    if not _REASON:
        _REASON.append(unavailable_reason())
    reason = _REASON[0]
    if reason is None:
        return
    if os.environ.get("CI") and os.geteuid() == 0:
        pytest.fail(f"CI runs as root, so the multi-host tests must run: {reason}")
    pytest.skip(reason)


@contextlib.contextmanager
def module_net(tag: str = "") -> Iterator[Net]:
    """A :class:`Net` torn down on leaving; AssertionError if anything of it was left."""
    require_namespaces()
    net = Net(tag)
    try:
        yield net
    finally:
        net.close()  # raises NetError (naming what was left) when it could not remove it all
    assert net.leftovers() == {}, net.leftovers()


@pytest.fixture
def net() -> Iterator[Net]:
    with module_net() as made:
        yield made


class HostWorker:
    """A ``host_worker.py`` rank inside ``host`` (forked by the session's fork server,
    :mod:`warm_spawn`, with :func:`netns_enter.enter` as its pre-exec hook): JSON lines out,
    commands in.

    A thread moves stdout lines into a queue (no line stuck in a buffer a poll cannot see);
    stderr goes to ``log_path`` so a failure can show what the worker said.
    """

    def __init__(self, forks: Forks, host: Any, args: list[Any], log_path: pathlib.Path) -> None:
        self.host, self.log_path = host, log_path
        self._log = open(log_path, "wb")
        try:
            self.proc = forks.spawn(host.name, [str(a) for a in args], self._log.fileno())
        except BaseException:
            self._log.close()
            raise
        self.pid: int = self.proc.pid
        self.stdin, self.stdout = self.proc.stdin, self.proc.stdout
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.said: list[dict[str, Any]] = []
        self._reader = threading.Thread(target=self._pump, daemon=True, name=f"host-worker-{self.pid}")
        self._reader.start()

    def _pump(self) -> None:
        try:
            for line in self.stdout:
                self.lines.put(line)
        except (OSError, ValueError):
            pass
        finally:
            self.lines.put(None)

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def alive(self) -> bool:
        return self.proc.poll() is None

    def wait_gone(self, timeout_s: float = READ_S) -> bool:
        """True once the process has ended (within ``timeout_s``)."""
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return False
        return True

    def read(self, timeout_s: float = READ_S) -> dict[str, Any]:
        try:
            line = self.lines.get(timeout=timeout_s)
        except queue.Empty:
            raise AssertionError(
                f"worker {self.pid} on {self.host.label} said nothing within {timeout_s} s\n{self.log_tail()}"
            ) from None
        if line is None:
            self.lines.put(None)
            gone = self.wait_gone()
            raise AssertionError(f"worker {self.pid} on {self.host.label} ended (gone: {gone})\n{self.log_tail()}")
        said = json.loads(line)
        self.said.append(said)
        return said

    def send(self, obj: dict[str, Any]) -> None:
        self.stdin.write(json.dumps(obj) + "\n")
        self.stdin.flush()

    def ask(self, obj: dict[str, Any], timeout_s: float = READ_S) -> dict[str, Any]:
        self.send(obj)
        return self.read(timeout_s)

    def finish(self, timeout_s: float = READ_S) -> dict[str, Any]:
        """Ask the worker to exit; its last words (``{"closed": rank}``) once it has ended.
        AssertionError (after killing it) when it does not end within ``timeout_s``."""
        try:
            if self.alive():
                with contextlib.suppress(BrokenPipeError, OSError, ValueError):
                    self.send({"op": "exit"})
                    self.stdin.close()
            if not self.wait_gone(timeout_s):
                self.kill()
                raise AssertionError(f"worker {self.pid} did not exit within {timeout_s} s\n{self.log_tail()}")
            last: dict[str, Any] = {}
            while True:
                line = self.lines.get(timeout=timeout_s)
                if line is None:
                    return last
                last = json.loads(line)
        finally:
            self.close_pipes()

    def kill(self) -> None:
        """SIGKILL and wait until the process is gone."""
        self.proc.kill()
        if not self.wait_gone(READ_S):
            raise AssertionError(f"worker {self.pid} survived SIGKILL")

    def close_pipes(self) -> None:
        with contextlib.suppress(BrokenPipeError, OSError, ValueError):
            self.stdin.close()
        self._reader.join(READ_S)
        with contextlib.suppress(OSError, ValueError):
            self.stdout.close()
        self._log.close()

    def kill_quietly(self) -> None:
        if self._log.closed:
            return
        if self.alive():
            self.kill()
        self.close_pipes()


class Forks:
    """Starts ``host_worker.py`` ranks inside hosts: the session's fork server
    (:func:`warm_spawn.popen`) forks each one and its pre-exec hook enters the host's network
    namespace. A rank gets the test process's environment, plus the defaults the worker sets
    for itself (set here too: a warm child has imported torch already)."""

    def spawn(self, ns: str, args: list[str], stderr: int) -> Any:
        env = {**WORKER_ENV, **os.environ}
        return warm_spawn.popen(
            [str(WORKER), *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
            bufsize=1,
            cwd=HERE,
            env=env,
            pre_exec=functools.partial(netns_enter.enter, ns),
        )


@pytest.fixture(scope="session")
def forks() -> Forks:
    """The session's worker factory (see :class:`Forks`)."""
    require_namespaces()
    warm_spawn.prestart()
    return Forks()
