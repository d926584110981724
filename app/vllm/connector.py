"""``KVFerryConnector``: kvferry as a vLLM v1 KV connector (``KVConnectorBase_V1``).

Load it with ``KVTransferConfig(kv_connector="KVFerryConnector",
kv_connector_module_path="kvferry.app.vllm", kv_role=..., kv_connector_extra_config={...})``.
vLLM builds one instance per role: the scheduler's (:class:`~kvferry.app.vllm.scheduler.
PageScheduler`) and each worker's (:class:`~kvferry.app.vllm.worker.PageWorker`); this module
only adapts vLLM's calls to them. See docs/vllm.md.

Hybrid models (several KV cache groups: vLLM's hybrid manager, which vLLM enables with a
connector that declares ``SupportsHMA``): every group's pages move, a sliding-window group's
only inside its window (:mod:`kvferry.app.vllm.groups`), a Mamba group's the request's state
block (:mod:`kvferry.app.vllm.state_pages`; the prefill computes all but the prompt's last
token); a spec kvferry does not move fails the engine at start, and a failed load is reported
per request (``failed_recving``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

from kvferry.app.vllm.backends import layer_layouts, layer_scales
from kvferry.app.vllm.groups import GroupSpec, describe_groups
from kvferry.app.vllm.params import ConnectorSettings
from kvferry.app.vllm.records import FAILURE_KINDS, POOL_COUNTERS, THREADS_GAUGE, split_gauge_key
from kvferry.app.vllm.scheduler import PageScheduler, StepPlan
from kvferry.app.vllm.state_pages import StateSpec
from kvferry.app.vllm.worker import PageWorker
from kvferry.core.backends import BackendLayout
from kvferry.core.errors import ConfigError

if TYPE_CHECKING:
    import torch

__all__ = ["KVFerryConnector", "KVFerryConnectorMetadata", "KVFerryStats", "KVFerryPromMetrics"]

logger = logging.getLogger(__name__)


@dataclass
class KVFerryConnectorMetadata(KVConnectorMetadata):
    """Scheduler -> workers, once per step: the saves and loads to run."""

    plan: StepPlan = field(default_factory=StepPlan)


def _num_layers(vllm_config: Any, kv_cache_config: Any) -> int:
    groups = getattr(kv_cache_config, "kv_cache_groups", None) or ()
    names = [n for g in groups for n in getattr(g, "layer_names", ())]
    if names:
        return len(names)
    return int(vllm_config.model_config.get_num_layers(vllm_config.parallel_config))


def _page_layouts(vllm_config: Any, kv_caches: dict[str, torch.Tensor], kv_cache_config: Any) -> BackendLayout:
    """The one layout of every registered cache, from what vLLM chose (app.vllm.backends);
    ConfigError at start for a backend kvferry does not move and for layers in different
    layouts. A dense cache in NHD order (``LBNHC``) is moved through strided views of its
    (block, head) pages (pages.PageGeometry ``nhd``: the payload holds the bytes an HND cache's
    would); an MLA cache (``mla``: one latent per token, one "head") in any stride order: with
    one head NHD and HND are the same bytes."""
    layouts = layer_layouts(vllm_config, kv_caches, kv_cache_config)
    labels = {bl.label for bl in layouts.values()}
    if len(labels) > 1:
        raise ConfigError(
            f"kv_caches: layers in different layouts {sorted(labels)}; kvferry moves one layout per engine"
        )
    return next(iter(layouts.values()))


def _layer_groups(groups: tuple[GroupSpec, ...], kv_caches: dict[str, torch.Tensor]) -> tuple[int, ...]:
    """Each registered layer's group (layer order); ConfigError for a layer in no group and for
    groups whose pages differ in shape or dtype (vLLM's hybrid manager pools pages of one size)."""
    of = {name: g.index for g in groups for name in g.layers}
    out: list[int] = []
    first: tuple[str, int, tuple[int, ...], Any] | None = None
    for name, t in kv_caches.items():
        if name not in of:
            raise ConfigError(f"layer {name!r}: in no KV cache group of {[g.label for g in groups]}")
        g = of[name]
        out.append(g)
        if groups[g].state:  # a Mamba layer's state block: its own shape (state_pages)
            continue
        if first is None:
            first = (name, g, tuple(t.shape[1:]), t.dtype)
        elif (tuple(t.shape[1:]), t.dtype) != first[2:]:
            raise ConfigError(
                f"layer {name!r} (KV cache group {g}, {groups[g].label}): pages {tuple(t.shape[1:])} {t.dtype}, "
                f"layer {first[0]!r}'s (group {first[1]}) are {first[2]} {first[3]}; kvferry moves groups of "
                f"one page shape"
            )
    return tuple(out)


def _layer_states(
    groups: tuple[GroupSpec, ...], kv_cache_config: Any, kv_caches: dict[str, torch.Tensor]
) -> tuple[StateSpec | None, ...]:
    """Each registered layer's state tensors (a Mamba group's ``MambaSpec`` shapes and dtypes)
    or None, in layer order."""
    specs: dict[str, StateSpec] = {}
    for spec, group in zip(groups, getattr(kv_cache_config, "kv_cache_groups", None) or ()):
        if spec.state:
            state = StateSpec.of(group.kv_cache_spec)
            specs.update((name, state) for name in spec.layers)
    return tuple(specs.get(name) for name in kv_caches)


class KVFerryConnector(KVConnectorBase_V1, SupportsHMA):
    """Prefill (``kv_producer``) and decode (``kv_consumer``) hand-off through kvferry."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        tc = self._kv_transfer_config
        self.settings = ConnectorSettings.from_extra_config(tc.kv_connector_extra_config)
        producer, consumer = bool(tc.is_kv_producer), bool(tc.is_kv_consumer)
        #: vLLM's KV cache groups; ConfigError at start for a spec kvferry does not move.
        self.groups = describe_groups(kv_cache_config)
        self.hybrid = len(self.groups) > 1
        tp_size = int(vllm_config.parallel_config.tensor_parallel_size)
        self._scheduler: PageScheduler | None = None
        self._worker: PageWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = PageScheduler(
                self.settings,
                engine_id=str(tc.engine_id),
                block_size=int(vllm_config.cache_config.block_size),
                num_layers=_num_layers(vllm_config, kv_cache_config),
                tp_size=tp_size,
                producer=producer,
                consumer=consumer,
                block_ids_of=self._block_ids_of,
                groups=self.groups if self.hybrid else (),
                group_block_ids_of=self._group_block_ids_of,
            )
        else:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            self._worker = PageWorker(
                self.settings,
                tp_rank=int(get_tensor_model_parallel_rank()),
                tp_size=tp_size,
                total_kv_heads=int(vllm_config.model_config.get_total_num_kv_heads()),
                producer=producer,
                consumer=consumer,
            )

    def _block_ids_of(self, req_id: str) -> list[int]:
        manager = self._kv_cache_manager
        return [] if manager is None else list(manager.get_block_ids(req_id)[0])

    def _group_block_ids_of(self, req_id: str) -> tuple[list[int], ...]:
        manager = self._kv_cache_manager
        return () if manager is None else tuple(list(ids) for ids in manager.get_block_ids(req_id))

    @property
    def page_worker(self) -> PageWorker | None:
        """This worker-role connector's page transfers (None in the scheduler role)."""
        return self._worker

    # ------------------------------------------------------------------------ worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self._worker is not None
        states = _layer_states(self.groups, self._kv_cache_config, kv_caches)
        pages = {name: t for (name, t), spec in zip(kv_caches.items(), states) if spec is None}
        layout = _page_layouts(self._vllm_config, pages, self._kv_cache_config)
        self._worker.kernel_isa = layout.layout.isa
        self._worker.cache_layout = layout.label
        self._worker.latent = layout.layout.name == "mla"
        if self.hybrid:
            self._worker.layer_groups = _layer_groups(self.groups, kv_caches)
            if any(spec is not None for spec in states):
                self._worker.layer_states = states
            logger.info("kvferry: KV cache groups %s", ", ".join(g.label for g in self.groups))
        self._worker.fp8 = layout.fp8
        if layout.fp8 is not None:  # FP8 bytes move with their layers' scales, compared on load
            self._worker.kv_scales = layer_scales(self._vllm_config, list(kv_caches))  # (no FP8 Mamba state)
        logger.info("kvferry: %d layers, backend %s, layout %s", len(kv_caches), layout.backend, layout.label)
        self._worker.register(kv_caches)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self._worker is not None and isinstance(connector_metadata, KVFerryConnectorMetadata):
            self._worker.begin_step(connector_metadata.plan.saves)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._connector_metadata
        if self._worker is not None and isinstance(meta, KVFerryConnectorMetadata) and meta.plan.loads:
            self._worker.start_loads(meta.plan.loads)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None  # loads are asynchronous: a request runs only after its load finished

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        if self._worker is not None:
            self._worker.save_layer(layer_name, kv_layer)

    def wait_for_save(self) -> None:
        if self._worker is not None:
            self._worker.end_step()  # saves continue in the background; blocks are kept until done

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        if self._worker is None:
            return None, None
        meta = self._connector_metadata
        idle = isinstance(meta, KVFerryConnectorMetadata) and meta.plan.idle
        sent, loaded = self._worker.finished(finished_req_ids, idle=idle)
        return sent or None, loaded or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        sent, loaded = self.get_finished(finished_req_ids)
        failed = self._worker.failed_loads() if self._worker is not None else set()
        return KVConnectorTransferResults(set(sent or ()), set(loaded or ()), failed)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return set() if self._worker is None else self._worker.load_errors()

    def get_kv_connector_stats(self) -> KVFerryStats | None:
        if self._worker is None:
            return None
        data = self._worker.take_stats()
        return KVFerryStats(data=data) if data else None

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()

    # --------------------------------------------------------------------- scheduler side
    def on_new_request(self, request: Any) -> None:
        """With a Mamba group, a prefill for a remote decode computes all but the prompt's last
        token (PageScheduler.new_request)."""
        if self._scheduler is not None:
            self._scheduler.new_request(request)

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self._scheduler is not None
        return self._scheduler.matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        assert self._scheduler is not None
        self._scheduler.track(request)
        if num_external_tokens > 0:
            ids = blocks.get_block_ids()
            self._scheduler.after_alloc(request, ids[0], num_external_tokens, ids)

    def get_loaded_kv_cache_group_ids(self, request: Any) -> tuple[int, ...]:
        return tuple(range(max(1, len(self.groups))))  # a load restores every group

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        assert self._scheduler is not None
        return KVFerryConnectorMetadata(self._scheduler.build_plan(dict(scheduler_output.num_scheduled_tokens)))

    def update_connector_output(self, connector_output: Any) -> None:
        if self._scheduler is not None:
            self._scheduler.sent(connector_output.finished_sending)

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        assert self._scheduler is not None
        return self._scheduler.request_finished(request)

    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """vLLM's finish call with the hybrid manager (every group's blocks): the same as
        :meth:`request_finished`; the saves hold each group's blocks until the request is sent."""
        assert self._scheduler is not None
        return self._scheduler.request_finished(request)

    def has_pending_push_work(self) -> bool:
        return self._scheduler is not None and self._scheduler.pending_sends

    # ------------------------------------------------------------------------------ stats
    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVFerryStats:
        return KVFerryStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(
        cls, vllm_config: Any, metric_types: Any, labelnames: list[str], per_engine_labelvalues: dict[int, list[object]]
    ) -> KVFerryPromMetrics:
        return KVFerryPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)


