"""The plain data of kvferry's vLLM connector, without torch: what one step asks of a worker
(:class:`SaveJob`, :class:`LoadJob`), what a finished load leaves (:class:`LoadRecord`), and the
counters a worker keeps (:class:`TransferStats`, :data:`FAILURE_KINDS`), and what a rank reports
of its pool and threads (:class:`PoolWatch`).

The scheduler builds the jobs (:mod:`kvferry.app.vllm.scheduler`), the worker carries them out
(:mod:`kvferry.app.vllm.worker`, :mod:`~kvferry.app.vllm.saver`, :mod:`~kvferry.app.vllm.loader`).
This module imports neither torch nor vLLM, so the scheduler side loads without them
(tests/app/test_torch_free.py).
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

import attrs

from kvferry.app.vllm.groups import GroupPages
from kvferry.app.vllm.params import DecodeSource

__all__ = [
    "FAILURE_KINDS",
    "POOL_GAUGES",
    "POOL_COUNTERS",
    "THREADS_GAUGE",
    "SaveJob",
    "LoadJob",
    "LoadRecord",
    "TransferStats",
    "PoolWatch",
    "gauge_key",
    "split_gauge_key",
]

#: Failure kinds counted in the stats (``failures_<kind>``).
#: ``sender_failed``: a decode's load answered at once by its prefill's failure record (the
#: save failed there: ``put`` or ``timeout`` on the prefill).
FAILURE_KINDS = ("timeout", "expired", "corrupt", "params", "layout", "unavailable", "put", "error", "sender_failed")

#: Values now (not counts) a rank reports with its stats, each under :func:`gauge_key`: what
#: the prefill's pool holds (bytes, regions and entries not freed yet), the entries of those no
#: reader has taken yet (published, unread: a decode that reads them has not asked), and
#: kvferry's threads in the rank's process.
POOL_GAUGES = ("pool_bytes_held", "pool_regions_held", "pool_entries_held", "pool_entries_unread")
THREADS_GAUGE = "threads"
#: Counts since the last report of a prefill's pool: entries freed because every reader
#: released them, and entries freed because their lease (or a gone reader's hold) ran out.
POOL_COUNTERS = ("pool_entries_released", "pool_entries_expired")
#: The pool's own cumulative counters (memory.pool.LocalPool) each of those sums.
_POOL_SOURCES = {
    "pool_entries_released": ("released",),
    "pool_entries_expired": ("expired_unread", "expired_unreleased"),
}
#: The pool's values now behind each gauge (LocalPool.stats()).
_GAUGE_SOURCES = {
    "pool_bytes_held": "used_bytes",
    "pool_regions_held": "live_regions",
    "pool_entries_held": "entries",
    "pool_entries_unread": "readable",
}


def gauge_key(name: str, rank: int) -> str:
    """The stats key of gauge ``name`` of TP rank ``rank``: ``name@rank``."""
    return f"{name}@{rank}"


def split_gauge_key(key: str) -> tuple[str, int] | None:
    """``(name, rank)`` of a :func:`gauge_key`, None for a counter's key."""
    name, sep, rank = key.rpartition("@")
    if not sep or not rank.isdigit() or not name:
        return None
    return name, int(rank)


@attrs.frozen
class SaveJob:
    """Prefill side: send this request's prompt pages (its first ``ceil(num_tokens /
    block_size)`` blocks) under ``transfer_id`` for a decode stage of ``decode_tp`` ranks.
    ``groups``: with several KV cache groups (vLLM's hybrid manager), the pages each group
    sends (:func:`kvferry.app.vllm.groups.sent_pages`), one entry per group in group order;
    each layer sends its group's; ``block_ids`` is then group 0's."""

    req_id: str
    transfer_id: str
    block_ids: tuple[int, ...]
    num_tokens: int
    decode_tp: int
    groups: tuple[GroupPages, ...] = ()
    #: vLLM frees a page this save sends right after this step (a sliding-window page below
    #: the window of the prompt's next token: groups.freed_at_finish): the step ends only once
    #: the save is out (``wait_for_save``).
    hold_step: bool = False
    #: The request ends in the step its prefill completes (it generates one token, as the
    #: prefill half of a P/D pair does): vLLM then keeps its blocks until the save says it is
    #: sent, and no later step writes or frees them, so its pages may be read in place
    #: (ConnectorSettings.in_place). A request that runs on could be preempted meanwhile.
    ends_now: bool = False


