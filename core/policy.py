"""Retry, backoff, deadline, lease and prefetch-gate policies as pure functions of time.

Nothing here reads a clock: every ``now_s`` is a monotonic time in seconds passed in by the
caller (an injected :class:`~kvferry.core.ports.Clock`), so tests drive time by hand.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Any

import attrs

from kvferry.core.errors import ConfigError
from kvferry.core.roles import ReceiveRole
from kvferry.core.validate import check_int, check_number

__all__ = [
    "RetryPolicy",
    "PUT_FAILURES",
    "UNRETRIED_PUT_FAILURES",
    "put_failure_reason",
    "retry_may_help",
    "PollBackoff",
    "SENDER_DOWN_GRACE_S",
    "SenderLiveness",
    "Deadline",
    "lease_expired",
    "PREFETCH_OK",
    "prefetch_allowed",
]


def _number(name: str, value: Any, *, minimum: float, inclusive: bool = True) -> float:
    if inclusive:
        return check_number(name, value, minimum=minimum)
    return check_number(name, value, above=minimum)


def _check(minimum: float, inclusive: bool = True) -> Callable[[Any, attrs.Attribute[float], Any], None]:
    def validator(instance: Any, attribute: attrs.Attribute[float], value: Any) -> None:
        _number(attribute.name, value, minimum=minimum, inclusive=inclusive)

    return validator


def _positive_int(instance: Any, attribute: attrs.Attribute[int], value: Any) -> None:
    check_int(attribute.name, value, 1)


@attrs.frozen
class RetryPolicy:
    """Bounded retries of a put: ``attempts`` tries with doubling sleeps between them.

    Defaults are the reference's: 3 attempts, 0.1 s then 0.2 s between them (seconds).
    """

    attempts: int = attrs.field(default=3, validator=_positive_int)
    first_backoff_s: float = attrs.field(default=0.1, validator=_check(0.0))
    factor: float = attrs.field(default=2.0, validator=_check(1.0))

    def delays(self) -> tuple[float, ...]:
        """Sleep before attempt ``i + 2``, for each retry: ``attempts - 1`` values (seconds)."""
        return tuple(self.first_backoff_s * self.factor**i for i in range(self.attempts - 1))

    def total_backoff_s(self) -> float:
        """Seconds spent sleeping when every attempt fails."""
        return sum(self.delays())


#: Why a put did not publish: no room now, never fits, connector gone, anything else.
PUT_FAILURES = ("pool_full", "too_large", "closed", "put_failed")
#: Put failures that another attempt cannot cure: the payload never fits; the connector is gone.
UNRETRIED_PUT_FAILURES = ("too_large", "closed")


def put_failure_reason(reason: object) -> str:
    """The put failure word for a connector's ``reason`` (anything unknown is ``put_failed``)."""
    return reason if isinstance(reason, str) and reason in PUT_FAILURES else "put_failed"


def retry_may_help(reason: str) -> bool:
    """Whether another attempt of a put that failed for ``reason`` can succeed (the one rule)."""
    return put_failure_reason(reason) not in UNRETRIED_PUT_FAILURES


#: Seconds a sender endpoint that was reached before may stay unreachable before the gets asking
#: it give up on it (a sender restarted on its port within this is asked as usual; zmq itself
#: retries the connection every 0.1-0.5 s meanwhile).
SENDER_DOWN_GRACE_S = 1.5


@attrs.define
class SenderLiveness:
    """Whether the gets asking one sender endpoint should give up on it (the sender died) or
    keep waiting for it (it has not started yet, or it is back). Fed by the caller:

    - :meth:`reached` when a connection to it came up or a reply came from it;
    - :meth:`failed` when a request to it could not connect or lost its connection; True means
      give up now: the connection dropped while a request was out on it (its reply can no
      longer come), or the endpoint was reached before and has been unreachable for
      ``grace_s`` since. An endpoint never reached is never given up on: a receiver may start
      before its sender, and its deadline bounds that wait.
    """

    grace_s: float = SENDER_DOWN_GRACE_S
    was_reached: bool = False
    down_since: float | None = None

    def reached(self) -> None:
        self.was_reached, self.down_since = True, None

    def failed(self, now_s: float, *, dropped: bool = False) -> bool:
        if dropped:
            self.was_reached = True  # it was up: a drop is the end of a connection that was made
        if not self.was_reached:
            return False
        if self.down_since is None:
            self.down_since = now_s
        return dropped or now_s - self.down_since >= self.grace_s


