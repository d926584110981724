"""The nixl connector's parts that need no agent: config validation, the missing-package error,
the UCX environment rule and the agent exchange's codec (decoding never raises)."""

from __future__ import annotations

import logging
from typing import Any

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvferry.adapters.connectors.nixl.agent import INSTALL_HINT, apply_ucx_env, default_ucx_modules, load_nixl
from kvferry.adapters.connectors.nixl.config import NixlConfig
from kvferry.adapters.connectors.nixl.control import (
    AgentReply,
    AgentRequest,
    decode_reply,
    decode_request,
    encode_reply,
    encode_request,
)
from kvferry.core.control import Rejection
from kvferry.core.errors import ConfigError


def test_defaults_and_keys() -> None:
    cfg = NixlConfig.from_mapping({"type": "nixl", "backend_options": {"num_threads": "2"}})
    assert (cfg.role, cfg.backend, cfg.port, cfg.ucx_tls) == ("sender", "UCX", 0, None)
    assert cfg.backend_options == (("num_threads", "2"),)


@pytest.mark.parametrize(
    ("raw", "key"),
    [
        ({"role": "both"}, "role"),
        ({"port": 70000}, "port"),
        ({"backend": ""}, "backend"),
        ({"backend_options": {"num_threads": 2}}, "backend_options"),
        ({"alignment": 48}, "alignment"),
        ({"transfer_timeout_s": 30.0, "hold_s": 30.0}, "transfer_timeout_s"),
        ({"ucx_tls": 5}, "ucx_tls"),
    ],
)
def test_bad_values_name_their_key(raw: dict, key: str) -> None:
    with pytest.raises(ConfigError, match=key):
        NixlConfig.from_mapping(raw)


def test_missing_nixl_is_a_config_error_naming_the_extra_and_the_cpu_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(__import__("sys").modules, "nixl", None)  # as if not installed
    with pytest.raises(ConfigError) as info:
        load_nixl()
    assert "kvferry[nixl]" in str(info.value) and "--no-deps nixl-cu12==1.5.1 nixl==1.5.1" in str(info.value)
    assert "kvferry[nixl]" in INSTALL_HINT
    from kvferry.adapters.connectors.nixl.connector import NixlConnector

    with pytest.raises(ConfigError, match="kvferry"):
        NixlConnector.from_config({"role": "receiver", "pool_bytes": 4096})


def test_ucx_env_is_set_once_and_a_different_value_is_refused() -> None:
    env: dict[str, str] = {}
    apply_ucx_env("tcp,self", "lo", env, rdma=True)
    assert env == {"UCX_TLS": "tcp,self", "UCX_NET_DEVICES": "lo", "UCX_TCP_CONN_NB": "y"}
    apply_ucx_env("tcp,self", None, env, rdma=True)  # the same value again, or none: fine
    with pytest.raises(ConfigError, match="ucx_tls"):
        apply_ucx_env("rc,self", None, env, rdma=True)
    apply_ucx_env(None, None, env, rdma=True)
    assert env == {"UCX_TLS": "tcp,self", "UCX_NET_DEVICES": "lo", "UCX_TCP_CONN_NB": "y"}


def test_ucx_tcp_connects_without_blocking_unless_the_environment_says_otherwise() -> None:
    env: dict[str, str] = {}
    apply_ucx_env(None, None, env, rdma=True)
    assert env == {"UCX_TCP_CONN_NB": "y"}
    mine = {"UCX_TCP_CONN_NB": "n"}
    apply_ucx_env(None, None, mine, rdma=True)  # the operator's choice wins
    assert mine == {"UCX_TCP_CONN_NB": "n"}


def test_ucx_ib_module_is_left_out_only_without_rdma_devices_and_without_a_choice() -> None:
    assert default_ucx_modules(None, rdma=False) == "^ib"
    assert default_ucx_modules(None, rdma=True) is None
    assert default_ucx_modules("", rdma=False) is None  # "": leave UCX alone
    assert default_ucx_modules("^cuda", rdma=False) == "^cuda"
    env: dict[str, str] = {}
    apply_ucx_env(None, None, env, rdma=False)
    assert env == {"UCX_MODULES": "^ib", "UCX_TCP_CONN_NB": "y"}
    mine = {"UCX_MODULES": "^cma"}
    apply_ucx_env(None, None, mine, rdma=False)  # the environment's choice wins over the default
    assert mine == {"UCX_MODULES": "^cma", "UCX_TCP_CONN_NB": "y"}
    with pytest.raises(ConfigError, match="ucx_modules"):
        apply_ucx_env(None, None, mine, modules="^ib", rdma=False)


