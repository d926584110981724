"""Request ids and connector keys (SPEC 1, 2.2).

Sender and receiver derive every key from the functions here, so the set of keys all sender
ranks put equals the set of keys all receiver ranks get, for every valid topology.

Key formats (golden vectors pin them; both are the reference's, byte for byte):

- legacy (both TP sizes <= 1): ``omni_{from_stage}_to_{to_stage}_kv_cache_{request_id}``;
- rank-aware: ``{request_id}_{from_stage}_{chunk_id}_{from_rank}_{to_rank}`` (``chunk_id`` is
  0 for a whole-request payload).

Stages may be ints or strings; keys use ``str(stage)``. Parsing reads the rank-aware format
from the right, so request ids may contain underscores; a *stage* id containing ``_`` cannot be
parsed back unambiguously (keys are still built, as the reference does).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import attrs

from kvferry.core.errors import RoutingError
from kvferry.core.routing import routing_for
from kvferry.core.topology import TPTopology, source_ranks, target_ranks
from kvferry.core.validate import check_int

__all__ = [
    "DUMMY_REQUEST_ID",
    "WHOLE_REQUEST_CHUNK",
    "Stage",
    "SendKeyHook",
    "RecvKeyHook",
    "ConnectorKey",
    "LegacyKey",
    "is_dummy_request",
    "legacy_key",
    "connector_key",
    "send_keys",
    "recv_keys",
    "parse_connector_key",
    "parse_legacy_key",
    "feeds",
    "reads",
]

#: The warm-up request id; ids equal to it or starting with ``DUMMY_REQUEST_ID + "/"`` never
#: wait for KV and never take part in a collective exchange.
DUMMY_REQUEST_ID = "dummy_req_id"
#: ``chunk_id`` of a payload carrying a whole request.
WHOLE_REQUEST_CHUNK = 0

Stage = int | str
#: ``hook(request_id, from_stage, to_stage) -> keys``; an empty result means "use the default".
SendKeyHook = Callable[[str, Stage, Stage], Sequence[str]]
#: ``hook(request_id, from_stage, to_stage) -> [(key, from_rank) | key, ...]``.
RecvKeyHook = Callable[[str, Stage, Stage], Sequence[Any]]

_LEGACY_PREFIX = "omni_"
_LEGACY_TO = "_to_"
_LEGACY_MID = "_kv_cache_"


def is_dummy_request(request_id: object) -> bool:
    """True for the warm-up id ``dummy_req_id`` or any id starting with ``dummy_req_id/``."""
    if not isinstance(request_id, str):
        return False
    return request_id == DUMMY_REQUEST_ID or request_id.startswith(DUMMY_REQUEST_ID + "/")


def _check_request_id(request_id: object) -> str:
    if not isinstance(request_id, str):
        raise RoutingError(f"request_id must be a string, got {type(request_id).__name__}")
    return request_id


def _stage_str(name: str, stage: object) -> str:
    if isinstance(stage, bool) or not isinstance(stage, (int, str)):
        raise RoutingError(f"{name} must be an int or a string, got {stage!r}")
    return str(stage)


def _check_non_negative(name: str, value: object) -> int:
    return check_int(name, value, 0, RoutingError)


def legacy_key(from_stage: Stage, to_stage: Stage, request_id: str) -> str:
    """The single-rank key ``omni_{from_stage}_to_{to_stage}_kv_cache_{request_id}``."""
    frm = _stage_str("from_stage", from_stage)
    to = _stage_str("to_stage", to_stage)
    return f"{_LEGACY_PREFIX}{frm}{_LEGACY_TO}{to}{_LEGACY_MID}{_check_request_id(request_id)}"


def connector_key(request_id: str, from_stage: Stage, chunk_id: int, from_rank: int, to_rank: int) -> str:
    """The rank-aware key ``{request_id}_{from_stage}_{chunk_id}_{from_rank}_{to_rank}``."""
    rid = _check_request_id(request_id)
    frm = _stage_str("from_stage", from_stage)
    chunk = _check_non_negative("chunk_id", chunk_id)
    src = _check_non_negative("from_rank", from_rank)
    dst = _check_non_negative("to_rank", to_rank)
    return f"{rid}_{frm}_{chunk}_{src}_{dst}"


@attrs.frozen
class ConnectorKey:
    """A parsed rank-aware key. ``from_stage`` is the string form used in the key."""

    request_id: str
    from_stage: str
    chunk_id: int
    from_rank: int
    to_rank: int

    def __str__(self) -> str:
        return connector_key(self.request_id, self.from_stage, self.chunk_id, self.from_rank, self.to_rank)


@attrs.frozen
class LegacyKey:
    """A parsed legacy key. Stages are the string forms used in the key."""

    from_stage: str
    to_stage: str
    request_id: str

    def __str__(self) -> str:
        return legacy_key(self.from_stage, self.to_stage, self.request_id)


def parse_connector_key(key: str) -> ConnectorKey:
    """Parse a rank-aware key (from the right, so request ids may contain ``_``).

    Raises RoutingError when ``key`` is not in the format (too few parts, a non-integer or
    negative chunk/rank, an empty stage).
    """
    if not isinstance(key, str):
        raise RoutingError(f"key must be a string, got {type(key).__name__}")
    parts = key.rsplit("_", 4)
    if len(parts) != 5:
        raise RoutingError(f"not a rank-aware connector key: {key!r}")
    rid, stage, chunk, src, dst = parts
    numbers = []
    for name, text in (("chunk_id", chunk), ("from_rank", src), ("to_rank", dst)):
        if not (text.isascii() and text.isdigit()) or str(int(text)) != text:
            raise RoutingError(f"not a rank-aware connector key: {key!r} ({name} is {text!r})")
        numbers.append(int(text))
    if not stage:
        raise RoutingError(f"not a rank-aware connector key: {key!r} (empty from_stage)")
    return ConnectorKey(rid, stage, numbers[0], numbers[1], numbers[2])


def parse_legacy_key(key: str) -> LegacyKey:
    """Parse ``omni_{from}_to_{to}_kv_cache_{rid}`` (stages must not contain ``_to_``/``_kv_cache_``)."""
    if not isinstance(key, str) or not key.startswith(_LEGACY_PREFIX):
        raise RoutingError(f"not a legacy key: {key!r}")
    stages, sep, rid = key[len(_LEGACY_PREFIX) :].partition(_LEGACY_MID)
    frm, sep2, to = stages.partition(_LEGACY_TO)
    if not sep or not sep2 or not frm or not to:
        raise RoutingError(f"not a legacy key: {key!r}")
    return LegacyKey(frm, to, rid)


def feeds(topo: TPTopology, num_heads: int | None = None) -> tuple[int, ...]:
    """Receiver ranks sender ``topo.local_rank`` feeds: with a head count, as
    :func:`~kvferry.core.routing.route_heads` routes them (a replica may feed none); without
    one, the reference's rank map (:func:`~kvferry.core.topology.target_ranks`)."""
    target_ranks(topo)  # the rank checks
    return routing_for(topo.source_tp, topo.target_tp, num_heads).targets(topo.local_rank)


