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
from kvferry.app.vllm.pages import FP8_FORMAT_KEY, PageGeometry, PageWriter, layer_key, send_slices
from kvferry.app.vllm.params import ConnectorSettings
from kvferry.app.vllm.records import SaveJob, TransferStats
from kvferry.core.errors import KVFerryError, PoolFullError, TransferError
from kvferry.core.policy import PUT_FAILURES, RetryPolicy
from kvferry.core.ports import Implements, Reservable
from kvferry.core.scales import KV_SCALES_KEY, scales_record

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

    @property
    def done(self) -> bool:
        return self.layers_left == 0


@attrs.define(eq=False)
class PageSaver:
    """One rank's saves. ``lock``/``progress`` are the worker's: ``progress`` is signalled
    (under ``lock``) when a save ends; :meth:`attach` gives it the caches, :meth:`start` the sender."""

    settings: ConnectorSettings
    tp_rank: int
    tp_size: int
    total_kv_heads: int
    stats: TransferStats
    lock: threading.Lock
    progress: threading.Condition
    clock: Callable[[], float]
    sleep: Callable[[float], None]
    retry: RetryPolicy
    kernel_isa: str | None = None
    cache_layout: str | None = None
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

    def attach(self, layers: list[torch.Tensor], index: Mapping[str, int], geometry: PageGeometry) -> None:
        """The registered caches (layer order), their names' indexes and geometry."""
        self._layers, self._index, self.geometry = layers, index, geometry

    def start(self, sender: Any) -> None:
        """Save through ``sender`` from now on, on the save thread."""
        self.sender = sender
        self._thread = threading.Thread(target=self._save_loop, name="kvferry-save", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------------------ a step
    def begin_step(self, saves: Sequence[SaveJob]) -> None:
        """The saves of the step about to run (from the scheduler's metadata)."""
        now = self.clock()
        with self.lock:
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
        with self.lock:
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
        self._step_saves = ()

    # ---------------------------------------------------------------------- the save thread
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
            with self.lock:
                state.layers_left -= 1
                done = state.done
                if done:
                    self.progress.notify_all()
            if done and state.failed is None:
                self.stats.add(
                    requests_sent=1, bytes_sent=state.nbytes, save_seconds=max(0.0, self.clock() - state.started)
                )

    def _save_one(self, job: SaveJob, layer_idx: int, layer: torch.Tensor) -> int:
        geometry, writer = self.geometry, self.writer
        assert geometry is not None and writer is not None
        index = torch.tensor(job.block_ids, dtype=torch.long, device=layer.device)
        stage = self.settings.from_stage
        nbytes = 0
        scales = None
        if self.fp8 is not None:  # every layer's scales in every payload: the first read checks them all
            assert self.kv_scales is not None
            scales = scales_record("layer", *self.kv_scales())
        for sl in send_slices(self.tp_size, job.decode_tp, self.total_kv_heads, self.tp_rank, latent=geometry.latent):
            meta = {
                "layout": geometry.payload_layout,
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
            if scales is not None:
                meta[FP8_FORMAT_KEY], meta[KV_SCALES_KEY] = self.fp8, scales
            layout = writer.layout(job.transfer_id, job.block_ids, sl.num_heads, meta)
            key = layer_key(job.transfer_id, stage, layer_idx, self.tp_rank, sl.target_rank)
            nbytes += self._put(
                key, layout, lambda dest: writer.gather(layer, index, sl.head_start, sl.head_stop, dest, layout)
            )
        return nbytes

    def _put(self, key: str, layout: Any, fill: Callable[[torch.Tensor], None]) -> int:
        """Publish one page payload under the one put rule (:func:`kvferry.app.put.put_with_retry`);
        its bytes in the pool. PoolFullError (with its reason) or TransferError when it fails."""
        conn = self.sender
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

    # ------------------------------------------------------------------------ completions
    def in_flight(self) -> int:
        """Saves not ended yet (call with ``lock`` held)."""
        return sum(1 for s in self.saves.values() if not s.done)

    def take_sent(self, finished_req_ids: Iterable[str]) -> set[str]:
        """Requests vLLM finished whose every layer is out: their blocks may be freed now
        (call with ``lock`` held). A request vLLM finished before its save ended is kept
        until a later call finds it done."""
        sent: set[str] = set()
        self._engine_finished.update(r for r in finished_req_ids if r in self.saves)
        for rid in list(self._engine_finished):
            if self.saves[rid].done:
                sent.add(rid)
                self._engine_finished.discard(rid)
                del self.saves[rid]
        return sent

    def stop(self) -> None:
        """End the save thread once the layers queued before it are out (waits up to 10 s)."""
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(timeout=10)
