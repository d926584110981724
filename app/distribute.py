"""Distribution inside the receiving stage and pure-TP consensus (SPEC 6, 9.1, 9.3).

Consume-once data is pulled by one rank (the LEADER) and handed to the others (FOLLOWERS)
over the stage's collective groups; a LOCAL rank pulls its own shard. Every collective step
runs on every rank of its group whatever happened before: a leader that missed sends the
"sender failed" sentinel, so no rank ever waits for a message that will not come.

Messages move in two phases, size then data: a size ``n > 0`` is followed by ``n`` bytes of
the packed side payload (SPEC 3.2, data-only), ``0`` means "no KV" (followed by a one-byte
tensor so that both phases always happen), ``-1`` means the fields could not be packed and
follow as one data-only object (the fallback).

The request object is duck-typed: KV fields are ``past_key_values`` / ``kv_metadata`` on the
request, and ``past_key_values``, ``kv_metadata`` and every ``cfg_*`` KV field on its
``sampling_params``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from kvferry.adapters.side_codec import pack_request_kv, unpack_request_kv
from kvferry.core.errors import ConfigError, KVFerryError
from kvferry.core.roles import (
    PREFERRED_CFG_ROLES,
    DistributionKind,
    ReceiveRole,
    cfg_payload_plan,
    consensus_signature,
    consensus_verdict,
    distribution_plan,
    needs_consensus,
    order_branch_roles,
)

__all__ = [
    "PRIMARY_FIELD",
    "kv_fields_of",
    "apply_kv_fields",
    "clear_kv_fields",
    "broadcast_fields",
    "send_fields",
    "recv_fields",
    "tp_consensus",
    "Distributor",
]

logger = logging.getLogger(__name__)

PRIMARY_FIELD = "past_key_values"
_KV_SUFFIXES = ("past_key_values", "kv_metadata")
_NO_KV, _AS_OBJECT = 0, -1


# ------------------------------------------------------------------------------ request fields
#: CFG bookkeeping fields that travel with the KV (the reference collects them too).
CFG_FIELDS = ("cfg_kv_request_ids", "cfg_active_branch", "cfg_branch_roles")
#: ``{role: ...}`` maps of the branch KV and its metadata (``cfg_branch_*``).
BRANCH_KV_MAP, BRANCH_METADATA_MAP = "cfg_branch_past_key_values", "cfg_branch_kv_metadata"


def _branch_attrs(params: Any) -> dict[str, Any]:
    """Every ``cfg_*`` KV field of the sampling params that is set: per-role branch KV and
    metadata, the ``cfg_branch_*`` maps and :data:`CFG_FIELDS`."""
    if params is None:
        return {}
    try:
        items = vars(params).items()
    except TypeError:
        return {}
    return {
        k: v
        for k, v in items
        if k.startswith("cfg_") and (k.endswith(_KV_SUFFIXES) or k in CFG_FIELDS) and v is not None
    }


def kv_fields_of(req: Any) -> dict[str, Any] | None:
    """The request's applied KV fields (None when it holds no primary KV)."""
    kv = getattr(req, PRIMARY_FIELD, None)
    if kv is None:
        return None
    fields: dict[str, Any] = {PRIMARY_FIELD: kv, "kv_metadata": getattr(req, "kv_metadata", None) or {}}
    fields.update(_branch_attrs(getattr(req, "sampling_params", None)))
    return fields


def apply_kv_fields(req: Any, fields: dict[str, Any], kv_factory: type[Any] | None = None) -> None:
    """Set received fields on the request and mirror them onto its sampling params."""
    kv = fields.get(PRIMARY_FIELD)
    if kv_factory is not None and kv is not None and not isinstance(kv, kv_factory):
        kv = kv_factory(list(kv.key_cache), list(kv.value_cache))
    req.past_key_values = kv
    req.kv_metadata = fields.get("kv_metadata") or {}
    params = getattr(req, "sampling_params", None)
    if params is not None:
        for name, value in fields.items():
            setattr(params, name, kv if name == PRIMARY_FIELD else value)
        params.kv_metadata = req.kv_metadata


def clear_kv_fields(req: Any) -> None:
    """Drop every KV field from the request (the no-KV path)."""
    req.past_key_values = None
    req.kv_metadata = None
    params = getattr(req, "sampling_params", None)
    if params is not None:
        for name in list(_branch_attrs(params)):
            setattr(params, name, None)
        for name in ("past_key_values", "kv_metadata"):
            if hasattr(params, name):
                setattr(params, name, None)


