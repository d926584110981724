"""The transfer manager an inference engine embeds (SPEC 6-7), with a typed API.

:class:`KVTransferManager` owns the connectors of one rank, the send path, the receive path,
distribution inside the receiving stage (with the pure-TP consensus that drops KV a peer
missed) and the optional prefetch worker. It is built from a
:class:`~kvferry.core.config.TransferConfig` by :mod:`kvferry.app.wiring` (the composition
root) or directly with injected adapters in tests. Every call returns typed outcomes
(:mod:`kvferry.app.stage` for the receiving stage's) and updates
:attr:`KVTransferManager.counters`; the reference's method names live in
:mod:`kvferry.app.compat` on top of this class.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import attrs

from kvferry.app.distribute import Distributor, kv_fields_of
from kvferry.app.prefetch import CONSUMED_KINDS, Prefetcher
from kvferry.app.receive import ReceivePath, ReceiveResult
from kvferry.app.registry import SERVING_CONNECTORS, connector_role_config, create_connector
from kvferry.app.send import SendPath
from kvferry.app.stage import Distribution, DistributionStatus, Prefetched, PrefetchStart, PrefetchStatus
from kvferry.core.addressing import kv_port, pull_port
from kvferry.core.config import TransferConfig
from kvferry.core.errors import ConfigError, ConnectorUnavailable
from kvferry.core.header import DecodeLimits
from kvferry.core.ids import is_dummy_request
from kvferry.core.outcomes import Counters, ReceiveKind, ReceiveOutcome, SendOutcome, SendReason
from kvferry.core.policy import RetryPolicy
from kvferry.core.ports import CollectiveGroup, Connector, SenderAware
from kvferry.core.roles import ReceiveRole
from kvferry.core.sender_info import SenderEndpoint, resolve_sender
from kvferry.core.topology import TPTopology

__all__ = [
    "KVTransferManager",
    "StageGroups",
    "KVCache",
    "SERVING_CONNECTORS",
    "SystemClock",
    "COLLECTIVE_MARGIN_S",
]

logger = logging.getLogger(__name__)

#: Followers wait for the leader's receive (up to ``recv_timeout``) plus this margin (seconds);
#: every collective step of the receiving stage is bounded by the sum.
COLLECTIVE_MARGIN_S = 30.0
#: Refusals a prefetch took (the marker is gone), kept for the synchronous receive that
#: follows; all are forgotten when this many are kept.
_REFUSALS_KEPT = 1024


class SystemClock:
    """The process's monotonic clock."""

    def monotonic(self) -> float:
        return time.monotonic()


@attrs.define(eq=False)
class KVCache:
    """What a request's ``past_key_values`` holds: per-layer key and value tensors."""

    key_cache: list[Any]
    value_cache: list[Any]

    def __len__(self) -> int:
        return len(self.key_cache)


@attrs.define(eq=False)
class StageGroups:
    """The collective groups of one receiving rank (None where not initialised)."""

    world: CollectiveGroup | None = None
    tp: CollectiveGroup | None = None
    cfg: CollectiveGroup | None = None
    sp: CollectiveGroup | None = None

    @property
    def initialised(self) -> bool:
        return self.world is not None


