"""``OmniKVTransferManager``: the reference's manager API on top of :class:`KVTransferManager`.

An engine written against the reference switches by changing imports. Where the reference read
global parallel state, this class takes ``tp_rank`` / ``tp_size`` / ``groups`` as keyword
arguments, else :func:`kvferry.app.compat.kv_utils.get_local_tp_rank` /
:func:`~kvferry.app.compat.kv_utils.get_tp_world_size`. Typed outcomes of the last calls stay
readable (``last_send_outcomes``, ``last_receive_outcome``, ``counters``).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from typing import Any

import attrs

from kvferry.app.compat.codec import KVCacheTransferData, KVPrefetchConsumeError, OmniKVCacheConfig
from kvferry.app.compat.kv_utils import (
    KV_RANK_PORT_STRIDE,
    KVTPTopology,
    LayerKV,
    build_rank_aware_recv_keys,
    build_rank_aware_send_keys,
    expand_env_int,
    get_kv_target_ranks,
    get_local_tp_rank,
    get_omni_replica_id,
    get_tp_world_size,
    kv_zmq_port,
    merge_received_rank_shards,
    normalize_layer_kv,
    slice_layer_blocks,
    slice_received_rank_shard,
)
from kvferry.app.distribute import kv_fields_of
from kvferry.app.manager import COLLECTIVE_MARGIN_S, KVTransferManager, StageGroups
from kvferry.app.receive import ReceiveResult
from kvferry.app.registry import check_connector_config
from kvferry.app.stage import Distribution, DistributionStatus, PrefetchStatus
from kvferry.core.addressing import pull_port
from kvferry.core.config import TransferConfig, extract_omni_kv_config
from kvferry.core.errors import ConfigError
from kvferry.core.layouts import VLLM_CPU_ISAS
from kvferry.core.outcomes import ReceiveOutcome, SendOutcome
from kvferry.core.roles import ReceiveRole, tp_active

# The reference's kv_transfer_manager module also holds the routing helpers, the port stride and
# expand_env_int under these names (engines and tests reach them, e.g. to patch them): the same
# names here, with the same meaning.
__all__ = [
    "OmniKVTransferManager",
    "TransferTopoConfig",
    "ReceiveRole",
    "KVCacheTransferData",
    "KVPrefetchConsumeError",
    "OmniKVCacheConfig",
    "LayerKV",
    "COLLECTIVE_MARGIN_S",
    "KV_RANK_PORT_STRIDE",
    "KVTPTopology",
    "build_rank_aware_recv_keys",
    "build_rank_aware_send_keys",
    "expand_env_int",
    "get_kv_target_ranks",
    "get_local_tp_rank",
    "get_omni_replica_id",
    "get_tp_world_size",
    "kv_zmq_port",
    "merge_received_rank_shards",
    "normalize_layer_kv",
    "slice_layer_blocks",
    "slice_received_rank_shard",
]

logger = logging.getLogger(__name__)


@attrs.frozen
class TransferTopoConfig:
    """A read-only snapshot of this rank's place in the receiving stage, with the reference's
    field names (its ``topo_config``): the receive role, whether TP is active, and the CFG, SP,
    world and TP groups (kvferry's :class:`~kvferry.core.ports.CollectiveGroup` objects, None
    where not initialised) with their sizes and this rank's index in them."""

    role: ReceiveRole
    tp_active: bool
    cfg_size: int
    cfg_rank: int
    cfg_group: Any
    sp_size: int
    sp_rank: int
    sp_group: Any
    world: Any
    tp_group: Any = None
    tp_size: int = 1

    @property
    def is_leader(self) -> bool:
        return self.role is ReceiveRole.LEADER

    @property
    def is_follower(self) -> bool:
        return self.role is ReceiveRole.FOLLOWER

    @property
    def is_local(self) -> bool:
        return self.role is ReceiveRole.LOCAL

    @property
    def cfg_active(self) -> bool:
        return self.cfg_size > 1

    @property
    def sp_active(self) -> bool:
        return self.sp_size > 1


