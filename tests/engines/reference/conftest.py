"""Harness for the tests against the reference itself (the released vllm-omni package).

The reference lives in a venv of its own (``.ci/venv-reference``); its interpreter is named by
``KVFERRY_REFERENCE_PYTHON``. Without it these tests skip, saying why, except under CI (env
``CI`` set), where a missing reference venv is a failure: CI must test against the reference.

:class:`Node` runs ``reference_node.py`` under an interpreter and speaks JSON lines with it;
every read has a deadline (a node that says nothing in time fails the test and is killed).
"""

from __future__ import annotations

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
NODE = HERE / "reference_node.py"
REFERENCE_ENV = "KVFERRY_REFERENCE_PYTHON"
#: Deadline of one answer from a node (seconds). Importing vLLM on a loaded 2-core machine can
#: take minutes; a transfer itself takes milliseconds.
READ_S = 420.0


def reference_python_or_skip() -> str:
    """The reference venv's interpreter; skip (fail under CI) when it is not there."""
    path = os.environ.get(REFERENCE_ENV, "")
    if not path:
        reason = f"{REFERENCE_ENV} is not set: build the reference venv with .ci/venv-reference and point it there"
        if os.environ.get("CI"):
            pytest.fail(f"CI must test against the reference: {reason}")
        pytest.skip(reason)
    if not os.access(path, os.X_OK):
        pytest.fail(f"{REFERENCE_ENV}={path!r} is not an executable interpreter")
    return path


@pytest.fixture(scope="session")
def reference_python() -> str:
    return reference_python_or_skip()


class Node:
    """``reference_node.py`` under ``python``: ``ask(cmd)`` sends one command, returns the answer."""

    def __init__(self, python: str, name: str, log_dir: pathlib.Path) -> None:
        self.name = name
        self.log_path = log_dir / f"{name}.log"
        self._log = open(self.log_path, "wb")
        env = {k: v for k, v in os.environ.items() if k != "LOCAL_RANK"}
        env["VLLM_PLUGINS"] = "none"  # the reference's vLLM plugin patches engines; none run here
        self.proc = subprocess.Popen(
            [python, str(NODE)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
            cwd=str(HERE),
            env=env,
        )
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._pump, name=f"node-{name}", daemon=True).start()
        self.started = False

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line)
        self._lines.put(None)

    def read(self, timeout_s: float = READ_S) -> dict[str, Any]:
        while True:
            try:
                line = self._lines.get(timeout=timeout_s)
            except queue.Empty:
                self.kill()
                raise AssertionError(f"node {self.name} said nothing for {timeout_s} s; log: {self.tail()}") from None
            if line is None:
                raise AssertionError(f"node {self.name} exited ({self.proc.poll()}); log: {self.tail()}")
            if line.startswith("{"):
                return json.loads(line)

    def wait_ready(self) -> None:
        if not self.started:
            assert self.read().get("ready"), self.name
            self.started = True

    def ask(self, cmd: dict[str, Any], timeout_s: float = READ_S) -> dict[str, Any]:
        self.wait_ready()
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        answer = self.read(timeout_s)
        assert "error" not in answer, f"node {self.name}: {answer['error']}; log: {self.tail()}"
        return answer

    def tail(self, n: int = 3000) -> str:
        self._log.flush()
        return self.log_path.read_bytes()[-n:].decode(errors="replace")

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.write(json.dumps({"op": "exit"}) + "\n")
                self.proc.stdin.close()
                if self.started:  # it closes its managers (and their connectors) first
                    self.read(timeout_s=120)
                self.proc.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired, AssertionError):
                self.kill()
        self._log.close()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)


@pytest.fixture(scope="module")
def nodes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """``nodes(python, name)`` starts a node (all started ones are closed at module end)."""
    log_dir = tmp_path_factory.mktemp("nodes")
    made: list[Node] = []

    def start(python: str, name: str) -> Node:
        node = Node(python, name, log_dir)
        made.append(node)
        return node

    yield start
    for node in made:
        node.close()


@pytest.fixture(scope="session")
def kvferry_python() -> str:
    return sys.executable
