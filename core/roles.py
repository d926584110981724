"""Receive roles, distribution plans, CFG payload plans and TP consensus (SPEC 6).

Ranks of a receiving stage may be grouped for tensor parallel (TP), classifier-free-guidance
parallel (CFG) and sequence parallel (SP). Everything here is pure: the caller passes the group
sizes and ranks it knows, and gets back which rank pulls from the connector, how the KV is then
spread inside the stage, which CFG rank gets which branch, and whether the pure-TP group keeps
or drops what it received.

World layout (:class:`GroupLayout`, used by the collective adapters to build sub-groups):
``world_rank = ((cfg_rank * sp_size) + sp_rank) * tp_size + tp_rank``, so TP ranks are the
fastest-moving coordinate (neighbours share a TP group), SP next, CFG slowest.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Sequence
from typing import Any

import attrs

from kvferry.core.errors import ConfigError, RoutingError
from kvferry.core.validate import check_int

__all__ = [
    "ReceiveRole",
    "DistributionKind",
    "DistributionPlan",
    "GroupLayout",
    "CfgAssignment",
    "PREFERRED_CFG_ROLES",
    "tp_active",
    "receive_role",
    "distribution_plan",
    "cfg_payload_plan",
    "order_branch_roles",
    "consensus_signature",
    "consensus_verdict",
    "needs_consensus",
]

#: Branch roles that come first, in this order, when present (the reference's stable order).
PREFERRED_CFG_ROLES = ("cfg_text", "cfg_img")


class ReceiveRole(enum.Enum):
    """How a rank of the receiving stage gets its KV.

    - ``LOCAL``: pulls its own shard from the connector; nothing to distribute.
    - ``LEADER``: pulls from the connector, then distributes to followers.
    - ``FOLLOWER``: never touches the connector; receives from its leader.
    """

    LOCAL = "local"
    LEADER = "leader"
    FOLLOWER = "follower"


class DistributionKind(enum.Enum):
    """How KV moves inside the receiving stage after the leader received (or failed to)."""

    #: LOCAL role: every rank pulled its own shard.
    NONE = "none"
    #: TP with CFG: one point-to-point payload per CFG rank (then an SP broadcast when SP > 1).
    TP_CFG = "tp_cfg"
    #: TP with SP only: the leader broadcasts to its SP group.
    TP_SP = "tp_sp"
    #: TP inactive: world rank 0 broadcasts to the world group.
    WORLD_BROADCAST = "world_broadcast"


def _rank(name: str, rank: Any, size: int, size_name: str) -> int:
    index = check_int(name, rank, 0, RoutingError)
    if index >= size:
        raise RoutingError(f"{name} {index} is outside the group ({size_name}={size})")
    return index


def tp_active(from_tp: int, to_tp: int, tp_size: int = 1) -> bool:
    """True when either side's TP size is > 1.

    ``from_tp``/``to_tp`` are the configured sizes; when both are <= 1 the run-time TP size
    ``tp_size`` stands for both (SPEC 7), so TP is active when ``tp_size > 1``.
    """
    check_int("from_tp", from_tp, 1, RoutingError)
    check_int("to_tp", to_tp, 1, RoutingError)
    check_int("tp_size", tp_size, 1, RoutingError)
    if from_tp <= 1 and to_tp <= 1:
        return tp_size > 1
    return True


def receive_role(
    world_size: int,
    world_rank: int,
    groups_initialised: bool,
    from_tp: int,
    to_tp: int,
    tp_size: int = 1,
    cfg_size: int = 1,
    cfg_rank: int = 0,
    sp_size: int = 1,
    sp_rank: int = 0,
) -> ReceiveRole:
    """The receive role of one rank (SPEC 6).

    - world size 1, or no groups initialised -> LOCAL;
    - TP active and neither CFG (``cfg_size > 1``) nor SP (``sp_size > 1``) -> LOCAL;
    - TP active with CFG or SP -> LEADER when ``cfg_rank == 0 and sp_rank == 0``, else FOLLOWER;
    - TP inactive -> LEADER on world rank 0, else FOLLOWER.

    Sizes must be >= 1 and ranks inside their groups, else RoutingError naming the field.
    """
    check_int("world_size", world_size, 1, RoutingError)
    _rank("world_rank", world_rank, world_size, "world_size")
    check_int("cfg_size", cfg_size, 1, RoutingError)
    _rank("cfg_rank", cfg_rank, cfg_size, "cfg_size")
    check_int("sp_size", sp_size, 1, RoutingError)
    _rank("sp_rank", sp_rank, sp_size, "sp_size")
    active = tp_active(from_tp, to_tp, tp_size)
    if world_size == 1 or not groups_initialised:
        return ReceiveRole.LOCAL
    if active:
        if cfg_size == 1 and sp_size == 1:
            return ReceiveRole.LOCAL
        return ReceiveRole.LEADER if cfg_rank == 0 and sp_rank == 0 else ReceiveRole.FOLLOWER
    return ReceiveRole.LEADER if world_rank == 0 else ReceiveRole.FOLLOWER


@attrs.frozen
class DistributionPlan:
    """How KV spreads inside the stage, and this rank's role in it.

    ``sp_broadcast_after_p2p`` is True for TP+CFG+SP: after the CFG point-to-point step every
    CFG rank broadcasts what it got to its SP group (SP rank 0 of that group is the source).
    """

    role: ReceiveRole
    kind: DistributionKind
    sp_broadcast_after_p2p: bool = False

    @property
    def pulls_from_connector(self) -> bool:
        """LOCAL and LEADER ranks pull; followers never touch the connector."""
        return self.role is not ReceiveRole.FOLLOWER


def distribution_plan(
    world_size: int,
    world_rank: int,
    groups_initialised: bool,
    from_tp: int,
    to_tp: int,
    tp_size: int = 1,
    cfg_size: int = 1,
    cfg_rank: int = 0,
    sp_size: int = 1,
    sp_rank: int = 0,
) -> DistributionPlan:
    """The role (:func:`receive_role`, same arguments) plus the distribution it implies.

    The kind is the same on every rank of a stage (it depends on sizes only), so all ranks
    enter the same collectives: LOCAL -> NONE; TP active with CFG -> TP_CFG (plus the SP
    broadcast when ``sp_size > 1``); TP active with SP only -> TP_SP; TP inactive -> WORLD_BROADCAST.
    """
    role = receive_role(
        world_size,
        world_rank,
        groups_initialised,
        from_tp,
        to_tp,
        tp_size,
        cfg_size,
        cfg_rank,
        sp_size,
        sp_rank,
    )
    if role is ReceiveRole.LOCAL:
        return DistributionPlan(role, DistributionKind.NONE)
    if tp_active(from_tp, to_tp, tp_size):
        if cfg_size > 1:
            return DistributionPlan(role, DistributionKind.TP_CFG, sp_broadcast_after_p2p=sp_size > 1)
        return DistributionPlan(role, DistributionKind.TP_SP)
    return DistributionPlan(role, DistributionKind.WORLD_BROADCAST)


@attrs.frozen
class GroupLayout:
    """A world of ``cfg_size * sp_size * tp_size`` ranks, TP fastest, then SP, then CFG.

    ``world_rank = ((cfg_rank * sp_size) + sp_rank) * tp_size + tp_rank``. Invariants
    (property-tested): ``coords`` and ``world_rank`` are inverse; every rank is in exactly one
    TP, one SP and one CFG group; a rank's index in each of its groups is its coordinate.
    """

    tp_size: int = attrs.field(default=1, validator=lambda i, a, v: check_int(a.name, v, 1, RoutingError))
    sp_size: int = attrs.field(default=1, validator=lambda i, a, v: check_int(a.name, v, 1, RoutingError))
    cfg_size: int = attrs.field(default=1, validator=lambda i, a, v: check_int(a.name, v, 1, RoutingError))

    @property
    def world_size(self) -> int:
        return self.tp_size * self.sp_size * self.cfg_size

    def world_rank(self, cfg_rank: int, sp_rank: int, tp_rank: int) -> int:
        """The world rank at these coordinates (RoutingError outside the layout)."""
        _rank("cfg_rank", cfg_rank, self.cfg_size, "cfg_size")
        _rank("sp_rank", sp_rank, self.sp_size, "sp_size")
        _rank("tp_rank", tp_rank, self.tp_size, "tp_size")
        return ((cfg_rank * self.sp_size) + sp_rank) * self.tp_size + tp_rank

    def coords(self, world_rank: int) -> tuple[int, int, int]:
        """``(cfg_rank, sp_rank, tp_rank)`` of a world rank."""
        _rank("world_rank", world_rank, self.world_size, "world_size")
        rest, tp_rank = divmod(world_rank, self.tp_size)
        cfg_rank, sp_rank = divmod(rest, self.sp_size)
        return cfg_rank, sp_rank, tp_rank

    def tp_group(self, world_rank: int) -> tuple[int, ...]:
        """World ranks of ``world_rank``'s TP group, in TP-rank order."""
        c, s, _ = self.coords(world_rank)
        return tuple(self.world_rank(c, s, t) for t in range(self.tp_size))

    def sp_group(self, world_rank: int) -> tuple[int, ...]:
        """World ranks of ``world_rank``'s SP group, in SP-rank order."""
        c, _, t = self.coords(world_rank)
        return tuple(self.world_rank(c, s, t) for s in range(self.sp_size))

    def cfg_group(self, world_rank: int) -> tuple[int, ...]:
        """World ranks of ``world_rank``'s CFG group, in CFG-rank order."""
        _, s, t = self.coords(world_rank)
        return tuple(self.world_rank(c, s, t) for c in range(self.cfg_size))

    def all_groups(self, kind: str) -> tuple[tuple[int, ...], ...]:
        """Every group of ``kind`` ("tp", "sp" or "cfg"), ordered by their smallest rank.

        torch.distributed needs every process to create every sub-group in the same order;
        this is that order.
        """
        pick = {"tp": self.tp_group, "sp": self.sp_group, "cfg": self.cfg_group}.get(kind)
        if pick is None:
            raise ConfigError(f"group kind must be 'tp', 'sp' or 'cfg', got {kind!r}")
        seen: dict[tuple[int, ...], None] = {}
        for r in range(self.world_size):
            seen.setdefault(pick(r), None)
        return tuple(sorted(seen))


