"""The transfer manager an inference engine embeds (SPEC 6-7), with a typed API.

:class:`KVTransferManager` owns the connectors of one rank, the send path, the receive path,
distribution inside the receiving stage and the optional prefetch worker. It is built from a
:class:`~kvferry.core.config.TransferConfig` by :mod:`kvferry.app.wiring` (the composition
root) or directly with injected adapters in tests. Every call returns typed outcomes and updates
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

from kvferry.app.receive import ReceivePath, ReceiveResult
from kvferry.app.registry import SERVING_CONNECTORS, connector_role_config, create_connector
from kvferry.app.send import SendPath
from kvferry.core.addressing import kv_port, pull_port
from kvferry.core.config import TransferConfig
from kvferry.core.errors import ConfigError, ConnectorUnavailable
from kvferry.core.header import DecodeLimits
from kvferry.core.outcomes import Counters, ReceiveKind, ReceiveOutcome, SendOutcome, SendReason
from kvferry.core.policy import RetryPolicy
from kvferry.core.ports import CollectiveGroup, Connector, SenderAware
from kvferry.core.sender_info import SenderEndpoint, resolve_sender
from kvferry.core.topology import TPTopology

__all__ = ["KVTransferManager", "StageGroups", "KVCache", "SERVING_CONNECTORS", "SystemClock"]

logger = logging.getLogger(__name__)

#: Connectors that serve payloads from the sender's process: the manager gives them a role and
#: the sender rank's port (SPEC 2.3).


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
    _send_connector: Connector | None = attrs.field(init=False, default=None)
    _recv_connector: Connector | None = attrs.field(init=False, default=None)
    _failures: dict[str, ConnectorUnavailable] = attrs.field(init=False, factory=dict)
    _sender: SenderEndpoint | None = attrs.field(init=False, default=None)
    _lock: threading.RLock = attrs.field(init=False, factory=threading.RLock)
    _closed: bool = attrs.field(init=False, default=False)
    _recv_path: tuple[tuple, ReceivePath] | None = attrs.field(init=False, default=None)
    _send_path: tuple[tuple, SendPath] | None = attrs.field(init=False, default=None)

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
        """
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
        """Close connectors this manager created (an injected one belongs to the caller)."""
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
