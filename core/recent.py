"""What was last noted of each of the most recent keys, bounded: the one home of a "last N"
memory.

Several parts remember something per key for a while after the key's own record is gone: the
lease table why a key left (drained, expired, failed), a receiver why its last get of a key
missed or which grant it could not read, a receiving side how each sender it talks to is doing.
Each must stay bounded however many keys pass, forget the oldest first, and treat a key noted
again as new. :class:`Recent` is that memory.

Invariants (property-tested against a plain model): it never holds more than ``limit`` keys;
:meth:`Recent.note` makes the key the newest and hands back the keys it forgot, oldest first,
which are exactly the oldest beyond ``limit``; every other key keeps its value and its place.
Not thread-safe: its owner holds its own lock around it.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Generic, TypeVar

from kvferry.core.validate import check_int

__all__ = ["Recent"]

K = TypeVar("K")
V = TypeVar("V")


class Recent(Generic[K, V]):
    """Values of at most ``limit`` keys, oldest noted first (iteration order)."""

    __slots__ = ("limit", "_items")

    def __init__(self, limit: int) -> None:
        self.limit = check_int("limit", limit, 1)
        self._items: dict[K, V] = {}

    def note(self, key: K, value: V) -> list[K]:
        """Remember ``value`` for ``key``, now its newest key; the keys forgotten to stay within
        ``limit``, oldest first (never ``key`` itself)."""
        items = self._items
        items.pop(key, None)
        items[key] = value
        forgotten: list[K] = []
        while len(items) > self.limit:
            oldest = next(iter(items))
            del items[oldest]
            forgotten.append(oldest)
        return forgotten

    def get(self, key: K, default: V | None = None) -> V | None:
        """The value noted for ``key``, or ``default``; the key keeps its place."""
        return self._items.get(key, default)

    def pop(self, key: K, default: V | None = None) -> V | None:
        """Forget ``key``; its value, or ``default`` when it was not remembered."""
        return self._items.pop(key, default)

    def __contains__(self, key: object) -> bool:
        return key in self._items

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[K]:
        return iter(self._items)

    def __repr__(self) -> str:
        return f"Recent(limit={self.limit}, keys={len(self._items)})"