@attrs.frozen
class CfgAssignment:
    """What one CFG rank gets from the leader (SPEC 6).

    Every assignment carries the primary KV. ``branch_roles`` is the full ordered list of
    branch roles (empty when the request has none); ``active_branch`` is the branch whose KV
    this rank also gets (None on rank 0); ``copy_of_primary`` marks the cfg-size-2 case where
    the request has no branches and rank 1 gets a copy of the primary.
    """

    cfg_rank: int
    branch_roles: tuple[str, ...] = ()
    active_branch: str | None = None
    copy_of_primary: bool = False


def cfg_payload_plan(cfg_size: int, branch_roles: Sequence[str]) -> tuple[CfgAssignment | None, ...]:
    """One entry per CFG rank (``len == cfg_size``): what the leader sends it.

    ``branch_roles`` are the roles whose branch KV the request carries, in order
    (:func:`order_branch_roles`). Rank 0: the primary plus the list of roles; rank ``i >= 1``:
    the primary plus ``branch_roles[i-1]`` as the active branch; with no roles and
    ``cfg_size == 2``, rank 1 gets a copy of the primary; otherwise a rank without a branch gets
    None. Roles beyond ``cfg_size - 1`` are listed on every assignment but not sent.
    """
    check_int("cfg_size", cfg_size, 1, RoutingError)
    if isinstance(branch_roles, str):
        raise ConfigError("branch_roles must be a sequence of role names, not one string")
    roles = tuple(branch_roles)
    for role in roles:
        if not isinstance(role, str) or not role:
            raise ConfigError(f"branch_roles entries must be non-empty strings, got {role!r}")
    if len(set(roles)) != len(roles):
        raise ConfigError(f"branch_roles has duplicates: {roles!r}")
    plan: list[CfgAssignment | None] = [CfgAssignment(0, roles)]
    for i in range(1, cfg_size):
        if i - 1 < len(roles):
            plan.append(CfgAssignment(i, roles, active_branch=roles[i - 1]))
        elif not roles and cfg_size == 2:
            plan.append(CfgAssignment(i, roles, copy_of_primary=True))
        else:
            plan.append(None)
    return tuple(plan)


