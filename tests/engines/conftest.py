"""Tests against real engines (their own venvs, minutes each): collected only when asked for by
path (``pytest tests/engines/vllm``), never by the default ``pytest`` run of the whole suite."""

from __future__ import annotations

from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


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


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, config: pytest.Config) -> None:
    if not _asked_for(config):
        terminalreporter.write_line(
            "tests/engines (real vLLM / reference engines) not run in this invocation: they need venvs of their own; "
            "bash .ci/run builds them and runs these suites (docs/contributing.md)"
        )
