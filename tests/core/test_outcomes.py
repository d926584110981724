"""Typed send/receive outcomes and counters (SPEC 9.5, 9.10)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvferry.core.errors import ConfigError
from kvferry.core.outcomes import (
    Counters,
    ReceiveKind,
    ReceiveOutcome,
    SendKind,
    SendOutcome,
    SendReason,
    SkipReason,
)

PROPERTY = settings(max_examples=100, deadline=None)


def test_send_outcomes() -> None:
    ok = SendOutcome.sent("r1", keys=["r1_0_0_0_0", "r1_0_0_0_1"], nbytes=100, attempts=2, seconds=0.5)
    assert ok.ok and ok.kind is SendKind.SENT and ok.keys == ("r1_0_0_0_0", "r1_0_0_0_1")
    bad = SendOutcome.failed("r2", SendReason.POOL_FULL, "pool has 0 bytes free", failed_keys=("k",), attempts=3)
    assert not bad.ok and bad.reason is SendReason.POOL_FULL and bad.failed_keys == ("k",)
    skip = SendOutcome.skipped("r3")
    assert skip.kind is SendKind.SKIPPED and skip.reason is SendReason.NOT_SENDING and not skip.ok


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(kind=SendKind.SENT, reason=SendReason.ERROR), "SENT"),
        (dict(kind=SendKind.SENT, failed_keys=("k",)), "SENT"),
        (dict(kind=SendKind.FAILED), "reason"),
        (dict(kind=SendKind.FAILED, reason=SendReason.NOT_SENDING), "reason"),
        (dict(kind=SendKind.SKIPPED, reason=SendReason.ERROR), "NOT_SENDING"),
        (dict(kind=SendKind.SENT, nbytes=-1), "nbytes"),
        (dict(kind=SendKind.SENT, attempts=True), "attempts"),
        (dict(kind=SendKind.SENT, seconds=-0.1), "seconds"),
        (dict(kind=SendKind.SENT, seconds=float("nan")), "seconds"),
    ],
)
def test_send_outcome_invariants(kwargs: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        SendOutcome("r", **kwargs)


def test_receive_outcomes() -> None:
    ok = ReceiveOutcome.received("r", keys=("a", "b"), nbytes=10, seconds=0.1)
    assert ok.ok and not ok.is_timeout and not ok.is_error and ok.via == "connector"
    t = ReceiveOutcome.failed("r", ReceiveKind.TIMED_OUT, keys=("a", "b"), missing_keys=("b",), seconds=30.0)
    assert t.is_timeout and not t.is_error and not t.ok and t.missing_keys == ("b",)
    d = ReceiveOutcome.failed("r", ReceiveKind.DECODE_FAILED, "bad header")
    assert d.is_error and not d.is_timeout
    s = ReceiveOutcome.skipped("dummy_req_id", SkipReason.DUMMY)
    assert s.kind is ReceiveKind.SKIPPED and not s.ok and not s.is_error and not s.is_timeout
    c = ReceiveOutcome.failed("r", ReceiveKind.DROPPED_BY_CONSENSUS)
    assert not c.is_error and not c.is_timeout and not c.ok


def test_receive_outcome_invariants() -> None:
    with pytest.raises(ConfigError, match="skip_reason"):
        ReceiveOutcome("r", ReceiveKind.SKIPPED)
    with pytest.raises(ConfigError, match="skip_reason"):
        ReceiveOutcome("r", ReceiveKind.TIMED_OUT, skip_reason=SkipReason.DUMMY)
    with pytest.raises(ConfigError, match="missing"):
        ReceiveOutcome("r", ReceiveKind.RECEIVED, missing_keys=("a",))
    with pytest.raises(ConfigError, match="failure kind"):
        ReceiveOutcome.failed("r", ReceiveKind.RECEIVED)
    with pytest.raises(ConfigError, match="nbytes"):
        ReceiveOutcome.received("r", nbytes=-5)


def test_outcomes_are_frozen_values() -> None:
    a = ReceiveOutcome.received("r", keys=["k"], nbytes=1)
    assert a == ReceiveOutcome.received("r", keys=("k",), nbytes=1)
    assert hash(a) == hash(ReceiveOutcome.received("r", keys=("k",), nbytes=1))
    with pytest.raises(AttributeError):
        a.nbytes = 2  # type: ignore[misc]


def test_counters_keep_timeouts_and_errors_apart() -> None:
    c = Counters()
    c.record(ReceiveOutcome.failed("a", ReceiveKind.TIMED_OUT))
    c.record(ReceiveOutcome.failed("b", ReceiveKind.TIMED_OUT))
    c.record(ReceiveOutcome.failed("c", ReceiveKind.DECODE_FAILED))
    c.record(ReceiveOutcome.received("d", nbytes=7))
    c.record(ReceiveOutcome.skipped("e", SkipReason.DUMMY))
    c.record(SendOutcome.failed("f", SendReason.POOL_FULL))
    c.record(SendOutcome.sent("g", keys=("k",), nbytes=5, attempts=1, seconds=0.0))
    snap = c.snapshot()
    assert c.timeouts == 2 and c.errors == 2
    assert snap["recv.timed_out"] == 2 and snap["recv.decode_failed"] == 1
    assert snap["recv.received"] == 1 and snap["recv.bytes"] == 7
    assert snap["recv.skipped"] == 1 and snap["recv.skipped.dummy"] == 1
    assert snap["send.failed"] == 1 and snap["send.failed.pool_full"] == 1
    assert snap["send.sent"] == 1 and snap["send.bytes"] == 5
    snap["timeouts"] = 99  # a snapshot is a copy
    assert c.timeouts == 2


recv_kinds = st.sampled_from([k for k in ReceiveKind if k not in (ReceiveKind.RECEIVED, ReceiveKind.SKIPPED)])


@PROPERTY
@given(
    st.lists(
        st.one_of(
            st.builds(lambda k: ReceiveOutcome.failed("r", k), recv_kinds),
            st.builds(lambda n: ReceiveOutcome.received("r", nbytes=n), st.integers(0, 1000)),
            st.builds(lambda s: ReceiveOutcome.skipped("r", s), st.sampled_from(list(SkipReason))),
        ),
        max_size=30,
    )
)
def test_counter_totals(outcomes: list[ReceiveOutcome]) -> None:
    c = Counters()
    for o in outcomes:
        c.record(o)
    snap = c.snapshot()
    assert sum(v for k, v in snap.items() if k.startswith("recv.") and k.count(".") == 1 and k != "recv.bytes") == len(
        outcomes
    )
    assert c.timeouts == sum(o.is_timeout for o in outcomes)
    assert c.errors == sum(o.is_error for o in outcomes)
    assert c.get("recv.bytes") == sum(o.nbytes for o in outcomes)


class _CountingLock:
    def __init__(self) -> None:
        self.entered = 0

    def __enter__(self) -> None:
        self.entered += 1

    def __exit__(self, *exc: object) -> None:
        return None


def test_counters_use_the_injected_lock() -> None:
    lock = _CountingLock()
    c = Counters(lock=lock)
    c.incr("x")
    c.incr("x", 2)
    c.record(ReceiveOutcome.received("r"))
    assert c.snapshot()["x"] == 3
    assert lock.entered == 4
    with pytest.raises(ConfigError):
        c.incr("x", -1)
    with pytest.raises(ConfigError):
        c.record("not an outcome")  # type: ignore[arg-type]