@attrs.define(eq=False)
class KVTransferManager:
    """One rank's KV transfer endpoint.

    ``tp_rank``/``tp_size``: this rank's place in its stage's TP group (the run-time TP size is
    used for both sides when the config's ``rank_mapping`` sizes are both <= 1). ``connector``:
    an instance to use for both sending and receiving (tests, stages in one process); otherwise
    connectors are created by ``connector_factory`` from the config, the sender's at
    :meth:`start`, the receiver's on first use. A failed creation is remembered and reported as
    a ``connector_unavailable`` outcome, never retried on a hot path.
    """

    config: TransferConfig
    tp_rank: int = 0
    tp_size: int = 1
    dp_rank: int = 0
    groups: StageGroups = attrs.field(factory=StageGroups)
    connector: Connector | None = None
    connector_factory: Callable[[dict[str, Any]], Connector] = create_connector
    clock: Any = attrs.field(factory=SystemClock)
    sleep: Callable[[float], None] = time.sleep
    free_memory_ratio: Callable[[], float | None] = lambda: None
    bind_host: str = "127.0.0.1"
    checksums: str | None = None
    #: What a received payload's header may claim (SPEC 3.1: validate before allocating).
    decode_limits: DecodeLimits = attrs.field(factory=DecodeLimits)
    #: Put retries (SPEC 7 default: 3 attempts, 0.1 s doubling). A producer that prefers to wait
    #: out a full pool (back-pressure) passes more attempts.
    retry: RetryPolicy = attrs.field(factory=RetryPolicy)
    kv_send_key_builder: Callable[..., Any] | None = None
    kv_recv_key_builder: Callable[..., Any] | None = None
    kv_payload_merger: Callable[..., Any] | None = None
    kv_payload_slicer: Callable[..., Any] | None = None
    counters: Counters = attrs.field(factory=lambda: Counters(threading.Lock()))
    prefetch: bool | None = None
    _send_connector: Connector | None = attrs.field(init=False, default=None)
    _recv_connector: Connector | None = attrs.field(init=False, default=None)
    _failures: dict[str, ConnectorUnavailable] = attrs.field(init=False, factory=dict)
    _sender: SenderEndpoint | None = attrs.field(init=False, default=None)
    _lock: threading.RLock = attrs.field(init=False, factory=threading.RLock)
    _closed: bool = attrs.field(init=False, default=False)
    _recv_path: tuple[tuple, ReceivePath] | None = attrs.field(init=False, default=None)
    _send_path: tuple[tuple, SendPath] | None = attrs.field(init=False, default=None)
    _prefetcher: Prefetcher = attrs.field(init=False)
    _refused: dict[str, ReceiveOutcome] = attrs.field(init=False, factory=dict)

    def __attrs_post_init__(self) -> None:
        wanted = self.config.enable_kv_async_prefetch if self.prefetch is None else self.prefetch
        self._prefetcher = Prefetcher(
            lambda rid, info, device: self._receive(rid, info, device, None, False),
            enabled=bool(wanted) and self.config.need_recv_cache and not self.config.receiver_pool_on_device,
            role=self.receive_role,
            free_ratio=lambda: self.free_memory_ratio(),
            min_free_ratio=self.config.kv_prefetch_min_free_mem_ratio,
            wait_s=self.collective_timeout_s,
        )

    # ------------------------------------------------------------------------------ topology
    @property
    def tp_sizes(self) -> tuple[int, int]:
        """``(from_tp, to_tp)`` used for routing."""
        return self.config.effective_tp(self.tp_size)

    @property
    def sending(self) -> bool:
        return self.config.need_send_cache and self.config.send_stages != (None, None)

    @property
    def receiving(self) -> bool:
        return self.config.need_recv_cache and self.config.recv_stages != (None, None)

    def topology(self) -> TPTopology:
        from_tp, to_tp = self.tp_sizes
        return TPTopology(from_tp, to_tp, self.tp_rank)

    def sender_port(self) -> int:
        """The port this rank binds as a sender (SPEC 2.3)."""
        from_tp, _ = self.tp_sizes
        return kv_port(
            self.config.base_port,
            self.config.from_stage,
            self.tp_rank,
            self.config.replica_id,
            self.dp_rank,
            tp_size=from_tp,
        )

    # ---------------------------------------------------------------------------- connectors
    def _connector_config(self, role: str) -> dict[str, Any] | None:
        cfg = self.config.connector_dict()
        if cfg is None:
            return None
        return connector_role_config(
            cfg,
            role=role,
            sender_port=self.sender_port() if role == "sender" else None,
            host=self.bind_host,
            from_stage=self.config.from_stage,
            to_stage=self.config.to_stage,
        )

    def _create(self, role: str) -> Connector | None:
        if self.connector is not None:
            return self.connector
        if role in self._failures:
            return None
        cfg = self._connector_config(role)
        if cfg is None:
            self._failures[role] = ConnectorUnavailable("connector_config is not set")
            return None
        try:
            conn = self.connector_factory(cfg)
        except Exception as exc:  # any failure of an injected factory: remembered, never retried
            error = (
                exc if isinstance(exc, ConnectorUnavailable) else ConnectorUnavailable(f"{type(exc).__name__}: {exc}")
            )
            if error is not exc:
                error.__cause__ = exc
            self._failures[role] = error
            logger.error("cannot create the %s connector %r: %s", role, cfg.get("type"), exc)
            return None
        if role == "receiver" and self._sender is not None and isinstance(conn, SenderAware):
            if self._sender.port is not None:
                conn.update_sender_info(self._sender.host, pull_port(self._sender.port, None, self.tp_rank))
        return conn

    def send_connector(self) -> Connector | None:
        """The sending connector (created on first call; None when creation failed)."""
        with self._lock:
            if self._send_connector is None and not self._closed:
                self._send_connector = self._create("sender")
            return self._send_connector

    def recv_connector(self) -> Connector | None:
        """The receiving connector (created on first call; None when creation failed)."""
        with self._lock:
            if self._recv_connector is None and not self._closed:
                self._recv_connector = self._create("receiver")
            return self._recv_connector

    def connector_failure(self, role: str) -> ConnectorUnavailable | None:
        """The remembered creation failure for ``"sender"`` or ``"receiver"``, if any."""
        return self._failures.get(role)

    def start(self) -> None:
        """Create the sending connector now (SPEC 7: a sending stage fails at start).

        Raises ConnectorUnavailable when it cannot be created.
        """
        for note in self.config.notes():
            logger.warning("%s", note)
        if self.sending and self.send_connector() is None:
            raise self._failures.get("sender") or ConnectorUnavailable("no sending connector")

    # --------------------------------------------------------------------------- sender info
    def update_sender_info(self, sender_info: Any, sender_stage_id: Any = None) -> SenderEndpoint | None:
        """Store the default sender (SPEC 2.5) and tell a live receiving connector.

        Returns the resolved endpoint, or None (with a warning) when unresolved.
        """
        if not self.receiving:
            return None
        stage = self.config.recv_from_stage if sender_stage_id is None else sender_stage_id
        resolution = resolve_sender(sender_info, stage)
        endpoint = resolution.endpoint
        if endpoint is None:  # not resolved
            logger.warning("sender info unresolved: %s", resolution.reason)
            return None
        with self._lock:
            self._sender = endpoint
            conn = self._recv_connector if self.connector is None else self.connector
        if conn is not None and isinstance(conn, SenderAware) and endpoint.port is not None:
            conn.update_sender_info(endpoint.host, pull_port(endpoint.port, None, self.tp_rank))
        return endpoint

    @property
    def sender_endpoint(self) -> SenderEndpoint | None:
        return self._sender

    # ---------------------------------------------------------------------------------- send
    #: The engine's hooks (SPEC 2.2, 2.4), set through :meth:`set_hooks`.
    HOOKS = ("kv_send_key_builder", "kv_recv_key_builder", "kv_payload_merger", "kv_payload_slicer")

    def set_hooks(self, **hooks: Callable[..., Any] | None) -> None:
        """Set any of :data:`HOOKS` (a callable, or None for the default) in one call; the send
        and receive paths are rebuilt on their next use. ConfigError naming an unknown hook or a
        value that is not callable; nothing is set then."""
        for name, value in hooks.items():
            if name not in self.HOOKS:
                raise ConfigError(f"unknown hook {name!r}; hooks: {', '.join(self.HOOKS)}")
            if value is not None and not callable(value):
                raise ConfigError(f"{name} must be callable or None, got {type(value).__name__}")
        with self._lock:
            for name, value in hooks.items():
                setattr(self, name, value)
            self._send_path = self._recv_path = None

    def send_path(self) -> SendPath:
        """The send path for the current settings: built once and reused while the key hook,
        retry policy, checksums, clock and TP sizes stay the same."""
        from_tp, to_tp = self.tp_sizes
        signature = (
            from_tp,
            to_tp,
            self.tp_rank,
            self.config,
            self.clock,
            self.sleep,
            self.retry,
            self.kv_send_key_builder,
            self.checksums,
        )
        cached = self._send_path
        if cached is not None and all(a is b or a == b for a, b in zip(cached[0], signature)):
            return cached[1]
        path = SendPath(
            self.config.from_stage,
            self.config.to_stage,
            TPTopology(from_tp, to_tp, self.tp_rank),
            self.send_connector,
            self.clock,
            self.sleep,
            retry=self.retry,
            key_builder=self.kv_send_key_builder,
            checksums=self.checksums,
            num_heads=self.config.num_kv_heads,
            layout=self.config.kv_layout,
        )
        self._send_path = (signature, path)
        return path

    def send_requests(
        self,
        finished: Mapping[str, Mapping[str, Any]],
        kv_caches: Any,
        block_size: int,
        cache_dtype: Any,
        request_id_resolver: Callable[[str], str] | None = None,
        kv_scales: Mapping[str, Any] | None = None,
    ) -> list[SendOutcome]:
        """Send every finished request (``{block_ids, seq_len, custom_metadata?}``).

        ``kv_scales``: an FP8 cache's scales (see :meth:`kvferry.app.send.SendPath.send`); they
        travel with every payload and come back in the receiver's ``metadata["kv_scales"]``.
        One outcome per request, in input order; counted in :attr:`counters`.
        """
        outcomes: list[SendOutcome] = []
        if not self.sending:
            for rid in finished:
                outcomes.append(SendOutcome.skipped(str(rid)))
            for o in outcomes:
                self.counters.record(o)
            return outcomes
        path = self.send_path()
        for rid, spec in finished.items():
            rid = str(rid)
            try:
                global_id = request_id_resolver(rid) if request_id_resolver else rid
                spec = spec if isinstance(spec, Mapping) else {}
                outcome = path.send(
                    str(global_id),
                    kv_caches,
                    spec.get("block_ids"),
                    spec.get("seq_len", 0),
                    block_size,
                    cache_dtype,
                    spec.get("custom_metadata"),
                    kv_scales,
                )
            except Exception as exc:  # one bad request must not stop the others
                logger.exception("request %s: send failed", rid)
                outcome = SendOutcome.failed(rid, SendReason.ERROR, f"{type(exc).__name__}: {exc}")
            self.counters.record(outcome)
            outcomes.append(outcome)
        return outcomes

    # ------------------------------------------------------------------------------- receive
    def receive_path(self) -> ReceivePath:
        """The receive path for the current settings: built once and reused while the hooks,
        limits, clock and TP sizes stay the same (the hooks may be replaced at any time)."""
        from_tp, to_tp = self.tp_sizes
        signature = (
            from_tp,
            to_tp,
            self.tp_rank,
            self.config,
            self.clock,
            self.sleep,
            self.kv_recv_key_builder,
            self.kv_payload_merger,
            self.kv_payload_slicer,
            self.decode_limits,
        )
        cached = self._recv_path
        if (
            cached is not None
            and len(cached[0]) == len(signature)
            and all(a is b for a, b in zip(cached[0], signature))
        ):
            return cached[1]
        path = ReceivePath(
            self.config.recv_from_stage,
            self.config.stage_id,
            TPTopology(from_tp, to_tp, self.tp_rank),
            self.recv_connector,
            self.clock,
            self.sleep,
            self.config.recv_timeout,
            key_builder=self.kv_recv_key_builder,
            merger=self.kv_payload_merger,
            slicer=self.kv_payload_slicer,
            limits=self.decode_limits,
            num_heads=self.config.num_kv_heads,
            layout=self.config.kv_layout,
        )
        self._recv_path = (signature, path)
        return path

    def receive(
        self,
        request_id: str,
        *,
        sender_info: Any = None,
        target_device: Any = None,
        timeout_s: float | None = None,
        zero_copy: bool = True,
    ) -> ReceiveResult:
        """Receive one request's KV for this rank (SPEC 7); the outcome is counted.

        ``sender_info`` (request-scoped) overrides, and does not change, the stored sender.
        ``zero_copy`` (the default): the payload's tensors are views of the connector's pool
        buffers, which the result holds until ``result.release()`` or until the result and
        every such tensor are garbage (see :mod:`kvferry.app.receive`); while held, the sender
        cannot reuse those bytes, so a caller that keeps the KV for long copies it (or passes
        ``zero_copy=False``). ``zero_copy=False`` copies the tensors out and releases the
        buffers before returning (what the reference does; :mod:`kvferry.app.compat` uses it).
        A refusal a prefetch already took for ``request_id`` (:meth:`consume_prefetched`) is
        answered at once (it was counted then).
        """
        with self._lock:
            refused = self._refused.pop(str(request_id), None)
        if refused is not None:
            return ReceiveResult(refused)
        return self._receive(request_id, sender_info, target_device, timeout_s, zero_copy)

    def _receive(
        self, request_id: str, sender_info: Any, target_device: Any, timeout_s: float | None, zero_copy: bool
    ) -> ReceiveResult:
        try:
            result = self.receive_path().receive(
                str(request_id) if request_id is not None else "",
                sender_info=sender_info,
                stored_sender=self._sender,
                target_device=target_device,
                timeout_s=timeout_s,
                receiving=self.receiving,
                zero_copy=zero_copy,
            )
        except Exception as exc:
            logger.exception("request %s: receive failed", request_id)
            result = ReceiveResult(
                ReceiveOutcome.failed(str(request_id), ReceiveKind.ERROR, f"{type(exc).__name__}: {exc}")
            )
        self.counters.record(result.outcome)
        return result

    def record_consensus_drop(self, request_id: str) -> ReceiveOutcome:
        """Count that KV this rank received was dropped because a TP peer missed (SPEC 9.1)."""
        outcome = ReceiveOutcome.failed(
            str(request_id), ReceiveKind.DROPPED_BY_CONSENSUS, "a TP peer did not receive; every rank dropped its KV"
        )
        self.counters.record(outcome)
        return outcome

    # ------------------------------------------------------------------------- distribution
    @property
    def collective_timeout_s(self) -> float:
        """What bounds each collective step of the receiving stage, and a prefetch's wait
        (seconds): ``recv_timeout`` (followers wait while the leader receives) plus
        :data:`COLLECTIVE_MARGIN_S`."""
        return self.config.recv_timeout + COLLECTIVE_MARGIN_S

    def _distributor(self, on_drop: Callable[[str], None] | None = None) -> Distributor:
        from_tp, to_tp = self.tp_sizes
        return Distributor(
            self.groups, from_tp, to_tp, timeout_s=self.collective_timeout_s, kv_factory=KVCache, on_drop=on_drop
        )

    def receive_role(self) -> ReceiveRole:
        """This rank's role in the receiving stage (SPEC 6): LOCAL pulls its own shard, a
        LEADER pulls and hands KV to its FOLLOWERS, which never touch the connector."""
        return self._distributor().plan().role

    def _takes_part(self, request: Any) -> bool:
        """Whether ``request`` is distributed at all: a real request id on a receiving stage
        (the same answer on every rank, so either all enter the collectives or none)."""
        rid = getattr(request, "request_id", None)
        return bool(rid) and not is_dummy_request(rid) and self.receiving

    def distribute(self, request: Any, receive: Callable[[Any], bool] | None = None) -> Distribution:
        """Receive by role and distribute inside the receiving stage (SPEC 6, 9.1, 9.3).

        Call on every rank of the stage for the same request, in the same order. ``receive``
        (run on LOCAL and LEADER ranks only) pulls this rank's KV and applies it to
        ``request`` (``past_key_values`` / ``kv_metadata`` and the ``cfg_*`` fields of its
        ``sampling_params``), returning whether it did; None: the KV this rank has already
        applied to ``request``, if any. Leaders then hand it to their followers; pure-TP LOCAL
        ranks agree on it, and KV a peer missed is dropped on every rank (counted as
        ``dropped_by_consensus``). Raises KVFerryError when a collective fails (the group is
        broken; this rank keeps no KV then).
        """
        rid = str(getattr(request, "request_id", "") or "")
        role = self.receive_role()
        if not self._takes_part(request):
            return Distribution(rid, role, DistributionStatus.SKIPPED)
        drops: list[ReceiveOutcome] = []
        pull = receive if receive is not None else (lambda r: kv_fields_of(r) is not None)
        has_kv = self._distributor(lambda r: drops.append(self.record_consensus_drop(r))).run(
            request, pull, active=True
        )
        if has_kv:
            return Distribution(rid, role, DistributionStatus.HAS_KV)
        if drops:
            return Distribution(rid, role, DistributionStatus.DROPPED_BY_CONSENSUS, drop=drops[0])
        return Distribution(rid, role, DistributionStatus.NO_KV)

    def receive_and_distribute(
        self,
        request: Any,
        *,
        sender_info: Any = None,
        target_device: Any = None,
        timeout_s: float | None = None,
        zero_copy: bool = True,
    ) -> Distribution:
        """:meth:`distribute` with the manager's own receive: the prefetched payload for the
        request when there is one (:meth:`consume_prefetched`; one taken but unusable means no
        KV, never a second wait), else :meth:`receive` with these arguments; the payload is
        applied to ``request`` (:meth:`apply_to_request`). The result's ``received`` is this
        rank's receive (LOCAL and LEADER ranks); a zero-copy one is released here unless this
        rank ends with KV, then it is the caller's to release.
        """
        received: list[ReceiveResult] = []

        def pull(req: Any) -> bool:
            rid = str(req.request_id)
            prefetched = self.consume_prefetched(rid)
            result = prefetched.result
            if result is not None and prefetched.status is PrefetchStatus.CONSUMED:  # gone: no second wait
                received.append(result)
                logger.error(
                    "request %s: prefetched KV was consumed but could not be used (%s); the request runs without KV",
                    rid,
                    result.outcome.detail,
                )
                return False
            if result is None or not prefetched.hit:
                result = self.receive(
                    rid, sender_info=sender_info, target_device=target_device, timeout_s=timeout_s, zero_copy=zero_copy
                )
            received.append(result)
            return self.apply_to_request(req, result.payload) if result.ok else False

        try:
            dist = self.distribute(request, pull)
        except BaseException:
            for result in received:
                result.release()
            raise
        mine = received[-1] if received else None
        if mine is not None and not dist.ok:
            mine.release()
        return attrs.evolve(dist, received=mine)

    # ------------------------------------------------------------------------------ prefetch
    @property
    def prefetch_enabled(self) -> bool:
        """Whether :meth:`start_prefetch` may start anything (see ``prefetch``)."""
        return self._prefetcher.enabled

    def start_prefetch(self, request_id: str, *, sender_info: Any, target_device: Any = None) -> PrefetchStart:
        """Begin receiving ``request_id`` on the background worker (SPEC 7; one at a time: a
        prefetch of another id still outstanding is dropped). Copies its tensors out
        (``zero_copy=False``), so no pool buffer is held while the result waits. Followers,
        a missing ``sender_info``, a disabled or shut-down worker and low free device memory
        start nothing; the answer says which."""
        job: dict[str, Any] = {"request_id": request_id}
        if sender_info is not None:
            job["kv_sender_info"] = sender_info
        started, reason = self._prefetcher.start(job, target_device)
        if not started:
            logger.debug("prefetch of %r not started: %s", request_id, reason)
        return PrefetchStart(str(request_id), started, reason)

    def consume_prefetched(self, request_id: str) -> Prefetched:
        """The prefetch of ``request_id``, waiting for it (up to :attr:`collective_timeout_s`).

        A prefetch of another id is dropped. HIT: apply ``result.payload``. MISS: receive
        synchronously (a refusal the prefetch took is then answered at once). CONSUMED: the
        payload was taken but is unusable; it is gone, so do not receive again.
        """
        rid = str(request_id)
        result = self._prefetcher.take(rid)
        if result is None:
            return Prefetched(rid, PrefetchStatus.MISS)
        kind = result.outcome.kind
        if kind is ReceiveKind.REFUSED:  # the sender said it cannot come: never wait for it
            with self._lock:
                if len(self._refused) >= _REFUSALS_KEPT:
                    self._refused.clear()
                self._refused[rid] = result.outcome
        if kind in CONSUMED_KINDS:
            return Prefetched(rid, PrefetchStatus.CONSUMED, result)
        return Prefetched(rid, PrefetchStatus.HIT if result.ok else PrefetchStatus.MISS, result)

    def wait_prefetch(self, timeout_s: float | None = None) -> bool:
        """Block until no prefetch is running (its result stays to be consumed); False when one
        is still running after ``timeout_s`` seconds (None: as long as it takes)."""
        return self._prefetcher.wait(timeout_s)

    def shutdown_prefetch(self) -> None:
        """Drop pending prefetches and stop the worker (idempotent; waits for a running
        receive). Later starts answer ``shut_down``; receiving goes on."""
        self._prefetcher.shutdown()

    # ------------------------------------------------------------------------------- request
    @staticmethod
    def apply_to_request(req: Any, payload: Mapping[str, Any] | None) -> bool:
        """Set ``past_key_values`` and ``kv_metadata`` on the request (and its sampling params)."""
        if not payload:
            return False
        blocks = payload.get("layer_blocks") or {}
        kv = KVCache(list(blocks.get("key_cache") or []), list(blocks.get("value_cache") or []))
        meta = payload.get("metadata") or {}
        for target in (req, getattr(req, "sampling_params", None)):
            if target is None:
                continue
            target.past_key_values = kv
            target.kv_metadata = meta
        return True

    # ------------------------------------------------------------------------------ lifecycle
    def health(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "counters": self.counters.snapshot(),
            "failures": {k: str(v) for k, v in self._failures.items()},
        }
        for role, conn in (("sender", self._send_connector), ("receiver", self._recv_connector)):
            if conn is not None:
                try:
                    out[role] = conn.health()
                except Exception as exc:
                    out[role] = {"ok": False, "error": str(exc)}
        return out

    def close(self) -> None:
        """Stop the prefetch worker and close connectors this manager created (an injected one
        belongs to the caller)."""
        self.shutdown_prefetch()
        with self._lock:
            if self._closed:
                return
            self._closed = True
            owned = {
                id(c): c
                for c in (self._send_connector, self._recv_connector)
                if c is not None and c is not self.connector
            }
        for conn in owned.values():
            try:
                conn.close()
            except Exception:
                logger.exception("closing a connector failed")

    def __enter__(self) -> KVTransferManager:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