@dataclass
class KVFerryStats(KVConnectorStats):
    """Counters of one interval: ``requests_sent``, ``bytes_sent``, ``save_seconds``,
    ``requests_loaded``, ``bytes_loaded``, ``load_seconds``, ``failures_<kind>``,
    ``pool_entries_released``, ``pool_entries_expired``; and gauges, values now, one per rank
    (``<name>@<rank>``: ``pool_bytes_held``, ``pool_regions_held``, ``pool_entries_held``,
    ``pool_entries_unread``, ``threads``). Aggregating adds counters; a gauge keeps the later value (ranks have keys
    of their own)."""

    def reset(self) -> None:
        self.data: dict[str, Any] = {}

    def aggregate(self, other: KVConnectorStats) -> KVFerryStats:
        merged = dict(self.data)
        for k, v in (other.data or {}).items():
            merged[k] = v if split_gauge_key(k) is not None else merged.get(k, 0) + v
        return KVFerryStats(data=merged)

    def reduce(self) -> dict[str, int | float]:
        d: dict[str, Any] = self.data
        out: dict[str, int | float] = {}
        for side, verb in (("sent", "save"), ("loaded", "load")):
            n = int(d.get(f"requests_{side}", 0))
            if n:
                out[f"requests_{side}"] = n
                out[f"MB_{side}"] = round(d.get(f"bytes_{side}", 0) / 1e6, 3)
                out[f"avg_{verb}_ms"] = round(1e3 * d.get(f"{verb}_seconds", 0.0) / n, 2)
        for kind in FAILURE_KINDS:
            if d.get(f"failures_{kind}"):
                out[f"failures_{kind}"] = int(d[f"failures_{kind}"])
        for key in POOL_COUNTERS:
            if d.get(key):
                out[key] = int(d[key])
        held = [v for k, v in d.items() if (g := split_gauge_key(k)) is not None and g[0] == "pool_bytes_held"]
        if held:
            out["pool_MB_held"] = round(sum(held) / 1e6, 3)
        return out

    def is_empty(self) -> bool:
        """No counter counted and no gauge reported (a gauge of 0 is a report)."""
        return not any(v or split_gauge_key(k) is not None for k, v in self.data.items())


