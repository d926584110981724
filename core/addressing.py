"""Network port numbers (SPEC 2.3). Hexagonal ports (interfaces) live in ``core/ports.py``.

A sender rank serves its payloads on one TCP port derived from the configured base port::

    port = base + KV_TRANSFER_PORT_OFFSET                    (100)
                + replica * KV_REPLICA_PORT_STRIDE           (1024)
                + (dp_rank * tp_size + tp_rank) * KV_RANK_PORT_STRIDE   (16)
                + from_stage

With ``dp_rank = 0`` this is the reference's formula. Bounds that make ports collision-free:
``0 <= from_stage < 16``, rank slot ``(dp_rank * tp_size + tp_rank) < 64`` (so the slot never
spills into the next replica's 1024-wide window), and the result inside ``1..65535``. Within
those bounds, distinct ``(replica, dp_rank, tp_rank, from_stage)`` give distinct ports
(property-tested). The orchestrator advertises rank 0's port; rank ``s`` of the same stage,
replica and DP group serves on ``advertised + s * 16`` (:func:`sender_endpoint_port`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import attrs

from kvferry.core.errors import ConfigError, RoutingError
from kvferry.core.validate import check_int, check_port

__all__ = [
    "KV_TRANSFER_PORT_OFFSET",
    "KV_RANK_PORT_STRIDE",
    "KV_REPLICA_PORT_STRIDE",
    "DEFAULT_BASE_PORT",
    "MAX_STAGE_ID",
    "MAX_RANK_SLOTS",
    "MIN_PORT",
    "MAX_PORT",
    "kv_port",
    "sender_endpoint_port",
    "pull_port",
    "get_metadata",
    "GetSource",
    "resolve_get_source",
    "replica_id_from_env",
    "expand_base_port",
    "expand_env_text",
]

KV_TRANSFER_PORT_OFFSET = 100
KV_RANK_PORT_STRIDE = 16
KV_REPLICA_PORT_STRIDE = 1024
DEFAULT_BASE_PORT = 50051
#: Largest stage id whose port cannot collide with the next rank's (stride 16).
MAX_STAGE_ID = KV_RANK_PORT_STRIDE - 1
#: Rank slots (``dp_rank * tp_size + tp_rank``) that fit in one replica's window.
MAX_RANK_SLOTS = KV_REPLICA_PORT_STRIDE // KV_RANK_PORT_STRIDE
MIN_PORT = 1
MAX_PORT = 65535

_NAME = r"[A-Za-z_][A-Za-z0-9_]*"
_VAR = re.compile(r"\$(?:\{(" + _NAME + r")\}|(" + _NAME + r"))")


def _stage_number(from_stage: Any) -> int:
    """A stage id as a port offset: an int, or a string of decimal digits, in ``0..15``."""
    if isinstance(from_stage, str) and from_stage.isascii() and from_stage.isdigit():
        from_stage = int(from_stage)
    expected = f"an integer in 0..{MAX_STAGE_ID} for ports (a larger id collides with the next rank's port)"
    return check_int("from_stage", from_stage, 0, RoutingError, MAX_STAGE_ID, expected=expected)


def _check_port(name: str, port: int, detail: str) -> int:
    if not MIN_PORT <= port <= MAX_PORT:
        raise RoutingError(f"{name} {port} is outside {MIN_PORT}..{MAX_PORT} ({detail})")
    return port


def kv_port(
    base_port: int,
    from_stage: int | str | None,
    tp_rank: int = 0,
    replica: int = 0,
    dp_rank: int = 0,
    tp_size: int = 1,
) -> int:
    """The port sender rank ``tp_rank`` of stage ``from_stage`` binds (see module docstring).

    ``tp_size`` matters only with ``dp_rank > 0``; when ``dp_rank > 0`` or ``tp_size > 1``,
    ``tp_rank`` must be below ``tp_size``. Raises RoutingError naming the field for: a stage
    outside ``0..15`` (or None), a negative rank/replica/dp rank, ``tp_size < 1``, a rank slot
    ``(dp_rank*tp_size+tp_rank)*16 >= 1024``, a base port or result outside ``1..65535``.
    """
    base = check_int("base_port", base_port, MIN_PORT, RoutingError)
    _check_port("base_port", base, "the configured base port")
    stage = _stage_number(from_stage)
    rank = check_int("tp_rank", tp_rank, 0, RoutingError)
    rep = check_int("replica", replica, 0, RoutingError)
    dp = check_int("dp_rank", dp_rank, 0, RoutingError)
    size = check_int("tp_size", tp_size, 1, RoutingError)
    if (dp > 0 or size > 1) and rank >= size:
        raise RoutingError(f"tp_rank {rank} is not below tp_size {size}")
    slot = dp * size + rank
    if slot * KV_RANK_PORT_STRIDE >= KV_REPLICA_PORT_STRIDE:
        raise RoutingError(
            f"rank slot too large: (dp_rank*tp_size+tp_rank)*{KV_RANK_PORT_STRIDE} = "
            f"{slot * KV_RANK_PORT_STRIDE} >= {KV_REPLICA_PORT_STRIDE} "
            f"(tp_rank={rank}, dp_rank={dp}, tp_size={size}); it would collide with replica {rep + 1}"
        )
    port = base + KV_TRANSFER_PORT_OFFSET + rep * KV_REPLICA_PORT_STRIDE + slot * KV_RANK_PORT_STRIDE + stage
    return _check_port(
        "port",
        port,
        f"base_port={base}, replica={rep}, dp_rank={dp}, tp_rank={rank}, from_stage={stage}",
    )


def sender_endpoint_port(advertised_port: int, source_rank: int) -> int:
    """Port of sender rank ``source_rank`` given the advertised rank-0 port: ``+ source_rank*16``.

    Raises RoutingError for an advertised port outside ``1..65535``, a negative source rank,
    ``source_rank*16 >= 1024`` or a result outside ``1..65535``.
    """
    adv = check_int("advertised_port", advertised_port, MIN_PORT, RoutingError)
    _check_port("advertised_port", adv, "the sender's advertised rank-0 port")
    rank = check_int("source_rank", source_rank, 0, RoutingError)
    if rank * KV_RANK_PORT_STRIDE >= KV_REPLICA_PORT_STRIDE:
        raise RoutingError(f"source_rank {rank} too large: {rank}*{KV_RANK_PORT_STRIDE} >= {KV_REPLICA_PORT_STRIDE}")
    return _check_port("port", adv + rank * KV_RANK_PORT_STRIDE, f"advertised_port={adv}, source_rank={rank}")


def pull_port(advertised_port: int, from_rank: int | None, local_rank: int) -> int:
    """Port a receiver rank pulls one key from, given the sender's advertised rank-0 port.

    A key with a known source rank (``from_rank``) is served by that sender rank:
    ``advertised + from_rank*16``. A key without one (legacy keys, custom hooks) follows the
    homogeneous rule: the sender rank with the receiver's own index, ``advertised +
    local_rank*16``. Same errors as :func:`sender_endpoint_port`.
    """
    return sender_endpoint_port(advertised_port, local_rank if from_rank is None else from_rank)


def get_metadata(
    host: str | None, advertised_port: int | None, from_rank: int | None, *, request_scoped: bool
) -> dict[str, Any] | None:
    """The metadata a receiver hands ``connector.get`` for one key, as the reference builds it.

    ``host``/``advertised_port``: the sender's endpoint (the request's own when
    ``request_scoped``, else the stored default; None when there is none). With a known
    source rank (TP > 1) or a request-scoped sender, and an endpoint with both host and port:
    ``{"source_host": host, "source_port": advertised + (from_rank or 0)*16}``. Otherwise None:
    the connector uses its default sender (the legacy single-rank case, TP 1/1, passes None
    even when a sender was stored, which a third-party connector may rely on). Same errors as
    :func:`sender_endpoint_port`.
    """
    if host is None or advertised_port is None or (from_rank is None and not request_scoped):
        return None
    return {"source_host": host, "source_port": sender_endpoint_port(advertised_port, from_rank or 0)}


@attrs.frozen
class GetSource:
    """The sender a get asks, read from the get's metadata or the connector's default sender.

    ``host`` is None only for a connector that ignores hosts (shm: same host by nature);
    ``size`` (bytes) when the put's metadata announced it; ``transport``/``ipc_path`` when the
    metadata names them (zmq's put metadata); ``from_metadata`` tells the default apart.
    """

    host: str | None
    port: int
    size: int | None = None
    transport: str | None = None
    ipc_path: str | None = None
    from_metadata: bool = True


def _metadata_port(value: Any) -> int:
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value.strip())
    return check_port("get metadata 'source_port'", value, expected="a port number in 1..65535")


def resolve_get_source(
    metadata: Mapping[str, Any] | None, default: tuple[str, int] | None, *, needs_host: bool = True
) -> GetSource | None:
    """The one rule every connector's get uses to find its sender (the inverse of
    :func:`get_metadata`; ``put`` metadata, which holds the same two fields, resolves alike).

    - ``source_port`` named: that sender, on ``source_host`` (required when ``needs_host``;
      ConfigError naming ``source_host`` otherwise). A port may be a decimal string.
    - no ``source_port``: the ``default`` sender (``update_sender_info``), unless the metadata
      names another host (then None: unresolved, the get misses).
    - None when nothing names a sender.

    Wrongly typed metadata (not a mapping, a port outside 1..65535, a bad ``size``) is a
    ConfigError naming the field.
    """
    if metadata is not None and not isinstance(metadata, Mapping):
        raise ConfigError(f"get metadata must be a mapping or None, got {type(metadata).__name__}")
    meta = metadata or {}
    size = meta.get("size")
    if size is not None:
        check_int("get metadata 'size'", size, 0, expected="a non-negative int")
    host, port = meta.get("source_host"), meta.get("source_port")
    if port is None:
        if default is None or (host is not None and host != default[0]):
            return None
        return GetSource(default[0], _metadata_port(default[1]), size, from_metadata=False)
    if host is not None or needs_host:
        if not isinstance(host, str) or not host.strip():
            raise ConfigError(f"get metadata 'source_host' must be a non-empty host string, got {host!r}")
        host = host.strip()
    transport, path = meta.get("transport"), meta.get("ipc_path")
    return GetSource(
        host,
        _metadata_port(port),
        size,
        transport if isinstance(transport, str) else None,
        path if isinstance(path, str) else None,
    )


def replica_id_from_env(raw: str | None) -> int:
    """The replica id from the raw environment value (the reference's reading).

    Unset, empty, non-integer or negative -> 0. The caller reads the environment.
    """
    if raw is None:
        return 0
    try:
        value = int(str(raw).strip())
    except ValueError:
        return 0
    return value if value >= 0 else 0


def expand_base_port(value: int | str, env: Mapping[str, str], field: str = "base_port") -> int:
    """A configured base port: an int, or a string with ``${VAR}`` / ``$VAR`` references.

    Expansion is strict: an unset variable raises ConfigError naming it; a ``$`` not starting
    a variable reference, a non-integer result or a port outside ``1..65535`` raises
    ConfigError naming ``field``.
    """
    if isinstance(value, bool):
        raise ConfigError(f"{field} must be an integer port or a string, got {value!r}")
    if isinstance(value, int):
        text = str(value)
    elif isinstance(value, str):
        text = _expand(value, env, field)
    else:
        raise ConfigError(f"{field} must be an integer port or a string, got {value!r}")
    stripped = text.strip()
    if not (stripped.isascii() and stripped.isdigit()):
        raise ConfigError(f"{field} must be an integer port, got {value!r} (expanded to {text!r})")
    port = int(stripped)
    if not MIN_PORT <= port <= MAX_PORT:
        raise ConfigError(f"{field} {port} is outside {MIN_PORT}..{MAX_PORT} (from {value!r})")
    return port


def expand_env_text(text: str, env: Mapping[str, str], field: str) -> str:
    """``text`` with every ``${VAR}`` / ``$VAR`` replaced from ``env`` (strict: an unset
    variable or a malformed reference raises ConfigError naming ``field`` and the variable)."""
    return _expand(text, env, field)


def _expand(text: str, env: Mapping[str, str], field: str) -> str:
    out: list[str] = []
    pos = 0
    while True:
        dollar = text.find("$", pos)
        if dollar < 0:
            out.append(text[pos:])
            return "".join(out)
        out.append(text[pos:dollar])
        match = _VAR.match(text, dollar)
        if match is None:
            raise ConfigError(f"{field}: malformed variable reference in {text!r} at position {dollar}")
        name = match.group(1) or match.group(2)
        if name not in env:
            raise ConfigError(f"{field}: environment variable {name} is not set (in {text!r})")
        out.append(env[name])
        pos = match.end()
