"""The one put primitive: attempts of a put under one retry rule, with one failure vocabulary.

Every sending path (the manager's send path, the vLLM connector's saver) hands :func:`put_with_retry`
a callable that makes one attempt (reserve and fill a region then commit, or put frames) and
returns the connector's ``(ok, size, info)``; a :class:`~kvferry.core.errors.PoolFullError`
raised by a reservation counts as a failed attempt with its ``reason``. The rule:

- at most ``retry.attempts`` attempts, sleeping ``retry.delays()`` between them;
- a failure another attempt cannot cure (:data:`kvferry.core.policy.UNRETRIED_PUT_FAILURES`:
  ``too_large``, ``closed``) ends at once;
- any other :class:`~kvferry.core.errors.KVFerryError` from the attempt is a local fault (a
  layout, a shape): it ends at once as ``error``, never retried.

The result is a :class:`PutAttempts` value; nothing here raises for a failed put.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

import attrs

from kvferry.core.errors import KVFerryError, PoolFullError
from kvferry.core.policy import RetryPolicy, put_failure_reason, retry_may_help

__all__ = ["PutAttempts", "put_with_retry"]


@attrs.frozen
class PutAttempts:
    """How a put ended: ``ok`` with ``size`` bytes published, else ``reason`` (a
    :data:`~kvferry.core.policy.PUT_FAILURES` word, or ``error`` for a local fault) and
    ``detail``; ``attempts`` made (0 when none could start)."""

    ok: bool
    size: int
    attempts: int
    reason: str = ""
    detail: str = ""


def _failure(info: Any) -> tuple[str, str]:
    info = info if isinstance(info, Mapping) else {}
    reason = put_failure_reason(info.get("reason"))
    detail = str(info.get("detail") or info.get("reason") or "put returned ok=False")
    return reason, detail


def put_with_retry(
    attempt: Callable[[], tuple[bool, int, Any]],
    retry: RetryPolicy,
    sleep: Callable[[float], None] = time.sleep,
) -> PutAttempts:
    """Run ``attempt`` under the rule in the module docstring."""
    delays = retry.delays()
    reason, detail = "put_failed", ""
    for n in range(retry.attempts):
        try:
            ok, size, info = attempt()
        except PoolFullError as exc:
            ok, size, info = False, 0, {"reason": exc.reason, "detail": str(exc)}
        except KVFerryError as exc:
            return PutAttempts(False, 0, n + 1, "error", str(exc))
        if ok:
            return PutAttempts(True, int(size), n + 1)
        reason, detail = _failure(info)
        if not retry_may_help(reason):
            return PutAttempts(False, 0, n + 1, reason, detail)
        if n < len(delays):
            sleep(delays[n])
    return PutAttempts(False, 0, retry.attempts, reason, detail)