def test_agent_exchange_round_trips() -> None:
    assert decode_request(encode_request(AgentRequest(9))) == AgentRequest(9)
    reply = AgentReply(9, "kvferry-sender-1-abc", b"\x00meta\xff")
    assert decode_reply(encode_reply(reply)) == reply
    # a lookup is not an agent request; an agent request is not a reply
    assert decode_request(msgpack.packb({"v": 1, "op": "lookup", "id": 1})) is None
    assert isinstance(decode_reply(encode_request(AgentRequest(1))), Rejection)
    bad = msgpack.packb({"v": 1, "op": "nixl_agent_reply", "id": 1, "agent": "a", "metadata": "text"})
    assert isinstance(decode_reply(bad), Rejection)


@given(st.binary(max_size=256))
def test_decoding_random_bytes_never_raises(raw: bytes) -> None:
    assert decode_request(raw) is None or isinstance(decode_request(raw), AgentRequest)
    assert isinstance(decode_reply(raw), (AgentReply, Rejection))


@pytest.fixture
def nixl_pair() -> Any:
    """``make(pool_bytes)``: a nixl sender and receiver on loopback, closed after the test; the
    test skips naming what is missing when nixl is not installed here."""
    from nixl_support import NIXL_TEST_CONFIG, nixl_missing

    missing = nixl_missing()
    if missing:
        pytest.skip(missing)
    from kvferry.adapters.connectors.nixl.connector import NixlConnector

    made: list[Any] = []

    def make(pool_bytes: int) -> tuple[Any, Any]:
        cfg = {"pool_bytes": pool_bytes, **NIXL_TEST_CONFIG}
        made.append(NixlConnector.from_config({"role": "sender", "port": 0, **cfg}))
        made.append(NixlConnector.from_config({"role": "receiver", **cfg}))
        return made[-2], made[-1]

    yield make
    for connector in reversed(made):
        connector.close()


def test_get_many_reads_every_claimed_payload_in_one_nixl_read(nixl_pair: Any) -> None:
    """The nixl connector's get_many (shared with mooncake): the lookups together, ONE NIXL READ
    request for every claimed payload (the agent's ``reads`` counter), the claims ended together;
    each payload bit-exact, a missing key None, and a get of one key is one READ of its own."""
    sender, receiver = nixl_pair(4 << 20)
    blobs = {f"layer_{i}": bytes([7 * i + 1]) * (4096 + 512 * i) for i in range(8)}
    metas = [sender.put("0", "1", key, blob)[2] for key, blob in blobs.items()]
    warm = receiver.get("0", "1", "layer_0", metas[0])  # the agents meet on the first read
    assert warm is not None and bytes(warm[0].tensor.numpy()) == blobs["layer_0"]
    warm[0].release()
    before = receiver.health()["agent_reads"]
    keys = [*list(blobs)[1:], "absent"]
    got = receiver.get_many("0", "1", keys, metas[0])
    assert receiver.health()["agent_reads"] == before + 1
    assert got[-1] is None and receiver.last_failure("absent") == "not_found"
    for key, one in zip(keys[:-1], got[:-1]):
        assert one is not None and bytes(one[0].tensor.numpy()) == blobs[key], key
        one[0].release()
    assert sender.health()["delivered"] == len(blobs) and sender.health()["used_bytes"] == 0


def test_its_receive_logs_name_nixl(nixl_pair: Any, caplog: pytest.LogCaptureFixture) -> None:
    """The nixl connector receives through the code it shares with mooncake; its log lines name
    nixl, so an operator reading a nixl receiver's log is not sent to mooncake."""
    sender, receiver = nixl_pair(1 << 20)
    ok, _, meta = sender.put("0", "1", "sized", b"1234")
    assert ok
    with caplog.at_level(logging.WARNING, logger="kvferry"):
        assert receiver.get("0", "1", "sized", {**meta, "size": 5}) is None
    assert receiver.last_failure("sized") == "size_mismatch"
    lines = [r.getMessage() for r in caplog.records if "announces" in r.getMessage()]
    assert lines == ["nixl get 'sized': sender announces 4 bytes, put said 5"], lines


