"""The decode side of a vLLM worker rank: loading the prefill's pages into vLLM's blocks.

:meth:`PageLoader.start_loads` starts one load per request: for every layer, a get (arrival
notification, bounded by ``load_timeout_s``), decode (checksums verified), checks against this
cache's geometry, and a copy of the pages into the blocks vLLM allocated (re-laid per token
where the prefill's cache differs: pages.write_relaid). A load first runs in the engine's
thread for up to ``inline_load_s``: when the prefill is done, its layers are all there and the
load ends before the step does, with no thread hand-off. (A load thread competes for the GIL
with the engine's busy loop, and waits up to the interpreter's switch interval, 5 ms, at every
get and every torch call: hundreds of milliseconds for one request.) What is not there in time
continues on a small thread pool.

A failed load (timeout, expired lease, corrupt payload, bad params, layout, unreachable
prefill, a save the prefill failed and said so, ``sender_failed``, at once: one of
:data:`~kvferry.app.vllm.records.FAILURE_KINDS`) is counted, logged, and
reported by :meth:`PageLoader.take_loaded` as finished with all of its blocks in
:meth:`PageLoader.load_errors` (a hybrid load, several KV cache groups: the request in
:meth:`PageLoader.take_failed`); vLLM's ``kv_load_failure_policy`` then recomputes or fails it.
Nothing here waits without a deadline.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import logging
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import torch

from kvferry.adapters.checked_scatter import writable_bytes
from kvferry.adapters.connectors.pool_buffer import release_soon
from kvferry.adapters.torch_decode import decode_payload, verify_deferred
from kvferry.app.vllm.context import WorkerContext
from kvferry.app.vllm.group_pages import GroupLoadError, write_group_pages
from kvferry.app.vllm.pages import (
    FP8_FORMAT_KEY,
    PageGeometry,
    block_runs,
    check_payload,
    layer_key,
    layout_family,
    needs_relay,
    recv_slices,
    write_pages,
    write_relaid,
)
from kvferry.app.vllm.params import DecodeSource
from kvferry.app.vllm.records import LoadJob, LoadRecord
from kvferry.app.vllm.state_pages import StateSpec, write_state
from kvferry.core.errors import ConfigError, FailedAtSender, KVFerryError, LeaseExpired, PayloadError
from kvferry.core.layouts import VLLM_CPU_PAGE_ISAS, reblock_span
from kvferry.core.ports import BatchedReleases, GetMany, Implements
from kvferry.core.scales import read_scales, scales_mismatch

__all__ = ["PageLoader"]

logger = logging.getLogger(__name__)
_has_get_many = Implements(GetMany)
_has_batched_releases = Implements(BatchedReleases)


class _LoadFailed(Exception):
    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(f"{kind}: {detail}")
        self.kind = kind


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


@attrs.frozen
class _StateRead:
    """The read of a Mamba layer's state: from the prefill rank of this rank's number."""

    source_rank: int


@attrs.define(eq=False)
class _LoadRun:
    """One load in progress: planned on its first step; ``ok`` once every read is written."""

    job: LoadJob
    started: float
    plan: _LoadPlan | None = None
    ok: bool = False


@attrs.define(eq=False)
class PageLoader:
    """One rank's loads. ``context`` is the rank's shared state (the worker's): its
    ``progress`` is signalled (under its ``lock``) when a load on the load threads ends; each
    finished load is appended to ``recent_loads``. :meth:`attach` gives it the caches,
    :meth:`start` the receiver."""

    context: WorkerContext
    recent_loads: collections.deque[LoadRecord]
    #: Each layer's KV cache group (layer order), with several groups; () with one.
    layer_groups: tuple[int, ...] = ()
    #: Each layer's state spec (a Mamba layer) or None (PageWorker.layer_states); () without.
    layer_states: tuple[StateSpec | None, ...] = ()
    #: Each state layer's ``[num_blocks, state bytes]`` view (state_pages.state_view), else None.
    state_views: list[torch.Tensor | None] = attrs.field(factory=list)
    #: An FP8 cache's format and its current per-layer scales (PageWorker.fp8 / kv_scales).
    fp8: str | None = None
    kv_scales: Callable[[], tuple[Sequence[float], Sequence[float | None] | None]] | None = None
    geometry: PageGeometry | None = attrs.field(init=False, default=None)
    receiver: Any = attrs.field(init=False, default=None)
    #: Hybrid loads in flight, and those reported failed (vLLM's ``failed_recving``).
    _group_loads: set[str] = attrs.field(init=False, factory=set)
    _failed: set[str] = attrs.field(init=False, factory=set)
    _layers: list[torch.Tensor] = attrs.field(init=False, factory=list)
    _names: list[str] = attrs.field(init=False, factory=list)
    _layer_bytes: list[memoryview | None] = attrs.field(init=False, factory=list)
    _pool: concurrent.futures.ThreadPoolExecutor | None = attrs.field(init=False, default=None)
    _loads: dict[str, concurrent.futures.Future] = attrs.field(init=False, factory=dict)
    _load_errors: set[int] = attrs.field(init=False, factory=set)
    _load_blocks: dict[str, tuple[int, ...]] = attrs.field(init=False, factory=dict)

    def attach(self, layers: list[torch.Tensor], geometry: PageGeometry, names: Sequence[str] = ()) -> None:
        """The registered caches (layer order), their geometry and vLLM's names of the layers;
        each cache's own bytes for the page writes that check the checksum in their copy (None
        on a device, or for an NHD cache, whose pages are strided)."""
        self._layers, self.geometry, self._names = layers, geometry, list(names)
        self._layer_bytes = [writable_bytes(t) for t in layers]

    def start(self, receiver: Any) -> None:
        """Load through ``receiver`` from now on, on ``load_threads`` threads past the inline part."""
        self.receiver = receiver
        self._pool = concurrent.futures.ThreadPoolExecutor(
            self.context.settings.load_threads, thread_name_prefix="kvferry-load"
        )

    # ------------------------------------------------------------------------ starting loads
    def start_loads(self, loads: Sequence[LoadJob]) -> None:
        """Start one load per job. The loads first run here, in the engine's thread, for up
        to ``inline_load_s`` in all (what is there already is read and written at once); what
        is not there by then continues on the load threads, and this returns."""
        until = self.context.clock() + self.context.settings.inline_load_s
        for job in loads:
            if job.req_id in self._loads:
                continue
            if self._pool is None:
                raise ConfigError("this instance is not a kv_consumer: it cannot load KV")
            if job.sync:
                self._load_now(job, until)
                continue
            self._load_blocks[job.req_id] = job.block_ids
            if job.groups:
                self._group_loads.add(job.req_id)
            run = _LoadRun(job, self.context.clock())
            if self.context.settings.inline_load_s > 0 and self._step(run, until):
                done: concurrent.futures.Future[bool] = concurrent.futures.Future()
                done.set_result(self._finish(run))
                self._loads[job.req_id] = done
            else:
                fut = self._pool.submit(self._load_rest, run)
                fut.add_done_callback(self._ended)
                self._loads[job.req_id] = fut

    def _load_now(self, job: LoadJob, until: float) -> None:
        """A sync load: read what is there by ``until``; whatever is missing then fails it."""
        run = _LoadRun(job, self.context.clock())
        if not self._step(run, until):
            plan = run.plan
            missing = "?" if plan is None else f"{len(plan.reads) - plan.next} of {len(plan.reads)}"
            for data, _ in plan.ready.values() if plan is not None else ():
                release_soon(data)
            self.context.stats.fail("timeout")
            logger.error(
                "request %s: %s layer reads not there within inline_load_s (%s s) of a sync load; "
                "kv_load_failure_policy applies",
                job.req_id,
                missing,
                self.context.settings.inline_load_s,
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
            self.context.stats.fail(exc.kind)
            logger.error("request %s: KV load failed (%s); kv_load_failure_policy applies", run.job.req_id, exc)
        except Exception:  # any other fault of one load fails that load, never the engine
            self.context.stats.fail("error")
            logger.exception("request %s: KV load failed", run.job.req_id)
        return True

    def _finish(self, run: _LoadRun) -> bool:
        end = self.context.clock()
        job, nbytes = run.job, (run.plan.nbytes if run.plan is not None else 0)
        tid = job.source.transfer_id if job.source is not None else None
        self.recent_loads.append(LoadRecord(job.req_id, tid, nbytes, run.started, end, run.ok))
        if run.ok:
            self.context.stats.add(requests_loaded=1, bytes_loaded=nbytes, load_seconds=max(0.0, end - run.started))
        return run.ok

    # ------------------------------------------------------------------------------ planning
    def _plan(self, job: LoadJob, started: float) -> _LoadPlan:
        if job.error is not None or job.source is None:
            raise _LoadFailed("params", job.error or "no source")
        src, geometry = job.source, self.geometry
        assert geometry is not None
        if src.decode_tp_size != self.context.tp_size:
            raise _LoadFailed(
                "layout",
                f"the prefill sliced heads for decode TP {src.decode_tp_size}, this "
                f"instance runs TP {self.context.tp_size} (set decode_tp_size on the prefill)",
            )
        if src.num_layers != geometry.num_layers:
            raise _LoadFailed("layout", f"prefill has {src.num_layers} layers, this cache {geometry.num_layers}")
        if job.groups and len(self.layer_groups) != geometry.num_layers:
            raise _LoadFailed(
                "layout",
                f"hybrid load: {len(self.layer_groups)} of {geometry.num_layers} layers in KV cache groups",
            )
        if src.block_size != geometry.block_size and not self._relays():
            ours = self.context.cache_layout or self.context.kernel_isa
            raise _LoadFailed(
                "layout",
                f"prefill block_size {src.block_size}, this cache {geometry.block_size}: re-blocking needs a "
                f"page order kvferry knows, and this cache's is {ours!r}",
            )
        try:
            slices = recv_slices(
                src.prefill_tp_size,
                self.context.tp_size,
                self.context.total_kv_heads,
                self.context.tp_rank,
                latent=geometry.latent,
            )
        except KVFerryError as exc:
            raise _LoadFailed("layout", str(exc)) from exc
        states = self.layer_states
        if any(s is not None for s in states) and src.prefill_tp_size != self.context.tp_size:
            raise _LoadFailed(
                "layout",
                f"Mamba state moves between equal TP sizes; the prefill runs TP {src.prefill_tp_size}, "
                f"this decode {self.context.tp_size}",
            )
        needed_pages = -(-src.num_tokens // geometry.block_size)
        count = max(0, min(len(job.block_ids), needed_pages - job.first_page))
        own = _StateRead(self.context.tp_rank)
        reads = (
            [
                (layer, sl)
                for layer in range(geometry.num_layers)
                for sl in ((own,) if layer < len(states) and states[layer] is not None else slices)
            ]
            if count
            else []
        )
        index = torch.tensor(job.block_ids[:count], dtype=torch.long)
        runs = block_runs(job.block_ids[:count])
        try:
            src_pages = reblock_span(job.first_page, count, geometry.block_size, src.block_size, src.num_tokens)[3]
        except ConfigError as exc:
            raise _LoadFailed("params", str(exc)) from exc
        deadline = started + self.context.settings.load_timeout_s
        return _LoadPlan(job, src, index, count, reads, deadline, runs, src_pages=src_pages)

    def _relays(self) -> bool:
        """Whether this cache's pages can be written from other pages per token (its page
        order is known: a dense ``packed`` cache, a CPU kernel kvferry knows, or MLA latent
        pages, one latent per token in every MLA backend)."""
        if self.geometry is not None and self.geometry.latent:
            return True
        family = (self.context.cache_layout or "vllm_cpu").split("/", 1)[0].split(":", 1)[0]
        if self.fp8 is not None and family == "vllm_cpu":  # the CPU kernel's FP8 page order is not measured
            return False
        return family == "packed" or (self.context.kernel_isa or "").lower() in VLLM_CPU_PAGE_ISAS

    # ------------------------------------------------------------------------------- reading
    def _prefetch(self, plan: _LoadPlan) -> None:
        """Ask each prefill rank for every layer it sends at once, where the receiver can
        (``get_many``): what is there already comes back in one exchange per rank."""
        receiver = self.receiver
        if not _has_get_many(receiver) or len(plan.reads) < 2:
            return
        get_many = receiver.get_many
        src, stage = plan.source, self.context.settings.from_stage
        by_rank: dict[int, list[tuple[int, str]]] = {}
        for i, (layer_idx, sl) in enumerate(plan.reads):
            key = layer_key(src.transfer_id, stage, layer_idx, sl.source_rank, self.context.tp_rank)
            by_rank.setdefault(sl.source_rank, []).append((i, key))
        stages = str(self.context.settings.from_stage), str(self.context.settings.to_stage)
        for rank, items in by_rank.items():
            got = get_many(*stages, [key for _, key in items], src.source_metadata(rank))
            for (i, _), one in zip(items, got):
                if one is not None:
                    plan.ready[i] = one

    def _read_layers(self, plan: _LoadPlan, until: float | None) -> bool:
        receiver = self.receiver
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
        stages = str(self.context.settings.from_stage), str(self.context.settings.to_stage)
        while plan.next < len(plan.reads):
            layer_idx, sl = plan.reads[plan.next]
            got = plan.ready.pop(plan.next, None)
            if got is None:
                got = self._get_one(plan, until, layer_idx, sl, stages)
                if got is None:
                    return False
            data = got[0]
            try:
                decoded = decode_payload(data, defer_verify=True)  # checked as the pages are written
                self._check_fp8(decoded.metadata or {}, layer_idx)  # before anything is written
                layer = self._layers[layer_idx]
                spec = self.layer_states[layer_idx] if layer_idx < len(self.layer_states) else None
                if spec is not None:
                    view = self.state_views[layer_idx]
                    assert view is not None
                    group = self.layer_groups[layer_idx]
                    tokens = plan.job.upto_tokens if plan.job.upto_tokens is not None else plan.source.num_tokens
                    plan.nbytes += write_state(view, spec, decoded, layer_idx, group, plan.job.groups[group], tokens)
                    continue
                if plan.job.groups:
                    group = self.layer_groups[layer_idx]
                    heads = (sl.num_heads, sl.recv_head_start, sl.recv_head_stop)
                    pages = -(-plan.source.num_tokens // geometry.block_size)
                    target, cache = plan.job.groups[group], (self.context.cache_layout, self.context.kernel_isa)
                    args_g = (layer_idx, group, target, pages, heads, cache)
                    relay = self._relays() and not (
                        self.fp8 is not None
                        and layout_family((decoded.metadata or {}).get("cache_layout")) == "vllm_cpu"
                    )
                    plan.nbytes += write_group_pages(
                        layer, geometry, decoded, *args_g, self._layer_bytes[layer_idx], relay
                    )
                    continue
                if "group" in (decoded.metadata or {}):  # a hybrid prefill's: some layers hold a window only
                    raise GroupLoadError(f"layer {layer_idx}: pages of KV cache groups; this decode runs one group")
                check_payload(decoded, geometry, layer_idx, sl.num_heads, plan.src_pages)
                args = (plan.index, plan.job.first_page, sl.recv_head_start, sl.recv_head_stop)
                if needs_relay(decoded.metadata, geometry, self.context.cache_layout, self.context.kernel_isa):
                    meta = decoded.metadata or {}
                    theirs = f"{meta.get('cache_layout') or 'vllm_cpu'}, block_size {meta.get('block_size')}"
                    fp8_cpu = self.fp8 is not None and layout_family(meta.get("cache_layout")) == "vllm_cpu"
                    if not self._relays() or fp8_cpu:
                        raise _LoadFailed(
                            "layout",
                            f"layer {layer_idx}: the prefill's pages ({theirs}) differ from this cache's "
                            f"({self.context.cache_layout}), and kvferry cannot re-lay them (an FP8 CPU page's "
                            f"order is not known; other pages need a page order it knows)",
                        )
                    verify_deferred(decoded)
                    try:
                        plan.nbytes += write_relaid(
                            layer, geometry, self.context.cache_layout, self.context.kernel_isa, decoded, *args
                        )
                    except PayloadError as exc:
                        raise _LoadFailed("layout", f"layer {layer_idx}: {exc}") from exc
                else:
                    plan.nbytes += write_pages(layer, geometry, decoded, *args, plan.runs, self._layer_bytes[layer_idx])
            except GroupLoadError as exc:
                raise _LoadFailed("layout", str(exc)) from exc
            except PayloadError as exc:
                raise _LoadFailed("corrupt", str(exc)) from exc
            finally:
                release_soon(data)  # written: the sender may reuse the region once it hears
                plan.next += 1  # (a failure ends the load: ``next`` is not read again)
        return True

    def _check_fp8(self, meta: Any, layer_idx: int) -> None:
        """A ``layout`` failure, before anything is written, unless the payload's FP8 format
        and every layer's scales are this cache's (core.scales.scales_mismatch): FP8 bytes
        quantised with other scales would read as other numbers. PayloadError (``corrupt``)
        for a malformed scales record."""
        theirs = meta.get(FP8_FORMAT_KEY)
        if theirs != self.fp8:
            name = self._names[layer_idx] if layer_idx < len(self._names) else ""
            raise _LoadFailed(
                "layout",
                f"layer {layer_idx} ({name}): the prefill's cache is {theirs or 'not FP8'}, "
                f"this cache is {self.fp8 or 'not FP8'}",
            )
        if self.fp8 is None:
            return
        assert self.kv_scales is not None
        k, v = self.kv_scales()
        why = scales_mismatch(read_scales(meta), k, v, self._names or None)
        if why is not None:
            raise _LoadFailed("layout", f"FP8 scales differ: {why}")

    def _get_one(
        self, plan: _LoadPlan, until: float | None, layer_idx: int, sl: Any, stages: tuple[str, str]
    ) -> tuple[Any, int] | None:
        """One layer's payload, waiting until ``until`` (None: not there by then, more time
        left) or the load's deadline (then a timeout failure). A short wait loses nothing: a
        reply that comes after it answers the next get of the key (shm: its sender answers
        within the wait; zmq: a late reply goes to the newer get, or to its stash)."""
        src = plan.source
        key = layer_key(
            src.transfer_id, self.context.settings.from_stage, layer_idx, sl.source_rank, self.context.tp_rank
        )
        final = until is None or until >= plan.deadline
        remaining = (plan.deadline if final or until is None else min(until, plan.deadline)) - self.context.clock()
        if remaining <= 0:
            if not final:
                return None
            raise _LoadFailed("timeout", f"{key!r} not there within {self.context.settings.load_timeout_s} s")
        source = src.source_metadata(sl.source_rank)
        try:
            got = self.receiver.get_blocking(*stages, key, source, timeout_s=remaining)
        except LeaseExpired as exc:
            raise _LoadFailed("expired", str(exc)) from exc
        except FailedAtSender as exc:  # the prefill's save failed and said so: no wait for the deadline
            raise _LoadFailed("sender_failed", f"{exc} (the prefill counted it as {exc.kind!r})") from exc
        except KVFerryError as exc:
            raise _LoadFailed("unavailable", str(exc)) from exc
        if got is None:
            if not final and self.context.clock() < plan.deadline:
                return None
            where = f"prefill at {src.host}:{source['source_port']}"
            raise _LoadFailed("timeout", f"{key!r} not there within {self.context.settings.load_timeout_s} s ({where})")
        return got

    # ------------------------------------------------------------------------ completions
    def _ended(self, _fut: concurrent.futures.Future[bool]) -> None:
        with self.context.lock:
            self.context.progress.notify_all()

    def in_flight(self) -> int:
        """Loads not ended yet."""
        return sum(1 for f in list(self._loads.values()) if not f.done())

    def take_loaded(self) -> set[str]:
        """Loads ended since the last call (vLLM may schedule their requests now), stamped
        reported; a failed one's blocks go to the next :meth:`load_errors`."""
        loaded: set[str] = set()
        for rid, fut in list(self._loads.items()):
            if fut.done():
                loaded.add(rid)
                del self._loads[rid]
                blocks = self._load_blocks.pop(rid, ())
                hybrid = rid in self._group_loads
                self._group_loads.discard(rid)
                if not fut.result():
                    (self._failed.add(rid) if hybrid else self._load_errors.update(blocks))
        if loaded:
            self._mark_reported(loaded, self.context.clock())
        return loaded

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

    def take_failed(self) -> set[str]:
        """Hybrid loads reported failed (in :meth:`take_loaded`) since the last call."""
        out, self._failed = self._failed, set()
        return out

    def load_errors(self) -> set[int]:
        """Blocks of loads reported failed since the last call."""
        out, self._load_errors = self._load_errors, set()
        return out

    def stop(self) -> None:
        """Stop the load threads without waiting; loads not started are cancelled."""
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
