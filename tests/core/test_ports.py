"""``Implements``: a remembered runtime Protocol check that never answers for a stale object."""

from __future__ import annotations

from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from kvferry.core.ports import BlockingGet, Implements


class _Blocking:
    def get_blocking(
        self, from_stage: str, to_stage: str, get_key: str, metadata: Any = None, *, timeout_s: float
    ) -> None:
        return None


class _Plain:
    pass


@given(st.lists(st.sampled_from([0, 1, 2]), max_size=30))
def test_implements_answers_like_isinstance_for_any_sequence_of_objects(picks: list[int]) -> None:
    objects = [_Blocking(), _Plain(), None]
    check = Implements(BlockingGet)
    for pick in picks:
        assert check(objects[pick]) is isinstance(objects[pick], BlockingGet)


class _Counted(type):
    checks: list = []

    def __instancecheck__(cls, obj: Any) -> bool:
        cls.checks.append(obj)
        return isinstance(obj, _Blocking)


class _Probe(metaclass=_Counted):
    pass


def test_implements_checks_each_object_once_and_a_new_object_again() -> None:
    _Counted.checks = []
    check = Implements(_Probe)
    first, second = _Blocking(), _Plain()
    assert check(first) and check(first) and check(first)
    assert _Counted.checks == [first]
    assert not check(second) and _Counted.checks == [first, second]
    assert check(first) and _Counted.checks == [first, second, first]
