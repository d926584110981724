"""Configuration of the nixl connector, validated once from the connector config dict.

Keys (all optional; unknown keys are ignored so that one connector dict can serve several
connector types):

=================== ============ ==========================================================
key                 default      meaning
=================== ============ ==========================================================
role                "sender"     ``"sender"`` (binds the control channel, serves puts) or
                                 ``"receiver"`` (reads from senders)
host                "127.0.0.1"  address the control channel binds (sender)
port                0            control-channel TCP port (sender); 0 = OS-chosen, the real
                                 port is in put metadata and ``health()["port"]``
pool_bytes          1 GiB        registered pool size in bytes (each side, allocated once)
readers             1            gets that may read one payload before it is freed
lease_s             120.0        seconds an unread payload is kept before it expires
hold_s              30.0         seconds a reader's claim pins a sender region (then revoked)
control_timeout_s   2.0          extra seconds to wait for a control reply beyond the long-poll
transfer_timeout_s  10.0         deadline of one NIXL READ (must be below ``hold_s``; default
                                 10 s or half of ``hold_s``, whichever is less)
alignment           64           byte alignment of pool regions (power of two)
backend             "UCX"        the NIXL backend plugin the agent creates and transfers with
backend_options     {}           the backend's init parameters (strings), e.g.
                                 ``{"num_threads": "2"}``
ucx_tls             None         sets ``UCX_TLS`` for this process when given (``"tcp,self"``
                                 on hosts without RDMA); None leaves the environment alone
ucx_net_devices     None         sets ``UCX_NET_DEVICES`` likewise (``"lo"`` for loopback)
ucx_modules         None         sets ``UCX_MODULES``; None: ``"^ib"`` on a host without RDMA
                                 devices unless the environment sets it (the IB module of
                                 nixl-cu12 1.5.1 crashes the process at exit there), ``""``:
                                 leave it alone
=================== ============ ==========================================================

``ucx_tls`` and ``ucx_net_devices`` are read by UCX once, when the first agent of the process
starts; they are process-wide (a later connector with other values gets a ConfigError).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import attrs

from kvferry.adapters.connectors.mooncake.config import ROLES, PoolConfig
from kvferry.core.errors import ConfigError

__all__ = ["NixlConfig", "ROLES"]


def _options(value: Any) -> tuple[tuple[str, str], ...]:
    if not isinstance(value, Mapping) or not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        raise ConfigError(f"nixl config 'backend_options' must map strings to strings, got {value!r}")
    return tuple(sorted(value.items()))


@attrs.frozen
class NixlConfig(PoolConfig):
    """Validated settings; build with :meth:`from_mapping` (errors name the key). The keys it
    shares with the mooncake connector are :class:`PoolConfig`'s."""

    WHAT: ClassVar[str] = "nixl"

    backend: str = "UCX"
    backend_options: tuple[tuple[str, str], ...] = ()
    ucx_tls: str | None = None
    ucx_net_devices: str | None = None
    ucx_modules: str | None = None

    @property
    def protocol(self) -> str:
        """The backend's name (what ``health()`` reports as the protocol)."""
        return self.backend

    @classmethod
    def from_mapping(cls, raw: Mapping[str, Any]) -> NixlConfig:
        checks, shared = cls.pool_keys(raw)
        d = cls()
        get = raw.get

        def optional(key: str) -> str | None:
            value = get(key)
            return None if value is None else checks.text(key, value)

        return cls(
            **shared,
            backend=checks.text("backend", get("backend", d.backend), empty=False),
            backend_options=_options(get("backend_options", {})),
            ucx_tls=optional("ucx_tls"),
            ucx_net_devices=optional("ucx_net_devices"),
            ucx_modules=optional("ucx_modules"),
        )
