"""The one put primitive (app/put.py): one retry rule, one failure vocabulary, typed PoolFullError."""

from __future__ import annotations

import pytest

from kvferry.app.put import PutAttempts, put_with_retry
from kvferry.core.errors import ConfigError, PoolFullError
from kvferry.core.policy import RetryPolicy, put_failure_reason, retry_may_help


def _attempts(*results):
    """An attempt callable returning (or raising) ``results`` in turn, and the list of calls."""
    calls: list[int] = []

    def attempt():
        calls.append(len(calls))
        result = results[len(calls) - 1]
        if isinstance(result, BaseException):
            raise result
        return result

    return attempt, calls


def test_a_full_pool_is_retried_with_the_policy_backoff_then_succeeds() -> None:
    attempt, calls = _attempts(
        (False, 0, {"reason": "pool_full", "detail": "no room"}), PoolFullError("pool_full: x"), (True, 64, None)
    )
    slept: list[float] = []
    done = put_with_retry(attempt, RetryPolicy(attempts=3, first_backoff_s=0.1), slept.append)
    assert done == PutAttempts(True, 64, 3)
    assert slept == [0.1, 0.2] and len(calls) == 3


def test_a_payload_that_never_fits_or_a_closed_connector_is_not_retried() -> None:
    for failure in ((False, 0, {"reason": "too_large", "detail": "8 GiB"}), PoolFullError("closed: gone")):
        attempt, calls = _attempts(failure, (True, 1, None))
        slept: list[float] = []
        done = put_with_retry(attempt, RetryPolicy(attempts=5), slept.append)
        assert not done.ok and done.attempts == 1 and done.reason in ("too_large", "closed")
        assert slept == [] and len(calls) == 1


def test_a_local_fault_ends_at_once_as_error() -> None:
    attempt, calls = _attempts(ConfigError("bad layout"), (True, 1, None))
    done = put_with_retry(attempt, RetryPolicy(attempts=5), lambda s: None)
    assert done == PutAttempts(False, 0, 1, "error", "bad layout") and len(calls) == 1


def test_every_attempt_failing_reports_the_last_reason() -> None:
    attempt, calls = _attempts(*[(False, 0, {"reason": "weird", "detail": "d"})] * 4)
    done = put_with_retry(attempt, RetryPolicy(attempts=4), lambda s: None)
    assert done == PutAttempts(False, 0, 4, "put_failed", "d") and len(calls) == 4


def test_pool_full_error_carries_a_typed_reason() -> None:
    assert PoolFullError("too_large: 9 bytes over").reason == "too_large"
    assert PoolFullError("too_large: 9 bytes over").detail == "9 bytes over"
    assert PoolFullError("no room at all").reason == "pool_full"
    typed = PoolFullError(reason="closed", detail="shut")
    assert (typed.reason, typed.detail, str(typed)) == ("closed", "shut", "closed: shut")


@pytest.mark.parametrize(
    ("reason", "word", "retry"),
    [
        ("pool_full", "pool_full", True),
        ("too_large", "too_large", False),
        ("closed", "closed", False),
        (None, "put_failed", True),
        ("x", "put_failed", True),
    ],
)
def test_the_retry_rule(reason, word, retry) -> None:
    assert put_failure_reason(reason) == word
    assert retry_may_help(word) is retry
