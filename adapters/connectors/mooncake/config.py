"""Configuration of the mooncake connector, validated once from the connector config dict.

Keys (all optional except as noted; unknown keys are ignored so that one connector dict can
serve several connector types):

============== ============ ===============================================================
key            default      meaning
============== ============ ===============================================================
role           "sender"     ``"sender"`` (binds the control channel, serves puts) or
                            ``"receiver"`` (reads from senders)
host           "127.0.0.1"  address the control channel binds and the engine announces
port           0            control-channel TCP port (sender); 0 = OS-chosen (tests),
                            the real port is in put metadata and ``health()["port"]``
pool_bytes     1 GiB        registered pool size in bytes (each side, allocated once)
readers        1            gets that may read one payload before it is freed
lease_s        120.0        seconds an unread payload is kept before it expires
hold_s         30.0         seconds a reader's claim pins a sender region (then it is revoked)
protocol       "tcp"        engine transport: ``"tcp"`` or ``"rdma"``
device_name    ""           RDMA device(s) for the engine (e.g. ``"mlx5_0"``); "" for tcp
pool_device    "cpu"        where the pool lives: ``"cpu"`` or a torch device (``"cuda:0"``)
control_timeout_s 2.0       extra seconds to wait for a control reply beyond the long-poll
chunk_bytes    16 MiB       size of one engine transfer request inside a batch
alignment      64           byte alignment of pool regions (power of two)
shared_engine  True         share one engine per (host, protocol, device_name) in the process
============== ============ ===============================================================
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from kvferry.core.errors import ConfigError
from kvferry.core.validate import check_int, check_seconds

__all__ = ["MooncakeConfig", "ROLES"]

ROLES = ("sender", "receiver")


def _int(name: str, value: Any, lo: int, hi: int | None = None) -> int:
    return check_int(f"mooncake config {name!r}", value, lo, maximum=hi)


def _seconds(name: str, value: Any) -> float:
    return check_seconds(f"mooncake config {name!r}", value)


def _flag(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"mooncake config {name!r} must be true or false, got {value!r}")
    return value


def _text(name: str, value: Any, choices: tuple[str, ...] | None = None) -> str:
    if not isinstance(value, str):
        raise ConfigError(f"mooncake config {name!r} must be a string, got {value!r}")
    if choices is not None and value not in choices:
        raise ConfigError(f"mooncake config {name!r} must be one of {choices}, got {value!r}")
    return value


@attrs.frozen
class MooncakeConfig:
    """Validated settings; build with :meth:`from_mapping` (errors name the key)."""

    role: str = "sender"
    host: str = "127.0.0.1"
    port: int = 0
    pool_bytes: int = 1 << 30
    readers: int = 1
    lease_s: float = 120.0
    hold_s: float = 30.0
    protocol: str = "tcp"
    device_name: str = ""
    pool_device: str = "cpu"
    control_timeout_s: float = 2.0
    chunk_bytes: int = 16 << 20
    alignment: int = 64
    shared_engine: bool = True

    @classmethod
    def from_mapping(cls, raw: Mapping[str, Any]) -> MooncakeConfig:
        if not isinstance(raw, Mapping):
            raise ConfigError(f"mooncake config must be a mapping, got {type(raw).__name__}")
        d = cls()
        get = raw.get
        host = _text("host", get("host", d.host))
        if not host:
            raise ConfigError("mooncake config 'host' must not be empty")
        alignment = _int("alignment", get("alignment", d.alignment), 1)
        if alignment & (alignment - 1):
            raise ConfigError(f"mooncake config 'alignment' must be a power of two, got {alignment}")
        return cls(
            role=_text("role", get("role", d.role), ROLES),
            host=host,
            port=_int("port", get("port", d.port), 0, 65535),
            pool_bytes=_int("pool_bytes", get("pool_bytes", d.pool_bytes), alignment),
            readers=_int("readers", get("readers", d.readers), 1),
            lease_s=_seconds("lease_s", get("lease_s", d.lease_s)),
            hold_s=_seconds("hold_s", get("hold_s", d.hold_s)),
            protocol=_text("protocol", get("protocol", d.protocol), ("tcp", "rdma")),
            device_name=_text("device_name", get("device_name", d.device_name)),
            pool_device=_text("pool_device", get("pool_device", d.pool_device)),
            control_timeout_s=_seconds("control_timeout_s", get("control_timeout_s", d.control_timeout_s)),
            chunk_bytes=_int("chunk_bytes", get("chunk_bytes", d.chunk_bytes), 4096),
            alignment=alignment,
            shared_engine=_flag("shared_engine", get("shared_engine", d.shared_engine)),
        )