# ----------------------------------------------------------------------------- two-phase moves
_KV_MARK = "__kvferry_kv__"


def _plain(value: Any) -> Any:
    """Fields as the data-only object codec carries them: KV objects become marked dicts."""
    if hasattr(value, "key_cache") and hasattr(value, "value_cache") and not isinstance(value, dict):
        return {_KV_MARK: True, "key_cache": list(value.key_cache), "value_cache": list(value.value_cache)}
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _unplain(value: Any, kv_factory: Callable[..., Any]) -> Any:
    if isinstance(value, dict):
        if value.get(_KV_MARK) is True:
            return kv_factory(list(value.get("key_cache") or []), list(value.get("value_cache") or []))
        return {k: _unplain(v, kv_factory) for k, v in value.items()}
    if isinstance(value, list):
        return [_unplain(v, kv_factory) for v in value]
    return value


def _pack(fields: dict[str, Any] | None, request_id: str) -> tuple[int, Any]:
    """``(size, tensor-or-object)`` for the size phase and the data phase."""
    if fields is None:
        return _NO_KV, torch.zeros(1, dtype=torch.uint8)
    try:
        frames = pack_request_kv(fields, request_id=request_id)
    except ConfigError as exc:
        logger.warning("request %s: KV fields not packable (%s); sending them as an object", request_id, exc)
        return _AS_OBJECT, _plain(fields)
    joined = bytearray().join(frames)
    return len(joined), torch.frombuffer(joined, dtype=torch.uint8) if joined else torch.zeros(1, dtype=torch.uint8)


def _unpack(size: Any, data: Any, kv_factory: Callable[..., Any]) -> dict[str, Any] | None:
    if size == _AS_OBJECT:
        return _unplain(data, kv_factory) if isinstance(data, dict) else None
    if not isinstance(size, int) or size <= 0:
        return None
    try:
        return unpack_request_kv(data, kv_factory=kv_factory)
    except KVFerryError as exc:
        logger.warning("undecodable KV from a peer: %s", exc)
        return None


def broadcast_fields(
    group: Any,
    fields: dict[str, Any] | None,
    src: int,
    *,
    timeout_s: float,
    request_id: str = "",
    kv_factory: Callable[..., Any],
) -> dict[str, Any] | None:
    """Broadcast ``fields`` (meaningful on ``src`` only) to the group; every rank returns them."""
    if group.rank == src:
        size, data = _pack(fields, request_id)
        group.broadcast_object(size, src, timeout_s=timeout_s)
        if size == _AS_OBJECT:
            group.broadcast_object(data, src, timeout_s=timeout_s)
        else:
            group.broadcast_tensor(data, src, timeout_s=timeout_s)
        return fields
    size = group.broadcast_object(None, src, timeout_s=timeout_s)
    if size == _AS_OBJECT:
        return _unpack(size, group.broadcast_object(None, src, timeout_s=timeout_s), kv_factory)
    buf = torch.empty(size if isinstance(size, int) and size > 0 else 1, dtype=torch.uint8)
    buf = group.broadcast_tensor(buf, src, timeout_s=timeout_s)
    return _unpack(size, buf, kv_factory)


def send_fields(group: Any, fields: dict[str, Any] | None, dst: int, *, timeout_s: float, request_id: str = "") -> None:
    size, data = _pack(fields, request_id)
    group.send_object(size, dst, timeout_s=timeout_s)
    if size == _AS_OBJECT:
        group.send_object(data, dst, timeout_s=timeout_s)
    else:
        group.send_tensor(data, dst, timeout_s=timeout_s)


def recv_fields(group: Any, src: int, *, timeout_s: float, kv_factory: Callable[..., Any]) -> dict[str, Any] | None:
    size = group.recv_object(src, timeout_s=timeout_s)
    if size == _AS_OBJECT:
        return _unpack(size, group.recv_object(src, timeout_s=timeout_s), kv_factory)
    buf = torch.empty(size if isinstance(size, int) and size > 0 else 1, dtype=torch.uint8)
    buf = group.recv_tensor(buf, src, timeout_s=timeout_s)
    return _unpack(size, buf, kv_factory)


