"""SPEC 2.5: sender info resolution."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvferry.core.errors import RoutingError
from kvferry.core.sender_info import SenderEndpoint, resolve_sender, resolve_sender_info

A = {"host": "10.0.0.1", "zmq_port": 50151}
B = {"host": "10.0.0.2", "zmq_port": 50152}


@pytest.mark.parametrize(
    ("info", "stage", "expected"),
    [
        (A, 0, SenderEndpoint("10.0.0.1", 50151)),
        (A, None, SenderEndpoint("10.0.0.1", 50151)),
        ({"host": "h"}, 3, SenderEndpoint("h", None)),
        ({"host": "h", "zmq_port": "6000"}, 0, SenderEndpoint("h", 6000)),
        ({0: A, 1: B}, 1, SenderEndpoint("10.0.0.2", 50152)),
        ({"0": A, "1": B}, 1, SenderEndpoint("10.0.0.2", 50152)),
        ({0: A, 1: B}, "1", SenderEndpoint("10.0.0.2", 50152)),
        ({"llm": A, "dit": B}, "llm", SenderEndpoint("10.0.0.1", 50151)),
        ({"-1": A, 5: B}, -1, SenderEndpoint("10.0.0.1", 50151)),
        ({7: A}, 0, SenderEndpoint("10.0.0.1", 50151)),  # exactly one entry with a host
        ({7: A, "meta": {"x": 1}, "n": 3}, 0, SenderEndpoint("10.0.0.1", 50151)),
        ({7: A}, None, SenderEndpoint("10.0.0.1", 50151)),
    ],
)
def test_resolved(info: object, stage: object, expected: SenderEndpoint) -> None:
    assert resolve_sender_info(info, stage) == expected
    result = resolve_sender(info, stage)
    assert result.resolved and result.reason is None


@pytest.mark.parametrize(
    ("info", "stage", "reason"),
    [
        (None, 0, "no sender info"),
        ("10.0.0.1:5000", 0, "not a dict"),
        ({}, 0, "no entry for stage 0"),
        ({0: A, 1: B}, 2, "ambiguous"),
        ({0: A, 1: B}, None, "ambiguous"),
        ({"host": ""}, 0, "no usable host"),
        ({"host": None}, 0, "no usable host"),
        ({"host": "h", "zmq_port": 0}, 0, "invalid zmq_port"),
        ({"host": "h", "zmq_port": "x"}, 0, "invalid zmq_port"),
        ({"host": "h", "zmq_port": True}, 0, "invalid zmq_port"),
        ({0: {"zmq_port": 1}, 1: B}, 0, "no usable host"),  # never falls back to another stage
        ({0: "h", 1: B}, 0, "not a dict"),
        ({1: {"zmq_port": 5}}, 0, "no entry with a host"),
    ],
)
def test_unresolved_with_reason(info: object, stage: object, reason: str) -> None:
    assert resolve_sender_info(info, stage) is None
    result = resolve_sender(info, stage)
    assert not result.resolved
    assert reason in (result.reason or "")


def test_unhashable_stage_does_not_raise() -> None:
    assert resolve_sender_info({7: A}, ["x"]) == SenderEndpoint("10.0.0.1", 50151)


def test_stage_key_is_reported() -> None:
    assert resolve_sender({"0": A, "1": B}, 0).stage_key == "0"
    assert resolve_sender(A, 0).stage_key is None


@settings(max_examples=100, deadline=None)
@given(
    st.dictionaries(
        st.one_of(st.integers(0, 5), st.sampled_from(["0", "1", "2", "x"])),
        st.one_of(
            st.fixed_dictionaries({"host": st.sampled_from(["a", "b"]), "zmq_port": st.integers(1, 65535)}),
            st.none(),
            st.integers(),
            st.fixed_dictionaries({"zmq_port": st.integers(1, 9)}),
        ),
        max_size=5,
    ),
    st.one_of(st.integers(0, 5), st.sampled_from(["0", "1", "x"]), st.none()),
)
def test_never_raises_and_never_picks_another_stage_when_own_entry_exists(info: dict, stage: object) -> None:
    result = resolve_sender(info, stage)
    assert result.resolved == (result.reason is None)
    own = [k for k in info if stage is not None and (k == stage or str(k) == str(stage)) and info[k] is not None]
    if result.resolved and own:
        assert str(result.stage_key) == str(stage)
    if result.resolved and not own:
        assert sum(isinstance(v, dict) and "host" in v for v in info.values()) == 1


def test_endpoint_validation() -> None:
    with pytest.raises(RoutingError, match="host"):
        SenderEndpoint("", 1)
    with pytest.raises(RoutingError, match="port"):
        SenderEndpoint("h", 70000)
    with pytest.raises(RoutingError, match="port"):
        SenderEndpoint("h", True)  # type: ignore[arg-type]
