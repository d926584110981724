"""The plain data of kvferry's vLLM connector, without torch: what one step asks of a worker
(:class:`SaveJob`, :class:`LoadJob`), what a finished load leaves (:class:`LoadRecord`), and the
counters a worker keeps (:class:`TransferStats`, :data:`FAILURE_KINDS`).

The scheduler builds the jobs (:mod:`kvferry.app.vllm.scheduler`), the worker carries them out
(:mod:`kvferry.app.vllm.worker`, :mod:`~kvferry.app.vllm.saver`, :mod:`~kvferry.app.vllm.loader`).
This module imports neither torch nor vLLM, so the scheduler side loads without them
(tests/app/test_torch_free.py).
"""

from __future__ import annotations

import threading

import attrs

from kvferry.app.vllm.groups import GroupPages
from kvferry.app.vllm.params import DecodeSource

__all__ = ["FAILURE_KINDS", "SaveJob", "LoadJob", "LoadRecord", "TransferStats"]

#: Failure kinds counted in the stats (``failures_<kind>``).
FAILURE_KINDS = ("timeout", "expired", "corrupt", "params", "layout", "unavailable", "put", "error")


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
    #: per group in group order; ``block_ids`` is then group 0's. A failure in any group fails
    #: the request (reported in ``failed_recving``, never as blocks: vLLM refuses block errors
    #: with several groups).
    groups: tuple[GroupPages, ...] = ()


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
