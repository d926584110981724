"""The shared argument checks: which values pass, and the error type and message otherwise."""

from __future__ import annotations

import math
import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvferry.core.errors import ConfigError, RoutingError
from kvferry.core.validate import check_int, check_number, check_seconds


@given(st.integers(-10, 10), st.integers(-5, 5))
def test_check_int_passes_integers_at_or_above_the_bound(value: int, minimum: int) -> None:
    if value >= minimum:
        assert check_int("n", value, minimum) == value
    else:
        with pytest.raises(ConfigError, match=f"n must be >= {minimum}, got {value}"):
            check_int("n", value, minimum)


@pytest.mark.parametrize("value", [True, 1.0, "1", None])
def test_check_int_refuses_non_integers_with_the_callers_error(value: object) -> None:
    with pytest.raises(RoutingError, match="tp_rank must be an integer"):
        check_int("tp_rank", value, 0, RoutingError)


@given(st.floats(allow_nan=True, allow_infinity=True) | st.integers(-3, 3) | st.booleans())
def test_check_seconds_passes_positive_finite_numbers_only(value: object) -> None:
    good = not isinstance(value, bool) and value > 0 and math.isfinite(value)
    if good:
        assert check_seconds("lease_s", value) == float(value)
    else:
        with pytest.raises(ConfigError, match="lease_s must be"):
            check_seconds("lease_s", value)


@given(st.floats(allow_nan=True, allow_infinity=True) | st.integers(-3, 3) | st.booleans(), st.integers(-2, 2))
def test_check_number_passes_finite_numbers_in_bounds_only(value: object, low: int) -> None:
    good = not isinstance(value, bool) and math.isfinite(value) and low <= value <= low + 1
    if good:
        assert check_number("ratio", value, minimum=low, maximum=low + 1) == float(value)
    else:
        with pytest.raises(RoutingError, match="ratio must be"):
            check_number("ratio", value, RoutingError, minimum=low, maximum=low + 1)


@pytest.mark.parametrize("value", [0, -1, True, "2", float("nan")])
def test_expected_words_every_refusal_of_a_check_alike(value: object) -> None:
    with pytest.raises(ConfigError, match=rf"^size must be a positive integer, got {re.escape(repr(value))}$"):
        check_int("size", value, 1, expected="a positive integer")
    with pytest.raises(ConfigError, match=rf"^wait must be > 0, got {re.escape(repr(value))}$"):
        check_number("wait", value, above=0.0, expected="> 0")
