"""Typed outcomes of sending and receiving one request, and counters over them.

Failure is a value the caller sees (SPEC 9.5, 9.10): every request handed to the send path
gets a :class:`SendOutcome`; every receive gets a :class:`ReceiveOutcome`. Timeouts and errors
are different kinds and are counted separately by :class:`Counters`.
"""

from __future__ import annotations

import contextlib
import enum
import math
from collections.abc import Mapping
from typing import Any

import attrs

from kvferry.core.errors import ConfigError
from kvferry.core.validate import check_int

__all__ = [
    "SendKind",
    "SendReason",
    "SendOutcome",
    "ReceiveKind",
    "SkipReason",
    "ReceiveOutcome",
    "Counters",
]


class SendKind(enum.Enum):
    """What happened to one request on the send side."""

    #: Every send key was put successfully (delivery is the receiver's to report).
    SENT = "sent"
    #: At least one key was not put, or there was nothing to put; ``reason`` says why.
    FAILED = "failed"
    #: The configuration does not send (``need_send_cache`` false); not a failure.
    SKIPPED = "skipped"


class SendReason(enum.Enum):
    """Why a send failed or was skipped."""

    NO_BLOCKS = "no_blocks"  # the request came with no block ids
    NO_PAYLOAD = "no_payload"  # every layer came out empty
    POOL_FULL = "pool_full"  # the connector's pool had no room (back-pressure)
    PUT_FAILED = "put_failed"  # put returned ok=False after every retry
    CONNECTOR_UNAVAILABLE = "connector_unavailable"  # no connector could be created
    STAGES_UNCONFIGURED = "stages_unconfigured"  # omni_from_stage / omni_to_stage missing
    ERROR = "error"  # an unexpected fault (detail has it)
    NOT_SENDING = "not_sending"  # SKIPPED only


def _non_negative_int(instance: Any, attribute: attrs.Attribute[int], value: Any) -> None:
    check_int(attribute.name, value, 0, expected="an integer >= 0")


