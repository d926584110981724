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
from collections.abc import Callable, Mapping
from typing import Any

import attrs

from kvferry.adapters.connectors.mooncake.connector import MooncakeConnector, _as_clock
from kvferry.adapters.connectors.nixl.agent import AgentPool, apply_ucx_env, load_nixl
from kvferry.adapters.connectors.nixl.config import NixlConfig

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

    def health(self) -> dict[str, Any]:
        """JSON-able snapshot: role, agent, endpoints, pool usage and counters."""
        out = super().health()
        out.pop("rpc_port", None)
        pool: AgentPool = self._pool  # type: ignore[assignment]  # set by from_config
        out.update(type="nixl", backend=self.config.protocol, agent=pool.name)
        out.update({f"agent_{k}": v for k, v in pool.counters.items()})
        return out
