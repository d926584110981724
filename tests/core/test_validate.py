"""The shared argument checks: which values pass, and the error type and message otherwise."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvferry.core.errors import ConfigError, RoutingError
from kvferry.core.validate import check_int, check_seconds


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