def order_branch_roles(branch_map_roles: Iterable[str], attribute_roles: Iterable[str] = ()) -> tuple[str, ...]:
    """Stable order of CFG branch roles: ``cfg_text``, ``cfg_img`` first when present, then the
    other roles of the branch map in their order, then roles found only as
    ``{role}_past_key_values`` attributes in their order. Duplicates are dropped.

    Callers pass only roles whose KV is actually present (not None).
    """
    first = list(branch_map_roles)
    second = [r for r in attribute_roles if r != "cfg_branch"]
    present = set(first) | set(second)
    ordered = [r for r in PREFERRED_CFG_ROLES if r in present]
    for role in first + second:
        if role not in ordered:
            ordered.append(role)
    return tuple(ordered)


Signature = tuple[bool, tuple[str, ...]]


def consensus_signature(received: bool, applied_fields: Iterable[str]) -> Signature:
    """A rank's signature for the pure-TP consensus: ``(received, sorted unique applied fields)``.

    Plain data (bool, strings), so it travels through the data-only collective codec.
    """
    if not isinstance(received, bool):
        raise ConfigError(f"received must be a bool, got {received!r}")
    fields = tuple(sorted(set(applied_fields)))
    for name in fields:
        if not isinstance(name, str):
            raise ConfigError(f"applied field names must be strings, got {name!r}")
    return (received, fields)


