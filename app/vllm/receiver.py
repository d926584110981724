"""A kvferry receiving stage fed by a vLLM prefill instance, with no vLLM in its process.

A vLLM prefill instance running ``KVFerryConnector`` (``kv_role="kv_producer"``) publishes each
request's pages, one payload per layer and per decode rank (docs/vllm.md). The same payloads
feed a stage that is not vLLM: :class:`VllmPageReceiver` is installed on that stage's
:class:`~kvferry.app.manager.KVTransferManager` (its key and merge hooks) and receives a
request through the manager's normal :meth:`~kvferry.app.manager.KVTransferManager.receive`,
given the prefill's ``RequestOutput.kv_transfer_params`` unchanged:

* keys: per layer ``l`` the rank-aware key with ``chunk_id = l + 1`` from every prefill rank
  holding this rank's heads (:func:`kvferry.core.routing.route_heads`, the same plan the
  prefill sliced with; the prefill's ``decode_tp_size`` must be this stage's TP size);
* sender: the params' ``remote_host``/``remote_port`` (prefill rank ``r`` at ``+ r * 16``);
* merge: each layer's page regions (heads of several prefill ranks concatenated in merge
  order) are decoded to per-token ``[num_tokens, heads, head_dim]`` K and V by
  :func:`kvferry.adapters.kv_layouts.vllm_pages_to_tokens`, with the CPU kernel the prefill
  stated in the payload (``isa``), else the one this receiver was given.

The result is a :class:`~kvferry.app.receive.ReceiveResult` whose payload has the usual shape:
``layer_blocks["key_cache"][l]`` is layer ``l``'s K of this rank's heads. Requests that are
not announced through :meth:`VllmPageReceiver.receive` go through the hooks untouched (the
manager's default keys and merge, or the hooks installed before).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from typing import Any

import attrs
import torch

from kvferry.app.manager import KVTransferManager
from kvferry.app.receive import ReceiveResult
from kvferry.app.vllm.pages import PAGE_LAYOUT, layer_key, layout_family, pages_to_tokens, recv_slices
from kvferry.app.vllm.params import DecodeSource, parse_decode_params
from kvferry.core.errors import ConfigError, KVFerryError, PayloadError
from kvferry.core.head_slices import tp_head_slice_record
from kvferry.core.layouts import VLLM_PAGES
from kvferry.core.outcomes import ReceiveKind, ReceiveOutcome
from kvferry.core.routing import HeadSlice

__all__ = ["VllmPageReceiver", "vllm_sender_info"]


def vllm_sender_info(source: DecodeSource) -> dict[str, Any]:
    """The manager's sender info (SPEC 2.5) for a vLLM prefill: its host and rank-0 port."""
    return {"host": source.host, "zmq_port": source.port}


@attrs.frozen
class _Expected:
    source: DecodeSource
    slices: tuple[HeadSlice, ...]
    keys: tuple[tuple[str, int], ...]