def tp_consensus(group: Any, received: bool, applied_fields: Any, *, timeout_s: float) -> bool:
    """Pure-TP agreement: True when every rank's ``(received, fields)`` signature is equal.

    Rank 0 gathers the signatures point-to-point and broadcasts the verdict; every rank makes
    the same calls in the same order.
    """
    got, fields = consensus_signature(bool(received), applied_fields)
    mine = [got, list(fields)]
    if group.rank == 0:
        sigs = [mine] + [group.recv_object(r, timeout_s=timeout_s) for r in range(1, group.size)]
        verdict = consensus_verdict(sigs)
        group.broadcast_object(verdict, 0, timeout_s=timeout_s)
        return verdict
    group.send_object(mine, 0, timeout_s=timeout_s)
    return bool(group.broadcast_object(None, 0, timeout_s=timeout_s))


# ---------------------------------------------------------------------------------- distributor
def _branch_roles(fields: dict[str, Any]) -> tuple[str, ...]:
    """The request's CFG branch roles in the reference's order: ``cfg_text``, ``cfg_img`` when
    named in the branch map or set as ``{role}_past_key_values``, then the map's other roles
    with KV, then roles found only as ``{role}_past_key_values``."""
    branch_map = fields.get(BRANCH_KV_MAP) or {}
    map_roles = [r for r, kv in branch_map.items() if kv is not None or r in PREFERRED_CFG_ROLES]
    attr_roles = [
        name[: -len("_past_key_values")]
        for name in fields
        if name.startswith("cfg_") and name.endswith("_past_key_values") and name != BRANCH_KV_MAP
    ]
    return order_branch_roles(map_roles, attr_roles)


def _cfg_payloads(fields: dict[str, Any] | None, cfg_size: int) -> list[dict[str, Any] | None]:
    """Per CFG rank, the fields the leader hands it (SPEC 6; the reference's per-rank payloads):
    index 0 is the leader's own (and, with SP, what its SP group gets).

    Every payload has the primary KV and its metadata. With branch roles: rank 0 also gets the
    list of roles and no active branch; rank ``i`` gets branch ``roles[i-1]``'s KV (from the
    ``cfg_branch_past_key_values`` map, else ``{role}_past_key_values``) both as
    ``{role}_past_key_values`` and as the one-entry map, the same for its metadata, the role as
    ``cfg_active_branch`` and the list of roles; a rank whose branch has no KV gets None.
    Without roles and ``cfg_size == 2``, rank 1 gets the primary alone.
    """
    if fields is None:
        return [None] * cfg_size
    roles = _branch_roles(fields)
    base = {PRIMARY_FIELD: fields[PRIMARY_FIELD], "kv_metadata": fields.get("kv_metadata") or {}}
    listed = {"cfg_branch_roles": list(roles), "cfg_active_branch": None} if roles else {}
    kv_map = fields.get(BRANCH_KV_MAP) or {}
    metadata_map = fields.get(BRANCH_METADATA_MAP) or {}
    out: list[dict[str, Any] | None] = []
    for assignment in cfg_payload_plan(cfg_size, roles):
        if assignment is None:
            out.append(None)
        elif assignment.cfg_rank == 0:
            out.append({**base, **listed})
        elif assignment.active_branch is not None:
            role = assignment.active_branch
            kv = kv_map.get(role)
            kv = fields.get(f"{role}_past_key_values") if kv is None else kv
            if kv is None:
                out.append(None)
                continue
            payload = {**base, **listed, "cfg_active_branch": role, BRANCH_KV_MAP: {role: kv}}
            payload[f"{role}_past_key_values"] = kv
            meta = metadata_map.get(role)
            meta = fields.get(f"{role}_kv_metadata") if meta is None else meta
            if meta is not None:
                payload[BRANCH_METADATA_MAP] = {role: meta}
                payload[f"{role}_kv_metadata"] = meta
            out.append(payload)
        else:  # copy_of_primary: the request did not split its KV by branch
            out.append(dict(base))
    return out