def _normalise(sig: Any) -> Signature | None:
    if not isinstance(sig, (tuple, list)) or len(sig) != 2:
        return None
    received, fields = sig
    if not isinstance(received, bool) or not isinstance(fields, (tuple, list)):
        return None
    if not all(isinstance(f, str) for f in fields):
        return None
    return (received, tuple(fields))


def consensus_verdict(signatures: Sequence[Any]) -> bool:
    """True (every rank keeps its KV) when all signatures are equal, else False (all drop).

    Signatures may arrive as lists after a trip through a codec; a malformed one counts as a
    disagreement. An empty sequence is a local misuse (ConfigError): a group has >= 1 rank.
    """
    if len(signatures) == 0:
        raise ConfigError("consensus_verdict needs at least one signature")
    normal = [_normalise(s) for s in signatures]
    if any(n is None for n in normal):
        return False
    return all(n == normal[0] for n in normal)


def needs_consensus(role: ReceiveRole, tp_group_size: int, is_dummy: bool, receiving: bool) -> bool:
    """Whether the TP group runs the consensus exchange for this request.

    Only LOCAL ranks of a TP group of size > 1, for a real (non-dummy) request on a receiving
    config. Every input is the same on all ranks of a TP group, so the answer is too: the
    exchange is skipped identically everywhere.
    """
    if not isinstance(role, ReceiveRole):
        raise ConfigError(f"role must be a ReceiveRole, got {role!r}")
    check_int("tp_group_size", tp_group_size, 1, RoutingError)
    return role is ReceiveRole.LOCAL and tp_group_size > 1 and not is_dummy and bool(receiving)
