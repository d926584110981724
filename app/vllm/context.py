"""What one vLLM worker rank's saver and loader share (:class:`WorkerContext`): the settings,
the rank and its model's KV heads, the counters, the lock and progress condition, the clock,
and what the payloads say of the caches (``isa``, ``cache_layout``). Built once by
:class:`~kvferry.app.vllm.worker.PageWorker`; a setting changed on the worker replaces it in
both halves at once (it is a frozen value). No torch."""

from __future__ import annotations

import threading
from collections.abc import Callable

import attrs

from kvferry.app.vllm.params import ConnectorSettings
from kvferry.app.vllm.records import TransferStats

__all__ = ["WorkerContext"]


@attrs.frozen
class WorkerContext:
    """One rank's shared state. ``progress`` is signalled (under ``lock``) when a save or a
    load ends; ``stats`` are the rank's counters (both halves count into them)."""

    settings: ConnectorSettings
    tp_rank: int
    tp_size: int
    total_kv_heads: int
    stats: TransferStats
    lock: threading.Lock
    progress: threading.Condition
    clock: Callable[[], float]
    #: The CPU attention kernel that writes the pages (payload metadata ``isa``); None: unknown.
    kernel_isa: str | None = None
    #: What vLLM's backend writes these caches in (payload metadata ``cache_layout``).
    cache_layout: str | None = None
