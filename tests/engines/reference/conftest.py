"""Harness for the tests against the reference itself (the released vllm-omni package).

The reference lives in a venv of its own (``.ci/venv-reference``); its interpreter is named by
``KVFERRY_REFERENCE_PYTHON``. Without it these tests skip, saying why, except under CI (env
``CI`` set), where a missing reference venv is a failure: CI must test against the reference.

:class:`Node` runs ``reference_node.py`` under an interpreter and speaks JSON lines with it
(:mod:`jsonlines`); every read has a deadline (a node that says nothing in time fails the test
and is killed).
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest
from interpreters import REFERENCE, engine_python
from jsonlines import Channel, ChannelSilent

HERE = pathlib.Path(__file__).resolve().parent
NODE = HERE / "reference_node.py"
REFERENCE_ENV = REFERENCE.env_var
#: Deadline of one answer from a node (seconds). Importing vLLM on a loaded 2-core machine can
#: take minutes; a transfer itself takes milliseconds.
READ_S = 420.0


def reference_python_or_skip() -> str:
    """The reference venv's interpreter; skip (fail under CI) when it is not there."""
    return engine_python(REFERENCE)


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
        # the reference's libraries print to stdout too: only JSON objects are answers
        self.channel = Channel(self.proc, f"node {name}", context=lambda: f"log: {self.tail()}", json_only=True)
        self.started = False

    def read(self, timeout_s: float = READ_S) -> dict[str, Any]:
        try:
            return self.channel.read(timeout_s)
        except ChannelSilent:
            self.kill()
            raise

    def wait_ready(self) -> None:
        if not self.started:
            assert self.read().get("ready"), self.name
            self.started = True

    def ask(self, cmd: dict[str, Any], timeout_s: float = READ_S) -> dict[str, Any]:
        self.wait_ready()
        self.channel.send(cmd)
        answer = self.read(timeout_s)
        assert "error" not in answer, f"node {self.name}: {answer['error']}; log: {self.tail()}"
        return answer

    def tail(self, n: int = 3000) -> str:
        self._log.flush()
        return self.log_path.read_bytes()[-n:].decode(errors="replace")

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.channel.send({"op": "exit"})
                self.channel.close_input()
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
