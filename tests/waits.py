"""The bounded wait the tests share: poll an observable condition until it holds or a deadline
passes (never a sleep standing in for synchronisation: the wait ends as soon as it holds)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

#: Generous bound for things that should happen at once (the machine is shared and loaded).
WAIT_S = 20.0


def eventually(
    predicate: Callable[[], Any], what: str = "condition", timeout_s: float = WAIT_S, pause_s: float = 0.005
) -> Any:
    """Call ``predicate()`` until it is truthy and return its value; fail the test (naming
    ``what``) if it is not within ``timeout_s``, looking every ``pause_s``."""
    deadline = time.monotonic() + timeout_s
    pause = threading.Event()
    while True:
        value = predicate()
        if value:
            return value
        assert time.monotonic() < deadline, f"{what} not reached within {timeout_s} s"
        pause.wait(pause_s)
