"""core.recent: the bounded "last N keys" memory, against a plain model."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvferry.core.errors import ConfigError
from kvferry.core.recent import Recent

ops = st.lists(
    st.tuples(st.sampled_from(["note", "pop", "get"]), st.integers(0, 12), st.integers()),
    max_size=80,
)


@given(limit=st.integers(1, 6), steps=ops)
@settings(max_examples=300, deadline=None)
def test_recent_keeps_the_newest_noted_keys_and_forgets_the_oldest_first(limit: int, steps: list) -> None:
    recent: Recent[int, int] = Recent(limit)
    model: list[tuple[int, int]] = []  # (key, value), oldest first
    for op, key, value in steps:
        if op == "note":
            model = [kv for kv in model if kv[0] != key] + [(key, value)]
            expected = [k for k, _ in model[: max(0, len(model) - limit)]]
            model = model[len(expected) :]
            assert recent.note(key, value) == expected
            assert key not in expected
        elif op == "pop":
            was = dict(model).get(key)
            model = [kv for kv in model if kv[0] != key]
            assert recent.pop(key) == was
        else:
            assert recent.get(key) == dict(model).get(key)
        assert len(recent) == len(model) <= limit
        assert list(recent) == [k for k, _ in model]
        assert all((k in recent) for k, _ in model)


def test_a_key_noted_again_is_the_newest_and_keeps_its_neighbours() -> None:
    recent: Recent[str, str] = Recent(2)
    assert recent.note("a", "1") == [] and recent.note("b", "2") == []
    assert recent.note("a", "3") == []  # "a" again: now the newest, nothing forgotten
    assert recent.note("c", "4") == ["b"]  # so "b" is the oldest
    assert list(recent) == ["a", "c"] and recent.get("a") == "3"
    assert recent.get("b", "gone") == "gone" and not recent.pop("b")


@pytest.mark.parametrize("limit", [0, -1, 1.5, True])
def test_a_limit_that_holds_nothing_is_refused_naming_it(limit: object) -> None:
    with pytest.raises(ConfigError, match="limit"):
        Recent(limit)  # type: ignore[arg-type]
