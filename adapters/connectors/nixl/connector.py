"""The ``nixl`` connector: payload bytes move by one-sided NIXL READs (UCX by default).

Same shape as the mooncake connector, whose pool ledger, control channel and receive path it
shares (:class:`~kvferry.adapters.connectors.mooncake.connector.MooncakeConnector`): both sides
own ONE pool (``pool_bytes``) registered with a NIXL agent at start. The sender copies each put
into its pool (or the caller gathers straight into it through ``reserve``) and publishes it in a
lease table (``readers`` reads within ``lease_s`` seconds). A receiver asks the sender over the
ZMQ control channel (msgpack) for the key; the reply is sent once the payload is committed
(a long-poll parks until then) and claims it (the region is pinned for ``hold_s``). The
receiver reserves that many bytes in its own pool and READs them from the sender's pool with
its agent, within ``transfer_timeout_s``; then it tells the sender the claim is over (``Done``,
answered by ``Ack``), which releases the reader's lease. The sender's agent metadata is fetched
once per sender endpoint over the same channel (:mod:`.control`).

Failures are values: ``put`` returns ``(False, 0, {"reason", "detail"})``; ``get`` returns None
and :meth:`last_failure` says why (``sender_unavailable``, ``timeout``, ``expired``,
``no_room``, ``size_mismatch``, ``transfer_failed``, ``failed``, ...); ``get_blocking`` raises
LeaseExpired when the sender dropped the key unread and FailedAtSender when it recorded that the
key will never come (``publish_failure``, inherited). Without the nixl package construction
raises ConfigError naming the extra ``kvferry[nixl]`` and the CPU install.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

import attrs

from kvferry.adapters.connectors.mooncake import wire
from kvferry.adapters.connectors.mooncake.connector import MooncakeConnector, _as_clock
from kvferry.adapters.connectors.nixl.agent import AgentPool, apply_ucx_env, load_nixl
from kvferry.adapters.connectors.nixl.config import NixlConfig
from kvferry.core.errors import ConfigError

__all__ = ["NixlConnector"]

logger = logging.getLogger(__name__)


@attrs.define(eq=False)
class NixlConnector(MooncakeConnector):
    """Connector over NIXL agents. Build with :meth:`from_config` (see the module doc)."""

    @classmethod
    def from_config(  # type: ignore[override]
        cls,
        config: Mapping[str, Any] | NixlConfig,
        *,
        clock: Callable[[], float] | None = None,
    ) -> NixlConnector:
        """Create from ``{"type": "nixl", "role": ..., ...}`` (keys: :mod:`.config`).

        Raises ConfigError for bad values (naming the key) or a missing nixl package,
        ConnectorUnavailable when the agent or its backend fails to start, BindError when the
        sender's control port cannot be bound.
        """
        import zmq

        from kvferry.adapters.connectors.mooncake.server import SenderState, bind_router
        from kvferry.adapters.connectors.nixl.control import NixlControlServer, fetch_agent
        from kvferry.core.pool import PoolLedger

        cfg = config if isinstance(config, NixlConfig) else NixlConfig.from_mapping(config)
        if clock is None and not isinstance(config, NixlConfig):
            clock = config.get("clock")
        now = _as_clock(clock)
        load_nixl()  # the ConfigError naming the extra, before anything is allocated
        apply_ucx_env(cfg.ucx_tls, cfg.ucx_net_devices, modules=cfg.ucx_modules)
        pool = AgentPool.create(
            pool_bytes=cfg.pool_bytes,
            backend=cfg.backend,
            options=dict(cfg.backend_options),
            role=cfg.role,
            transfer_timeout_s=cfg.transfer_timeout_s,
        )
        ctx = zmq.Context()

        def resolve(peer: str) -> tuple[str, bytes] | None:
            host, _, port = peer.rpartition(":")
            return fetch_agent(ctx, host, int(port), cfg.control_timeout_s)

        pool.resolve = resolve
        sender = server = None
        port = 0
        try:
            if cfg.role == "sender":
                router, port = bind_router(ctx, cfg.host, cfg.port)
                pool.rpc_port = port
                ledger = PoolLedger.create(pool.pool_bytes, alignment=cfg.alignment, hold_s=cfg.hold_s)
                sender = SenderState(ledger, pool.base, port, cfg.hold_s, now)
                server = NixlControlServer(ctx, router, sender, agent=pool.name, metadata=pool.metadata())
                server.start()
        except BaseException:
            pool.close()
            ctx.destroy(linger=0)
            raise
        conn = cls(cfg, pool, ctx, sender, server, port, now)  # type: ignore[arg-type]
        logger.info(
            "nixl %s up: agent %s, backend %s, control %s:%d, pool %d bytes",
            cfg.role,
            pool.name,
            cfg.backend,
            cfg.host,
            port,
            pool.pool_bytes,
        )
        return conn

    # -- in place (the PiecesPut ability) -------------------------------------------------

    #: Most spans of registered memory one put_pieces takes (a reply lists them all).
    max_pieces: ClassVar[int] = wire.MAX_SPANS - 1

    def register_memory(self, tensor: Any) -> None:
        """Sender: make ``tensor``'s bytes (a host tensor: the engine's KV cache) readable by
        receivers, so that :meth:`put_pieces` can point them there. Its storage is registered
        once (tensors sharing one are covered by the first) and stays registered until
        :meth:`close`; receivers that learnt this agent before are told again on their next
        failed read. ConfigError for a device tensor or on a receiver; ConnectorUnavailable when
        the agent refuses it."""
        if self._sender is None or self._server is None:
            raise ConfigError("register_memory is for a sender-role nixl connector")
        pool: AgentPool = self._pool  # type: ignore[assignment]  # set by from_config
        if pool.register_tensor(tensor):
            self._server.metadata = pool.metadata()  # what agent requests are answered with from now on

    def put_pieces(
        self,
        from_stage: Any,
        to_stage: Any,
        put_key: str,
        head: Any,
        spans: Sequence[tuple[int, int]],
        on_free: Callable[[], None],
    ) -> tuple[bool, int, Any]:
        """Publish ``head`` (copied into the pool) followed by ``spans`` of memory given to
        :meth:`register_memory`, as one payload under ``put_key``; a receiver reads the pieces
        with one NIXL READ. The caller keeps those bytes unchanged until ``on_free()`` (called
        once, on the control thread or the caller's: every reader done, the lease passed, or the
        key dropped). Fails like :meth:`put` (never calling ``on_free``), also ``error`` for a
        span outside the registered memory."""
        pool: AgentPool = self._pool  # type: ignore[assignment]
        outside = pool.unregistered(spans)
        if outside:
            return self._put_failed("error", f"{len(outside)} spans lie outside registered memory, first {outside[0]}")
        return self._put_pieces(put_key, head, spans, on_free)

    def health(self) -> dict[str, Any]:
        """JSON-able snapshot: role, agent, endpoints, pool usage and counters."""
        out = super().health()
        out.pop("rpc_port", None)
        pool: AgentPool = self._pool  # type: ignore[assignment]  # set by from_config
        out.update(type="nixl", backend=self.config.protocol, agent=pool.name)
        out.update({f"agent_{k}": v for k, v in pool.counters.items()})
        return out
