"""One error tree for kvferry.

Who is at fault decides the branch:

- local misuse (bad configuration, bad argument, impossible topology): ``ConfigError`` and
  ``RoutingError``; both are ``ValueError`` so callers written against the reference, which
  raised ``ValueError``, keep working;
- a remote fault in received bytes: ``PayloadError`` (also a ``ValueError``, as in the
  reference's decoder);
- a fault while moving data (peer gone, deadline passed, pool full): ``TransferError`` and its
  subclasses.
"""

from __future__ import annotations

__all__ = [
    "KVFerryError",
    "ConfigError",
    "RoutingError",
    "PayloadError",
    "TransferError",
    "TransferTimeout",
    "SenderUnavailable",
    "ConnectorUnavailable",
    "PoolFullError",
    "LeaseExpired",
    "BindError",
]


class KVFerryError(Exception):
    """Base of every error kvferry raises on purpose."""


class ConfigError(KVFerryError, ValueError):
    """A configuration value or argument is invalid. The message names the key or field."""


class RoutingError(KVFerryError, ValueError):
    """A topology, rank, port or head-slice request that cannot be satisfied."""


class PayloadError(KVFerryError, ValueError):
    """Received bytes are not a valid payload. The message says why (and which tensor)."""


class TransferError(KVFerryError):
    """Moving a payload failed."""


class TransferTimeout(TransferError, TimeoutError):
    """A deadline passed before the payload arrived."""


class SenderUnavailable(TransferError):
    """The sender could not be reached or its endpoint could not be resolved."""


class ConnectorUnavailable(TransferError):
    """No connector could be created (missing package, bad config); remembered, not retried."""


class PoolFullError(TransferError):
    """The connector's bounded pool has no room for the payload (back-pressure)."""


class LeaseExpired(TransferError):
    """A payload was dropped because its lease expired before all readers took it."""


class BindError(TransferError, OSError):
    """A socket could not bind; the message names host and port."""
