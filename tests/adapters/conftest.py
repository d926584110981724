"""Fixtures of the adapter tests: ``engine`` runs a test once with each CRC-32C routine this
CPU has (the native extension's ``vpclmulqdq`` folding, its ``sse4.2`` three-stream rounds and
its ``table``), and puts
the best one back after; a test of it skips where the extension is not built."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

_native: Any
try:
    from kvferry.adapters import _crc32c as _native
except ImportError:  # not built here: the tests that take ``engine`` skip
    _native = None

CRC_ENGINES = [name for name in ("vpclmulqdq", "sse4.2", "table") if _native is not None and _native.set_engine(name)]
if _native is not None:
    _native.set_engine(None)


@pytest.fixture(params=CRC_ENGINES or [pytest.param(None, marks=pytest.mark.skip(reason="native CRC-32C not built"))])
def engine(request: pytest.FixtureRequest) -> Iterator[str]:
    assert _native.set_engine(request.param)
    try:
        yield request.param
    finally:
        _native.set_engine(None)
