"""Fixtures of the reliability suite: private shm namespaces (nothing may be left in /dev/shm)."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator

import pytest
import warm_spawn
from fault_kit import SHM_DIR, ShmSpace

warm_spawn.prestart()  # the workers of these tests fork from it; it imports torch meanwhile


@pytest.fixture
def shm_space() -> Iterator[ShmSpace]:
    space = ShmSpace()
    yield space
    segments, files = space.leftovers()
    for name in segments:
        os.unlink(os.path.join(SHM_DIR, name))
    shutil.rmtree(space.base, ignore_errors=True)
    assert segments == [] and files == [], f"left behind: {segments} {files}"