class Distributor:
    """Runs one request's receive-and-distribute on one rank of the receiving stage.

    ``receive(req) -> bool`` pulls this rank's KV and applies it to ``req`` (LOCAL and LEADER
    ranks only); ``timeout_s`` bounds every collective step (it must exceed the receive
    deadline, since followers wait while the leader receives).
    """

    def __init__(
        self,
        groups: Any,
        from_tp: int,
        to_tp: int,
        *,
        timeout_s: float,
        kv_factory: type[Any],
        on_drop: Callable[[str], None] | None = None,
    ) -> None:
        self.groups = groups
        #: called with the request id when this rank had KV but the TP group dropped it
        self.on_drop = on_drop
        self.from_tp, self.to_tp = from_tp, to_tp
        self.timeout_s = timeout_s
        self.kv_factory = kv_factory

    def plan(self) -> Any:
        g = self.groups
        world, tp, cfg, sp = g.world, g.tp, g.cfg, g.sp
        return distribution_plan(
            world.size if world else 1,
            world.rank if world else 0,
            world is not None,
            self.from_tp,
            self.to_tp,
            tp.size if tp else 1,
            cfg.size if cfg else 1,
            cfg.rank if cfg else 0,
            sp.size if sp else 1,
            sp.rank if sp else 0,
        )

    def run(self, req: Any, receive: Callable[[Any], bool], *, active: bool) -> bool:
        """Receive (by role) then distribute; True when this rank ends up with KV.

        ``active`` is False for dummy requests and non-receiving configs: then nothing happens
        on any rank (the decision is the same on all of them).
        """
        if not active:
            return False
        plan = self.plan()
        rid = str(getattr(req, "request_id", ""))
        if plan.role is ReceiveRole.LOCAL:
            tp = self.groups.tp
            agree = tp is not None and needs_consensus(plan.role, tp.size, False, True)
            try:
                ok = bool(receive(req))
            except Exception:
                if not agree:
                    raise
                # the consensus below must still happen on every TP rank: this rank has no KV
                logger.exception("request %s: the local receive failed", rid)
                clear_kv_fields(req)
                ok = False
            if agree:
                fields = kv_fields_of(req) if ok else None
                names = sorted(fields) if fields else []
                try:
                    agreed = tp_consensus(tp, ok, names, timeout_s=self.timeout_s)
                except KVFerryError:  # the group is broken: never keep KV it did not agree on
                    clear_kv_fields(req)
                    raise
                if not agreed:
                    if ok:
                        logger.warning("request %s: a TP peer did not receive; every rank drops KV", rid)
                        if self.on_drop is not None:
                            self.on_drop(rid)
                    clear_kv_fields(req)
                    return False
            return ok
        fields = None
        if plan.role is ReceiveRole.LEADER:
            try:
                fields = kv_fields_of(req) if receive(req) else None
            except Exception:  # the collectives below must still happen
                logger.exception("request %s: the leader's receive failed", rid)
                fields = None
        try:
            fields = self._spread(plan, fields, rid)
        except KVFerryError:  # a collective failed: the group is broken and the peers have no
            clear_kv_fields(req)  # KV from this rank, so neither may it keep what it received
            raise
        if fields is None:
            clear_kv_fields(req)
            return False
        apply_kv_fields(req, fields, self.kv_factory)
        return True

    def _spread(self, plan: Any, fields: dict[str, Any] | None, rid: str) -> dict[str, Any] | None:
        g, t, k = self.groups, self.timeout_s, self.kv_factory
        if plan.kind is DistributionKind.WORLD_BROADCAST:
            return broadcast_fields(g.world, fields, 0, timeout_s=t, request_id=rid, kv_factory=k)
        if plan.kind is DistributionKind.TP_SP:
            return broadcast_fields(g.sp, fields, 0, timeout_s=t, request_id=rid, kv_factory=k)
        if plan.kind is DistributionKind.TP_CFG:
            sp_rank = g.sp.rank if g.sp is not None else 0
            if sp_rank == 0:
                if g.cfg.rank == 0:
                    payloads = _cfg_payloads(fields, g.cfg.size)
                    for dst in range(1, g.cfg.size):
                        send_fields(g.cfg, payloads[dst], dst, timeout_s=t, request_id=rid)
                    fields = payloads[0]
                else:
                    fields = recv_fields(g.cfg, 0, timeout_s=t, kv_factory=k)
            if plan.sp_broadcast_after_p2p and g.sp is not None:
                fields = broadcast_fields(g.sp, fields, 0, timeout_s=t, request_id=rid, kv_factory=k)
            return fields
        return fields
