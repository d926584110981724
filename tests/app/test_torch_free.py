"""Modules documented torch-free load without torch, also through the package facades."""

from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.mark.parametrize("module", ["kvferry.app.vllm.params", "kvferry.app.vllm", "kvferry.core"])
def test_a_torch_free_module_does_not_load_torch(module: str) -> None:
    probe = f"import sys, {module}; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "False", out.stderr


def test_the_facade_still_hands_out_every_name() -> None:
    probe = (
        "import sys, kvferry.app as app\n"
        "assert 'torch' not in sys.modules\n"
        "names = [getattr(app, n) for n in app.__all__]\n"
        "print('torch' in sys.modules, app.build_manager.__module__)"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.split() == ["True", "kvferry.app.wiring"], out.stderr


@pytest.mark.parametrize(
    "module", ["kvferry.app.vllm.scheduler", "kvferry.app.vllm.records", "kvferry.app.vllm.groups"]
)
def test_the_vllm_scheduler_side_loads_without_torch(module: str) -> None:
    """The scheduler builds the step records; neither it nor they need torch (the worker does)."""
    probe = f"import sys, {module}; print('torch' in sys.modules, {module}.__name__)"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.split() == ["False", module], out.stderr


def test_the_vllm_worker_still_loads_torch() -> None:
    """The control for the test above: the same probe sees torch when a module does load it."""
    probe = "import sys, kvferry.app.vllm.worker; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "True", out.stderr
