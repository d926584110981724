"""Suite-wide checks: nothing kvferry creates under /dev/shm may outlive the suite."""

from __future__ import annotations

import os

import pytest

SHM_DIR = "/dev/shm"


def _kvferry_shm_entries() -> set[str]:
    try:
        return {name for name in os.listdir(SHM_DIR) if "kvferry" in name or name.startswith("kvf")}
    except FileNotFoundError:  # pragma: no cover - platforms without /dev/shm
        return set()


@pytest.fixture(scope="session", autouse=True)
def no_shm_leaks():
    """Fail the session if the suite left kvferry segments or lock files in /dev/shm."""
    before = _kvferry_shm_entries()
    yield
    leaked = _kvferry_shm_entries() - before
    assert not leaked, f"kvferry left files in {SHM_DIR}: {sorted(leaked)}"