def _with_engine_layout(typed: TransferConfig, vllm_config: Any) -> TransferConfig:
    """``typed`` with ``kv_layout`` taken from what the engine runs (its attention backend, its
    platform and CPU kernel ISA: :func:`kvferry.app.vllm.backends.engine_layout`) when the
    config names none. A named ``kv_layout`` wins; when vLLM cannot tell, or runs a backend
    kvferry does not move, the config is left without a layout and the reason is logged (the
    cache is then read only where its shape is unambiguous, never guessed)."""
    if typed.is_empty or typed.kv_layout is not None:
        return typed
    from kvferry.app.vllm.backends import engine_layout

    try:
        chosen = engine_layout(vllm_config)
    except ConfigError as exc:
        logger.error("kv_layout: not taken from the engine (%s); name kv_layout in omni_kv_config", exc)
        return typed
    except ImportError as exc:  # no vLLM: the engine's config cannot be asked
        logger.warning("kv_layout: vLLM is not importable (%s); name kv_layout in omni_kv_config", exc)
        return typed
    if not chosen.per_token or (chosen.layout.name == "vllm_cpu" and chosen.layout.isa not in VLLM_CPU_ISAS):
        logger.error(
            "kv_layout: the engine writes %s (backend %s), which kvferry's manager cannot read per token "
            "(it reads the vLLM CPU kernel's %s order); its sends will be refused, never misread",
            chosen.label,
            chosen.backend,
            "/".join(sorted(VLLM_CPU_ISAS)),
        )
    logger.info("kv_layout %s from the engine (backend %s)", chosen.label, chosen.backend)
    return attrs.evolve(typed, kv_layout=chosen.layout)


