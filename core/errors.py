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
    "FailedAtSender",
    "UnreadableGrant",
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
    """The connector's bounded pool has no room for the payload (back-pressure).

    ``reason`` is the put failure word (:data:`kvferry.core.policy.PUT_FAILURES`): ``pool_full``
    (no room now: retrying may help), ``too_large`` (it never fits) or ``closed`` (the connector
    is gone); ``detail`` says more. A message of the old form ``"<reason>: <detail>"`` without
    ``reason=`` is read the same way.
    """

    def __init__(self, message: str = "", *, reason: str | None = None, detail: str | None = None) -> None:
        word, sep, rest = message.partition(":")
        if reason is None:
            reason = word.strip() if sep and word.strip() in ("pool_full", "too_large", "closed") else "pool_full"
            detail = rest.strip() if sep and detail is None and word.strip() == reason else detail
        self.reason: str = reason
        self.detail: str = message if detail is None else detail
        super().__init__(message or f"{reason}: {self.detail}")


class LeaseExpired(TransferError):
    """A payload was dropped because its lease expired before all readers took it."""


class FailedAtSender(TransferError):
    """The sender recorded that it will never publish this key (its save failed): a blocking
    get raises it at once instead of waiting out its deadline. ``kind`` and ``reason`` are the
    sender's (:class:`kvferry.core.tombstones.SenderFailure`)."""

    def __init__(self, message: str, *, kind: str, reason: str) -> None:
        self.kind: str = kind
        self.reason: str = reason
        super().__init__(message)


class UnreadableGrant(TransferError):
    """The sender granted a payload that this receiver cannot read where the grant says it is
    (its shared memory cannot be mapped here, or the mapping went under the grant). The grant
    was given back; asking again cannot help, so a blocking get raises it at once instead of
    waiting out its deadline."""


class BindError(TransferError, OSError):
    """A socket could not bind; the message names host and port."""
