"""Retry / poll / deadline / lease schedules and the prefetch gate, driven by injected numbers."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvferry.core.errors import ConfigError
from kvferry.core.policy import (
    PREFETCH_OK,
    SENDER_DOWN_GRACE_S,
    Deadline,
    PollBackoff,
    RetryPolicy,
    SenderLiveness,
    lease_expired,
    prefetch_allowed,
)
from kvferry.core.roles import ReceiveRole

PROPERTY = settings(max_examples=100, deadline=None)
times = st.floats(min_value=0.0, max_value=1e6, allow_nan=False)


def test_retry_defaults_match_reference() -> None:
    policy = RetryPolicy()
    assert policy.attempts == 3
    assert policy.delays() == pytest.approx((0.1, 0.2))
    assert policy.total_backoff_s() == pytest.approx(0.3)
    assert RetryPolicy(attempts=1).delays() == ()
    assert RetryPolicy(attempts=4, first_backoff_s=1.0, factor=3.0).delays() == (1.0, 3.0, 9.0)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        (dict(attempts=0), "attempts"),
        (dict(attempts=True), "attempts"),
        (dict(attempts=2.0), "attempts"),
        (dict(first_backoff_s=-0.1), "first_backoff_s"),
        (dict(first_backoff_s=math.nan), "first_backoff_s"),
        (dict(factor=0.5), "factor"),
        (dict(factor="2"), "factor"),
    ],
)
def test_retry_rejects_bad_values(kwargs: dict, field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        RetryPolicy(**kwargs)


def test_poll_defaults() -> None:
    poll = PollBackoff()
    assert poll.delays(8) == pytest.approx((0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.5, 0.5))
    assert poll.delay(10_000) == 0.5
    it = iter(poll)
    assert [next(it) for _ in range(3)] == pytest.approx([0.01, 0.02, 0.04])


@PROPERTY
@given(
    st.floats(1e-4, 1.0),
    st.floats(1.0, 4.0),
    st.floats(1e-4, 5.0),
    st.integers(0, 200),
    st.floats(0.0, 10.0),
)
def test_poll_schedule_invariants(first: float, factor: float, cap: float, n: int, left: float) -> None:
    if cap < first:
        with pytest.raises(ConfigError, match="max_s"):
            PollBackoff(first, factor, cap)
        return
    poll = PollBackoff(first, factor, cap)
    d = poll.delays(n + 2)
    assert all(first - 1e-12 <= x <= cap for x in d)
    assert all(a <= b + 1e-12 for a, b in zip(d, d[1:]))
    s = poll.next_sleep(n, left)
    assert 0.0 <= s <= left and s <= poll.delay(n)


def test_poll_rejects_bad_values() -> None:
    with pytest.raises(ConfigError, match="first_s"):
        PollBackoff(first_s=0.0)
    with pytest.raises(ConfigError, match="index"):
        PollBackoff().delay(-1)
    assert PollBackoff(first_s=0.1, factor=1.0, max_s=0.3).delays(3) == (0.1, 0.1, 0.1)


@PROPERTY
@given(times, st.floats(0.0, 1e4), times)
def test_deadline(start: float, timeout: float, now: float) -> None:
    d = Deadline(start, timeout)
    assert d.at_s == start + timeout
    assert d.remaining(now) >= 0.0
    assert d.expired(now) == (now >= start + timeout)
    assert (d.remaining(now) == 0.0) or not d.expired(now)
    assert d.elapsed(now) >= 0.0


def test_deadline_boundaries() -> None:
    d = Deadline(10.0, 30.0)
    assert d.remaining(10.0) == 30.0 and not d.expired(39.999)
    assert d.expired(40.0) and d.remaining(40.0) == 0.0 and d.remaining(100.0) == 0.0
    assert d.elapsed(25.0) == 15.0
    assert Deadline(5.0, 0.0).expired(5.0)
    with pytest.raises(ConfigError, match="timeout_s"):
        Deadline(0.0, -1.0)
    with pytest.raises(ConfigError, match="timeout_s"):
        Deadline(0.0, math.inf)


def test_lease() -> None:
    assert not lease_expired(100.0, 5.0, 104.9)
    assert lease_expired(100.0, 5.0, 105.0)
    assert not lease_expired(100.0, None, 1e9)
    with pytest.raises(ConfigError, match="lease_s"):
        lease_expired(0.0, 0.0, 1.0)
    with pytest.raises(ConfigError, match="lease_s"):
        lease_expired(0.0, -3.0, 1.0)


@PROPERTY
@given(times, st.floats(0.001, 1e4), times)
def test_lease_monotone(created: float, lease: float, now: float) -> None:
    if lease_expired(created, lease, now):
        assert lease_expired(created, lease, now + 1.0)


GATE_OK = dict(
    enabled=True, role=ReceiveRole.LOCAL, has_sender_info=True, in_flight=False, free_ratio=0.5, min_free_ratio=0.2
)


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({}, PREFETCH_OK),
        (dict(role=ReceiveRole.LEADER), PREFETCH_OK),
        (dict(enabled=False), "disabled"),
        (dict(role=ReceiveRole.FOLLOWER), "follower"),
        (dict(has_sender_info=False), "no_sender_info"),
        (dict(in_flight=True), "in_flight"),
        (dict(free_ratio=0.1), "low_memory"),
        (dict(free_ratio=0.2), PREFETCH_OK),
        (dict(free_ratio=None), PREFETCH_OK),
        (dict(free_ratio=0.0, min_free_ratio=0.0), PREFETCH_OK),
        (dict(enabled=False, role=ReceiveRole.FOLLOWER), "disabled"),
    ],
)
def test_prefetch_gate(change: dict, reason: str) -> None:
    args = {**GATE_OK, **change}
    assert prefetch_allowed(**args) == (reason == PREFETCH_OK, reason)


def test_prefetch_gate_rejects_bad_values() -> None:
    with pytest.raises(ConfigError, match="kv_prefetch_min_free_mem_ratio"):
        prefetch_allowed(**{**GATE_OK, "min_free_ratio": 1.5})
    with pytest.raises(ConfigError, match="kv_prefetch_min_free_mem_ratio"):
        prefetch_allowed(**{**GATE_OK, "min_free_ratio": -0.1})
    with pytest.raises(ConfigError, match="role"):
        prefetch_allowed(**{**GATE_OK, "role": "local"})


_EVENTS = st.lists(
    st.tuples(st.sampled_from(["reached", "failed", "dropped"]), st.floats(0, 5, allow_nan=False)), max_size=30
)


@settings(max_examples=300)
@given(_EVENTS)
def test_a_sender_is_given_up_on_only_after_it_was_reached(events) -> None:
    """Against a model: an endpoint is given up on when a connection to it drops while a request
    is out, or when it was reached (a connection or a reply) and then failed for ``grace_s``
    without being reached again; never when it has not been reached at all."""
    live, now, reached, down_since = SenderLiveness(), 0.0, False, None
    for kind, step in events:
        now += step
        if kind == "reached":
            live.reached()
            reached, down_since = True, None
            continue
        dropped = kind == "dropped"
        reached = reached or dropped
        if reached and down_since is None:
            down_since = now
        expected = reached and (dropped or now - down_since >= SENDER_DOWN_GRACE_S)
        assert live.failed(now, dropped=dropped) is expected
        assert reached or not expected  # never reached: never given up on


def test_a_restarted_sender_within_the_grace_is_waited_for_again() -> None:
    live = SenderLiveness(grace_s=1.5)
    assert live.failed(0.0) is False and live.failed(10.0) is False  # never reached: wait on
    live.reached()
    assert live.failed(20.0) is False and live.failed(21.4) is False  # down 1.4 s: within the grace
    live.reached()  # back
    assert live.failed(22.0) is False and live.failed(23.5) is True  # down 1.5 s since 22.0
    assert SenderLiveness().failed(0.0, dropped=True) is True  # a connection dropped under a request
