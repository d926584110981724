"""Argument checks the pure core shares: an integer at or above a bound, a positive duration.

Each raises the caller's error type (``RoutingError`` for routing numbers, ``ConfigError`` for
settings) with a message naming the field, so every module reports bad input the same way.
"""

from __future__ import annotations

from typing import Any

from kvferry.core.errors import ConfigError, KVFerryError

__all__ = ["check_int", "check_seconds"]


def check_int(name: str, value: Any, minimum: int, error: type[KVFerryError] = ConfigError) -> int:
    """``value`` when it is an int (not a bool) ``>= minimum``; else ``error`` naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise error(f"{name} must be an integer, got {value!r}")
    if value < minimum:
        raise error(f"{name} must be >= {minimum}, got {value}")
    return value


def check_seconds(name: str, value: Any, error: type[KVFerryError] = ConfigError) -> float:
    """``value`` as a float when it is a positive, finite number (not a bool); else ``error``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise error(f"{name} must be a positive number of seconds, got {value!r}")
    if value == float("inf"):
        raise error(f"{name} must be finite, got {value!r}")
    return float(value)
