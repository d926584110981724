"""kvferry.core: the pure, side-effect-free heart of kvferry.

Imports only the standard library and attrs. Computes keys, ports, rank maps, head-slice
plans, the wire header codec, receive roles, policies and typed configuration.
"""

from kvferry.core.errors import (
    BindError,
    ConfigError,
    ConnectorUnavailable,
    KVFerryError,
    LeaseExpired,
    PayloadError,
    PoolFullError,
    RoutingError,
    SenderUnavailable,
    TransferError,
    TransferTimeout,
)

__all__ = [
    "BindError",
    "ConfigError",
    "ConnectorUnavailable",
    "KVFerryError",
    "LeaseExpired",
    "PayloadError",
    "PoolFullError",
    "RoutingError",
    "SenderUnavailable",
    "TransferError",
    "TransferTimeout",
]
