"""A sender's failure record (a tombstone): what a sender says of a key it will never publish.

A prefill whose save of a transfer fails (its pool stays full through the put's retries, or
the save is not out by the end of its step) records, under each key of that transfer it did
not publish, *why*: a :class:`SenderFailure` (a failure ``kind`` word and a ``reason`` text).
The record is no payload: it takes no pool space (the lease table remembers it with the keys it
has forgotten, bounded by its ``history``), it travels in a connector's miss reply (the field
:data:`FAILURE_FIELD` next to ``reason`` :data:`FAILED_REASON`), and a get of the key answers
"not there" (None) while a blocking get raises :class:`~kvferry.core.errors.FailedAtSender` at
once instead of waiting out its deadline. It is never handed out as data, so no reader of a
payload key can take it for KV.

Invariants (property-tested): ``decode_failure(encode_failure(f)) == f`` for every record;
:func:`decode_failure` of any other value raises :class:`~kvferry.core.errors.PayloadError`
only; :func:`failure_record` bounds the reason to :data:`MAX_REASON_CHARS` characters and
refuses a kind that is not a short word (a local misuse: ConfigError).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import attrs

from kvferry.core.errors import ConfigError, FailedAtSender, KVFerryError, PayloadError

__all__ = [
    "FAILED_REASON",
    "FAILURE_FIELD",
    "MAX_KIND_CHARS",
    "MAX_REASON_CHARS",
    "SenderFailure",
    "failure_record",
    "encode_failure",
    "decode_failure",
    "failed_error",
]

#: The miss ``reason`` word of a key its sender recorded as failed.
FAILED_REASON = "failed"
#: The field of a miss reply that carries the encoded record.
FAILURE_FIELD = "failure"
MAX_KIND_CHARS = 32
MAX_REASON_CHARS = 300
_KIND = re.compile(r"[a-z][a-z0-9_]*")


def _is_kind(value: Any) -> bool:
    return isinstance(value, str) and 0 < len(value) <= MAX_KIND_CHARS and _KIND.fullmatch(value) is not None


@attrs.frozen
class SenderFailure:
    """Why a sender will never publish a key: ``kind`` (a short word such as ``put`` or
    ``timeout``) and ``reason`` (human text, at most :data:`MAX_REASON_CHARS` characters).
    Build it with :func:`failure_record` (sender) or :func:`decode_failure` (receiver)."""

    kind: str
    reason: str

    def __str__(self) -> str:
        return f"{self.kind}: {self.reason}"


def _make(kind: Any, reason: Any, error: type[KVFerryError]) -> SenderFailure:
    if not _is_kind(kind):
        raise error(f"failure kind must be a word of 1..{MAX_KIND_CHARS} of [a-z0-9_], got {kind!r}")
    if not isinstance(reason, str):
        raise error(f"failure reason must be text, got {type(reason).__name__}")
    return SenderFailure(kind, reason[:MAX_REASON_CHARS])


def failure_record(kind: str, reason: str) -> SenderFailure:
    """The sender's record: ``reason`` cut to :data:`MAX_REASON_CHARS`; ConfigError for a
    ``kind`` that is not a word of at most :data:`MAX_KIND_CHARS` of ``[a-z0-9_]``."""
    return _make(kind, reason, ConfigError)


def encode_failure(failure: SenderFailure) -> dict[str, str]:
    """The record as plain data for a control message: ``{"kind": ..., "reason": ...}``."""
    return {"kind": failure.kind, "reason": failure.reason}


def decode_failure(value: Any) -> SenderFailure:
    """The record a sender's miss reply carried; PayloadError (a remote fault) unless ``value``
    is a map of exactly ``kind`` (a word) and ``reason`` (text within bounds)."""
    if not isinstance(value, Mapping) or set(value) != {"kind", "reason"}:
        raise PayloadError(f"a failure record is a map of kind and reason, got {type(value).__name__}")
    reason = value["reason"]
    if isinstance(reason, str) and len(reason) > MAX_REASON_CHARS:
        raise PayloadError(f"failure reason longer than {MAX_REASON_CHARS} characters")
    return _make(value["kind"], reason, PayloadError)


def failed_error(key: str, failure: SenderFailure, where: str = "") -> FailedAtSender:
    """The error a blocking get raises for a key whose sender (``where``: its endpoint, or
    empty for a pool of this process) recorded ``failure``."""
    sender = f"the sender at {where}" if where else "the sender"
    return FailedAtSender(f"{sender} failed {key!r} ({failure})", kind=failure.kind, reason=failure.reason)
