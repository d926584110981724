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
transfer_timeout_s 10.0     deadline of one engine read (receiver); must be below ``hold_s``;
                            default 10 s or half of ``hold_s``, whichever is less
chunk_bytes    16 MiB       size of one engine transfer request inside a batch
alignment      64           byte alignment of pool regions (power of two)
shared_engine  True         share one engine per (host, protocol, device_name) in the process
============== ============ ===============================================================
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import attrs

from kvferry.core.errors import ConfigError
from kvferry.core.validate import check_int, check_seconds

__all__ = ["Checks", "MooncakeConfig", "PoolConfig", "ROLES"]

ROLES = ("sender", "receiver")


@attrs.frozen
class Checks:
    """Validators of one connector's config dict; each error names ``<what> config 'key'``."""

    what: str

    def int(self, name: str, value: Any, lo: int, hi: int | None = None) -> int:
        return check_int(f"{self.what} config {name!r}", value, lo, maximum=hi)

    def seconds(self, name: str, value: Any) -> float:
        return check_seconds(f"{self.what} config {name!r}", value)

    def flag(self, name: str, value: Any) -> bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{self.what} config {name!r} must be true or false, got {value!r}")
        return value

    def text(self, name: str, value: Any, choices: tuple[str, ...] | None = None, *, empty: bool = True) -> str:
        if not isinstance(value, str) or (not value and not empty):
            kind = "a string" if empty else "a non-empty string"
            raise ConfigError(f"{self.what} config {name!r} must be {kind}, got {value!r}")
        if choices is not None and value not in choices:
            raise ConfigError(f"{self.what} config {name!r} must be one of {choices}, got {value!r}")
        return value


@attrs.frozen
class PoolConfig:
    """The settings every pool-and-control-channel connector shares (mooncake, nixl); a
    subclass names itself in ``WHAT`` and builds from :meth:`pool_keys` plus its own keys."""

    WHAT: ClassVar[str] = "pool"

    role: str = "sender"
    host: str = "127.0.0.1"
    port: int = 0
    pool_bytes: int = 1 << 30
    readers: int = 1
    lease_s: float = 120.0
    hold_s: float = 30.0
    control_timeout_s: float = 2.0
    transfer_timeout_s: float = 10.0
    alignment: int = 64

    @classmethod
    def pool_keys(cls, raw: Mapping[str, Any]) -> tuple[Checks, dict[str, Any]]:
        """The validated shared keys of ``raw`` (missing keys: the class defaults), and the
        checks the subclass validates its own keys with."""
        checks = Checks(cls.WHAT)
        if not isinstance(raw, Mapping):
            raise ConfigError(f"{cls.WHAT} config must be a mapping, got {type(raw).__name__}")
        d = cls()
        get = raw.get
        alignment = checks.int("alignment", get("alignment", d.alignment), 1)
        if alignment & (alignment - 1):
            raise ConfigError(f"{cls.WHAT} config 'alignment' must be a power of two, got {alignment}")
        hold_s = checks.seconds("hold_s", get("hold_s", d.hold_s))
        transfer_s = get("transfer_timeout_s")
        if transfer_s is None:
            transfer_s = min(d.transfer_timeout_s, hold_s / 2)
        transfer_s = checks.seconds("transfer_timeout_s", transfer_s)
        if transfer_s >= hold_s:
            raise ConfigError(
                f"{cls.WHAT} config 'transfer_timeout_s' ({transfer_s}) must be below 'hold_s' ({hold_s}): "
                "a claim revoked mid-read would let the sender reuse the region being read"
            )
        return checks, {
            "role": checks.text("role", get("role", d.role), ROLES),
            "host": checks.text("host", get("host", d.host), empty=False),
            "port": checks.int("port", get("port", d.port), 0, 65535),
            "pool_bytes": checks.int("pool_bytes", get("pool_bytes", d.pool_bytes), alignment),
            "readers": checks.int("readers", get("readers", d.readers), 1),
            "lease_s": checks.seconds("lease_s", get("lease_s", d.lease_s)),
            "hold_s": hold_s,
            "control_timeout_s": checks.seconds("control_timeout_s", get("control_timeout_s", d.control_timeout_s)),
            "transfer_timeout_s": transfer_s,
            "alignment": alignment,
        }


@attrs.frozen
class MooncakeConfig(PoolConfig):
    """Validated settings; build with :meth:`from_mapping` (errors name the key)."""

    WHAT: ClassVar[str] = "mooncake"

    protocol: str = "tcp"
    device_name: str = ""
    pool_device: str = "cpu"
    chunk_bytes: int = 16 << 20
    shared_engine: bool = True

    @classmethod
    def from_mapping(cls, raw: Mapping[str, Any]) -> MooncakeConfig:
        checks, shared = cls.pool_keys(raw)
        d = cls()
        get = raw.get
        return cls(
            **shared,
            protocol=checks.text("protocol", get("protocol", d.protocol), ("tcp", "rdma")),
            device_name=checks.text("device_name", get("device_name", d.device_name)),
            pool_device=checks.text("pool_device", get("pool_device", d.pool_device)),
            chunk_bytes=checks.int("chunk_bytes", get("chunk_bytes", d.chunk_bytes), 4096),
            shared_engine=checks.flag("shared_engine", get("shared_engine", d.shared_engine)),
        )