class OmniKVTransferManager:
    """The reference's manager (REFERENCE_API.md) backed by kvferry's typed manager.

    Every behaviour is the typed manager's (:class:`~kvferry.app.manager.KVTransferManager`:
    receive, distribution, prefetch, consensus drops); this class renames, reads the
    reference's arguments (requests, job dicts) and answers in its shapes (bools, ``(payload,
    nbytes)`` tuples, :class:`KVPrefetchConsumeError`).
    """

    def __init__(
        self,
        config: OmniKVCacheConfig | TransferConfig | None,
        *,
        async_prefetch: bool = False,
        connector: Any = None,
        tp_rank: int | None = None,
        tp_size: int | None = None,
        dp_rank: int = 0,
        groups: StageGroups | None = None,
        env: Mapping[str, str] | None = None,
        has_cfg_collector: bool = False,
        **manager_kwargs: Any,
    ) -> None:
        env = os.environ if env is None else env
        if config is None:
            config = OmniKVCacheConfig()
        if isinstance(config, TransferConfig):
            typed, config = config, OmniKVCacheConfig.from_transfer_config(config)
        else:
            typed = config.to_transfer_config(env)
        self.config = config
        if (
            connector is None
            and "connector_factory" not in manager_kwargs
            and (typed.need_send_cache or typed.need_recv_cache)
        ):
            check_connector_config(typed.connector_config)  # a name that cannot be served fails here
        # a CFG collector receives the companion requests synchronously: no prefetch then
        manager_kwargs.setdefault(
            "prefetch", bool(async_prefetch or typed.enable_kv_async_prefetch) and not has_cfg_collector
        )
        self._manager = KVTransferManager(
            typed,
            tp_rank=get_local_tp_rank() if tp_rank is None else tp_rank,
            tp_size=get_tp_world_size() if tp_size is None else tp_size,
            dp_rank=dp_rank,
            groups=groups or StageGroups(),
            connector=connector,
            **manager_kwargs,
        )
        m = self._manager
        self.last_send_outcomes: list[SendOutcome] = []
        self.last_receive_outcome: ReceiveOutcome | None = None
        if m.sending and m.send_connector() is None:
            logger.error(
                "KV sending is configured but no connector could be created: %s", m.connector_failure("sender")
            )

    # ------------------------------------------------------------------------ constructors
    @classmethod
    def from_od_config(cls, config: Any, **kwargs: Any) -> OmniKVTransferManager:
        omni = extract_omni_kv_config(config)
        collector = getattr(config, "cfg_kv_collect_func", None)
        if omni is None:
            return cls(OmniKVCacheConfig(), has_cfg_collector=collector is not None, **kwargs)
        env = kwargs.pop("env", None)
        typed = TransferConfig.from_omni_kv_config(omni, os.environ if env is None else env)
        return cls(typed, has_cfg_collector=collector is not None, env=env, **kwargs)

    from_model_config = from_od_config

    @classmethod
    def from_vllm_config(cls, vllm_config: Any, model_config: Any = None, **kwargs: Any) -> OmniKVTransferManager:
        env = kwargs.pop("env", None)
        typed = TransferConfig.from_vllm_config(vllm_config, model_config, os.environ if env is None else env)
        typed = _with_engine_layout(typed, vllm_config)
        collector = getattr(model_config, "cfg_kv_collect_func", None) if model_config is not None else None
        return cls(typed, has_cfg_collector=collector is not None, env=env, **kwargs)

    # --------------------------------------------------------------------------- attributes
    @property
    def manager(self) -> KVTransferManager:
        """The typed manager underneath."""
        return self._manager

    @property
    def counters(self) -> Any:
        return self._manager.counters

    @property
    def send_stages(self) -> tuple[Any, Any]:
        return self._manager.config.send_stages

    @property
    def recv_stages(self) -> tuple[Any, Any]:
        return self._manager.config.recv_stages

    @property
    def tp_topology(self) -> KVTPTopology:
        from_tp, to_tp = self._manager.tp_sizes
        return KVTPTopology(from_tp, to_tp, self._manager.tp_rank)

    @property
    def topo_config(self) -> TransferTopoConfig:
        """This rank's receive role and groups (:class:`TransferTopoConfig`), built on first use
        from the groups the manager was given (the reference read global parallel state)."""
        snapshot = self.__dict__.get("_topo_config")
        if snapshot is None:
            snapshot = self.__dict__["_topo_config"] = self._build_topo_config()
        return snapshot

    def _build_topo_config(self) -> TransferTopoConfig:
        g = self._manager.groups
        world, tp, cfg, sp = g.world, g.tp, g.cfg, g.sp
        if world is None or world.size <= 1:  # no world group: a single receiving rank
            return TransferTopoConfig(ReceiveRole.LOCAL, False, 1, 0, None, 1, 0, None, world)
        from_tp, to_tp = self._manager.tp_sizes
        return TransferTopoConfig(
            role=self._manager.receive_role(),
            tp_active=tp_active(from_tp, to_tp),
            cfg_size=cfg.size if cfg else 1,
            cfg_rank=cfg.rank if cfg else 0,
            cfg_group=cfg,
            sp_size=sp.size if sp else 1,
            sp_rank=sp.rank if sp else 0,
            sp_group=sp,
            world=world,
            tp_group=tp,
            tp_size=tp.size if tp else 1,
        )

    @property
    def get_connector(self) -> Any:
        """The connector this manager uses (a property, as in the reference: no call)."""
        return self.connector

    @property
    def connector(self) -> Any:
        """The connector (lazy; None when creation failed, which is not retried)."""
        m = self._manager
        return m.send_connector() if m.sending else m.recv_connector()

    def _hook(name: str) -> property:  # type: ignore[misc]
        def get(self: OmniKVTransferManager) -> Any:
            return getattr(self._manager, name)

        def set_(self: OmniKVTransferManager, value: Any) -> None:
            self._manager.set_hooks(**{name: value})

        return property(get, set_)

    kv_send_key_builder = _hook("kv_send_key_builder")
    kv_recv_key_builder = _hook("kv_recv_key_builder")
    kv_payload_merger = _hook("kv_payload_merger")
    kv_payload_slicer = _hook("kv_payload_slicer")
    del _hook

    # ------------------------------------------------------------------------------ sending
    def update_sender_info(self, sender_info: Any, sender_stage_id: Any = None) -> None:
        endpoint = self._manager.update_sender_info(sender_info, sender_stage_id)
        if endpoint is None:
            return
        cc = self.config.connector_config
        if isinstance(cc, dict):
            cc["sender_host"] = endpoint.host
            if endpoint.port is not None:
                cc["sender_zmq_port"] = pull_port(endpoint.port, None, self._manager.tp_rank)

    def handle_finished_requests_kv_transfer(
        self,
        finished_reqs: Mapping[str, Any],
        kv_caches: Any,
        block_size: int,
        cache_dtype: str,
        request_id_resolver: Callable[[str], str] | None = None,
    ) -> list[str]:
        """Send every finished request; returns every processed id (sent or not).

        The typed outcome of each is in :attr:`last_send_outcomes`.
        """
        if not finished_reqs:
            self.last_send_outcomes = []
            return []
        self.last_send_outcomes = self._manager.send_requests(
            finished_reqs, kv_caches, block_size, cache_dtype, request_id_resolver
        )
        return [str(rid) for rid in finished_reqs]

    # ---------------------------------------------------------------------------- receiving
    def _receive(self, request_id: str, target_device: Any = None, sender_info: Any = None) -> ReceiveResult:
        result = self._manager.receive(
            request_id, sender_info=sender_info, target_device=target_device, zero_copy=False
        )  # the reference hands out tensors of their own
        self.last_receive_outcome = result.outcome
        return result

    def receive_kv_cache_for_request(
        self, request_id: str, target_device: Any = None, *, sender_info: Any = None
    ) -> tuple[dict | None, int]:
        result = self._receive(request_id, target_device, sender_info)
        return (result.payload, result.nbytes) if result.ok else (None, 0)

    @staticmethod
    def apply_kv_cache_to_request(req: Any, data: Any) -> None:
        KVTransferManager.apply_to_request(req, data)

    def _apply_sender_info(self, req: Any) -> None:
        info = getattr(req, "kv_sender_info", None)
        if info is not None:
            self.update_sender_info(info)

    def receive_kv_cache(self, req: Any, target_device: Any = None) -> bool:
        request_id = getattr(req, "request_id", None)
        if not request_id:
            return False
        self._apply_sender_info(req)
        data, _ = self.receive_kv_cache_for_request(request_id, target_device)
        if data is None:
            return False
        self.apply_kv_cache_to_request(req, data)
        return True

    def _collect_cfg(self, req: Any, collector: Callable[..., Any] | None, target_device: Any) -> None:
        params = getattr(req, "sampling_params", None)
        cfg_ids = getattr(params, "cfg_kv_request_ids", None) if params is not None else None
        if not cfg_ids or collector is None:
            return
        try:
            extra = collector(req.request_id, cfg_ids, self, target_device)
        except Exception:
            logger.exception("request %s: the CFG KV collector failed; the primary KV stands", req.request_id)
            return
        for name, value in (extra or {}).items():
            setattr(params, name, value)

    def receive_multi_kv_cache(
        self, req: Any, cfg_kv_collect_func: Callable[..., Any] | None = None, target_device: Any = None
    ) -> bool:
        ok = self.receive_kv_cache(req, target_device)
        if ok:
            self._collect_cfg(req, cfg_kv_collect_func, target_device)
        return ok

    def _distributed(self, dist: Distribution) -> bool:
        if dist.status is DistributionStatus.DROPPED_BY_CONSENSUS:  # counted by the manager
            self.last_receive_outcome = dist.drop
        return dist.ok

    def receive_multi_kv_cache_distributed(
        self, req: Any, cfg_kv_collect_func: Callable[..., Any] | None = None, target_device: Any = None
    ) -> bool:
        """Receive by role (LOCAL / LEADER pull; FOLLOWER waits) and distribute (SPEC 6)."""
        return self._distributed(
            self._manager.distribute(req, lambda r: self.receive_multi_kv_cache(r, cfg_kv_collect_func, target_device))
        )

    def distribute_kv_cache(self, req: Any, target_device: Any = None, *, received: bool = False) -> dict | None:
        """Distribute what the leader already applied to ``req``; the fields this rank ends with."""
        ok = self._distributed(self._manager.distribute(req, None if received else (lambda r: False)))
        return kv_fields_of(req) if ok else None

    # ------------------------------------------------------------------------------ prefetch
    def start_prefetch(self, kv_prefetch_job: Mapping[str, Any], target_device: Any = None) -> None:
        job = kv_prefetch_job if isinstance(kv_prefetch_job, Mapping) else {}
        self._manager.start_prefetch(
            str(job.get("request_id") or ""), sender_info=job.get("kv_sender_info"), target_device=target_device
        )

    def consume_prefetched_kv(self, req: Any) -> tuple[dict | None, int]:
        """The prefetched payload for ``req`` or ``(None, 0)`` (then receive synchronously).

        Raises KVPrefetchConsumeError when the payload was taken but post-processing failed.
        """
        rid = getattr(req, "request_id", None)
        if not rid:
            return None, 0
        prefetched = self._manager.consume_prefetched(str(rid))
        result = prefetched.result
        if result is None:
            return None, 0
        self.last_receive_outcome = result.outcome
        if prefetched.status is PrefetchStatus.CONSUMED:
            raise KVPrefetchConsumeError(
                f"request {rid}: prefetched KV was consumed but could not be used: {result.outcome.detail}",
                request_id=str(rid),
            )
        return (result.payload, result.nbytes) if prefetched.hit else (None, 0)

    def consume_and_distribute_kv_cache(self, req: Any, target_device: Any = None) -> bool:
        """Use a prefetched payload when there is one, else receive; then distribute."""

        def receive(r: Any) -> bool:
            try:
                data, _ = self.consume_prefetched_kv(r)
            except KVPrefetchConsumeError as exc:  # the payload is gone: no synchronous retry
                logger.error("%s; the request runs without KV", exc)
                return False
            if data is not None:
                self.apply_kv_cache_to_request(r, data)
                return True
            return self.receive_kv_cache(r, target_device)

        return self._distributed(self._manager.distribute(req, receive))

    def wait_prefetch(self, timeout: float | None = None) -> bool:
        """Block until no background prefetch is running; its payload stays to be consumed.
        False when one is still running after ``timeout`` seconds."""
        return self._manager.wait_prefetch(timeout)

    def shutdown_prefetch(self) -> None:
        self._manager.shutdown_prefetch()

    def close(self) -> None:
        self._manager.close()  # the prefetch worker first, then the connectors

    def __enter__(self) -> OmniKVTransferManager:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