class KVFerryPromMetrics(KVConnectorPromMetrics):
    """``vllm:kvferry_*`` counters and gauges on vLLM's metrics endpoint; the gauges carry a
    ``rank`` label (the TP rank that reported them)."""

    _COUNTERS = (
        ("requests_sent", "vllm:kvferry_requests_sent", "Requests whose KV pages kvferry sent."),
        ("bytes_sent", "vllm:kvferry_bytes_sent", "Bytes of KV pages kvferry sent."),
        (
            "bytes_in_place",
            "vllm:kvferry_bytes_in_place",
            "Bytes of those sent that decodes read straight from this prefill's KV cache (not copied into a pool).",
        ),
        ("save_seconds", "vllm:kvferry_save_seconds", "Seconds from a prefill's first layer to its last one sent."),
        ("requests_loaded", "vllm:kvferry_requests_loaded", "Requests whose KV pages kvferry loaded."),
        ("bytes_loaded", "vllm:kvferry_bytes_loaded", "Bytes of KV pages kvferry loaded."),
        ("load_seconds", "vllm:kvferry_load_seconds", "Seconds spent loading KV pages."),
        ("put_waits", "vllm:kvferry_put_waits", "Page payloads whose put waited for room in a full pool."),
        (
            "saves_failed_told",
            "vllm:kvferry_saves_failed_told",
            "Failed rank saves whose decode was told at once (failure records under their keys).",
        ),
        (
            "pool_entries_released",
            "vllm:kvferry_pool_entries_released",
            "Entries (a layer of a request for one decode rank) of the prefill's pool freed when read.",
        ),
        (
            "pool_entries_expired",
            "vllm:kvferry_pool_entries_expired",
            "Entries of the prefill's pool freed because their lease ran out unread (or a gone reader's hold).",
        ),
    )
    _GAUGES = (
        ("pool_bytes_held", "vllm:kvferry_pool_bytes_held", "Bytes the prefill's pool holds now."),
        ("pool_regions_held", "vllm:kvferry_pool_regions_held", "Regions the prefill's pool holds now."),
        ("pool_entries_held", "vllm:kvferry_pool_entries_held", "Published entries the prefill's pool holds now."),
        (
            "pool_entries_unread",
            "vllm:kvferry_pool_entries_unread",
            "Entries the prefill's pool holds that no reader has taken yet.",
        ),
        (THREADS_GAUGE, "vllm:kvferry_threads", "kvferry's threads in the rank's process."),
    )

    def __init__(
        self,
        vllm_config: Any,
        metric_types: Any,
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters: dict[str, dict[int, Any]] = {}
        for key, name, doc in self._COUNTERS:
            metric = self._counter_cls(name=name, documentation=doc, labelnames=labelnames)
            self._counters[key] = {i: metric.labels(*v) for i, v in per_engine_labelvalues.items()}
        failures = self._counter_cls(
            name="vllm:kvferry_failures",
            documentation="KV transfers that failed, by kind.",
            labelnames=[*labelnames, "kind"],
        )
        self._failures = {
            i: {k: failures.labels(*v, k) for k in FAILURE_KINDS} for i, v in per_engine_labelvalues.items()
        }
        self._labels = per_engine_labelvalues
        self._gauges = {
            key: self._gauge_cls(
                name=name, documentation=doc, labelnames=[*labelnames, "rank"], multiprocess_mode="mostrecent"
            )
            for key, name, doc in self._GAUGES
        }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for key, per_engine in self._counters.items():
            value = transfer_stats_data.get(key)
            if value and engine_idx in per_engine:
                per_engine[engine_idx].inc(value)
        for kind, counter in self._failures.get(engine_idx, {}).items():
            value = transfer_stats_data.get(f"failures_{kind}")
            if value:
                counter.inc(value)
        labels = self._labels.get(engine_idx)
        if labels is None:
            return
        for key, value in transfer_stats_data.items():
            g = split_gauge_key(key)
            if g is not None and g[0] in self._gauges:
                self._gauges[g[0]].labels(*labels, str(g[1])).set(value)
