"""SPEC 2.3: port numbers."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvferry.core.addressing import (
    DEFAULT_BASE_PORT,
    KV_RANK_PORT_STRIDE,
    KV_REPLICA_PORT_STRIDE,
    KV_TRANSFER_PORT_OFFSET,
    MAX_RANK_SLOTS,
    GetSource,
    expand_base_port,
    get_metadata,
    kv_port,
    pull_port,
    replica_id_from_env,
    resolve_get_source,
    sender_endpoint_port,
)
from kvferry.core.errors import ConfigError, RoutingError

PROPERTY = settings(max_examples=150, deadline=None)


def test_reference_constants() -> None:
    assert (KV_TRANSFER_PORT_OFFSET, KV_RANK_PORT_STRIDE, KV_REPLICA_PORT_STRIDE) == (100, 16, 1024)
    assert DEFAULT_BASE_PORT == 50051


@pytest.mark.parametrize(
    ("kwargs", "port"),
    [
        ({}, 50151),
        ({"tp_rank": 1}, 50167),
        ({"replica": 1}, 51175),
        ({"from_stage": 1}, 50152),
        ({"tp_rank": 3, "replica": 2, "from_stage": 2}, 50051 + 100 + 2048 + 48 + 2),
        ({"tp_rank": 1, "dp_rank": 1, "tp_size": 4}, 50051 + 100 + 5 * 16),
        ({"from_stage": "1"}, 50152),
    ],
)
def test_golden_ports(kwargs: dict, port: int) -> None:
    args = {"base_port": 50051, "from_stage": 0, **kwargs}
    assert kv_port(**args) == port


@PROPERTY
@given(
    st.integers(1, 30000),
    st.integers(0, 15),
    st.integers(0, 63),
    st.integers(0, 20),
)
def test_dp_zero_reproduces_the_reference(base: int, stage: int, rank: int, replica: int) -> None:
    expected = base + 100 + replica * 1024 + rank * 16 + stage
    if expected <= 65535:
        assert kv_port(base, stage, rank, replica) == expected
        assert kv_port(base, stage, rank, replica, dp_rank=0, tp_size=64) == expected


@PROPERTY
@given(st.sampled_from([1, 2, 4, 8, 16, 32, 64]), st.integers(1, 10000), st.data())
def test_no_collisions_within_bounds(tp_size: int, base: int, data: st.DataObject) -> None:
    dp_groups = MAX_RANK_SLOTS // tp_size
    combos = data.draw(
        st.lists(
            st.tuples(
                st.integers(0, 3),  # replica
                st.integers(0, dp_groups - 1),  # dp rank
                st.integers(0, tp_size - 1),  # tp rank
                st.integers(0, 15),  # stage
            ),
            min_size=2,
            max_size=40,
            unique=True,
        )
    )
    ports = [kv_port(base, s, r, rep, dp, tp_size) for rep, dp, r, s in combos]
    assert len(set(ports)) == len(ports)


def test_no_collisions_exhaustive_one_replica_window() -> None:
    for tp_size in (1, 2, 8, 64):
        seen = {}
        for dp in range(MAX_RANK_SLOTS // tp_size):
            for rank in range(tp_size):
                for stage in range(16):
                    port = kv_port(50051, stage, rank, 0, dp, tp_size)
                    assert port not in seen, (port, seen.get(port), (dp, rank, stage))
                    seen[port] = (dp, rank, stage)
        assert max(seen) < kv_port(50051, 0, 0, 1)  # never reaches replica 1's window


@PROPERTY
@given(st.integers(0, 63), st.integers(0, 15), st.integers(0, 3), st.integers(0, 3))
def test_endpoint_of_rank_s_is_advertised_plus_stride(rank: int, stage: int, replica: int, dp: int) -> None:
    tp_size = 16
    rank %= tp_size
    advertised = kv_port(50051, stage, 0, replica, dp, tp_size)
    assert sender_endpoint_port(advertised, rank) == kv_port(50051, stage, rank, replica, dp, tp_size)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"from_stage": 16}, "from_stage"),
        ({"from_stage": -1}, "from_stage"),
        ({"from_stage": "llm"}, "from_stage"),
        ({"from_stage": True}, "from_stage"),
        ({"tp_rank": -1}, "tp_rank"),
        ({"tp_rank": 64}, "tp_rank"),
        ({"tp_rank": 4, "tp_size": 4}, "tp_rank"),
        ({"replica": -1}, "replica"),
        ({"replica": 16}, r"^port 66535 is outside"),
        ({"dp_rank": -1}, "dp_rank"),
        ({"dp_rank": 16, "tp_size": 4}, "dp_rank"),
        ({"tp_size": 0}, "tp_size"),
        ({"base_port": 0}, "base_port"),
        ({"base_port": 70000}, "base_port"),
        ({"base_port": 65500}, r"^port 65600 is outside"),
        ({"base_port": "50051"}, "base_port"),
        ({"tp_rank": 1.0}, "tp_rank"),
    ],
)
def test_bad_values_are_rejected_naming_the_field(kwargs: dict, field: str) -> None:
    args = {"base_port": 50051, "from_stage": 0, **kwargs}
    with pytest.raises(RoutingError, match=field):
        kv_port(**args)


def test_sender_endpoint_port() -> None:
    assert sender_endpoint_port(50151, 0) == 50151
    assert sender_endpoint_port(50151, 3) == 50199
    for args, field in (
        ((50151, -1), "source_rank"),
        ((50151, 64), "source_rank"),
        ((0, 0), "advertised_port"),
        ((65530, 1), r"^port 65546 is outside"),
        ((True, 0), "advertised_port"),
    ):
        with pytest.raises(RoutingError, match=field):
            sender_endpoint_port(*args)


@pytest.mark.parametrize(
    ("raw", "replica"),
    [(None, 0), ("", 0), ("3", 3), (" 2 ", 2), ("-1", 0), ("abc", 0), ("1.5", 0), ("0", 0)],
)
def test_replica_id_from_env(raw: str | None, replica: int) -> None:
    assert replica_id_from_env(raw) == replica


@pytest.mark.parametrize(
    ("value", "env", "port"),
    [
        (50051, {}, 50051),
        ("50051", {}, 50051),
        ("${KV_BASE_PORT}", {"KV_BASE_PORT": "6000"}, 6000),
        ("$KV_BASE_PORT", {"KV_BASE_PORT": " 6001 "}, 6001),
        ("${A}${B}", {"A": "60", "B": "02"}, 6002),
        ("5${X}", {"X": "1"}, 51),
    ],
)
def test_expand_base_port(value: object, env: dict, port: int) -> None:
    assert expand_base_port(value, env) == port


@pytest.mark.parametrize(
    ("value", "env", "needle"),
    [
        ("${KV_BASE_PORT}", {}, "KV_BASE_PORT"),
        ("$KV_BASE_PORT", {"OTHER": "1"}, "KV_BASE_PORT"),
        ("${A}${B}", {"A": "1"}, "B"),
        ("${KV", {}, "base_port"),
        ("$", {}, "base_port"),
        ("${}", {}, "base_port"),
        ("abc", {}, "base_port"),
        ("${P}", {"P": "x"}, "base_port"),
        ("0", {}, "base_port"),
        ("65536", {}, "base_port"),
        (-5, {}, "base_port"),
        (True, {}, "base_port"),
        (None, {}, "base_port"),
        ("5.5", {}, "base_port"),
    ],
)
def test_expand_base_port_errors_name_the_variable_or_field(value: object, env: dict, needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        expand_base_port(value, env)


@PROPERTY
@given(st.integers(1, 65535), st.from_regex(r"[A-Z_][A-Z0-9_]{0,8}", fullmatch=True))
def test_expand_round_trip(port: int, name: str) -> None:
    env = {name: str(port)}
    assert expand_base_port("${" + name + "}", env) == port
    assert expand_base_port("$" + name, env) == port
    with pytest.raises(ConfigError, match=name):
        expand_base_port("${" + name + "}", {})


def test_pull_port() -> None:
    assert pull_port(50151, 2, 0) == 50183  # the key's source rank wins
    assert pull_port(50151, None, 0) == 50151  # legacy: homogeneous rule
    assert pull_port(50151, None, 3) == 50199
    with pytest.raises(RoutingError, match="source_rank"):
        pull_port(50151, None, -1)


@given(
    host=st.one_of(st.none(), st.text(min_size=1, max_size=8)),
    port=st.one_of(st.none(), st.integers(1, 60000)),
    from_rank=st.one_of(st.none(), st.integers(0, 63)),
    request_scoped=st.booleans(),
)
def test_get_metadata_is_the_reference_rule(host, port, from_rank, request_scoped) -> None:
    meta = get_metadata(host, port, from_rank, request_scoped=request_scoped)
    builds = from_rank is not None or request_scoped
    if not builds or host is None or port is None:
        assert meta is None
    else:
        assert meta == {"source_host": host, "source_port": port + (from_rank or 0) * 16}


# ------------------------------------------------------------------ the one get-source rule


@settings(max_examples=200, deadline=None)
@given(
    st.sampled_from(["127.0.0.1", "10.0.0.7", "::1", "node-3"]),
    st.integers(1, 50000),
    st.integers(0, 31),
    st.one_of(st.none(), st.tuples(st.sampled_from(["127.0.0.1", "other"]), st.integers(1, 65535))),
)
def test_property_get_metadata_resolves_to_the_rank_it_names(host, advertised, rank, default) -> None:
    """resolve_get_source is the inverse of get_metadata: the sender a receiver is told to ask
    is the one every connector asks, whatever default sender it holds."""
    meta = get_metadata(host, advertised, rank, request_scoped=False)
    source = resolve_get_source(meta, default)
    assert source == GetSource(host, sender_endpoint_port(advertised, rank))
    # the port as a decimal string (partial metadata written by hand) names the same sender
    assert resolve_get_source({"source_host": host, "source_port": str(source.port)}, default) == source


def test_get_source_without_a_port_is_the_default_unless_another_host_is_named() -> None:
    assert resolve_get_source(None, None) is None
    assert resolve_get_source(None, ("h", 9)) == GetSource("h", 9, from_metadata=False)
    assert resolve_get_source({"source_host": "h"}, ("h", 9)) == GetSource("h", 9, from_metadata=False)
    assert resolve_get_source({"source_host": "other"}, ("h", 9)) is None
    assert resolve_get_source({"size": 5}, ("h", 9)) == GetSource("h", 9, 5, from_metadata=False)
    assert resolve_get_source({"source_port": 7}, None, needs_host=False) == GetSource(None, 7)


@pytest.mark.parametrize(
    ("metadata", "field"),
    [
        ({"source_host": "h", "source_port": 0}, "source_port"),
        ({"source_host": "h", "source_port": 70000}, "source_port"),
        ({"source_host": "h", "source_port": True}, "source_port"),
        ({"source_port": 5}, "source_host"),
        ({"source_host": "", "source_port": 5}, "source_host"),
        ({"source_host": "h", "source_port": 5, "size": -1}, "size"),
        (["not", "a", "mapping"], "mapping"),
    ],
)
def test_get_source_names_the_bad_field(metadata, field) -> None:
    with pytest.raises(ConfigError, match=field):
        resolve_get_source(metadata, None)