@attrs.frozen
class PollBackoff:
    """Sleep durations while polling a non-blocking ``get``: 10 ms doubling to a 0.5 s cap.

    ``delay(n)`` is the ``n``-th sleep (0-based); ``sleeps(remaining_s)`` never sleeps past the
    caller's deadline. Invariants: delays are non-decreasing, each within
    ``[first_s, max_s]``.
    """

    first_s: float = attrs.field(default=0.010, validator=_check(0.0, inclusive=False))
    factor: float = attrs.field(default=2.0, validator=_check(1.0))
    max_s: float = attrs.field(default=0.5, validator=_check(0.0, inclusive=False))

    def __attrs_post_init__(self) -> None:
        if self.max_s < self.first_s:
            raise ConfigError(f"max_s ({self.max_s}) must be >= first_s ({self.first_s})")

    def delay(self, n: int) -> float:
        """The ``n``-th sleep in seconds (``n >= 0``)."""
        check_int("poll index", n, 0)
        if self.factor == 1.0:
            return self.first_s
        # stop growing once capped (avoids float overflow for large n)
        cap_index = math.ceil(math.log(self.max_s / self.first_s, self.factor))
        if n >= cap_index:
            return self.max_s
        return min(self.first_s * self.factor**n, self.max_s)

    def __iter__(self) -> Iterator[float]:
        """The endless schedule ``delay(0), delay(1), ...``."""
        n = 0
        while True:
            yield self.delay(n)
            n += 1

    def next_sleep(self, n: int, remaining_s: float) -> float:
        """The ``n``-th sleep clipped to the time left before a deadline (never negative)."""
        return max(0.0, min(self.delay(n), remaining_s))

    def delays(self, count: int) -> tuple[float, ...]:
        """The first ``count`` sleeps."""
        return tuple(self.delay(i) for i in range(count))


@attrs.frozen
class Deadline:
    """A point in monotonic time ``start_s + timeout_s`` (seconds).

    ``timeout_s`` must be >= 0 and finite. ``expired(now)`` is True from the deadline on;
    ``remaining(now)`` is never negative.
    """

    start_s: float = attrs.field(validator=_check(-math.inf))
    timeout_s: float = attrs.field(validator=_check(0.0))

    @property
    def at_s(self) -> float:
        return self.start_s + self.timeout_s

    def remaining(self, now_s: float) -> float:
        """Seconds left at ``now_s`` (0.0 once expired)."""
        return max(0.0, self.at_s - now_s)

    def expired(self, now_s: float) -> bool:
        return now_s >= self.at_s

    def elapsed(self, now_s: float) -> float:
        """Seconds since ``start_s`` (0.0 if ``now_s`` is earlier)."""
        return max(0.0, now_s - self.start_s)


def lease_expired(created_s: float, lease_s: float | None, now_s: float) -> bool:
    """Whether a payload stored at ``created_s`` with a lease of ``lease_s`` seconds has expired.

    ``lease_s=None`` means no lease (never expires). Expiry is inclusive: at exactly
    ``created_s + lease_s`` the lease is over.
    """
    if lease_s is None:
        return False
    _number("lease_s", lease_s, minimum=0.0, inclusive=False)
    return now_s - created_s >= lease_s


#: The reason returned with an allowed prefetch.
PREFETCH_OK = "ok"


def prefetch_allowed(
    enabled: bool,
    role: ReceiveRole,
    has_sender_info: bool,
    in_flight: bool,
    free_ratio: float | None,
    min_free_ratio: float,
) -> tuple[bool, str]:
    """Whether to start a prefetch, and why not (SPEC 7).

    Checked in this order; the first failing check names the reason:
    ``"disabled"``, ``"follower"`` (followers never touch the connector), ``"no_sender_info"``,
    ``"in_flight"`` (this request id is already being prefetched), ``"low_memory"`` (free
    device memory ratio below ``min_free_ratio``). ``free_ratio=None`` means unknown and does
    not block; ``min_free_ratio <= 0`` disables the memory check. Allowed -> ``(True, "ok")``.
    """
    if not isinstance(role, ReceiveRole):
        raise ConfigError(f"role must be a ReceiveRole, got {role!r}")
    minimum = _number("kv_prefetch_min_free_mem_ratio", min_free_ratio, minimum=0.0)
    if minimum > 1.0:
        raise ConfigError(f"kv_prefetch_min_free_mem_ratio must be <= 1, got {min_free_ratio!r}")
    if not enabled:
        return False, "disabled"
    if role is ReceiveRole.FOLLOWER:
        return False, "follower"
    if not has_sender_info:
        return False, "no_sender_info"
    if in_flight:
        return False, "in_flight"
    if free_ratio is not None and minimum > 0.0:
        ratio = _number("free_ratio", free_ratio, minimum=0.0)
        if ratio < minimum:
            return False, "low_memory"
    return True, PREFETCH_OK
