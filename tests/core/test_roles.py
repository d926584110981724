"""SPEC 6: receive roles, distribution plans, world layout, CFG payload plans, consensus."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvferry.core.errors import ConfigError, RoutingError
from kvferry.core.roles import (
    CfgAssignment,
    DistributionKind,
    GroupLayout,
    ReceiveRole,
    cfg_payload_plan,
    consensus_signature,
    consensus_verdict,
    distribution_plan,
    needs_consensus,
    order_branch_roles,
    receive_role,
    tp_active,
)

PROPERTY = settings(max_examples=100, deadline=None)
L, LD, F = ReceiveRole.LOCAL, ReceiveRole.LEADER, ReceiveRole.FOLLOWER

# ---------------------------------------------------------------------------------------------
# The SPEC 6 table, row by row:
# (world_size, world_rank, groups, from_tp, to_tp, tp_size, cfg_size, cfg_rank, sp_size, sp_rank)
ROLE_TABLE = [
    # world size 1 -> LOCAL whatever else holds
    ((1, 0, True, 2, 4, 1, 1, 0, 1, 0), L),
    ((1, 0, True, 1, 1, 1, 1, 0, 1, 0), L),
    # groups not initialised -> LOCAL
    ((8, 3, False, 2, 2, 2, 2, 1, 2, 1), L),
    ((4, 0, False, 1, 1, 1, 1, 0, 1, 0), L),
    # TP active, no CFG, no SP -> LOCAL
    ((2, 1, True, 2, 2, 2, 1, 0, 1, 0), L),
    ((4, 3, True, 1, 4, 4, 1, 0, 1, 0), L),
    ((4, 3, True, 4, 1, 1, 1, 0, 1, 0), L),
    # TP active via the run-time size (both configured sizes <= 1)
    ((2, 1, True, 1, 1, 2, 1, 0, 1, 0), L),
    ((4, 2, True, 1, 1, 2, 2, 1, 1, 0), F),
    # TP active with CFG or SP -> LEADER iff cfg_rank == 0 and sp_rank == 0
    ((4, 0, True, 2, 2, 2, 2, 0, 1, 0), LD),
    ((4, 1, True, 2, 2, 2, 2, 0, 1, 0), LD),
    ((4, 2, True, 2, 2, 2, 2, 1, 1, 0), F),
    ((4, 1, True, 2, 2, 2, 1, 0, 2, 0), LD),
    ((4, 3, True, 2, 2, 2, 1, 0, 2, 1), F),
    ((8, 5, True, 2, 2, 2, 2, 1, 2, 0), F),
    ((8, 1, True, 2, 2, 2, 2, 0, 2, 0), LD),
    ((8, 3, True, 2, 2, 2, 2, 0, 2, 1), F),
    # TP inactive -> world rank 0 leads
    ((2, 0, True, 1, 1, 1, 2, 0, 1, 0), LD),
    ((2, 1, True, 1, 1, 1, 2, 1, 1, 0), F),
    ((4, 0, True, 1, 1, 1, 1, 0, 4, 0), LD),
    ((4, 3, True, 1, 1, 1, 1, 0, 4, 3), F),
    ((3, 2, True, 1, 1, 1, 1, 0, 1, 0), F),
]


@pytest.mark.parametrize(("args", "expected"), ROLE_TABLE)
def test_role_table(args: tuple, expected: ReceiveRole) -> None:
    assert receive_role(*args) is expected


@pytest.mark.parametrize(
    ("from_tp", "to_tp", "tp_size", "active"),
    [
        (1, 1, 1, False),
        (1, 1, 2, True),
        (2, 1, 1, True),
        (1, 2, 1, True),
        (2, 2, 1, True),
        (1, 1, 8, True),
        (4, 2, 8, True),
    ],
)
def test_tp_active(from_tp: int, to_tp: int, tp_size: int, active: bool) -> None:
    assert tp_active(from_tp, to_tp, tp_size) is active


sizes = st.integers(1, 4)


@st.composite
def stage_layouts(draw: st.DrawFn) -> tuple[GroupLayout, int, int, bool]:
    layout = GroupLayout(draw(sizes), draw(sizes), draw(sizes))
    from_tp = draw(st.sampled_from([1, 2, 4]))
    to_tp = draw(st.sampled_from([1, layout.tp_size]))
    return layout, from_tp, to_tp, draw(st.booleans())


def _roles(layout: GroupLayout, from_tp: int, to_tp: int, groups: bool) -> list:
    out = []
    for r in range(layout.world_size):
        c, s, _ = layout.coords(r)
        out.append(
            distribution_plan(
                layout.world_size,
                r,
                groups,
                from_tp,
                to_tp,
                layout.tp_size,
                layout.cfg_size,
                c,
                layout.sp_size,
                s,
            )
        )
    return out


@PROPERTY
@given(stage_layouts())
def test_every_rank_agrees_on_the_distribution_kind(case: tuple) -> None:
    layout, from_tp, to_tp, groups = case
    plans = _roles(layout, from_tp, to_tp, groups)
    assert len({(p.kind, p.sp_broadcast_after_p2p) for p in plans}) == 1


@PROPERTY
@given(stage_layouts())
def test_leaders_followers_and_local_ranks_partition_the_stage(case: tuple) -> None:
    layout, from_tp, to_tp, groups = case
    plans = _roles(layout, from_tp, to_tp, groups)
    roles = [p.role for p in plans]
    kind = plans[0].kind
    if kind is DistributionKind.NONE:
        assert set(roles) == {L}
    elif kind is DistributionKind.WORLD_BROADCAST:
        # exactly one leader: world rank 0
        assert roles[0] is LD and roles[1:] == [F] * (len(roles) - 1)
    else:
        # one leader per TP rank: the (cfg 0, sp 0) rank of each TP position
        leaders = [r for r, role in enumerate(roles) if role is LD]
        assert leaders == [layout.world_rank(0, 0, t) for t in range(layout.tp_size)]
        assert all(role in (LD, F) for role in roles)
        assert kind is (DistributionKind.TP_CFG if layout.cfg_size > 1 else DistributionKind.TP_SP)
    assert [p.pulls_from_connector for p in plans] == [role is not F for role in roles]


def test_distribution_kinds_named_by_spec() -> None:
    assert distribution_plan(1, 0, True, 2, 2, 2).kind is DistributionKind.NONE
    assert distribution_plan(4, 0, True, 2, 2, 2, 1, 0, 1, 0).kind is DistributionKind.NONE
    p = distribution_plan(8, 0, True, 2, 2, 2, 2, 0, 2, 0)
    assert (p.kind, p.sp_broadcast_after_p2p) == (DistributionKind.TP_CFG, True)
    p = distribution_plan(4, 0, True, 2, 2, 2, 2, 0, 1, 0)
    assert (p.kind, p.sp_broadcast_after_p2p) == (DistributionKind.TP_CFG, False)
    assert distribution_plan(4, 2, True, 2, 2, 2, 1, 0, 2, 1).kind is DistributionKind.TP_SP
    assert distribution_plan(2, 1, True, 1, 1, 1, 2, 1).kind is DistributionKind.WORLD_BROADCAST


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        (dict(world_size=0, world_rank=0), "world_size"),
        (dict(world_size=2, world_rank=2), "world_rank"),
        (dict(world_size=2, world_rank=-1), "world_rank"),
        (dict(world_size=2, world_rank=0, from_tp=0), "from_tp"),
        (dict(world_size=2, world_rank=0, to_tp=-1), "to_tp"),
        (dict(world_size=2, world_rank=0, tp_size=0), "tp_size"),
        (dict(world_size=2, world_rank=0, cfg_size=2, cfg_rank=2), "cfg_rank"),
        (dict(world_size=2, world_rank=0, sp_size=0), "sp_size"),
        (dict(world_size=2, world_rank=0, sp_size=2, sp_rank=5), "sp_rank"),
        (dict(world_size=True, world_rank=0), "world_size"),
    ],
)
def test_invalid_role_arguments_name_the_field(kwargs: dict, field: str) -> None:
    args = dict(groups_initialised=True, from_tp=1, to_tp=1)
    args.update(kwargs)
    with pytest.raises(RoutingError, match=field):
        receive_role(**args)


# ---------------------------------------------------------------------------------------------
# world layout


@PROPERTY
@given(sizes, sizes, sizes)
def test_layout_coords_and_groups(tp: int, sp: int, cfg: int) -> None:
    layout = GroupLayout(tp_size=tp, sp_size=sp, cfg_size=cfg)
    assert layout.world_size == tp * sp * cfg
    for r in range(layout.world_size):
        c, s, t = layout.coords(r)
        assert layout.world_rank(c, s, t) == r
        assert r == ((c * sp) + s) * tp + t
        assert layout.tp_group(r).index(r) == t
        assert layout.sp_group(r).index(r) == s
        assert layout.cfg_group(r).index(r) == c
    for kind, size in (("tp", tp), ("sp", sp), ("cfg", cfg)):
        groups = layout.all_groups(kind)
        flat = [r for g in groups for r in g]
        assert sorted(flat) == list(range(layout.world_size))
        assert all(len(g) == size for g in groups)
        assert list(groups) == sorted(groups)


def test_layout_documented_example() -> None:
    layout = GroupLayout(tp_size=2, sp_size=2, cfg_size=2)
    assert layout.tp_group(5) == (4, 5)
    assert layout.sp_group(5) == (5, 7)
    assert layout.cfg_group(5) == (1, 5)
    assert layout.coords(6) == (1, 1, 0)


def test_layout_rejects_bad_values() -> None:
    with pytest.raises(RoutingError, match="tp_size"):
        GroupLayout(tp_size=0)
    with pytest.raises(RoutingError, match="world_rank"):
        GroupLayout(2, 1, 1).coords(2)
    with pytest.raises(RoutingError, match="tp_rank"):
        GroupLayout(2, 1, 1).world_rank(0, 0, 2)
    with pytest.raises(ConfigError, match="kind"):
        GroupLayout().all_groups("dp")


# ---------------------------------------------------------------------------------------------
# CFG payload plan


def test_cfg_plan_with_roles() -> None:
    roles = ("cfg_text", "cfg_img")
    plan = cfg_payload_plan(3, roles)
    assert plan == (
        CfgAssignment(0, roles),
        CfgAssignment(1, roles, active_branch="cfg_text"),
        CfgAssignment(2, roles, active_branch="cfg_img"),
    )


def test_cfg_plan_without_roles_size_two_copies_primary() -> None:
    assert cfg_payload_plan(2, ()) == (CfgAssignment(0), CfgAssignment(1, copy_of_primary=True))


def test_cfg_plan_without_roles_larger_sizes_leave_none() -> None:
    assert cfg_payload_plan(3, ()) == (CfgAssignment(0), None, None)
    assert cfg_payload_plan(1, ()) == (CfgAssignment(0),)


def test_cfg_plan_more_ranks_than_roles_and_more_roles_than_ranks() -> None:
    assert cfg_payload_plan(4, ("a",)) == (
        CfgAssignment(0, ("a",)),
        CfgAssignment(1, ("a",), active_branch="a"),
        None,
        None,
    )
    assert cfg_payload_plan(2, ("a", "b")) == (
        CfgAssignment(0, ("a", "b")),
        CfgAssignment(1, ("a", "b"), active_branch="a"),
    )


@PROPERTY
@given(st.integers(1, 8), st.lists(st.sampled_from("abcdefgh"), unique=True, max_size=8))
def test_cfg_plan_properties(cfg_size: int, roles: list[str]) -> None:
    plan = cfg_payload_plan(cfg_size, roles)
    assert len(plan) == cfg_size
    assert plan[0] == CfgAssignment(0, tuple(roles))
    active = [a.active_branch for a in plan if a is not None and a.active_branch]
    assert active == roles[: cfg_size - 1]  # each branch to at most one rank, in order
    for i, a in enumerate(plan):
        if a is not None:
            assert a.cfg_rank == i and a.branch_roles == tuple(roles)
    copies = [a for a in plan if a is not None and a.copy_of_primary]
    assert len(copies) == (1 if (not roles and cfg_size == 2) else 0)


@pytest.mark.parametrize("bad", ["cfg_text", ["a", "a"], ["", "b"], [None]])
def test_cfg_plan_rejects_bad_roles(bad: object) -> None:
    with pytest.raises(ConfigError, match="branch_roles"):
        cfg_payload_plan(2, bad)  # type: ignore[arg-type]


def test_cfg_plan_rejects_bad_size() -> None:
    with pytest.raises(RoutingError, match="cfg_size"):
        cfg_payload_plan(0, ())


def test_order_branch_roles() -> None:
    assert order_branch_roles(["zeta", "cfg_img"], ["cfg_text", "beta", "cfg_branch"]) == (
        "cfg_text",
        "cfg_img",
        "zeta",
        "beta",
    )
    assert order_branch_roles([], []) == ()
    assert order_branch_roles(["b", "a", "b"]) == ("b", "a")


# ---------------------------------------------------------------------------------------------
# consensus


def test_signature_is_sorted_and_unique() -> None:
    assert consensus_signature(True, ["kv_metadata", "past_key_values", "kv_metadata"]) == (
        True,
        ("kv_metadata", "past_key_values"),
    )
    assert consensus_signature(False, []) == (False, ())
    with pytest.raises(ConfigError, match="received"):
        consensus_signature(1, [])  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="field"):
        consensus_signature(True, [1])  # type: ignore[list-item]


signatures = st.builds(consensus_signature, st.booleans(), st.sets(st.sampled_from(["a", "b", "c"]), max_size=3))


@PROPERTY
@given(st.lists(signatures, min_size=1, max_size=8))
def test_verdict_keeps_only_when_all_equal(sigs: list) -> None:
    assert consensus_verdict(sigs) is (len(set(sigs)) == 1)
    # order of ranks does not matter, and list forms (after a codec) decide the same
    assert consensus_verdict(list(reversed(sigs))) is consensus_verdict(sigs)
    assert consensus_verdict([[s[0], list(s[1])] for s in sigs]) is consensus_verdict(sigs)


def test_one_rank_that_timed_out_makes_everyone_drop() -> None:
    ok = consensus_signature(True, ["past_key_values", "kv_metadata"])
    missed = consensus_signature(False, [])
    assert consensus_verdict([ok, ok, ok, ok]) is True
    assert consensus_verdict([ok, ok, missed, ok]) is False
    assert consensus_verdict([missed, missed]) is True  # all took the no-KV path already


@pytest.mark.parametrize("bad", [None, (True,), ("yes", ()), (True, "ab"), (True, (1,))])
def test_malformed_signature_means_drop(bad: object) -> None:
    ok = consensus_signature(True, ["a"])
    assert consensus_verdict([ok, bad]) is False


def test_verdict_needs_a_signature() -> None:
    with pytest.raises(ConfigError):
        consensus_verdict([])


@pytest.mark.parametrize(
    ("role", "size", "dummy", "receiving", "expected"),
    [
        (L, 2, False, True, True),
        (L, 1, False, True, False),
        (L, 4, True, True, False),
        (L, 4, False, False, False),
        (LD, 4, False, True, False),
        (F, 4, False, True, False),
    ],
)
def test_needs_consensus(role: ReceiveRole, size: int, dummy: bool, receiving: bool, expected: bool) -> None:
    assert needs_consensus(role, size, dummy, receiving) is expected


def test_needs_consensus_rejects_bad_input() -> None:
    with pytest.raises(ConfigError):
        needs_consensus("local", 2, False, True)  # type: ignore[arg-type]
    with pytest.raises(RoutingError, match="tp_group_size"):
        needs_consensus(L, 0, False, True)


def test_full_matrix_is_total() -> None:
    """Every combination in a small grid yields a role or a RoutingError, never anything else."""
    grid = itertools.product(
        [1, 2, 4], [0, 1, 3], [True, False], [1, 2], [1, 2], [1, 2], [1, 2], [0, 1], [1, 2], [0, 1]
    )
    for args in grid:
        try:
            assert isinstance(receive_role(*args), ReceiveRole)
        except RoutingError:
            ws, wr, _, _, _, _, cs, cr, ss, sr = args
            assert wr >= ws or cr >= cs or sr >= ss
