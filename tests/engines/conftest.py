"""Tests against real engines (their own venvs, minutes each): collected only when asked for by
path (``pytest tests/engines/vllm``), never by the default ``pytest`` run of the whole suite.

Every test of a suite runs its engine's interpreter (:mod:`interpreters`), so a suite whose
interpreter is not configured is skipped (or fails, see :func:`interpreters.engine_python`)
when its modules are collected, saying why, before they are imported."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from interpreters import SUITES, engine_python, problem
from shm_leftovers import Sweep, remove_orphans

HERE = Path(__file__).resolve().parent
#: Why a suite's modules were skipped at collection, by suite (for the summary).
_SKIPPED: dict[str, str] = {}
SHM_DIR = "/dev/shm"
#: /dev/shm's names when an engine session started, and what its end swept (for the summary).
_SHM_BEFORE: list[set[str]] = []
_SWEPT: list[Sweep] = []


class _SuiteModule(pytest.Module):
    """A test module of an engine suite: collected only when the suite's interpreter is there."""

    suite = ""

    def collect(self) -> Any:
        venv = SUITES[self.suite]
        found = problem(venv)
        if found is not None:
            _SKIPPED[venv.suite] = found[0]
            engine_python(venv)  # skips or fails, saying why
        return super().collect()


def pytest_pycollect_makemodule(module_path: Path, parent: pytest.Collector) -> pytest.Module | None:
    rel = module_path.resolve().relative_to(HERE)
    if len(rel.parts) < 2 or rel.parts[0] not in SUITES:
        return None
    module = _SuiteModule.from_parent(parent, path=module_path)
    module.suite = rel.parts[0]
    return module


def _asked_for(config: pytest.Config) -> bool:
    for arg in config.args:
        path = Path(arg.split("::", 1)[0]).resolve()
        if path == HERE or HERE in path.parents:
            return True
    return False


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    if collection_path.resolve() != HERE and HERE in collection_path.resolve().parents and not _asked_for(config):
        return True
    return None


def pytest_sessionstart(session: pytest.Session) -> None:
    if _asked_for(session.config) and os.path.isdir(SHM_DIR):
        _SHM_BEFORE.append(set(os.listdir(SHM_DIR)))


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if exitstatus == pytest.ExitCode.NO_TESTS_COLLECTED and _SKIPPED:  # all skipped, as the tests would
        session.exitstatus = pytest.ExitCode.OK
    if _SHM_BEFORE:  # what engines killed by the tests left in memory (shm_leftovers)
        _SWEPT.append(remove_orphans(SHM_DIR, _SHM_BEFORE[0]))


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, config: pytest.Config) -> None:
    for sweep in _SWEPT:
        if sweep.removed or sweep.kept:
            terminalreporter.write_line(
                f"{SHM_DIR}: removed {len(sweep.removed)} file(s) ({sweep.removed_bytes / 1e6:.0f} MB) that engine "
                f"processes killed in these tests left (psm_*, sem.mp-*, vllm_dist_*); {len(sweep.kept)} still held "
                "by a live process, kept"
            )
    for suite, reason in sorted(_SKIPPED.items()):
        terminalreporter.write_line(f"tests/engines/{suite} not run: {reason}")
    if not _asked_for(config):
        terminalreporter.write_line(
            "tests/engines (real vLLM / reference engines) not run in this invocation: they need venvs of their own; "
            "bash .ci/run builds them and runs these suites (docs/contributing.md)"
        )