@attrs.define(eq=False)
class VllmPageReceiver:
    """Receives vLLM prefill pages on one rank of a kvferry stage (see the module docstring).

    ``isa``: the prefill's CPU attention kernel (``"amx"``, ``"vec"``/``"avx2"``), used when a
    payload does not state it (a prefill of an older kvferry); a payload's own ``isa`` wins.
    ``num_kv_heads``: the model's KV heads (all ranks); default the manager config's.
    """

    manager: KVTransferManager
    isa: str | None = None
    num_kv_heads: int | None = None
    _expected: dict[str, _Expected] = attrs.field(init=False, factory=dict)
    _lock: threading.Lock = attrs.field(init=False, factory=threading.Lock)
    _next_keys: Callable[..., Any] | None = attrs.field(init=False, default=None)
    _next_merger: Callable[..., Any] | None = attrs.field(init=False, default=None)

    @classmethod
    def install(
        cls, manager: KVTransferManager, *, isa: str | None = None, num_kv_heads: int | None = None
    ) -> VllmPageReceiver:
        """Install the hooks on ``manager`` (hooks already there keep serving other requests)."""
        receiver = cls(manager, isa, num_kv_heads)
        receiver._next_keys = manager.kv_recv_key_builder
        receiver._next_merger = manager.kv_payload_merger
        manager.set_hooks(kv_recv_key_builder=receiver._keys, kv_payload_merger=receiver._merge)
        return receiver

    # ------------------------------------------------------------------------------ receive
    def receive(
        self, kv_transfer_params: Any, *, timeout_s: float | None = None, zero_copy: bool = True
    ) -> ReceiveResult:
        """Receive the request the prefill's ``kv_transfer_params`` describe (its
        ``RequestOutput.kv_transfer_params``, unchanged); the outcome is counted by the manager.
        Never raises for bad params or remote faults: the outcome says what went wrong."""
        tid = str(kv_transfer_params.get("transfer_id", "")) if isinstance(kv_transfer_params, Mapping) else ""
        try:
            expected = self._plan(kv_transfer_params)
        except KVFerryError as exc:
            outcome = ReceiveOutcome.failed(tid, ReceiveKind.SENDER_UNRESOLVED, str(exc))
            self.manager.counters.record(outcome)
            return ReceiveResult(outcome)
        tid = expected.source.transfer_id
        with self._lock:
            if tid in self._expected:
                outcome = ReceiveOutcome.failed(tid, ReceiveKind.ERROR, f"transfer {tid!r} is already being received")
                self.manager.counters.record(outcome)
                return ReceiveResult(outcome)
            self._expected[tid] = expected
        try:
            return self.manager.receive(
                tid, sender_info=vllm_sender_info(expected.source), timeout_s=timeout_s, zero_copy=zero_copy
            )
        finally:
            with self._lock:
                self._expected.pop(tid, None)

    def _plan(self, params: Any) -> _Expected:
        source = parse_decode_params(params)
        if source is None:
            raise ConfigError("kv_transfer_params.do_remote_prefill: not set (not a prefill's hand-off)")
        manager = self.manager
        if source.decode_tp_size != manager.tp_size:
            raise ConfigError(
                f"kv_transfer_params.decode_tp_size: the prefill sliced heads for TP {source.decode_tp_size}, "
                f"this stage runs TP {manager.tp_size} (set decode_tp_size on the prefill)"
            )
        heads = self.num_kv_heads if self.num_kv_heads is not None else manager.config.num_kv_heads
        if heads is None:
            raise ConfigError("num_kv_heads: the model's KV head count is needed to route a vLLM prefill's heads")
        slices = recv_slices(source.prefill_tp_size, manager.tp_size, heads, manager.tp_rank)
        stage = manager.config.recv_from_stage
        if isinstance(stage, str) and stage.strip().isdigit():
            stage = int(stage.strip())
        if not isinstance(stage, int) or isinstance(stage, bool):
            raise ConfigError(
                f"from_stage: a vLLM prefill's keys carry its integer from_stage (default 0), this stage "
                f"receives from {stage!r}"
            )
        keys = tuple(
            (layer_key(source.transfer_id, stage, layer, sl.source_rank, manager.tp_rank), sl.source_rank)
            for layer in range(source.num_layers)
            for sl in slices
        )
        return _Expected(source, slices, keys)

    # -------------------------------------------------------------------------------- hooks
    def _expected_for(self, request_id: Any) -> _Expected | None:
        with self._lock:
            return self._expected.get(str(request_id))

    def _keys(self, request_id: str, from_stage: Any, to_stage: Any) -> Any:
        expected = self._expected_for(request_id)
        if expected is not None:
            return expected.keys
        return self._next_keys(request_id, from_stage, to_stage) if self._next_keys is not None else None

    def _merge(self, payloads: list[dict[str, Any]]) -> dict[str, Any] | None:
        first = payloads[0] if payloads else {}
        expected = self._expected_for(first.get("request_id"))
        if expected is None or (first.get("metadata") or {}).get("layout") != PAGE_LAYOUT:
            return self._next_merger(payloads) if self._next_merger is not None else None
        return self._decode(expected, payloads)

    def _decode(self, expected: _Expected, payloads: list[dict[str, Any]]) -> dict[str, Any]:
        src, slices = expected.source, expected.slices
        if len(payloads) != len(expected.keys):
            raise PayloadError(f"{len(payloads)} payloads for {len(expected.keys)} keys")
        keys: list[torch.Tensor] = []
        values: list[torch.Tensor] = []
        isa = None
        for layer in range(src.num_layers):
            group = payloads[layer * len(slices) : (layer + 1) * len(slices)]
            k_parts, v_parts = [], []
            for sl, payload in zip(slices, group):
                meta = payload.get("metadata") or {}
                where = f"layer {layer} from prefill rank {sl.source_rank}"
                _check(meta, where, layer, src, sl)
                isa = meta.get("isa") or self.isa
                blocks = payload.get("layer_blocks") or {}
                k_pages, v_pages = ((blocks.get(name) or [None])[0] for name in ("key_cache", "value_cache"))
                if not isinstance(k_pages, torch.Tensor) or not isinstance(v_pages, torch.Tensor):
                    raise PayloadError(f"{where}: expected K and V pages")
                k_parts.append(k_pages)
                v_parts.append(v_pages)
            k_pages = k_parts[0] if len(k_parts) == 1 else torch.cat(k_parts, dim=1)
            v_pages = v_parts[0] if len(v_parts) == 1 else torch.cat(v_parts, dim=1)
            try:  # the layout the prefill's backend wrote (a dense GPU cache's packed pages, or the CPU kernel's)
                family = layout_family((group[0].get("metadata") or {}).get("cache_layout"))
                k, v = pages_to_tokens(k_pages, v_pages, family, isa, src.block_size, src.num_tokens)
            except ConfigError as exc:
                raise PayloadError(f"layer {layer}: {exc}") from exc
            keys.append(k)
            values.append(v)
        manager = self.manager
        metadata = {
            "source_layout": VLLM_PAGES,
            "isa": isa,
            "num_tokens": src.num_tokens,
            "heads": [slices[0].abs_head_start, slices[-1].abs_head_stop],
            "prefill_engine_id": src.engine_id,
            "tp_head_slice": tp_head_slice_record(
                "sender", slices[0].source_rank, manager.tp_rank, src.prefill_tp_size, manager.tp_size, 0, 1
            ),
        }
        return {
            "request_id": src.transfer_id,
            "block_ids": [],
            "metadata": metadata,
            "layer_blocks": {"key_cache": keys, "value_cache": values},
        }


def _check(meta: Mapping[str, Any], where: str, layer: int, src: DecodeSource, sl: HeadSlice) -> None:
    """PayloadError unless ``meta`` is this layer's pages of these heads, as announced."""
    if meta.get("layout") != PAGE_LAYOUT:
        raise PayloadError(f"{where}: payload layout {meta.get('layout')!r}, expected {PAGE_LAYOUT!r}")
    want = {
        "layer": layer,
        "num_tokens": src.num_tokens,
        "block_size": src.block_size,
        "heads": [sl.abs_head_start, sl.abs_head_stop],
    }
    for name, value in want.items():
        got = meta.get(name)
        if (list(got) if isinstance(got, (list, tuple)) else got) != value:
            raise PayloadError(f"{where}: metadata {name} is {got!r}, expected {value!r}")
