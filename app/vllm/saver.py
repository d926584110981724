"""The prefill side of a vLLM worker rank: saving pages as the forward computes them.

:meth:`PageSaver.save_layer` is called (through :class:`~kvferry.app.vllm.worker.PageWorker`)
by vLLM's attention layer for every layer during the forward; the layer's pages of every
request whose prefill completes in this step are handed to one background thread, which
gathers them straight into the connector's pool and publishes them (one payload per layer and
decode rank), while the model computes the next layers. A decode rank may pull layer 0 while
layer 1 is still computing. The engine keeps the request's blocks until every layer is out;
then :meth:`PageSaver.take_sent` reports the request as sent and vLLM frees them. The payloads
themselves stay in kvferry's pool until the decode side has read them or their lease expires.
A failed layer fails its request's transfer (counted as ``put`` or ``error``), never the engine.
A failed save (a layer's put failed, or the save was not out by the end of its step) is told
to the decode at once where the connector can say it (:class:`~kvferry.core.ports.FailureRecords`:
memory, shm, zmq; not mooncake): a failure record under every key of the rank's transfer, which a decode's get
answers at once (``sender_failed``) instead of waiting out ``load_timeout_s``; counted as
``saves_failed_told``. Over another connector the decode's load times out as before.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import attrs
import torch

from kvferry.app.put import put_with_retry
from kvferry.app.vllm.context import WorkerContext
from kvferry.app.vllm.pages import FP8_FORMAT_KEY, PageGeometry, PageWriter, layer_key, send_slices
from kvferry.app.vllm.records import SaveJob
from kvferry.app.vllm.state_pages import StateSpec, StateWriter
from kvferry.core.errors import KVFerryError, PoolFullError, TransferError
from kvferry.core.policy import PUT_FAILURES, RetryPolicy
from kvferry.core.ports import FailureRecords, Implements, PiecesPut, Reservable
from kvferry.core.scales import KV_SCALES_KEY, scales_record
from kvferry.core.tombstones import failure_record

__all__ = ["PageSaver"]

logger = logging.getLogger(__name__)


@attrs.define(eq=False)
class _SaveState:
    job: SaveJob
    layers_left: int
    started: float
    nbytes: int = 0
    failed: str | None = None
    queued: set[int] = attrs.field(factory=set)
    told: bool = False  #: its failure records were published
    #: Keys of its payloads read in place that the connector has not freed yet: the request's
    #: blocks are held until this is empty.
    pinned: set[str] = attrs.field(factory=set)

    @property
    def done(self) -> bool:
        return self.layers_left == 0


@attrs.define(eq=False)
class PageSaver:
    """One rank's saves. ``context`` is the rank's shared state (the worker's): its
    ``progress`` is signalled (under its ``lock``) when a save ends; :meth:`attach` gives it
    the caches, :meth:`start` the sender."""

    context: WorkerContext
    sleep: Callable[[float], None]
    retry: RetryPolicy
    #: Each layer's KV cache group (layer order), with several groups; () with one.
    layer_groups: tuple[int, ...] = ()
    #: Each layer's state spec (a Mamba layer) or None (PageWorker.layer_states); () without.
    layer_states: tuple[StateSpec | None, ...] = ()
    #: Each state layer's ``[num_blocks, state bytes]`` view (state_pages.state_view), else None.
    state_views: list[torch.Tensor | None] = attrs.field(factory=list)
    state_writer: StateWriter | None = None
    #: An FP8 cache's format and its current per-layer scales (PageWorker.fp8 / kv_scales).
    fp8: str | None = None
    kv_scales: Callable[[], tuple[Sequence[float], Sequence[float | None] | None]] | None = None
    geometry: PageGeometry | None = attrs.field(init=False, default=None)
    #: Gathers a layer's pages into a payload (set once the caches are checked).
    writer: PageWriter | None = attrs.field(init=False, default=None)
    sender: Any = attrs.field(init=False, default=None)
    saves: dict[str, _SaveState] = attrs.field(init=False, factory=dict)
    _layers: list[torch.Tensor] = attrs.field(init=False, factory=list)
    _index: Mapping[str, int] = attrs.field(init=False, factory=dict)
    _step_saves: tuple[SaveJob, ...] = attrs.field(init=False, default=())
    _engine_finished: set[str] = attrs.field(init=False, factory=set)
    _queue: queue.Queue[Any] = attrs.field(init=False, factory=queue.Queue)
    _thread: threading.Thread | None = attrs.field(init=False, default=None)
    _is_reservable: Implements = attrs.field(init=False, factory=lambda: Implements(Reservable))
    _records_failures: Implements = attrs.field(init=False, factory=lambda: Implements(FailureRecords))
    #: Set by :meth:`read_in_place`: a registered zero-filled buffer (padding between pages
    #: read in place) as ``(address, length)``; None: every payload is gathered into the pool.
    _zeros: tuple[int, int] | None = attrs.field(init=False, default=None)
    _zeros_buffer: torch.Tensor | None = attrs.field(init=False, default=None)

    def attach(self, layers: list[torch.Tensor], index: Mapping[str, int], geometry: PageGeometry) -> None:
        """The registered caches (layer order), their names' indexes and geometry."""
        self._layers, self._index, self.geometry = layers, index, geometry

    def start(self, sender: Any) -> None:
        """Save through ``sender`` from now on, on the save thread."""
        self.sender = sender
        self._thread = threading.Thread(target=self._save_loop, name="kvferry-save", daemon=True)
        self._thread.start()

    def read_in_place(self) -> str | None:
        """Let decodes read this rank's pages where the cache keeps them (ConnectorSettings.
        in_place): the sender must read payloads in pieces (PiecesPut) and the cache be vLLM's
        contiguous host layout; then every page layer is registered with the sender. None when
        enabled, else why not (logged by the caller)."""
        conn, geometry = self.sender, self.geometry
        if conn is None or geometry is None or not Implements(PiecesPut)(conn):
            return f"the {type(conn).__name__} connector reads payloads from its pool only"
        pages = [t for i, t in enumerate(self._layers) if not self._is_state(i)]
        if geometry.nhd or any(t.device.type != "cpu" or not t.is_contiguous() for t in pages):
            return "the cache is not vLLM's contiguous host layout [num_blocks, heads, block_size, 2 * head_size]"
        zeros = torch.zeros(4096, dtype=torch.uint8)
        conn.register_memory(zeros)
        for t in pages:
            conn.register_memory(t)
        self._zeros_buffer, self._zeros = zeros, (zeros.data_ptr(), zeros.numel())
        return None

    def _is_state(self, layer_idx: int) -> bool:
        return layer_idx < len(self.layer_states) and self.layer_states[layer_idx] is not None

    # ------------------------------------------------------------------------------ a step
    def begin_step(self, saves: Sequence[SaveJob]) -> None:
        """The saves of the step about to run (from the scheduler's metadata)."""
        now = self.context.clock()
        with self.context.lock:
            for job in saves:
                if job.req_id not in self.saves:
                    self.saves[job.req_id] = _SaveState(job, len(self._layers), now)
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
        with self.context.lock:
            states = [self.saves[j.req_id] for j in self._step_saves if j.req_id in self.saves]
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
        held = [j.req_id for j in self._step_saves if j.hold_step]
        self._step_saves = ()
        if held:
            self._hold(held)

    def _hold(self, req_ids: list[str]) -> None:
        """Wait (up to ``load_timeout_s``) until these saves are out: vLLM frees a page they send
        right after this step. One still not out then is failed (``timeout``): its last layers
        are not sent, and the decode's load fails rather than read a page vLLM reused."""
        ctx = self.context
        with ctx.lock:
            states = [self.saves[r] for r in req_ids if r in self.saves]
            if ctx.progress.wait_for(lambda: all(s.done for s in states), timeout=ctx.settings.load_timeout_s):
                return
            dropped = [s for s in states if not s.done and s.failed is None]
            for s in dropped:
                s.failed = "timeout: not out by the end of its step"
                ctx.stats.fail("timeout")
                logger.error("request %s: save not out by the end of its step; not sent", s.job.req_id)
        for s in dropped:
            self._tell_decode(s, "timeout", "the save was not out by the end of its step")

    # ---------------------------------------------------------------------- the save thread
    def _save_loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            state, layer_idx, layer = item
            try:
                if state.failed is None:
                    state.nbytes += self._save_one(state, layer_idx, layer)
            except Exception as exc:  # a failed layer fails the request's transfer, not the engine
                kind = "put" if isinstance(exc, (PoolFullError, KVFerryError)) else "error"
                state.failed = f"{kind}: {exc}"
                self.context.stats.fail(kind)
                logger.error("request %s: saving layer %d failed: %s", state.job.req_id, layer_idx, exc)
                self._tell_decode(state, kind, f"layer {layer_idx}: {exc}")
            with self.context.lock:
                state.layers_left -= 1
                done = state.done
                if done:
                    self.context.progress.notify_all()
            if done and state.failed is None:
                self.context.stats.add(
                    requests_sent=1,
                    bytes_sent=state.nbytes,
                    save_seconds=max(0.0, self.context.clock() - state.started),
                )

    def _tell_decode(self, state: _SaveState, kind: str, reason: str) -> None:
        """Publish a failure record under every key of this rank's save of ``state`` (every
        layer, every decode rank it sends to), once, where the connector can (FailureRecords);
        a page payload already out under one of them is dropped. Never raises."""
        conn = self.sender
        with self.context.lock:
            if state.told or conn is None or not self._records_failures(conn):
                return
            state.told = True
        job, ctx = state.job, self.context
        stages = str(ctx.settings.from_stage), str(ctx.settings.to_stage)
        failure = failure_record(kind, reason)
        latent = self.geometry.latent if self.geometry is not None else False
        told = 0
        try:
            slices = send_slices(ctx.tp_size, job.decode_tp, ctx.total_kv_heads, ctx.tp_rank, latent=latent)
            pages_to = sorted({sl.target_rank for sl in slices})
            for layer_idx in range(len(self._layers)):
                is_state = layer_idx < len(self.layer_states) and self.layer_states[layer_idx] is not None
                for rank in [ctx.tp_rank] if is_state else pages_to:  # a Mamba state goes to its own rank
                    key = layer_key(job.transfer_id, ctx.settings.from_stage, layer_idx, ctx.tp_rank, rank)
                    told += bool(conn.publish_failure(*stages, key, failure))
        except Exception:  # telling is best effort: the decode's load then times out, as before
            logger.exception("request %s: the failure records of its save could not be published", job.req_id)
        if told:
            ctx.stats.add(saves_failed_told=1)

    def _save_state(self, job: SaveJob, layer_idx: int, spec: StateSpec) -> int:
        """A Mamba layer's state block of ``job`` (its group's one block), to the decode rank of
        this rank's number: the state is sharded by vLLM's rule, moved between equal TP sizes."""
        ctx, writer, view = self.context, self.state_writer, self.state_views[layer_idx]
        assert writer is not None and view is not None
        if job.decode_tp != ctx.tp_size:
            raise KVFerryError(
                f"layer {layer_idx}: Mamba state moves between equal TP sizes; this prefill runs TP "
                f"{ctx.tp_size}, the decode {job.decode_tp}"
            )
        if not job.groups or layer_idx >= len(self.layer_groups):
            raise KVFerryError(f"layer {layer_idx}: no KV cache group registered for it")
        pages = job.groups[self.layer_groups[layer_idx]]
        meta = {
            "layer": layer_idx,
            "num_tokens": job.num_tokens,
            "group": pages.group,
            "first_page": pages.first_page,
            "from_rank": ctx.tp_rank,
            "to_rank": ctx.tp_rank,
        }
        layout = writer.layout(job.transfer_id, pages.block_ids, spec, meta)
        index = torch.tensor(pages.block_ids, dtype=torch.long)
        key = layer_key(job.transfer_id, ctx.settings.from_stage, layer_idx, ctx.tp_rank, ctx.tp_rank)
        return self._put(key, layout, lambda dest: writer.gather(view, index, dest, layout))

    def _save_one(self, state: _SaveState, layer_idx: int, layer: torch.Tensor) -> int:
        job = state.job
        spec = self.layer_states[layer_idx] if layer_idx < len(self.layer_states) else None
        if spec is not None:
            return self._save_state(job, layer_idx, spec)
        geometry, writer = self.geometry, self.writer
        assert geometry is not None and writer is not None
        block_ids = job.block_ids
        group_meta: dict[str, int] = {}
        if job.groups:  # a hybrid save: this layer's group's pages, stated in the metadata
            if layer_idx >= len(self.layer_groups):
                raise KVFerryError(f"layer {layer_idx}: no KV cache group registered for it")
            pages = job.groups[self.layer_groups[layer_idx]]
            block_ids, group_meta = pages.block_ids, {"group": pages.group, "first_page": pages.first_page}
        index = torch.tensor(block_ids, dtype=torch.long, device=layer.device)
        stage = self.context.settings.from_stage
        nbytes = 0
        scales = None
        if self.fp8 is not None:  # every layer's scales in every payload: the first read checks them all
            assert self.kv_scales is not None
            scales = scales_record("layer", *self.kv_scales())
        for sl in send_slices(
            self.context.tp_size,
            job.decode_tp,
            self.context.total_kv_heads,
            self.context.tp_rank,
            latent=geometry.latent,
        ):
            meta = {
                "layout": geometry.payload_layout,
                "layer": layer_idx,
                "num_tokens": job.num_tokens,
                "block_size": geometry.block_size,
                "head_size": geometry.head_size,
                "heads": [sl.abs_head_start, sl.abs_head_stop],
                "from_rank": self.context.tp_rank,
                "to_rank": sl.target_rank,
                **group_meta,
            }
            if self.context.kernel_isa is not None:
                meta["isa"] = self.context.kernel_isa
            if self.context.cache_layout is not None:
                meta["cache_layout"] = self.context.cache_layout
            if scales is not None:
                meta[FP8_FORMAT_KEY], meta[KV_SCALES_KEY] = self.fp8, scales
            layout = writer.layout(job.transfer_id, block_ids, sl.num_heads, meta)
            key = layer_key(job.transfer_id, stage, layer_idx, self.context.tp_rank, sl.target_rank)
            in_place = self._in_place(state, layer_idx, layer, block_ids, sl.head_start, sl.head_stop, layout)
            if in_place is not None:
                nbytes += self._put_in_place(state, key, *in_place)
                continue
            nbytes += self._put(
                key, layout, lambda dest: writer.gather(layer, index, sl.head_start, sl.head_stop, dest, layout)
            )
        return nbytes

    def _in_place(
        self,
        state: _SaveState,
        layer_idx: int,
        layer: torch.Tensor,
        block_ids: Sequence[int],
        head_start: int,
        head_stop: int,
        layout: Any,
    ) -> tuple[bytes, list[tuple[int, int]]] | None:
        """The header and page ranges of a payload read in place, or None: gather it (in place
        is off, the request runs on after this step, its pages are in more places than a reply
        lists, or this is not the registered cache tensor)."""
        job, writer = state.job, self.writer
        if self._zeros is None or not job.ends_now or job.hold_step or job.groups or writer is None:
            return None
        if layer.data_ptr() != self._layers[layer_idx].data_ptr():
            return None
        got = writer.pieces(layer, block_ids, head_start, head_stop, layout, self._zeros)
        if got is None or len(got[1]) > int(getattr(self.sender, "max_pieces", 0)):
            return None
        return got

    def _put_in_place(self, state: _SaveState, key: str, head: bytes, pieces: list[tuple[int, int]]) -> int:
        """Publish one payload read in place (PiecesPut) under the one put rule; the request's
        blocks stay held until the connector frees it (:meth:`_unpin`). Raises as :meth:`_put`."""
        conn = self.sender
        stages = str(self.context.settings.from_stage), str(self.context.settings.to_stage)
        with self.context.lock:
            state.pinned.add(key)  # before the put: a fast reader may free it before put returns
        done = put_with_retry(
            lambda: conn.put_pieces(*stages, key, head, pieces, lambda: self._unpin(state, key)),
            self.retry,
            self.sleep,
        )
        if not done.ok:
            self._unpin(state, key)  # nothing was published: on_free never comes
        size = self._settle(key, done, " (in place)")
        self.context.stats.add(bytes_in_place=size - len(head))
        return size

    def _unpin(self, state: _SaveState, key: str) -> None:
        """The connector freed a payload read in place: its pages may change again."""
        with self.context.lock:
            state.pinned.discard(key)
            if not state.pinned:
                self.context.progress.notify_all()

    def _put(self, key: str, layout: Any, fill: Callable[[torch.Tensor], None]) -> int:
        """Publish one page payload under the one put rule (:func:`kvferry.app.put.put_with_retry`);
        its bytes in the pool. PoolFullError (with its reason) or TransferError when it fails."""
        conn = self.sender
        stages = str(self.context.settings.from_stage), str(self.context.settings.to_stage)

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

        return self._settle(key, put_with_retry(attempt, self.retry, self.sleep))

    def _settle(self, key: str, done: Any, what: str = "") -> int:
        """The size of a put that succeeded (one that waited for room counted ``put_waits``);
        PoolFullError (with its reason) or TransferError for one that failed."""
        if done.ok:
            if done.attempts > 1:  # the pool was full: it waited for reads to free room
                self.context.stats.add(put_waits=1)
            return int(done.size)
        message = f"put of {key!r}{what} failed after {done.attempts} attempts ({done.reason}): {done.detail}"
        if done.reason in PUT_FAILURES:
            raise PoolFullError(message, reason=done.reason, detail=done.detail)
        raise TransferError(message)

    # ------------------------------------------------------------------------ completions
    def in_flight(self) -> int:
        """Saves not ended yet, or with pages still read in place (call with ``lock`` held)."""
        return sum(1 for s in self.saves.values() if not s.done or s.pinned)

    def take_sent(self, finished_req_ids: Iterable[str]) -> set[str]:
        """Requests vLLM finished whose every layer is out, and none of whose payloads is still
        read in place: their blocks may be freed now (call with ``lock`` held). A request vLLM
        finished before then is kept until a later call finds it so."""
        sent: set[str] = set()
        self._engine_finished.update(r for r in finished_req_ids if r in self.saves)
        for rid in list(self._engine_finished):
            if self.saves[rid].done and not self.saves[rid].pinned:
                sent.add(rid)
                self._engine_finished.discard(rid)
                del self.saves[rid]
        return sent

    def stop(self) -> None:
        """End the save thread once the layers queued before it are out (waits up to 10 s)."""
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(timeout=10)
