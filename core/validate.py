"""Argument checks every layer shares: an integer in bounds, a port, a finite number in
bounds, a positive duration.

Each raises the caller's error type (``RoutingError`` for routing numbers, ``ConfigError`` for
settings, ``PayloadError`` for remote data) with a message naming the field, so every module
reports bad input the same way. Modules do not write these checks out again. ``expected``
(``check_int``, ``check_port``, ``check_number``) words every refusal as one phrase, ``"{name}
must be {expected}, got {value!r}"``, where a module's documented message says what it wants
in its own words (``"a positive integer"``, ``"a port number in 1..65535"``); the rule is the
helper's either way.
"""

from __future__ import annotations

import math
from typing import Any

from kvferry.core.errors import ConfigError, KVFerryError

__all__ = ["check_int", "check_number", "check_port", "check_seconds"]


def check_int(
    name: str,
    value: Any,
    minimum: int,
    error: type[KVFerryError] = ConfigError,
    maximum: int | None = None,
    *,
    expected: str | None = None,
) -> int:
    """``value`` when it is an int (not a bool) ``>= minimum`` (and ``<= maximum`` when given);
    else ``error`` naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise error(
            f"{name} must be {expected}, got {value!r}" if expected else f"{name} must be an integer, got {value!r}"
        )
    if value < minimum:
        raise error(
            f"{name} must be {expected}, got {value!r}" if expected else f"{name} must be >= {minimum}, got {value}"
        )
    if maximum is not None and value > maximum:
        raise error(
            f"{name} must be {expected}, got {value!r}" if expected else f"{name} must be <= {maximum}, got {value}"
        )
    return value


def check_port(name: str, value: Any, error: type[KVFerryError] = ConfigError, *, expected: str | None = None) -> int:
    """``value`` when it is a port number (an int in 1..65535); else ``error`` naming ``name``."""
    return check_int(name, value, 1, error, 65535, expected=expected)


def check_number(
    name: str,
    value: Any,
    error: type[KVFerryError] = ConfigError,
    *,
    minimum: float | None = None,
    above: float | None = None,
    maximum: float | None = None,
    expected: str | None = None,
) -> float:
    """``value`` as a float when it is a finite number (an int or a float, not a bool), ``>=
    minimum``, ``> above`` and ``<= maximum`` where given; else ``error`` naming ``name``."""

    def refuse(plain: str) -> KVFerryError:
        return error(f"{name} must be {expected}, got {value!r}" if expected else f"{name} must be {plain}")

    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise refuse(f"a number, got {value!r}")
    number = float(value)
    if math.isnan(number) or math.isinf(number):
        raise refuse(f"finite, got {number!r}")
    if minimum is not None and number < minimum:
        raise refuse(f">= {minimum}, got {number!r}")
    if above is not None and number <= above:
        raise refuse(f"> {above}, got {number!r}")
    if maximum is not None and number > maximum:
        raise refuse(f"<= {maximum}, got {number!r}")
    return number


def check_seconds(name: str, value: Any, error: type[KVFerryError] = ConfigError) -> float:
    """``value`` as a float when it is a positive, finite number (not a bool); else ``error``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise error(f"{name} must be a positive number of seconds, got {value!r}")
    if value == float("inf"):
        raise error(f"{name} must be finite, got {value!r}")
    return float(value)