def test_a_payload_put_in_pieces_is_read_in_place_and_freed_once() -> None:
    """put_pieces: the header copied into the pool, the rest read where the sender keeps it (a
    registered tensor standing for the KV cache), in the order given, with one NIXL READ. The
    bytes are read at get time, not copied at put time (the control: a byte changed after the
    put arrives changed); on_free comes once, after the reader's Done, or when the lease passes
    unread; a span outside registered memory is a failed put without on_free."""
    import threading

    import torch
    from nixl_support import NIXL_TEST_CONFIG, nixl_missing

    missing = nixl_missing()
    if missing:
        pytest.skip(missing)
    from kvferry.adapters.connectors.nixl.connector import NixlConnector

    cfg = {"pool_bytes": 1 << 20, **NIXL_TEST_CONFIG}
    sender = NixlConnector.from_config({"role": "sender", "port": 0, "lease_s": 2.0, **cfg})
    receiver = NixlConnector.from_config({"role": "receiver", **cfg})
    cache = torch.randint(0, 256, (64, 4096), dtype=torch.uint8)  # 64 "pages" of 4 KiB
    other = torch.zeros(4096, dtype=torch.uint8)  # never registered
    freed: dict[str, int] = {}
    told = {k: threading.Event() for k in ("a", "b", "c")}

    def on_free(key: str):
        def call() -> None:
            freed[key] = freed.get(key, 0) + 1
            told[key].set()

        return call

    try:
        sender.register_memory(cache)
        sender.register_memory(cache[3:5])  # the same storage: registered once
        assert sender.health()["agent_registered_extra"] == 1
        pages = [9, 2, 40, 41, 63, 0]  # out of order, two adjacent
        spans = [(cache[p].data_ptr() + 100, 4096 - 100) for p in pages]
        head = b"HEAD" * 50
        ok, size, meta = sender.put_pieces("0", "1", "a", head, spans, on_free("a"))
        assert ok and size == len(head) + len(pages) * 3996 and meta["size"] == size
        assert len(head) <= sender.health()["used_bytes"] < len(head) + 64  # only the header is in the pool
        cache[40, 100] ^= 0xFF  # after the put, before the get
        want = head + b"".join(bytes(cache[p, 100:].numpy()) for p in pages)
        got = receiver.get("0", "1", "a", meta)
        assert got is not None and got[1] == size and bytes(got[0].tensor.numpy()) == want
        got[0].release()
        assert freed == {"a": 1}  # the get returned once the sender processed its Done
        # get_many of two payloads in pieces: one READ request for both
        ok_b, _, meta_b = sender.put_pieces("0", "1", "b", b"B" * 64, spans[:2], on_free("b"))
        ok_p = sender.put("0", "1", "plain", b"P" * 1000)[0]
        assert ok_b and ok_p
        reads = receiver.health()["agent_reads"]
        many = receiver.get_many("0", "1", ["b", "plain"], meta_b)
        assert receiver.health()["agent_reads"] == reads + 1
        first_two = b"".join(bytes(cache[p, 100:].numpy()) for p in pages[:2])
        assert bytes(many[0][0].tensor.numpy()) == b"B" * 64 + first_two
        assert bytes(many[1][0].tensor.numpy()) == b"P" * 1000
        for one in many:
            one[0].release()
        assert told["b"].wait(5) and freed["b"] == 1
        # never read: freed when the lease passes (the control thread's sweep)
        assert sender.put_pieces("0", "1", "c", b"C" * 64, spans[:1], on_free("c"))[0]
        assert told["c"].wait(10) and freed == {"a": 1, "b": 1, "c": 1}
        assert sender.health()["expired_unread"] == 1 and sender.health()["used_bytes"] == 0
        # memory the agent does not know: refused, nothing published, on_free never called
        bad = sender.put_pieces("0", "1", "d", b"D" * 64, [(other.data_ptr(), 4096)], on_free("d"))
        assert not bad[0] and bad[2]["reason"] == "error" and "registered" in bad[2]["detail"]
        assert sender.health()["used_bytes"] == 0 and "d" not in freed
    finally:
        receiver.close()
        sender.close()
