"""Where a receiver finds its sender (SPEC 2.5).

Sender info arrives with the request (it is request-scoped), either flat::

    {"host": "10.0.0.5", "zmq_port": 50151}

or keyed by sender stage id::

    {0: {"host": "10.0.0.5", "zmq_port": 50151}, "2": {"host": ..., "zmq_port": ...}}

Resolution for an expected source stage:

1. a dict with ``host`` is used as is;
2. otherwise the entry under the stage id, looked up as given, as ``str`` and as ``int``;
   if that entry exists but has no usable ``host``, resolution stops there (unresolved): a
   sender of another stage is never picked in its place;
3. otherwise, if exactly one entry has a ``host``, that one;
4. otherwise (none, or several) unresolved, with the reason.

The host is never derived from the receiver's own configuration. ``zmq_port`` is the
advertised rank-0 port; per-rank ports come from :func:`kvferry.core.addressing.sender_endpoint_port`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import attrs

from kvferry.core.errors import RoutingError
from kvferry.core.validate import check_port

__all__ = [
    "HOST_KEY",
    "PORT_KEY",
    "SenderEndpoint",
    "SenderResolution",
    "resolve_sender",
    "resolve_sender_info",
]

HOST_KEY = "host"
PORT_KEY = "zmq_port"
_INT_TEXT = re.compile(r"-?[0-9]+")


def _check_host(instance: Any, attribute: attrs.Attribute[str], value: Any) -> None:
    if not isinstance(value, str) or not value.strip():
        raise RoutingError(f"host must be a non-empty string, got {value!r}")


def _check_port(instance: Any, attribute: attrs.Attribute[int | None], value: Any) -> None:
    if value is None:
        return
    check_port("port", value, RoutingError)


@attrs.frozen
class SenderEndpoint:
    """A sender's host and advertised rank-0 port (None when the info carried no port)."""

    host: str = attrs.field(validator=_check_host)
    port: int | None = attrs.field(default=None, validator=_check_port)


@attrs.frozen
class SenderResolution:
    """The outcome of resolving sender info: an endpoint, or the reason there is none.

    ``stage_key`` is the key of the entry used (None for a flat dict or when unresolved).
    """

    endpoint: SenderEndpoint | None
    reason: str | None = None
    stage_key: Any = None

    @property
    def resolved(self) -> bool:
        return self.endpoint is not None


def _endpoint(entry: Mapping[str, Any], where: str) -> SenderEndpoint | str:
    """The endpoint in ``entry`` or a reason string."""
    host = entry.get(HOST_KEY)
    if not isinstance(host, str) or not host.strip():
        return f"{where} has no usable host (got {host!r})"
    port = entry.get(PORT_KEY)
    if isinstance(port, str) and port.strip().isascii() and port.strip().isdigit():
        port = int(port.strip())
    if port is not None and (isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535):
        return f"{where} has an invalid {PORT_KEY} {port!r}"
    return SenderEndpoint(host, port)


def _stage_variants(stage: Any) -> list[Any]:
    variants: list[Any] = [stage]
    if isinstance(stage, bool):
        return variants
    if isinstance(stage, int):
        variants.append(str(stage))
    elif isinstance(stage, str):
        text = stage.strip()
        if _INT_TEXT.fullmatch(text):
            variants.append(int(text))
    return variants


def _result(entry: Mapping[str, Any], where: str, key: Any) -> SenderResolution:
    found = _endpoint(entry, where)
    if isinstance(found, str):
        return SenderResolution(None, found)
    return SenderResolution(found, None, key)


def resolve_sender(info: Any, expected_stage: Any = None) -> SenderResolution:
    """Resolve ``info`` for the sender stage ``expected_stage`` (see the module docstring).

    Never raises for a malformed ``info`` (it is remote, request-scoped data): the reason says
    what is wrong.
    """
    if info is None:
        return SenderResolution(None, "no sender info")
    if not isinstance(info, Mapping):
        return SenderResolution(None, f"sender info is not a dict ({type(info).__name__})")
    if HOST_KEY in info:
        return _result(info, "sender info", None)
    if expected_stage is not None:
        for key in _stage_variants(expected_stage):
            try:
                entry = info.get(key)
            except TypeError:  # unhashable stage id
                entry = None
            if entry is None:
                continue
            if not isinstance(entry, Mapping):
                return SenderResolution(None, f"entry for stage {key!r} is not a dict")
            return _result(entry, f"entry for stage {key!r}", key)
    with_host = [(key, entry) for key, entry in info.items() if isinstance(entry, Mapping) and HOST_KEY in entry]
    if len(with_host) == 1:
        key, entry = with_host[0]
        return _result(entry, f"entry for stage {key!r}", key)
    wanted = "" if expected_stage is None else f" for stage {expected_stage!r}"
    if not with_host:
        return SenderResolution(None, f"no entry{wanted} and no entry with a host")
    stages = sorted(repr(k) for k, _ in with_host)
    return SenderResolution(None, f"ambiguous: no entry{wanted} and several stages have a host ({', '.join(stages)})")


def resolve_sender_info(info: Any, expected_stage: Any = None) -> SenderEndpoint | None:
    """The sender endpoint for ``expected_stage``, or None when unresolved (see :func:`resolve_sender`)."""
    return resolve_sender(info, expected_stage).endpoint