def _seconds(instance: Any, attribute: attrs.Attribute[float], value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{attribute.name} must be a number of seconds, got {value!r}")
    if math.isnan(value) or value < 0:
        raise ConfigError(f"{attribute.name} must be >= 0 seconds, got {value!r}")


def _str_tuple(value: Any) -> tuple[str, ...]:
    if isinstance(value, str):
        return (value,)
    return tuple(value)


@attrs.frozen
class SendOutcome:
    """The send-side result for one request.

    ``nbytes`` counts bytes of keys put successfully; ``keys`` are those keys, ``failed_keys``
    the ones that were not; ``attempts`` is the total number of ``put`` calls; ``seconds`` is
    wall time from extraction to the last put. ``refusal_keys``: the keys a FAILED send put a
    refusal marker under (:mod:`kvferry.core.refusal`), so the receiving stage learns of the
    failure at once. Invariants: SENT has no reason, no failed keys and no refusal keys; FAILED
    has a reason other than NOT_SENDING; SKIPPED has reason NOT_SENDING.
    """

    request_id: str
    kind: SendKind
    reason: SendReason | None = None
    detail: str = ""
    nbytes: int = attrs.field(default=0, validator=_non_negative_int)
    keys: tuple[str, ...] = attrs.field(default=(), converter=_str_tuple)
    failed_keys: tuple[str, ...] = attrs.field(default=(), converter=_str_tuple)
    attempts: int = attrs.field(default=0, validator=_non_negative_int)
    seconds: float = attrs.field(default=0.0, validator=_seconds)
    refusal_keys: tuple[str, ...] = attrs.field(default=(), converter=_str_tuple)

    def __attrs_post_init__(self) -> None:
        if self.kind is SendKind.SENT and (self.reason is not None or self.failed_keys or self.refusal_keys):
            raise ConfigError("a SENT outcome has no reason, no failed keys and no refusal keys")
        if self.kind is SendKind.FAILED and self.reason in (None, SendReason.NOT_SENDING):
            raise ConfigError(f"a FAILED outcome needs a failure reason, got {self.reason}")
        if self.kind is SendKind.SKIPPED and self.reason is not SendReason.NOT_SENDING:
            raise ConfigError(f"a SKIPPED send has reason NOT_SENDING, got {self.reason}")

    @property
    def ok(self) -> bool:
        return self.kind is SendKind.SENT

    @classmethod
    def sent(cls, request_id: str, *, keys: Any, nbytes: int, attempts: int, seconds: float) -> SendOutcome:
        return cls(request_id, SendKind.SENT, nbytes=nbytes, keys=keys, attempts=attempts, seconds=seconds)

    @classmethod
    def failed(cls, request_id: str, reason: SendReason, detail: str = "", **fields: Any) -> SendOutcome:
        return cls(request_id, SendKind.FAILED, reason, detail, **fields)

    @classmethod
    def skipped(cls, request_id: str, detail: str = "this stage does not send KV") -> SendOutcome:
        return cls(request_id, SendKind.SKIPPED, SendReason.NOT_SENDING, detail)


class ReceiveKind(enum.Enum):
    """What happened to one request on the receive side."""

    RECEIVED = "received"  # KV arrived, decoded and (where needed) merged/sliced
    TIMED_OUT = "timed_out"  # the deadline passed with keys missing
    EXPIRED = "expired"  # the sender dropped a key unread when its lease passed: it cannot come
    SENDER_UNRESOLVED = "sender_unresolved"  # sender info missing or ambiguous
    CONNECTOR_UNAVAILABLE = "connector_unavailable"  # no connector could be created
    DECODE_FAILED = "decode_failed"  # bytes arrived but are not a valid payload
    CONSUMED_BUT_FAILED = "consumed_but_failed"  # taken from the connector, then post-processing failed
    SKIPPED = "skipped"  # dummy request / stage not receiving (``skip_reason``)
    DROPPED_BY_CONSENSUS = "dropped_by_consensus"  # received, but a TP peer did not: all drop
    ERROR = "error"  # an unexpected fault (detail has it)
    REFUSED = "refused"  # the sender could not send and said so (a refusal marker): ended at once
    SENDER_GONE = "sender_gone"  # the sender died or its connection dropped (the KV with it): ended at once


class SkipReason(enum.Enum):
    DUMMY = "dummy"  # warm-up request: never waits
    NOT_RECEIVING = "not_receiving"  # configuration does not receive
    NO_REQUEST_ID = "no_request_id"  # the request carried no id


#: Receive kinds counted as errors (timeouts are counted on their own).
_RECEIVE_ERRORS = frozenset(
    {
        ReceiveKind.EXPIRED,
        ReceiveKind.SENDER_UNRESOLVED,
        ReceiveKind.CONNECTOR_UNAVAILABLE,
        ReceiveKind.DECODE_FAILED,
        ReceiveKind.CONSUMED_BUT_FAILED,
        ReceiveKind.ERROR,
        ReceiveKind.REFUSED,
        ReceiveKind.SENDER_GONE,
    }
)


@attrs.frozen
class ReceiveOutcome:
    """The receive-side result for one request on one rank.

    ``keys`` are the receive keys waited for, ``missing_keys`` those that did not arrive;
    ``nbytes`` the bytes taken from the connector (or from the leader); ``seconds`` the wall
    time of the receive; ``via`` where the KV came from (``"connector"``, ``"prefetch"``,
    ``"leader"``). Invariants: ``skip_reason`` is set exactly for SKIPPED; RECEIVED has no
    missing keys.
    """

    request_id: str
    kind: ReceiveKind
    skip_reason: SkipReason | None = None
    detail: str = ""
    keys: tuple[str, ...] = attrs.field(default=(), converter=_str_tuple)
    missing_keys: tuple[str, ...] = attrs.field(default=(), converter=_str_tuple)
    nbytes: int = attrs.field(default=0, validator=_non_negative_int)
    seconds: float = attrs.field(default=0.0, validator=_seconds)
    via: str = "connector"

    def __attrs_post_init__(self) -> None:
        if (self.kind is ReceiveKind.SKIPPED) != (self.skip_reason is not None):
            raise ConfigError("skip_reason is set exactly for SKIPPED receive outcomes")
        if self.kind is ReceiveKind.RECEIVED and self.missing_keys:
            raise ConfigError("a RECEIVED outcome has no missing keys")

    @property
    def ok(self) -> bool:
        """True when this rank ends up with KV."""
        return self.kind is ReceiveKind.RECEIVED

    @property
    def is_timeout(self) -> bool:
        return self.kind is ReceiveKind.TIMED_OUT

    @property
    def is_error(self) -> bool:
        return self.kind in _RECEIVE_ERRORS

    @classmethod
    def received(
        cls, request_id: str, *, keys: Any = (), nbytes: int = 0, seconds: float = 0.0, via: str = "connector"
    ) -> ReceiveOutcome:
        return cls(request_id, ReceiveKind.RECEIVED, keys=keys, nbytes=nbytes, seconds=seconds, via=via)

    @classmethod
    def skipped(cls, request_id: str, reason: SkipReason, detail: str = "") -> ReceiveOutcome:
        return cls(request_id, ReceiveKind.SKIPPED, skip_reason=reason, detail=detail)

    @classmethod
    def failed(cls, request_id: str, kind: ReceiveKind, detail: str = "", **fields: Any) -> ReceiveOutcome:
        if kind in (ReceiveKind.RECEIVED, ReceiveKind.SKIPPED):
            raise ConfigError(f"failed() takes a failure kind, got {kind}")
        return cls(request_id, kind, detail=detail, **fields)


@attrs.define(eq=False)
class Counters:
    """Counts of outcomes by side and kind, with timeouts and errors kept apart.

    Keys of :meth:`snapshot`: ``send.<kind>``, ``send.failed.<reason>``, ``send.bytes``,
    ``recv.<kind>``, ``recv.skipped.<reason>``, ``recv.bytes``, ``timeouts`` (receive
    TIMED_OUT), ``errors`` (failed sends and receive error kinds; never timeouts).

    Updates are guarded by ``lock`` (any context manager; default none). Without a lock a
    snapshot is still a consistent copy of a dict, but concurrent increments from several
    threads may lose counts: pass ``threading.Lock()`` when more than one thread records.
    """

    lock: contextlib.AbstractContextManager[Any] = attrs.field(factory=contextlib.nullcontext)
    _counts: dict[str, int] = attrs.field(factory=dict, init=False)

    def incr(self, name: str, n: int = 1) -> None:
        """Add ``n`` (>= 0) to counter ``name``."""
        check_int("counter increment", n, 0, expected="an integer >= 0")
        with self.lock:
            self._counts[name] = self._counts.get(name, 0) + n

    def _add_all(self, items: Mapping[str, int]) -> None:
        with self.lock:
            for name, n in items.items():
                self._counts[name] = self._counts.get(name, 0) + n

    def record(self, outcome: SendOutcome | ReceiveOutcome) -> None:
        """Count one outcome (send or receive)."""
        if isinstance(outcome, SendOutcome):
            items = {f"send.{outcome.kind.value}": 1, "send.bytes": outcome.nbytes}
            if outcome.kind is SendKind.FAILED and outcome.reason is not None:
                items[f"send.failed.{outcome.reason.value}"] = 1
                items["errors"] = 1
        elif isinstance(outcome, ReceiveOutcome):
            items = {f"recv.{outcome.kind.value}": 1, "recv.bytes": outcome.nbytes}
            if outcome.skip_reason is not None:
                items[f"recv.skipped.{outcome.skip_reason.value}"] = 1
            if outcome.is_timeout:
                items["timeouts"] = 1
            if outcome.is_error:
                items["errors"] = 1
        else:
            raise ConfigError(f"cannot count {type(outcome).__name__}; expected an outcome")
        self._add_all(items)

    def get(self, name: str) -> int:
        return self._counts.get(name, 0)

    @property
    def timeouts(self) -> int:
        return self.get("timeouts")

    @property
    def errors(self) -> int:
        return self.get("errors")

    def snapshot(self) -> dict[str, int]:
        """A copy of every counter (JSON-able)."""
        with self.lock:
            return dict(self._counts)
