"""Harness for the multi-process integration tests: worker processes spoken to in JSON lines,
free loopback ports, and a per-test check that nothing is left in /dev/shm.

Every read from a worker has a deadline; a worker that says nothing in time fails the test
(and is killed), so a hang shows up as a failure naming the worker, never as a stuck suite.
"""

from __future__ import annotations

import json
import multiprocessing
import multiprocessing.forkserver
import os
import pathlib
import signal
import subprocess
import sys
import types
from collections.abc import Iterator
from typing import Any

import pytest
import warm_spawn
from jsonlines import Channel

from kvferry.adapters.platform import free_base_port, free_port

HERE = pathlib.Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

WORKER = HERE / "stage_worker.py"
#: Deadline of one read from a worker (seconds): generous, the machine may be shared.
READ_S = 90.0
SHM_DIR = "/dev/shm"

warm_spawn.prestart()  # the workers of these tests fork from it; it imports torch meanwhile


# ----------------------------------------------------------------------------- ports
# --------------------------------------------------------------------------- workers
class LineWorker:
    """A ``stage_worker.py`` process: JSON lines out on stdout, commands in on stdin (a
    :class:`jsonlines.Channel`, every read with a deadline). stderr goes to ``log_path`` so
    that a failure can show what the worker said.
    """

    def __init__(self, args: list[str], log_path: pathlib.Path, script: pathlib.Path = WORKER) -> None:
        self.log_path = log_path
        self._log = open(log_path, "wb")
        self.proc = warm_spawn.popen(
            [str(script), *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
            cwd=str(HERE),
        )
        self.channel = Channel(self.proc, f"worker {self.proc.pid}", context=self.log_tail)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def read(self, timeout_s: float = READ_S) -> dict[str, Any]:
        """The next JSON line; AssertionError (with the worker's stderr) on silence or exit."""
        return self.channel.read(timeout_s)

    def send(self, obj: dict[str, Any]) -> None:
        self.channel.send(obj)

    def ask(self, obj: dict[str, Any], timeout_s: float = READ_S) -> dict[str, Any]:
        return self.channel.ask(obj, timeout_s)

    def sigkill(self) -> int:
        """SIGKILL and reap (so the pid is gone, not a zombie); returns the exit status."""
        os.kill(self.proc.pid, signal.SIGKILL)
        return self.proc.wait(timeout=READ_S)

    def finish(self, timeout_s: float = READ_S) -> int:
        """Ask a live sender to exit (and close its stdin), wait; kill it past the deadline."""
        try:
            if self.proc.poll() is None and not self.proc.stdin.closed:
                try:
                    self.send({"op": "exit"})
                    self.proc.stdin.close()
                except (BrokenPipeError, OSError):
                    pass
            try:
                return self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=timeout_s)
                raise AssertionError(
                    f"worker {self.pid} did not exit within {timeout_s} s\n{self.log_tail()}"
                ) from None
        finally:
            self.close_pipes()

    def close_pipes(self) -> None:
        self.channel.close(READ_S)
        self._log.close()

    def kill_quietly(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=READ_S)
        self.close_pipes()


@pytest.fixture
def workers(tmp_path: pathlib.Path) -> Iterator[Any]:
    """``workers(*args) -> LineWorker``; every worker still alive after the test is killed."""
    made: list[LineWorker] = []

    def start(*args: str) -> LineWorker:
        worker = LineWorker([str(a) for a in args], tmp_path / f"worker{len(made)}.log")
        made.append(worker)
        return worker

    yield start
    for worker in made:
        worker.kill_quietly()


# ------------------------------------------------------------------------------- shm
def shm_entries(namespace: str) -> list[str]:
    """Files in /dev/shm that belong to the shm connector's ``namespace``."""
    try:
        return sorted(n for n in os.listdir(SHM_DIR) if n.startswith(f"kvferry-{namespace}-"))
    except FileNotFoundError:  # pragma: no cover - no /dev/shm on this platform
        return []


@pytest.fixture
def shm_namespace(request: pytest.FixtureRequest) -> Iterator[str]:
    """A namespace of this test alone; the test fails if it leaves segments in /dev/shm."""
    namespace = f"it{os.getpid()}x{abs(hash(request.node.nodeid)) % 10**8}"
    assert shm_entries(namespace) == []
    yield namespace
    leaked = shm_entries(namespace)
    assert leaked == [], f"left in {SHM_DIR}: {leaked}"


@pytest.fixture(scope="session")
def itkit() -> types.SimpleNamespace:
    """The helpers above for test modules: ``itkit.free_port()``, ``itkit.free_base_port(tp)``,
    ``itkit.shm_entries(namespace)``, ``itkit.LineWorker(args, log_path)``."""
    return types.SimpleNamespace(
        free_port=free_port, free_base_port=free_base_port, shm_entries=shm_entries, LineWorker=LineWorker
    )


@pytest.fixture(scope="session")
def warm_mp_context() -> Iterator[Any]:
    """A :mod:`multiprocessing` context for ``run_demo(..., mp_context=...)`` whose processes
    fork from a forkserver that has imported torch and kvferry already (``warm_preload``)
    instead of each re-importing them; the server has no threads when it forks. The command
    line's own path (spawn) is still run end to end by ``test_the_demo_command_...``."""
    if os.environ.get(warm_spawn.COLD_VAR):  # every child a fresh interpreter: the plain spawn
        yield multiprocessing.get_context("spawn")
        return
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["warm_preload"])
    # The forkserver finds ``warm_preload`` through PYTHONPATH (it does not take this process's
    # sys.path); warm_preload puts the variable back as it was, so the ranks' environment is ours.
    saved = os.environ.get("PYTHONPATH")
    tests_dir = str(pathlib.Path(warm_spawn.__file__).resolve().parent)
    os.environ["PYTHONPATH"] = tests_dir + (os.pathsep + saved if saved else "")
    os.environ[warm_spawn.RESTORE_VAR] = json.dumps({"PYTHONPATH": saved})
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        del os.environ[warm_spawn.RESTORE_VAR]
        if saved is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = saved
    yield ctx
    stop = getattr(multiprocessing.forkserver._forkserver, "_stop", None)
    if stop is not None:  # stop (and reap) it now rather than when the session's process exits
        stop()
