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
