"""The worker side of kvferry's vLLM connector, without vLLM: one rank's saves and loads of pages.

:class:`PageWorker` is what the connector (:mod:`kvferry.app.vllm.connector`) calls; it takes
vLLM's caches, creates the connectors, and composes two parts that share one
:class:`~kvferry.app.vllm.context.WorkerContext` (settings, rank, stats, lock, progress
condition, clock, what the payloads say of the caches):

- prefill rank (producer): :class:`~kvferry.app.vllm.saver.PageSaver` hands each layer of the
  requests whose prefill completes in this step to a save thread, which publishes it while the
  model computes the next layers; the request is reported sent once every layer is out;
- decode rank (consumer): :class:`~kvferry.app.vllm.loader.PageLoader` loads each request's
  layers into the blocks vLLM allocated, first in the engine's thread for up to
  ``inline_load_s``, then on a small thread pool; a failed load reports its blocks in
  :meth:`PageWorker.load_errors`, and vLLM's ``kv_load_failure_policy`` recomputes or fails it.

The step records (:class:`SaveJob`, :class:`LoadJob`, :class:`LoadRecord`,
:class:`TransferStats`) live in :mod:`kvferry.app.vllm.records`, without torch, and are
importable from here too.

Both sides: while a save or a load is in flight and vLLM steps the engine only to poll the
connector (a step with no tokens), :meth:`PageWorker.finished` waits up to ``idle_wait_s``
for one of them to end, on the condition the save and load threads signal. An engine that polls
without pause holds the GIL, and the save or load thread would wait up to the switch interval
at each of its many GIL hand-offs (measured beside a thread that polls without pause: a
2047-token save of 8 layers took 556-1210 ms, against 12-32 ms with the wait; docs/vllm.md).
Nothing here waits without a deadline.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs
import torch

from kvferry.adapters.checksums import sending_checksum
from kvferry.adapters.platform import THP_ENABLED, HugePages, advise_huge_pages
from kvferry.app.registry import create_connector
from kvferry.app.vllm.context import WorkerContext
from kvferry.app.vllm.loader import PageLoader
from kvferry.app.vllm.pages import PageGeometry, PageWriter, rank_head_count
from kvferry.app.vllm.params import ConnectorSettings
from kvferry.app.vllm.records import FAILURE_KINDS, LoadJob, LoadRecord, PoolWatch, SaveJob, TransferStats
from kvferry.app.vllm.saver import PageSaver
from kvferry.app.vllm.state_pages import StateSpec, StateWriter, state_view
from kvferry.core.errors import ConfigError, KVFerryError
from kvferry.core.policy import RetryPolicy

__all__ = ["SaveJob", "LoadJob", "LoadRecord", "TransferStats", "PageWorker", "FAILURE_KINDS"]

logger = logging.getLogger(__name__)
#: A cache tensor of a torch float8 dtype is an FP8 cache of that format (vLLM's own FP8 caches
#: are uint8 tensors: their format comes from ``kv_cache_dtype``, PageWorker.fp8).
_TORCH_FP8 = {"float8_e4m3fn": "fp8_e4m3", "float8_e5m2": "fp8_e5m2"}


def _to_context(worker: Any, attribute: Any, value: Any) -> Any:
    """An ``on_setattr`` hook: a setting changed on the worker replaces the context its saver
    and loader share (one frozen value, so both see the change at once)."""
    worker._context = context = attrs.evolve(worker._context, **{attribute.name: value})
    worker._saver.context = worker._loader.context = context
    return value


def _to_saver(worker: Any, attribute: Any, value: Any) -> Any:
    """An ``on_setattr`` hook: a save-only setting changed on the worker is changed on its saver."""
    setattr(worker._saver, attribute.name, value)
    return value


def _to_both(worker: Any, attribute: Any, value: Any) -> Any:
    """An ``on_setattr`` hook: a setting of the registered caches (not of the context) changed
    on the worker is changed on its saver and its loader."""
    setattr(worker._saver, attribute.name, value)
    setattr(worker._loader, attribute.name, value)
    return value


@attrs.define(eq=False)
class PageWorker:
    """One vLLM worker rank's page transfers. ``producer``/``consumer``: its kv_role."""

    settings: ConnectorSettings
    tp_rank: int
    tp_size: int
    total_kv_heads: int
    producer: bool
    consumer: bool
    connector_factory: Callable[[Mapping[str, Any]], Any] = create_connector
    clock: Callable[[], float] = attrs.field(default=time.monotonic, on_setattr=_to_context)
    sleep: Callable[[float], None] = attrs.field(default=time.sleep, on_setattr=_to_saver)
    retry: RetryPolicy = attrs.field(factory=lambda: RetryPolicy(attempts=5), on_setattr=_to_saver)
    #: The CPU attention kernel that writes the pages (vLLM's name: ``amx``, ``vec``, ...), put
    #: in every payload's metadata as ``isa`` so that a receiver outside vLLM can decode them
    #: per token (core.layouts.vllm_page_order); None: unknown, not stated.
    kernel_isa: str | None = attrs.field(default=None, on_setattr=_to_context)
    #: What vLLM's backend writes these caches in (``core.backends.BackendLayout.label``, e.g.
    #: ``vllm_cpu:vec/LBHNC``), put in every payload as ``cache_layout``: a receiver whose cache
    #: differs (layout, block size, kernel) re-lays the pages per token (pages.write_relaid).
    cache_layout: str | None = attrs.field(default=None, on_setattr=_to_context)
    #: An MLA cache (kvferry's layout ``mla``, from vLLM's backend; set before :meth:`register`):
    #: one latent region per block, every rank holding all of it, each decode rank reading it
    #: whole from one prefill rank (pages.PageGeometry ``latent``; core.routing.latent_source).
    latent: bool = False
    #: With several KV cache groups (vLLM's hybrid manager): each registered layer's group, in
    #: layer order (set before :meth:`register`); a hybrid job's layers move their group's pages.
    layer_groups: tuple[int, ...] = attrs.field(default=(), on_setattr=_to_both)
    #: With a Mamba / gated-delta-net group: each registered layer's state tensors (None for a
    #: layer of pages), in layer order (set before :meth:`register`); a state layer moves the
    #: request's state block (state_pages), between equal TP sizes.
    layer_states: tuple[StateSpec | None, ...] = attrs.field(default=(), on_setattr=_to_both)
    #: An FP8 cache's format (``fp8_e4m3``, ``fp8_e5m2``: core.scales.fp8_format of vLLM's
    #: ``kv_cache_dtype``; set before :meth:`register`, or taken from a float8 cache's dtype):
    #: pages move as their bytes, each payload says the format and carries every layer's
    #: scales, and a load whose scales differ from this cache's fails (``layout``).
    fp8: str | None = None
    #: An FP8 cache's current per-layer scales, ``(k_scale, v_scale)`` lists in layer order
    #: (vLLM's attention layers' ``_k_scale_float`` / ``_v_scale_float``), read at every save
    #: and load (vLLM may compute them on its first forward). Needed for an FP8 cache.
    kv_scales: Callable[[], tuple[Sequence[float], Sequence[float | None] | None]] | None = None
    geometry: PageGeometry | None = attrs.field(init=False, default=None)
    #: What moving the cache onto huge pages did at registration (None: ``huge_pages: off``).
    huge_pages: HugePages | None = attrs.field(init=False, default=None)
    stats: TransferStats = attrs.field(init=False, factory=TransferStats)
    #: The last loads of this rank, oldest first (for a driver that wants per-request figures).
    recent_loads: collections.deque[LoadRecord] = attrs.field(init=False, factory=lambda: collections.deque(maxlen=256))
    _lock: threading.Lock = attrs.field(init=False, factory=threading.Lock)
    #: Signalled (under ``_lock``) when a save or a load ends.
    _progress: threading.Condition = attrs.field(
        init=False, default=attrs.Factory(lambda self: threading.Condition(self._lock), takes_self=True)
    )
    _context: WorkerContext = attrs.field(
        init=False,
        default=attrs.Factory(
            lambda self: WorkerContext(
                self.settings,
                self.tp_rank,
                self.tp_size,
                self.total_kv_heads,
                self.stats,
                self._lock,
                self._progress,
                self.clock,
                self.kernel_isa,
                self.cache_layout,
            ),
            takes_self=True,
        ),
    )
    _saver: PageSaver = attrs.field(
        init=False,
        default=attrs.Factory(lambda self: PageSaver(self._context, self.sleep, self.retry), takes_self=True),
    )
    _loader: PageLoader = attrs.field(
        init=False, default=attrs.Factory(lambda self: PageLoader(self._context, self.recent_loads), takes_self=True)
    )
    _closed: bool = attrs.field(init=False, default=False)
    _watch: PoolWatch = attrs.field(
        init=False, default=attrs.Factory(lambda self: PoolWatch(self.tp_rank), takes_self=True)
    )

    # ----------------------------------------------------------------------------- set-up
    def register(self, kv_caches: Mapping[str, torch.Tensor]) -> None:
        """Take vLLM's per-layer caches (layer order) and create the connectors: a producer's
        sender now, so that a connector that cannot start fails the engine at start."""
        layers = list(kv_caches.values())
        index = {name: i for i, name in enumerate(kv_caches)}
        if self.layer_groups and len(self.layer_groups) != len(layers):
            raise ConfigError(f"kv_caches: {len(layers)} layers, {len(self.layer_groups)} in KV cache groups")
        states = self.layer_states
        if states and len(states) != len(layers):
            raise ConfigError(f"kv_caches: {len(layers)} layers, {len(states)} with a state spec or none")
        names = list(kv_caches)
        views: list[torch.Tensor | None] = [None] * len(layers)
        for i, spec in enumerate(states):
            if spec is not None:
                views[i] = state_view(layers[i], spec, names[i])
        pages = [t for t, view in zip(layers, views) if view is None]
        geometry = PageGeometry.of(pages, latent=self.latent)
        self.geometry = geometry = attrs.evolve(geometry, num_layers=len(layers))
        fp8 = self.fp8 or _TORCH_FP8.get(geometry.dtype)
        if fp8 is not None:
            if self.kv_scales is None:
                raise ConfigError(
                    f"kv_scales: an FP8 cache ({fp8}) moves with its layers' scales, and none were given "
                    f"(the connector reads them from vLLM's attention layers)"
                )
            k, v = self.kv_scales()
            if len(k) != len(layers) or (v is not None and len(v) != len(layers)):
                raise ConfigError(f"kv_scales: {len(k)} k_scale entries for {len(layers)} layers")
        for part in (self._saver, self._loader):
            part.fp8, part.kv_scales = fp8, self.kv_scales
        self._huge_pages(layers)
        self._saver.attach(layers, index, geometry)
        self._loader.attach(layers, geometry, list(kv_caches))
        self._saver.state_views = self._loader.state_views = views
        if not geometry.latent:  # a latent is one "head" on every rank, whatever the model's head count
            self._check_heads(geometry)
        self._saver.writer = PageWriter(geometry, checksums=sending_checksum(self.settings.checksums))
        self._saver.state_writer = StateWriter(checksums=sending_checksum(self.settings.checksums))
        if self.producer:
            self._saver.start(self.connector_factory(self.settings.sender_config(self.tp_rank, self.tp_size)))
            if self.settings.in_place:
                why_not = self._saver.read_in_place()
                if why_not is None:
                    logger.info("kvferry rank %d: decodes read this prefill's pages in place", self.tp_rank)
                else:
                    logger.info("kvferry rank %d: pages are gathered into the pool: %s", self.tp_rank, why_not)
        if self.consumer:
            self._loader.start(self.connector_factory(self.settings.receiver_config()))

    def _huge_pages(self, layers: Sequence[torch.Tensor]) -> None:
        """Move a host cache onto huge pages as ``huge_pages`` says (kept in ``huge_pages``); a
        host cache that gets none is logged with why and what to change."""
        mode = self.settings.huge_pages
        if mode == "off":
            return
        started = time.monotonic()
        done = self.huge_pages = advise_huge_pages(layers, collapse=mode == "collapse")
        if not done.total:
            return  # a device cache: nothing on the host to advise
        if mode == "collapse" and done.advised and done.collapsed < done.advised:
            logger.warning(
                "kvferry rank %d: the kernel moved only part of the KV cache onto huge pages (%s); the rest "
                "follows in the background. Free memory for the kernel to compact, or set "
                "kv_connector_extra_config.huge_pages: advise to leave it to the kernel from the start",
                self.tp_rank,
                done.describe(),
            )
        elif done.advised:
            logger.info(
                "kvferry rank %d: KV cache: %s, in %.1f s (huge_pages: %s)",
                self.tp_rank,
                done.describe(),
                time.monotonic() - started,
                mode,
            )
        else:
            logger.warning(
                "kvferry rank %d: the KV cache stays on 4 KiB pages (%s); extraction and loads run slower. "
                "Let the kernel use transparent huge pages (echo madvise > %s) or set "
                "kv_connector_extra_config.huge_pages: off to keep this quiet",
                self.tp_rank,
                done.describe(),
                THP_ENABLED,
            )

    def _check_heads(self, geometry: PageGeometry) -> None:
        try:
            per_rank = rank_head_count(self.tp_size, self.total_kv_heads)
        except KVFerryError as exc:
            raise ConfigError(f"kv_caches: {exc}") from exc
        if geometry.heads != per_rank:
            raise ConfigError(
                f"kv_caches: {geometry.heads} KV heads on each of {self.tp_size} ranks, but a model "
                f"with {self.total_kv_heads} KV heads holds {per_rank} per rank at TP {self.tp_size}"
            )

    # ------------------------------------------------------------------------- prefill side
    def begin_step(self, saves: Sequence[SaveJob]) -> None:
        """The saves of the step about to run (from the scheduler's metadata)."""
        self._saver.begin_step(saves)

    def save_layer(self, layer_name: str, layer: torch.Tensor) -> None:
        """Hand one layer of this step's saves to the save thread (called during the forward)."""
        self._saver.save_layer(layer_name, layer)

    def end_step(self) -> None:
        """After the forward: any layer of this step's saves that vLLM did not hand over (no
        ``save_kv_layer`` call) is queued from the registered caches, so no save is left half."""
        self._saver.end_step()

    # -------------------------------------------------------------------------- decode side
    def start_loads(self, loads: Sequence[LoadJob]) -> None:
        """Start one load per job. The loads first run here, in the engine's thread, for up
        to ``inline_load_s`` in all (what is there already is read and written at once); what
        is not there by then continues on the load threads, and this returns."""
        self._loader.start_loads(loads)

    # ------------------------------------------------------------------------ completions
    def _in_flight(self) -> int:
        """Saves and loads not ended yet (call with ``_lock`` held)."""
        return self._saver.in_flight() + self._loader.in_flight()

    def finished(self, finished_req_ids: Sequence[str] | set[str], *, idle: bool = False) -> tuple[set[str], set[str]]:
        """``(sent, loaded)``: requests whose blocks vLLM may free / schedule now. A failed
        load is in ``loaded`` too, its blocks in the next :meth:`load_errors`. ``idle``: this
        step ran no tokens; with a save or load in flight, first wait up to ``idle_wait_s``
        for one to end."""
        with self._lock:
            wait = self.settings.idle_wait_s if idle else 0.0
            if wait > 0:
                before = self._in_flight()
                if before:
                    self._progress.wait_for(lambda: self._in_flight() < before, timeout=wait)
            sent = self._saver.take_sent(finished_req_ids)
        return sent, self._loader.take_loaded()

    def load_errors(self) -> set[int]:
        """Blocks of loads reported failed since the last call."""
        return self._loader.load_errors()

    def failed_loads(self) -> set[str]:
        """Hybrid loads (several KV cache groups) reported failed since the last call: vLLM
        takes them per request (``failed_recving``), not as blocks."""
        return self._loader.take_failed()

    @property
    def pending_saves(self) -> int:
        with self._lock:
            return len(self._saver.saves)

    @property
    def _saves(self) -> dict[str, Any]:
        """The saves not reported sent yet, by request (their state: ``layers_left``, ...)."""
        return self._saver.saves

    @property
    def _sender(self) -> Any:
        return self._saver.sender

    @property
    def _receiver(self) -> Any:
        return self._loader.receiver

    def sender_health(self) -> dict[str, Any] | None:
        return None if self._sender is None else self._sender.health()

    def take_stats(self) -> dict[str, float]:
        """This step's stats: the counters since the last call (:attr:`stats`) and the rank's
        report (:class:`~kvferry.app.vllm.records.PoolWatch`): what the prefill's pool holds
        now, how many of its entries were released and expired since, and kvferry's threads
        in this process. Empty once the worker is closed."""
        if self._closed:
            return self.stats.take()
        pool = self.sender_health() if self.producer else None
        threads = sum(1 for t in threading.enumerate() if t.name.startswith("kvferry"))
        report = self._watch.report(pool, threads)
        return {**self.stats.take(), **report}

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._saver.stop()
        self._loader.stop()
        for conn in (self._sender, self._receiver):
            if conn is not None:
                try:
                    conn.close()
                except Exception:
                    logger.exception("closing a kvferry connector failed")