@attrs.frozen
class LoadJob:
    """Decode side: fill ``block_ids`` (local blocks) with the prefill's pages
    ``first_page ..``; ``error`` set when the request's params were rejected."""

    req_id: str
    source: DecodeSource | None
    block_ids: tuple[int, ...]
    first_page: int
    error: str | None = None
    #: vLLM runs the request in this very step (``load_mode="sync"``): the load ends in
    #: :meth:`PageWorker.start_loads`, is never reported as received, and a failure is a load
    #: error of its blocks at once.
    sync: bool = False
    #: With several KV cache groups: each group's local blocks from its first page (null
    #: blocks, pages this decode's window does not keep, lead and are not written), one entry
    #: per group in group order; ``block_ids`` is then the first page group's. A failure in any group fails
    #: the request (reported in ``failed_recving``, never as blocks: vLLM refuses block errors
    #: with several groups).
    groups: tuple[GroupPages, ...] = ()
    #: The tokens computed once the load is in (vLLM's computed plus the external ones): what
    #: a group of recurrent state's payload must have seen (state_pages.write_state); None:
    #: not stated (no such group).
    upto_tokens: int | None = None


@attrs.frozen
class LoadRecord:
    """One finished load on a decode rank: its bytes, when it started and ended (the worker's
    clock), whether it succeeded, and when :meth:`PageWorker.finished` reported it to vLLM
    (None: not yet, or a sync load, which is never reported: its request runs in its step)."""

    req_id: str
    transfer_id: str | None
    nbytes: int
    started: float
    ended: float
    ok: bool
    reported: float | None = None

    @property
    def seconds(self) -> float:
        return max(0.0, self.ended - self.started)


@attrs.define(eq=False)
class TransferStats:
    """Counters since the last :meth:`take` (thread-safe)."""

    _lock: threading.Lock = attrs.field(factory=threading.Lock)
    _data: dict[str, float] = attrs.field(factory=dict)

    def add(self, **values: float) -> None:
        with self._lock:
            for k, v in values.items():
                self._data[k] = self._data.get(k, 0) + v

    def fail(self, kind: str) -> None:
        self.add(**{f"failures_{kind if kind in FAILURE_KINDS else 'error'}": 1})

    def take(self) -> dict[str, float]:
        with self._lock:
            out, self._data = self._data, {}
        return out

    def peek(self) -> dict[str, float]:
        with self._lock:
            return dict(self._data)


@attrs.define(eq=False)
class PoolWatch:
    """One rank's report of its pool and threads, with each step's stats: the gauges (values
    now, every time) and the pool's counters as counts since the last report (the pool keeps
    them cumulative; a pool whose counters went back, a new one, counts from 0)."""

    rank: int
    _seen: dict[str, float] = attrs.field(factory=dict)

    def report(self, pool: Mapping[str, Any] | None, threads: int) -> dict[str, float]:
        """``pool``: the pool's stats (None: this rank has no pool, a decode rank)."""
        out: dict[str, float] = {gauge_key(THREADS_GAUGE, self.rank): float(threads)}
        if pool is None:
            return out
        for gauge, source in _GAUGE_SOURCES.items():
            if source in pool:
                out[gauge_key(gauge, self.rank)] = float(pool[source])
        for counter, sources in _POOL_SOURCES.items():
            total = float(sum(pool.get(s, 0) for s in sources))
            seen = self._seen.get(counter, 0.0)
            delta = total - seen if total >= seen else total
            self._seen[counter] = total
            if delta:
                out[counter] = delta
        return out
