"""The worker side of kvferry's vLLM connector, without vLLM: saves and loads of pages.

Prefill rank (producer): :meth:`PageWorker.save_layer` is called by vLLM's attention layer for
every layer during the forward; the layer's pages of every request whose prefill completes in
this step are handed to one background thread, which gathers them straight into the
connector's pool and publishes them (one payload per layer and decode rank), while the model
computes the next layers. A decode rank may pull layer 0 while layer 1 is still computing.
The engine keeps the request's blocks until every layer is out; then
:meth:`PageWorker.finished` reports the request as sent and vLLM frees them. The payloads
themselves stay in kvferry's pool until the decode side has read them or their lease expires.

Decode rank (consumer): :meth:`PageWorker.start_loads` starts one load per request: for every
layer, a get (arrival notification, bounded by ``load_timeout_s``), decode (checksums
verified), checks against this cache's geometry, and a copy of the pages into the blocks vLLM
allocated. A load first runs in the engine's thread for up to ``inline_load_s``: when the
prefill is done, its layers are all there and the load ends before the step does, with no
thread hand-off. (A load thread competes for the GIL with the engine's busy loop, and waits up
to the interpreter's switch interval, 5 ms, at every get and every torch call: hundreds of
milliseconds for one request.) What is not there in time continues on a small thread pool.

Both sides: while a save or a load is in flight and vLLM steps the engine only to poll the
connector (a step with no tokens), :meth:`PageWorker.finished` waits up to ``idle_wait_s``
for one of them to end, on a condition the save and load threads signal. An engine that polls
without pause holds the GIL, and the save or load thread would wait up to the switch interval
at each of its many GIL hand-offs (measured beside a thread that polls without pause: a
2047-token save of 8 layers took 556-1210 ms, against 12-32 ms with the wait; docs/vllm.md).
A failed load (timeout, expired lease, corrupt payload, bad params, unreachable prefill)
reports the request as finished with all of its blocks in :meth:`PageWorker.load_errors`;
vLLM's ``kv_load_failure_policy`` then recomputes or fails it. Nothing here waits without a deadline.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs
import torch

from kvferry.adapters.checksums import sending_checksum
from kvferry.adapters.connectors.pool_buffer import release_soon
from kvferry.adapters.torch_decode import decode_payload
from kvferry.app.put import put_with_retry
from kvferry.app.registry import create_connector
from kvferry.app.vllm.pages import (
    PAGE_LAYOUT,
    PageGeometry,
    PageWriter,
    block_runs,
    check_payload,
    layer_key,
    needs_relay,
    rank_head_count,
    recv_slices,
    send_slices,
    write_pages,
    write_relaid,
)
from kvferry.app.vllm.params import ConnectorSettings, DecodeSource
from kvferry.core.errors import ConfigError, KVFerryError, LeaseExpired, PayloadError, PoolFullError, TransferError
from kvferry.core.layouts import VLLM_CPU_PAGE_ISAS, reblock_span
from kvferry.core.policy import PUT_FAILURES, RetryPolicy
from kvferry.core.ports import BatchedReleases, GetMany, Implements, Reservable

__all__ = ["SaveJob", "LoadJob", "LoadRecord", "TransferStats", "PageWorker", "FAILURE_KINDS"]

logger = logging.getLogger(__name__)
_has_get_many = Implements(GetMany)
_has_batched_releases = Implements(BatchedReleases)

#: Failure kinds counted in the stats (``failures_<kind>``).
FAILURE_KINDS = ("timeout", "expired", "corrupt", "params", "layout", "unavailable", "put", "error")


@attrs.frozen
class SaveJob:
    """Prefill side: send this request's prompt pages (its first ``ceil(num_tokens /
    block_size)`` blocks) under ``transfer_id`` for a decode stage of ``decode_tp`` ranks."""

    req_id: str
    transfer_id: str
    block_ids: tuple[int, ...]
    num_tokens: int
    decode_tp: int


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


class _LoadFailed(Exception):
    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(f"{kind}: {detail}")
        self.kind = kind


@attrs.define(eq=False)
class _SaveState:
    job: SaveJob
    layers_left: int
    started: float
    nbytes: int = 0
    failed: str | None = None
    queued: set[int] = attrs.field(factory=set)

    @property
    def done(self) -> bool:
        return self.layers_left == 0


@attrs.define(eq=False)
class _LoadPlan:
    """What one load reads (``reads``: (layer, head slice) in order, ``next`` the first not
    read yet) and writes (``count`` local blocks from ``index``), by ``deadline``."""

    job: LoadJob
    source: DecodeSource
    index: torch.Tensor
    count: int
    reads: list[tuple[int, Any]]
    deadline: float
    runs: tuple[tuple[int, int, int], ...] = ()
    #: The sender's pages the load needs (its block size; ``reblock_span``).
    src_pages: int = 0
    next: int = 0
    nbytes: int = 0
    #: Payloads fetched ahead (index into ``reads``), not written yet.
    ready: dict[int, tuple[Any, int]] = attrs.field(factory=dict)


@attrs.define(eq=False)
class _LoadRun:
    """One load in progress: planned on its first step; ``ok`` once every read is written."""

    job: LoadJob
    started: float
    plan: _LoadPlan | None = None
    ok: bool = False


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
    clock: Callable[[], float] = time.monotonic
    sleep: Callable[[float], None] = time.sleep
    retry: RetryPolicy = attrs.field(factory=lambda: RetryPolicy(attempts=5))
    #: The CPU attention kernel that writes the pages (vLLM's name: ``amx``, ``vec``, ...), put
    #: in every payload's metadata as ``isa`` so that a receiver outside vLLM can decode them
    #: per token (core.layouts.vllm_page_order); None: unknown, not stated.
    kernel_isa: str | None = None
    #: What vLLM's backend writes these caches in (``core.backends.BackendLayout.label``, e.g.
    #: ``vllm_cpu:vec/LBHNC``), put in every payload as ``cache_layout``: a receiver whose cache
    #: differs (layout, block size, kernel) re-lays the pages per token (pages.write_relaid).
    cache_layout: str | None = None
    geometry: PageGeometry | None = attrs.field(init=False, default=None)
    stats: TransferStats = attrs.field(init=False, factory=TransferStats)
    _layers: list[torch.Tensor] = attrs.field(init=False, factory=list)
    _index: dict[str, int] = attrs.field(init=False, factory=dict)
    _sender: Any = attrs.field(init=False, default=None)
    _receiver: Any = attrs.field(init=False, default=None)
    _writer: PageWriter | None = attrs.field(init=False, default=None)
    _lock: threading.Lock = attrs.field(init=False, factory=threading.Lock)
    #: Signalled (under ``_lock``) when a save or a load ends.
    _progress: threading.Condition = attrs.field(
        init=False, default=attrs.Factory(lambda self: threading.Condition(self._lock), takes_self=True)
    )
    _saves: dict[str, _SaveState] = attrs.field(init=False, factory=dict)
    _step_saves: tuple[SaveJob, ...] = attrs.field(init=False, default=())
    _engine_finished: set[str] = attrs.field(init=False, factory=set)
    _queue: queue.Queue[Any] = attrs.field(init=False, factory=queue.Queue)
    _thread: threading.Thread | None = attrs.field(init=False, default=None)
    _pool: concurrent.futures.ThreadPoolExecutor | None = attrs.field(init=False, default=None)
    _loads: dict[str, concurrent.futures.Future] = attrs.field(init=False, factory=dict)
    _load_errors: set[int] = attrs.field(init=False, factory=set)
    _load_blocks: dict[str, tuple[int, ...]] = attrs.field(init=False, factory=dict)
    _is_reservable: Implements = attrs.field(init=False, factory=lambda: Implements(Reservable))
    #: The last loads of this rank, oldest first (for a driver that wants per-request figures).
    recent_loads: collections.deque[LoadRecord] = attrs.field(init=False, factory=lambda: collections.deque(maxlen=256))
    _closed: bool = attrs.field(init=False, default=False)

    # ----------------------------------------------------------------------------- set-up
    def register(self, kv_caches: Mapping[str, torch.Tensor]) -> None:
        """Take vLLM's per-layer caches (layer order) and create the connectors: a producer's
        sender now, so that a connector that cannot start fails the engine at start."""
        self._layers = list(kv_caches.values())
        self._index = {name: i for i, name in enumerate(kv_caches)}
        self.geometry = PageGeometry.of(self._layers)
        try:
            per_rank = rank_head_count(self.tp_size, self.total_kv_heads)
        except KVFerryError as exc:
            raise ConfigError(f"kv_caches: {exc}") from exc
        if self.geometry.heads != per_rank:
            raise ConfigError(
                f"kv_caches: {self.geometry.heads} KV heads on each of {self.tp_size} ranks, but a model "
                f"with {self.total_kv_heads} KV heads holds {per_rank} per rank at TP {self.tp_size}"
            )
        self._writer = PageWriter(self.geometry, checksums=sending_checksum(self.settings.checksums))
        if self.producer:
            self._sender = self.connector_factory(self.settings.sender_config(self.tp_rank, self.tp_size))
            self._thread = threading.Thread(target=self._save_loop, name="kvferry-save", daemon=True)
            self._thread.start()
        if self.consumer:
            self._receiver = self.connector_factory(self.settings.receiver_config())
            self._pool = concurrent.futures.ThreadPoolExecutor(
                self.settings.load_threads, thread_name_prefix="kvferry-load"
            )

    # ------------------------------------------------------------------------- prefill side
    def begin_step(self, saves: Sequence[SaveJob]) -> None:
        """The saves of the step about to run (from the scheduler's metadata)."""
        now = self.clock()
        with self._lock:
            for job in saves:
                if job.req_id not in self._saves:
                    self._saves[job.req_id] = _SaveState(job, len(self._layers), now)
        self._step_saves = tuple(saves)

    def save_layer(self, layer_name: str, layer: torch.Tensor) -> None:
        """Hand one layer of this step's saves to the save thread (called during the forward)."""
        if not self._step_saves:
            return
        i = self._index.get(layer_name)
        if i is None:
            return
        self._enqueue(i, layer)

    def _enqueue(self, layer_idx: int, layer: torch.Tensor) -> None:
        with self._lock:
            states = [self._saves[j.req_id] for j in self._step_saves if j.req_id in self._saves]
            todo = [s for s in states if layer_idx not in s.queued]
            for s in todo:
                s.queued.add(layer_idx)
        for s in todo:
            self._queue.put((s, layer_idx, layer))

    def end_step(self) -> None:
        """After the forward: any layer of this step's saves that vLLM did not hand over (no
        ``save_kv_layer`` call) is queued from the registered caches, so no save is left half."""
        for i, layer in enumerate(self._layers):
            self._enqueue(i, layer)
        self._step_saves = ()

    def _save_loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            state, layer_idx, layer = item
            try:
                if state.failed is None:
                    state.nbytes += self._save_one(state.job, layer_idx, layer)
            except Exception as exc:  # a failed layer fails the request's transfer, not the engine
                kind = "put" if isinstance(exc, (PoolFullError, KVFerryError)) else "error"
                state.failed = f"{kind}: {exc}"
                self.stats.fail(kind)
                logger.error("request %s: saving layer %d failed: %s", state.job.req_id, layer_idx, exc)
            with self._lock:
                state.layers_left -= 1
                done = state.done
                if done:
                    self._progress.notify_all()
            if done and state.failed is None:
                self.stats.add(
                    requests_sent=1, bytes_sent=state.nbytes, save_seconds=max(0.0, self.clock() - state.started)
                )

    def _save_one(self, job: SaveJob, layer_idx: int, layer: torch.Tensor) -> int:
        geometry, writer = self.geometry, self._writer
        assert geometry is not None and writer is not None
        index = torch.tensor(job.block_ids, dtype=torch.long)
        stage = self.settings.from_stage
        nbytes = 0
        for sl in send_slices(self.tp_size, job.decode_tp, self.total_kv_heads, self.tp_rank):
            meta = {
                "layout": PAGE_LAYOUT,
                "layer": layer_idx,
                "num_tokens": job.num_tokens,
                "block_size": geometry.block_size,
                "head_size": geometry.head_size,
                "heads": [sl.abs_head_start, sl.abs_head_stop],
                "from_rank": self.tp_rank,
                "to_rank": sl.target_rank,
            }
            if self.kernel_isa is not None:
                meta["isa"] = self.kernel_isa
            if self.cache_layout is not None:
                meta["cache_layout"] = self.cache_layout
            layout = writer.layout(job.transfer_id, job.block_ids, sl.num_heads, meta)
            key = layer_key(job.transfer_id, stage, layer_idx, self.tp_rank, sl.target_rank)
            nbytes += self._put(
                key, layout, lambda dest: writer.gather(layer, index, sl.head_start, sl.head_stop, dest, layout)
            )
        return nbytes

    def _put(self, key: str, layout: Any, fill: Callable[[torch.Tensor], None]) -> int:
        """Publish one page payload under the one put rule (:func:`kvferry.app.put.put_with_retry`);
        its bytes in the pool. PoolFullError (with its reason) or TransferError when it fails."""
        conn = self._sender
        stages = str(self.settings.from_stage), str(self.settings.to_stage)

        def attempt() -> tuple[bool, int, Any]:
            if self._is_reservable(conn):
                reservation = conn.reserve(*stages, key, layout.total_nbytes)
                try:
                    fill(reservation.buffer)
                except BaseException:
                    reservation.abort()
                    raise
                return reservation.commit()
            buf = torch.empty(layout.total_nbytes, dtype=torch.uint8)
            fill(buf)
            return conn.put(from_stage=stages[0], to_stage=stages[1], put_key=key, data=buf)

        done = put_with_retry(attempt, self.retry, self.sleep)
        if done.ok:
            return done.size
        message = f"put of {key!r} failed after {done.attempts} attempts ({done.reason}): {done.detail}"
        if done.reason in PUT_FAILURES:
            raise PoolFullError(message, reason=done.reason, detail=done.detail)
        raise TransferError(message)

    # -------------------------------------------------------------------------- decode side
    def start_loads(self, loads: Sequence[LoadJob]) -> None:
        """Start one load per job. The loads first run here, in the engine's thread, for up
        to ``inline_load_s`` in all (what is there already is read and written at once); what
        is not there by then continues on the load threads, and this returns."""
        until = self.clock() + self.settings.inline_load_s
        for job in loads:
            if job.req_id in self._loads:
                continue
            if self._pool is None:
                raise ConfigError("this instance is not a kv_consumer: it cannot load KV")
            if job.sync:
                self._load_now(job, until)
                continue
            self._load_blocks[job.req_id] = job.block_ids
            run = _LoadRun(job, self.clock())
            if self.settings.inline_load_s > 0 and self._step(run, until):
                done: concurrent.futures.Future[bool] = concurrent.futures.Future()
                done.set_result(self._finish(run))
                self._loads[job.req_id] = done
            else:
                fut = self._pool.submit(self._load_rest, run)
                fut.add_done_callback(self._ended)
                self._loads[job.req_id] = fut

    def _load_now(self, job: LoadJob, until: float) -> None:
        """A sync load: read what is there by ``until``; whatever is missing then fails it."""
        run = _LoadRun(job, self.clock())
        if not self._step(run, until):
            plan = run.plan
            missing = "?" if plan is None else f"{len(plan.reads) - plan.next} of {len(plan.reads)}"
            for data, _ in plan.ready.values() if plan is not None else ():
                release_soon(data)
            self.stats.fail("timeout")
            logger.error(
                "request %s: %s layer reads not there within inline_load_s (%s s) of a sync load; "
                "kv_load_failure_policy applies",
                job.req_id,
                missing,
                self.settings.inline_load_s,
            )
        if not self._finish(run):
            self._load_errors.update(job.block_ids)

    def _load_rest(self, run: _LoadRun) -> bool:
        self._step(run, None)
        return self._finish(run)

    def _step(self, run: _LoadRun, until: float | None) -> bool:
        """Advance ``run`` until it is done (True) or, with ``until``, until that time passes
        with a layer not there yet (False: more to read). A failure ends the run (True)."""
        try:
            if run.plan is None:
                run.plan = self._plan(run.job, run.started)
            if self._read_layers(run.plan, until):
                run.ok = True
                return True
            return False
        except _LoadFailed as exc:
            self.stats.fail(exc.kind)
            logger.error("request %s: KV load failed (%s); kv_load_failure_policy applies", run.job.req_id, exc)
        except Exception:  # any other fault of one load fails that load, never the engine
            self.stats.fail("error")
            logger.exception("request %s: KV load failed", run.job.req_id)
        return True

    def _finish(self, run: _LoadRun) -> bool:
        end = self.clock()
        job, nbytes = run.job, (run.plan.nbytes if run.plan is not None else 0)
        tid = job.source.transfer_id if job.source is not None else None
        self.recent_loads.append(LoadRecord(job.req_id, tid, nbytes, run.started, end, run.ok))
        if run.ok:
            self.stats.add(requests_loaded=1, bytes_loaded=nbytes, load_seconds=max(0.0, end - run.started))
        return run.ok

    def _plan(self, job: LoadJob, started: float) -> _LoadPlan:
        if job.error is not None or job.source is None:
            raise _LoadFailed("params", job.error or "no source")
        src, geometry = job.source, self.geometry
        assert geometry is not None
        if src.decode_tp_size != self.tp_size:
            raise _LoadFailed(
                "layout",
                f"the prefill sliced heads for decode TP {src.decode_tp_size}, this "
                f"instance runs TP {self.tp_size} (set decode_tp_size on the prefill)",
            )
        if src.num_layers != geometry.num_layers:
            raise _LoadFailed("layout", f"prefill has {src.num_layers} layers, this cache {geometry.num_layers}")
        if src.block_size != geometry.block_size and not self._relays():
            raise _LoadFailed(
                "layout",
                f"prefill block_size {src.block_size}, this cache {geometry.block_size}: re-blocking needs a "
                f"page order kvferry knows, and this cache's is {self.cache_layout or self.kernel_isa!r}",
            )
        try:
            slices = recv_slices(src.prefill_tp_size, self.tp_size, self.total_kv_heads, self.tp_rank)
        except KVFerryError as exc:
            raise _LoadFailed("layout", str(exc)) from exc
        needed_pages = -(-src.num_tokens // geometry.block_size)
        count = max(0, min(len(job.block_ids), needed_pages - job.first_page))
        reads = [(layer, sl) for layer in range(geometry.num_layers) for sl in slices] if count else []
        index = torch.tensor(job.block_ids[:count], dtype=torch.long)
        runs = block_runs(job.block_ids[:count])
        try:
            src_pages = reblock_span(job.first_page, count, geometry.block_size, src.block_size, src.num_tokens)[3]
        except ConfigError as exc:
            raise _LoadFailed("params", str(exc)) from exc
        deadline = started + self.settings.load_timeout_s
        return _LoadPlan(job, src, index, count, reads, deadline, runs, src_pages=src_pages)

    def _relays(self) -> bool:
        """Whether this cache's pages can be written from other pages per token (its page
        order is known: a dense ``packed`` cache, or a CPU kernel kvferry knows)."""
        family = (self.cache_layout or "vllm_cpu").split("/", 1)[0].split(":", 1)[0]
        return family == "packed" or (self.kernel_isa or "").lower() in VLLM_CPU_PAGE_ISAS

    def _prefetch(self, plan: _LoadPlan) -> None:
        """Ask each prefill rank for every layer it sends at once, where the receiver can
        (``get_many``): what is there already comes back in one exchange per rank."""
        receiver = self._receiver
        if not _has_get_many(receiver) or len(plan.reads) < 2:
            return
        get_many = receiver.get_many
        src, stage = plan.source, self.settings.from_stage
        by_rank: dict[int, list[tuple[int, str]]] = {}
        for i, (layer_idx, sl) in enumerate(plan.reads):
            key = layer_key(src.transfer_id, stage, layer_idx, sl.source_rank, self.tp_rank)
            by_rank.setdefault(sl.source_rank, []).append((i, key))
        stages = str(self.settings.from_stage), str(self.settings.to_stage)
        for rank, items in by_rank.items():
            got = get_many(*stages, [key for _, key in items], src.source_metadata(rank))
            for (i, _), one in zip(items, got):
                if one is not None:
                    plan.ready[i] = one

    def _read_layers(self, plan: _LoadPlan, until: float | None) -> bool:
        receiver = self._receiver
        with receiver.batched_releases() if _has_batched_releases(receiver) else contextlib.nullcontext():
            return self._read_layers_releasing(plan, until)

    def _read_layers_releasing(self, plan: _LoadPlan, until: float | None) -> bool:
        if until is not None and plan.next == 0 and not plan.ready:
            self._prefetch(plan)
        try:
            return self._read_in_order(plan, until)
        except BaseException:
            for data, _ in plan.ready.values():  # fetched, never to be written: give them back
                release_soon(data)
            plan.ready.clear()
            raise

    def _read_in_order(self, plan: _LoadPlan, until: float | None) -> bool:
        geometry = self.geometry
        assert geometry is not None
        stages = str(self.settings.from_stage), str(self.settings.to_stage)
        while plan.next < len(plan.reads):
            layer_idx, sl = plan.reads[plan.next]
            got = plan.ready.pop(plan.next, None)
            if got is None:
                got = self._get_one(plan, until, layer_idx, sl, stages)
                if got is None:
                    return False
            data = got[0]
            try:
                decoded = decode_payload(data)
                check_payload(decoded, geometry, layer_idx, sl.num_heads, plan.src_pages)
                args = (plan.index, plan.job.first_page, sl.recv_head_start, sl.recv_head_stop)
                layer = self._layers[layer_idx]
                if needs_relay(decoded.metadata, geometry, self.cache_layout, self.kernel_isa):
                    meta = decoded.metadata or {}
                    theirs = f"{meta.get('cache_layout') or 'vllm_cpu'}, block_size {meta.get('block_size')}"
                    if not self._relays():
                        raise _LoadFailed(
                            "layout",
                            f"layer {layer_idx}: the prefill's pages ({theirs}) differ from this cache's "
                            f"({self.cache_layout}), whose page order kvferry cannot write",
                        )
                    try:
                        plan.nbytes += write_relaid(layer, geometry, self.cache_layout, self.kernel_isa, decoded, *args)
                    except PayloadError as exc:
                        raise _LoadFailed("layout", f"layer {layer_idx}: {exc}") from exc
                else:
                    plan.nbytes += write_pages(layer, geometry, decoded, *args, plan.runs)
            except PayloadError as exc:
                raise _LoadFailed("corrupt", str(exc)) from exc
            finally:
                release_soon(data)  # written: the sender may reuse the region once it hears
            plan.next += 1
        return True

    def _get_one(
        self, plan: _LoadPlan, until: float | None, layer_idx: int, sl: Any, stages: tuple[str, str]
    ) -> tuple[Any, int] | None:
        """One layer's payload, waiting until ``until`` (None: not there by then, more time
        left) or the load's deadline (then a timeout failure). A short wait loses nothing: a
        reply that comes after it answers the next get of the key (shm: its sender answers
        within the wait; zmq: a late reply goes to the newer get, or to its stash)."""
        src = plan.source
        key = layer_key(src.transfer_id, self.settings.from_stage, layer_idx, sl.source_rank, self.tp_rank)
        final = until is None or until >= plan.deadline
        remaining = (plan.deadline if final or until is None else min(until, plan.deadline)) - self.clock()
        if remaining <= 0:
            if not final:
                return None
            raise _LoadFailed("timeout", f"{key!r} not there within {self.settings.load_timeout_s} s")
        source = src.source_metadata(sl.source_rank)
        try:
            got = self._receiver.get_blocking(*stages, key, source, timeout_s=remaining)
        except LeaseExpired as exc:
            raise _LoadFailed("expired", str(exc)) from exc
        except KVFerryError as exc:
            raise _LoadFailed("unavailable", str(exc)) from exc
        if got is None:
            if not final and self.clock() < plan.deadline:
                return None
            where = f"prefill at {src.host}:{source['source_port']}"
            raise _LoadFailed("timeout", f"{key!r} not there within {self.settings.load_timeout_s} s ({where})")
        return got

    # ------------------------------------------------------------------------ completions
    def _ended(self, _fut: concurrent.futures.Future[bool]) -> None:
        with self._lock:
            self._progress.notify_all()

    def _in_flight(self) -> int:
        """Saves and loads not ended yet (call with ``_lock`` held)."""
        saves = sum(1 for s in self._saves.values() if not s.done)
        return saves + sum(1 for f in list(self._loads.values()) if not f.done())

    def finished(self, finished_req_ids: Sequence[str] | set[str], *, idle: bool = False) -> tuple[set[str], set[str]]:
        """``(sent, loaded)``: requests whose blocks vLLM may free / schedule now. A failed
        load is in ``loaded`` too, its blocks in the next :meth:`load_errors`. ``idle``: this
        step ran no tokens; with a save or load in flight, first wait up to ``idle_wait_s``
        for one to end."""
        sent: set[str] = set()
        with self._lock:
            wait = self.settings.idle_wait_s if idle else 0.0
            if wait > 0:
                before = self._in_flight()
                if before:
                    self._progress.wait_for(lambda: self._in_flight() < before, timeout=wait)
            self._engine_finished.update(r for r in finished_req_ids if r in self._saves)
            for rid in list(self._engine_finished):
                if self._saves[rid].done:
                    sent.add(rid)
                    self._engine_finished.discard(rid)
                    del self._saves[rid]
        loaded: set[str] = set()
        for rid, fut in list(self._loads.items()):
            if fut.done():
                loaded.add(rid)
                del self._loads[rid]
                blocks = self._load_blocks.pop(rid, ())
                if not fut.result():
                    self._load_errors.update(blocks)
        if loaded:
            self._mark_reported(loaded, self.clock())
        return sent, loaded

    def _mark_reported(self, req_ids: set[str], now: float) -> None:
        """Stamp the newest record of each of ``req_ids`` with the time vLLM heard of it."""
        left = set(req_ids)
        for i in range(len(self.recent_loads) - 1, -1, -1):
            if not left:
                return
            record = self.recent_loads[i]
            if record.req_id in left and record.reported is None:
                self.recent_loads[i] = attrs.evolve(record, reported=now)
                left.discard(record.req_id)

    def load_errors(self) -> set[int]:
        """Blocks of loads reported failed since the last call."""
        out, self._load_errors = self._load_errors, set()
        return out

    @property
    def pending_saves(self) -> int:
        with self._lock:
            return len(self._saves)

    def sender_health(self) -> dict[str, Any] | None:
        return None if self._sender is None else self._sender.health()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(timeout=10)
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
        for conn in (self._sender, self._receiver):
            if conn is not None:
                try:
                    conn.close()
                except Exception:
                    logger.exception("closing a kvferry connector failed")
