"""Fixtures of the multi-host tests: hosts are network namespaces (see :mod:`netns`).

Root only. Without root, or where the kernel refuses a namespace, every test here is skipped
with the reason, except when the environment variable ``CI`` is set and we are root: CI runs
as root and must run these tests for real, so there a refusal is a failure, not a skip.

``net``: a function-scoped :class:`netns.Net`; module-scoped topologies are built by the test
modules with :func:`module_net`. Either way the net is torn down on every path and the test
fails when a namespace, a veth or a process was left behind.

``HostWorker``: a ``host_worker.py`` process inside a host, spoken to in JSON lines
(:mod:`jsonlines`); every read has a deadline, so a hang fails the test (naming the worker)
instead of stalling the suite.
"""

from __future__ import annotations

import contextlib
import functools
import os
import pathlib
import signal
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest

HERE = pathlib.Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

import netns_enter  # noqa: E402
import warm_spawn  # noqa: E402
from jsonlines import READ_S, Channel  # noqa: E402
from waits import eventually  # noqa: E402

from kvferry.app.bench.netns import Net, unavailable_reason  # noqa: E402

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
    :mod:`warm_spawn`, with :func:`netns_enter.enter` as its pre-exec hook), spoken to over a
    :class:`jsonlines.Channel`; stderr goes to ``log_path`` so a failure can show what the
    worker said."""

    def __init__(self, forks: Forks, host: Any, args: list[Any], log_path: pathlib.Path) -> None:
        self.host, self.log_path = host, log_path
        self._log = open(log_path, "wb")
        try:
            self.proc = forks.spawn(host.name, [str(a) for a in args], self._log.fileno())
        except BaseException:
            self._log.close()
            raise
        self.pid: int = self.proc.pid
        self.stdin = self.proc.stdin
        self.channel = Channel(self.proc, f"worker {self.pid} on {host.label}", context=self.log_tail)
        self.said = self.channel.said

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stacks(self, timeout_s: float = 5.0) -> str:
        """The worker's log ending with every thread's Python stack (SIGUSR1: the worker's
        faulthandler writes them there), for a failure message; the log as it is when the
        worker is gone or wrote none within ``timeout_s``."""
        marker = "most recent call first"
        before = self.log_tail(1 << 20).count(marker)
        if self.alive():
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGUSR1)
            with contextlib.suppress(AssertionError):
                eventually(lambda: self.log_tail(1 << 20).count(marker) > before, "a stack dump", timeout_s)
        return self.log_tail(6000)

    def wait_gone(self, timeout_s: float = READ_S) -> bool:
        """True once the process has ended (within ``timeout_s``)."""
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return False
        return True

    def read(self, timeout_s: float = READ_S) -> dict[str, Any]:
        return self.channel.read(timeout_s)

    def send(self, obj: dict[str, Any]) -> None:
        self.channel.send(obj)

    def ask(self, obj: dict[str, Any], timeout_s: float = READ_S) -> dict[str, Any]:
        return self.channel.ask(obj, timeout_s)

    def finish(self, timeout_s: float = READ_S) -> dict[str, Any]:
        """Ask the worker to exit; its last words (``{"closed": rank}``) once it has ended.
        AssertionError (after killing it) when it does not end within ``timeout_s``."""
        try:
            if self.alive():
                with contextlib.suppress(BrokenPipeError, OSError, ValueError):
                    self.send({"op": "exit"})
                self.channel.close_input()
            if not self.wait_gone(timeout_s):
                self.kill()
                raise AssertionError(f"worker {self.pid} did not exit within {timeout_s} s\n{self.log_tail()}")
            rest = self.channel.rest(timeout_s)
            return rest[-1] if rest else {}
        finally:
            self.close_pipes()

    def kill(self) -> None:
        """SIGKILL and wait until the process is gone."""
        self.proc.kill()
        if not self.wait_gone(READ_S):
            raise AssertionError(f"worker {self.pid} survived SIGKILL")

    def close_pipes(self) -> None:
        self.channel.close(READ_S)
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