def reads(topo: TPTopology, num_heads: int | None = None) -> tuple[int, ...]:
    """Sender ranks receiver ``topo.local_rank`` reads, in merge order (see :func:`feeds`)."""
    source_ranks(topo)  # the rank checks
    return routing_for(topo.source_tp, topo.target_tp, num_heads).sources(topo.local_rank)


def send_keys(
    request_id: str,
    from_stage: Stage,
    to_stage: Stage,
    topo: TPTopology,
    hook: SendKeyHook | None = None,
    num_heads: int | None = None,
) -> tuple[str, ...]:
    """Keys sender rank ``topo.local_rank`` puts for ``request_id``: one per receiver rank it feeds.

    A callable ``hook`` is asked first; a non-empty result is used as the keys. Otherwise: the
    legacy key when both TP sizes are <= 1, else one rank-aware key (chunk 0) per target rank
    in increasing order (:func:`feeds`: with ``num_heads``, the model's KV head count, replicated
    heads are routed). Raises RoutingError for an unmappable topology or head count.
    """
    if hook is not None:
        custom = hook(request_id, from_stage, to_stage)
        if custom:
            keys = tuple(custom)
            for key in keys:
                if not isinstance(key, str):
                    raise RoutingError(f"send key hook returned a non-string key: {key!r}")
            return keys
    if topo.is_legacy:
        return (legacy_key(from_stage, to_stage, request_id),)
    return tuple(
        connector_key(request_id, from_stage, WHOLE_REQUEST_CHUNK, topo.local_rank, dst)
        for dst in feeds(topo, num_heads)
    )


def _from_hook(custom: Sequence[Any], topo: TPTopology) -> tuple[tuple[str, int | None], ...]:
    items = tuple(custom)
    plain_ranks: tuple[int | None, ...] | None = None
    out: list[tuple[str, int | None]] = []
    for index, item in enumerate(items):
        if isinstance(item, str):
            if plain_ranks is None:
                ranks = source_ranks(topo)
                plain_ranks = ranks if len(ranks) == len(items) else (None,) * len(items)
            out.append((item, plain_ranks[index]))
        elif isinstance(item, (tuple, list)) and len(item) == 2 and isinstance(item[0], str):
            rank = item[1]
            if rank is not None:
                rank = _check_non_negative("from_rank", rank)
            out.append((item[0], rank))
        else:
            raise RoutingError(f"receive key hook returned an invalid entry: {item!r}")
    return tuple(out)


def recv_keys(
    request_id: str,
    from_stage: Stage,
    to_stage: Stage,
    topo: TPTopology,
    hook: RecvKeyHook | None = None,
    num_heads: int | None = None,
) -> tuple[tuple[str, int | None], ...]:
    """``(key, from_rank)`` pairs receiver rank ``topo.local_rank`` gets, in merge order.

    A callable ``hook`` is asked first; a non-empty result wins: ``(key, from_rank)`` pairs are
    used as is, plain strings get ``from_rank`` from the receive rank map when the counts match,
    else None. Otherwise: ``((legacy_key, None),)`` when both TP sizes are <= 1, else one
    rank-aware key (chunk 0) per source rank in merge order (:func:`reads`, with ``num_heads``
    as for :func:`send_keys`). Raises RoutingError for an unmappable topology or head count.
    """
    if hook is not None:
        custom = hook(request_id, from_stage, to_stage)
        if custom:
            return _from_hook(custom, topo)
    if topo.is_legacy:
        return ((legacy_key(from_stage, to_stage, request_id), None),)
    return tuple(
        (connector_key(request_id, from_stage, WHOLE_REQUEST_CHUNK, src, topo.local_rank), src)
        for src in reads(topo, num_heads)
    )
