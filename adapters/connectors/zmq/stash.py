"""The zmq receiver's late-reply stash: data that came after its caller gave up.

A data reply whose request already timed out is kept, bounded in bytes (``max_bytes``) and age
(``max_age_s``, seconds on the caller's clock), and handed to the next get of the same key from
the same sender endpoint, never to any other key. Oldest entries go first. A stashed payload
that lives in the receive pool keeps its region until it is taken or evicted.

Not thread-safe on its own: the receiver calls it under its lock.
"""

from __future__ import annotations

import collections
from typing import Any

import attrs

from kvferry.core.pool import request_id_of_key

__all__ = ["LateStash"]


@attrs.define(eq=False)
class LateStash:
    """Outcomes by ``(endpoint, key)``; ``nbytes`` is the total ``size`` of what it holds."""

    max_bytes: int
    max_age_s: float
    nbytes: int = 0
    _items: collections.OrderedDict[tuple[str, str], tuple[Any, float]] = attrs.field(
        init=False, factory=collections.OrderedDict
    )

    def __len__(self) -> int:
        return len(self._items)

    def put(self, endpoint: str, key: str, outcome: Any, now_s: float) -> int:
        """Keep ``outcome`` (it replaces an older one of the same key); returns how many
        entries were evicted to stay within the bounds."""
        if not self.max_bytes:
            return 0
        old = self._items.pop((endpoint, key), None)
        if old is not None:
            self.nbytes -= old[0].size
        self._items[(endpoint, key)] = (outcome, now_s)
        self.nbytes += outcome.size
        return self.prune(now_s)

    def take(self, endpoint: str, key: str, now_s: float) -> Any | None:
        """The stashed outcome of ``key`` from ``endpoint`` (removed), or None."""
        self.prune(now_s)
        item = self._items.pop((endpoint, key), None)
        if item is None:
            return None
        self.nbytes -= item[0].size
        return item[0]

    def prune(self, now_s: float) -> int:
        """Evict entries older than ``max_age_s`` and the oldest while over ``max_bytes``."""
        evicted = 0
        while self._items:
            stash_key, (outcome, stored) = next(iter(self._items.items()))
            if now_s - stored < self.max_age_s and self.nbytes <= self.max_bytes:
                break
            del self._items[stash_key]
            self.nbytes -= outcome.size
            evicted += 1
        return evicted

    def drop_request(self, request_id: str) -> None:
        """Forget every stashed payload of ``request_id``."""
        for stash_key in [k for k in self._items if request_id_of_key(k[1]) == request_id]:
            outcome, _ = self._items.pop(stash_key)
            self.nbytes -= outcome.size

    def clear(self) -> None:
        self._items.clear()
        self.nbytes = 0
