"""Suite-wide checks: nothing kvferry creates under /dev/shm may outlive the suite. And the
warm-start server of the multi-process tests (``warm_spawn``): it takes the session's environment
now, before any test runs, and stops when the session ends.

The default suite (``pytest`` over the whole tree, no ``-m``) leaves out the multi-process tests
marked ``slow`` and says so at its end, to stay within its few minutes on 2 cores;
``pytest -m slow`` runs them, ``.ci/run`` runs both, and a run that names a folder, file or test
below ``tests/`` runs what it names, slow or not (docs/contributing.md)."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import pytest
import warm_spawn

SHM_DIR = "/dev/shm"
HERE = Path(__file__).resolve().parent
#: How many ``slow`` tests the default suite left out (for the summary).
_LEFT_OUT: list[int] = []


def _kvferry_shm_entries() -> set[str]:
    try:
        return {name for name in os.listdir(SHM_DIR) if "kvferry" in name or name.startswith("kvf")}
    except FileNotFoundError:  # pragma: no cover - platforms without /dev/shm
        return set()


_OWNER_PID = re.compile(r"^kvferry-[A-Za-z0-9_.]+-(\d+)-")


def _live_foreign_owner(name: str) -> bool:
    """True when ``name``'s owner pid is a live process outside this test session's tree
    (another run on a shared machine); such files are not this session's leak."""
    match = _OWNER_PID.match(name)
    if not match:
        return False
    pid = int(match.group(1))
    me = os.getpid()
    while pid > 1:
        if pid == me:
            return False
        try:
            with open(f"/proc/{pid}/stat") as f:
                pid = int(f.read().rsplit(")", 1)[1].split()[1])  # parent pid
        except (OSError, ValueError, IndexError):
            return False  # gone: a leak (ours, or a crashed run's)
    return True


@pytest.fixture(scope="session", autouse=True)
def no_shm_leaks():
    """Fail the session if the suite left kvferry segments or lock files in /dev/shm."""
    before = _kvferry_shm_entries()
    yield
    leaked = {n for n in _kvferry_shm_entries() - before if not _live_foreign_owner(n)}
    assert not leaked, f"kvferry left files in {SHM_DIR}: {sorted(leaked)}"


def _default_suite(config: pytest.Config) -> bool:
    """Whether this run is the default suite: no mark expression, and nothing named below
    ``tests/`` (pytest's ``testpaths``, ``tests`` itself or the repository)."""
    if config.option.markexpr:
        return False
    for arg in config.args:
        path = Path(arg.split("::", 1)[0]).resolve()
        if HERE in path.parents:
            return False
    return True


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not _default_suite(config):
        return
    slow = [item for item in items if item.get_closest_marker("slow") is not None]
    if slow:
        items[:] = [item for item in items if item.get_closest_marker("slow") is None]
        config.hook.pytest_deselected(items=slow)
        _LEFT_OUT.append(len(slow))


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    warm_spawn.shutdown()


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    """Say so when the nixl connector's tests were skipped, and why (pytest -q only counts skips);
    and how many slow tests the default suite left out, and how to run them."""
    from nixl_support import nixl_missing

    if _LEFT_OUT:
        terminalreporter.write_line(
            f"{_LEFT_OUT[0]} multi-process tests marked slow are not in the default suite: "
            "python -m pytest -q -m slow runs them (.ci/run does)",
            yellow=True,
        )
    skipped = [r for r in terminalreporter.stats.get("skipped", []) if "nixl" in getattr(r, "nodeid", "")]
    missing = nixl_missing() if skipped else None
    if missing is not None:
        terminalreporter.write_line(f"{len(skipped)} nixl tests skipped: {missing}", yellow=True)
