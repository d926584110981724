"""``OmniKVTransferManager``: the reference's manager API (REFERENCE_API.md) over kvferry's.

Constructors, attributes, lazy connector with a remembered failure, sender info written into
``config.connector_config``, the legacy receive entry points and CFG companions via a collector.
"""

from __future__ import annotations

import types
from collections.abc import Iterator
from typing import Any

import pytest

from kvferry.app.compat import KVTPTopology, OmniKVCacheConfig, OmniKVTransferManager
from kvferry.app.compat.kv_utils import clear_parallel_state, set_parallel_state
from kvferry.app.manager import KVCache
from kvferry.core.errors import ConfigError, ConnectorUnavailable
from kvferry.core.outcomes import ReceiveKind, SendReason

SPEC = {"block_ids": [3, 1, 5], "seq_len": 10}
INFO = {"host": "10.0.0.9", "zmq_port": 50151}


def omni_kv_config(**overrides: Any) -> dict[str, Any]:
    d: dict[str, Any] = {
        "connector_config": {"type": "memory"},
        "omni_from_stage": 0,
        "omni_to_stage": 1,
        "stage_id": 1,
        "need_recv_cache": True,
        "need_send_cache": False,
        "recv_timeout": 2.0,
        "rank_mapping": {"from_tp": 2, "to_tp": 4},
    }
    d.update(overrides)
    return d


@pytest.fixture(autouse=True)
def _no_parallel_state() -> Iterator[None]:
    clear_parallel_state()
    yield
    clear_parallel_state()


@pytest.fixture
def compat(kit, fake_time):
    """``compat(connector, config=None, **kwargs)``: a receiving compat manager on the fake clock."""
    made: list[OmniKVTransferManager] = []

    def make(connector: Any = None, config: Any = None, **kwargs: Any) -> OmniKVTransferManager:
        kwargs.setdefault("tp_rank", 0)
        kwargs.setdefault("tp_size", 1)
        m = OmniKVTransferManager(
            config if config is not None else kit.receiver_config(recv_timeout=1.0),
            connector=connector,
            env={},
            clock=fake_time,
            sleep=fake_time.sleep,
            **kwargs,
        )
        made.append(m)
        return m

    yield make
    for m in made:
        m.close()


# ---------------------------------------------------------------------------- constructors
@pytest.mark.parametrize("ctor", ["from_od_config", "from_model_config"])
def test_from_od_config_reads_omni_kv_config(ctor) -> None:
    od = types.SimpleNamespace(omni_kv_config=omni_kv_config())
    with getattr(OmniKVTransferManager, ctor)(od, tp_rank=3, tp_size=4, env={}) as m:
        assert isinstance(m.config, OmniKVCacheConfig)
        assert (m.config.from_stage, m.config.to_stage, m.config.stage_id) == (0, 1, 1)
        assert m.config.need_recv_cache and m.config.recv_timeout == 2.0
        assert (m.config.from_tp, m.config.to_tp) == (2, 4)
        assert m.send_stages == ("0", "1") and m.recv_stages == ("0", "1")
        assert m.tp_topology == KVTPTopology(2, 4, 3)
        for hook in ("kv_send_key_builder", "kv_recv_key_builder", "kv_payload_merger", "kv_payload_slicer"):
            assert getattr(m, hook) is None


@pytest.mark.parametrize(
    "od",
    [
        types.SimpleNamespace(),
        types.SimpleNamespace(omni_kv_config="not a dict"),
        types.SimpleNamespace(omni_kv_config=None),
    ],
    ids=["missing", "string", "none"],
)
def test_from_od_config_without_omni_kv_config_is_an_empty_manager(kit, od) -> None:
    with OmniKVTransferManager.from_od_config(od, tp_rank=0, tp_size=1, env={}) as m:
        assert m.send_stages == (None, None) and m.recv_stages == (None, None)
        assert m.connector is None
        assert m.handle_finished_requests_kv_transfer({"a": SPEC}, [], 4, "float32") == ["a"]
        assert m.receive_kv_cache(kit.make_request("a")) is False
        assert m.receive_kv_cache_for_request("a") == (None, 0)


def test_from_od_config_runtime_tp_size_when_rank_mapping_is_trivial() -> None:
    od = types.SimpleNamespace(omni_kv_config=omni_kv_config(rank_mapping={"from_tp": 1, "to_tp": 1}))
    with OmniKVTransferManager.from_od_config(od, tp_rank=1, tp_size=2, env={}) as m:
        assert m.tp_topology == KVTPTopology(2, 2, 1)


def test_tp_rank_and_size_come_from_the_parallel_state() -> None:
    set_parallel_state(1, 2)
    od = types.SimpleNamespace(omni_kv_config=omni_kv_config(rank_mapping=None))
    with OmniKVTransferManager.from_od_config(od, env={}) as m:
        assert m.tp_topology == KVTPTopology(2, 2, 1)


def test_from_od_config_rejects_invalid_values_naming_the_key() -> None:
    od = types.SimpleNamespace(omni_kv_config=omni_kv_config(rank_mapping={"from_tp": 0, "to_tp": 2}))
    with pytest.raises(ConfigError, match="rank_mapping.from_tp"):
        OmniKVTransferManager.from_od_config(od, tp_rank=0, tp_size=1, env={})


def test_from_vllm_config_prefers_the_model_config() -> None:
    model = types.SimpleNamespace(omni_kv_config=omni_kv_config(stage_id=3, engine_input_source=[2]))
    vllm = types.SimpleNamespace(kv_transfer_config=None)
    with OmniKVTransferManager.from_vllm_config(vllm, model, tp_rank=0, tp_size=1, env={}) as m:
        assert m.recv_stages == ("2", "3")


@pytest.mark.parametrize(
    "kv_transfer",
    [
        {"omni_connector_config": {"type": "memory", "pool_bytes": 4096}},
        types.SimpleNamespace(
            omni_connector_config=None,
            kv_connector_extra_config={"omni_connector_config": {"type": "memory", "pool_bytes": 4096}},
        ),
    ],
    ids=["direct", "extra-config"],
)
def test_from_vllm_config_reads_the_connector_from_kv_transfer_config(kv_transfer) -> None:
    vllm = types.SimpleNamespace(kv_transfer_config=kv_transfer)
    with OmniKVTransferManager.from_vllm_config(vllm, types.SimpleNamespace(), tp_rank=0, tp_size=1, env={}) as m:
        assert m.config.connector_config == {"type": "memory", "pool_bytes": 4096}
        assert m.send_stages == (None, None)


def test_from_vllm_config_with_nothing_is_empty() -> None:
    vllm = types.SimpleNamespace(kv_transfer_config=types.SimpleNamespace(kv_connector_extra_config={}))
    with OmniKVTransferManager.from_vllm_config(vllm, None, tp_rank=0, tp_size=1, env={}) as m:
        assert m.config.connector_config is None and m.recv_stages == (None, None)


def test_constructor_takes_the_reference_config_dataclass(kit, memory_connector, fake_time) -> None:
    config = OmniKVCacheConfig(
        connector_config={"type": "memory"},
        from_stage=0,
        to_stage=1,
        stage_id=1,
        need_recv_cache=True,
        from_tp=1,
        to_tp=1,
    )
    with OmniKVTransferManager(config, connector=memory_connector, tp_rank=0, tp_size=1, env={}) as m:
        assert m.config is config and m.recv_stages == ("0", "1")
        m.update_sender_info(INFO)
        assert config.connector_config["sender_host"] == "10.0.0.9"  # written into the caller's config


# ------------------------------------------------------------------------------ connector
class Factory:
    def __init__(self, result: Any = None, error: BaseException | None = None) -> None:
        self.result, self.error, self.calls = result, error, []

    def __call__(self, config: dict) -> Any:
        self.calls.append(dict(config))
        if self.error is not None:
            raise self.error
        return self.result


def test_connector_is_lazy_and_created_once(kit, compat, memory_connector) -> None:
    spy = kit.SpyConnector(memory_connector)
    factory = Factory(result=spy)
    m = compat(None, connector_factory=factory)
    assert factory.calls == []
    assert m.connector is spy and m.connector is spy
    assert len(factory.calls) == 1 and factory.calls[0]["type"] == "memory"


@pytest.mark.parametrize("sending", [False, True], ids=["receiver", "sender"])
def test_connector_is_none_after_a_failed_creation_and_not_retried(kit, compat, sending) -> None:
    factory = Factory(error=ImportError("No module named 'mooncake'"))
    config = kit.sender_config() if sending else kit.receiver_config()
    m = compat(None, config=config, connector_factory=factory)
    assert m.connector is None and m.connector is None
    if sending:
        assert m.handle_finished_requests_kv_transfer({"a": SPEC, "b": SPEC}, [], 4, "float32") == ["a", "b"]
        assert {o.reason for o in m.last_send_outcomes} == {SendReason.CONNECTOR_UNAVAILABLE}
    else:
        assert m.receive_kv_cache_for_request("a") == (None, 0)
        assert m.last_receive_outcome.kind is ReceiveKind.CONNECTOR_UNAVAILABLE
    assert len(factory.calls) == 1
    assert isinstance(m.manager.connector_failure("sender" if sending else "receiver"), ConnectorUnavailable)


def test_hooks_must_be_callable_and_reach_the_manager(compat, memory_connector) -> None:
    m = compat(memory_connector)

    def hook(*args: Any) -> list:
        return []

    m.kv_recv_key_builder = hook
    assert m.kv_recv_key_builder is hook and m.manager.kv_recv_key_builder is hook
    with pytest.raises(ConfigError):
        m.kv_payload_merger = "not callable"
    m.kv_recv_key_builder = None
    assert m.manager.kv_recv_key_builder is None


# ---------------------------------------------------------------------------- sender info
def test_update_sender_info_writes_rank_adjusted_endpoint_into_connector_config(kit, compat, memory_connector) -> None:
    spy = kit.SenderAwareSpy(memory_connector)
    m = compat(spy, config=kit.receiver_config(2, 4), tp_rank=2, tp_size=4)
    m.update_sender_info({"0": INFO, "5": {"host": "other", "zmq_port": 1}})
    assert m.config.connector_config["sender_host"] == "10.0.0.9"
    assert m.config.connector_config["sender_zmq_port"] == 50151 + 2 * 16
    assert spy.sender_updates == [("10.0.0.9", 50151 + 2 * 16)]
    m.update_sender_info({"0": {"host": "a"}, "5": {"host": "b"}}, sender_stage_id=5)
    assert m.config.connector_config["sender_host"] == "b"


def test_update_sender_info_ignores_unresolved_info(kit, compat, memory_connector) -> None:
    m = compat(memory_connector)
    m.update_sender_info({"1": {"host": "a"}, "2": {"host": "b"}})
    assert "sender_host" not in m.config.connector_config


def test_update_sender_info_is_a_no_op_when_not_receiving(kit, compat, memory_connector) -> None:
    m = compat(memory_connector, config=kit.sender_config())
    m.update_sender_info(INFO)
    assert "sender_host" not in m.config.connector_config


# ------------------------------------------------------------------------------ receiving
def test_receive_kv_cache_applies_the_requests_sender_info(kit, compat, memory_connector) -> None:
    model = kit.PagedModel()
    kit.send_all(model, memory_connector, 1, 1, {"r1": SPEC})
    spy = kit.BlockingSpyConnector(memory_connector)
    m = compat(spy)
    req = kit.make_request("r1", sender_info={"0": {"host": "h0", "zmq_port": 7000}})
    assert m.receive_kv_cache(req) is True
    assert m.config.connector_config["sender_host"] == "h0" and m.config.connector_config["sender_zmq_port"] == 7000
    assert spy.gets[0][1] is None  # stored as the default sender; TP 1/1 gets no metadata (the reference's call)
    keys, values = model.expected(SPEC["block_ids"], SPEC["seq_len"])
    assert all(kit.bits_equal(a, b) for a, b in zip(req.past_key_values.key_cache, keys))
    assert all(kit.bits_equal(a, b) for a, b in zip(req.sampling_params.past_key_values.value_cache, values))
    assert req.kv_metadata["seq_len"] == 10 and req.sampling_params.kv_metadata == req.kv_metadata


def test_receive_kv_cache_false_without_id_or_data(kit, compat, memory_connector, fake_time) -> None:
    m = compat(kit.SpyConnector(memory_connector))
    assert m.receive_kv_cache(kit.make_request(None)) is False
    req = kit.make_request("missing")
    assert m.receive_kv_cache(req) is False and req.past_key_values is None
    assert m.last_receive_outcome.is_timeout and fake_time.elapsed == pytest.approx(1.0)


def test_receive_kv_cache_for_request_returns_dict_and_size(kit, compat, memory_connector) -> None:
    model = kit.PagedModel()
    kit.send_all(model, memory_connector, 1, 1, {"r1": SPEC})
    m = compat(kit.SpyConnector(memory_connector))
    data, size = m.receive_kv_cache_for_request("r1")
    assert set(data) == {"request_id", "layer_blocks", "block_ids", "metadata"}
    assert size == m.last_receive_outcome.nbytes > 0
    assert m.receive_kv_cache_for_request("r1") == (None, 0)  # consumed once
    assert m.counters.get("recv.received") == 1 and m.counters.timeouts == 1


def test_receive_kv_cache_for_request_sender_info_does_not_change_the_stored_one(kit, compat, memory_connector) -> None:
    spy = kit.SpyConnector(memory_connector)
    m = compat(spy, config=kit.receiver_config(recv_timeout=0.0))
    m.update_sender_info(INFO)
    m.receive_kv_cache_for_request("a", sender_info={"host": "per-call", "zmq_port": 6000})
    m.receive_kv_cache_for_request("b")
    # TP 1/1: the per-call sender as metadata; the stored one is the connector's default (None)
    assert [meta and meta["source_host"] for _, meta, _ in spy.gets] == ["per-call", None]
    assert m.config.connector_config["sender_host"] == "10.0.0.9"


def test_apply_kv_cache_to_request(kit) -> None:
    req = kit.make_request("r")
    data = {"layer_blocks": {"key_cache": ["k0"], "value_cache": ["v0"]}, "metadata": {"m": 1}}
    OmniKVTransferManager.apply_kv_cache_to_request(req, data)
    assert req.past_key_values.key_cache == ["k0"] and req.past_key_values.value_cache == ["v0"]
    assert req.kv_metadata == {"m": 1} and req.sampling_params.past_key_values is req.past_key_values


# ---------------------------------------------------------------------------- CFG collector
def _send_with_branch(kit, memory_connector) -> Any:
    model = kit.PagedModel()
    kit.send_all(model, memory_connector, 1, 1, {"r1": SPEC, "r1__cfg_text": {"block_ids": [0], "seq_len": 4}})
    return model


def test_cfg_companions_are_collected_onto_sampling_params(kit, compat, memory_connector) -> None:
    model = _send_with_branch(kit, memory_connector)
    m = compat(kit.BlockingSpyConnector(memory_connector))
    calls: list[tuple] = []

    def collector(rid: str, cfg_ids: list, manager: Any, device: Any) -> dict:
        calls.append((rid, list(cfg_ids), manager, device))
        data, _ = manager.receive_kv_cache_for_request(cfg_ids[0], device)
        blocks = data["layer_blocks"]
        return {
            "cfg_text_past_key_values": KVCache(blocks["key_cache"], blocks["value_cache"]),
            "cfg_text_kv_metadata": data["metadata"],
        }

    req = kit.make_request("r1", cfg_kv_request_ids=["r1__cfg_text"])
    assert m.receive_multi_kv_cache(req, collector, target_device="cpu") is True
    assert calls == [("r1", ["r1__cfg_text"], m, "cpu")]
    branch = req.sampling_params.cfg_text_past_key_values
    assert kit.bits_equal(branch.key_cache[0], model.expected([0], 4)[0][0])
    assert req.sampling_params.cfg_text_kv_metadata["seq_len"] == 4
    assert req.past_key_values is not None


def test_failing_cfg_collector_does_not_fail_the_primary(kit, compat, memory_connector) -> None:
    _send_with_branch(kit, memory_connector)
    m = compat(kit.BlockingSpyConnector(memory_connector))

    def collector(*args: Any) -> dict:
        raise RuntimeError("companion lookup failed")

    req = kit.make_request("r1", cfg_kv_request_ids=["r1__cfg_text"])
    assert m.receive_multi_kv_cache(req, collector) is True
    assert req.past_key_values is not None and not hasattr(req.sampling_params, "cfg_text_past_key_values")


def test_cfg_collector_not_called_without_ids_or_primary(kit, compat, memory_connector) -> None:
    _send_with_branch(kit, memory_connector)
    m = compat(kit.SpyConnector(memory_connector))
    calls: list = []

    def collector(*args: Any) -> dict:
        calls.append(args)
        return {}

    assert m.receive_multi_kv_cache(kit.make_request("r1"), collector) is True  # no cfg ids
    assert m.receive_multi_kv_cache(kit.make_request("absent", cfg_kv_request_ids=["x"]), collector) is False
    assert calls == []


# -------------------------------------------------------------------------------- sending
def test_handle_finished_requests_returns_every_id(kit, compat, memory_connector) -> None:
    model = kit.PagedModel()
    m = compat(memory_connector, config=kit.sender_config())
    finished = {"a": SPEC, "b": {"block_ids": [], "seq_len": 2}, "c": {**SPEC, "custom_metadata": {"x": 1}}}
    assert m.handle_finished_requests_kv_transfer(finished, model.rank_cache(), 4, "float32") == ["a", "b", "c"]
    assert [o.ok for o in m.last_send_outcomes] == [True, False, True]
    assert m.handle_finished_requests_kv_transfer({}, model.rank_cache(), 4, "float32") == []


def test_handle_finished_requests_uses_the_resolver(kit, compat, memory_connector) -> None:
    model = kit.PagedModel()
    m = compat(memory_connector, config=kit.sender_config())
    assert m.handle_finished_requests_kv_transfer(
        {"a": SPEC}, model.rank_cache(), 4, "float32", request_id_resolver=lambda rid: "g-" + rid
    ) == ["a"]
    assert m.last_send_outcomes[0].keys == ("omni_0_to_1_kv_cache_g-a",)


def test_from_vllm_config_keeps_a_named_layout_and_needs_vllm_to_pick_one(caplog: pytest.LogCaptureFixture) -> None:
    """The engine's layout is asked of vLLM (tests/engines/vllm/test_compat_layout.py runs it
    for real); a named ``kv_layout`` wins without asking, and without vLLM the config keeps
    no layout and says why."""
    from types import SimpleNamespace

    from kvferry.app.compat import OmniKVTransferManager
    from kvferry.core.layouts import LayoutSpec

    engine = SimpleNamespace(model_config=SimpleNamespace(), cache_config=SimpleNamespace(block_size=32))
    named = {"connector_config": {"type": "memory"}, "need_send_cache": True, "kv_layout": "flash"}
    m = OmniKVTransferManager.from_vllm_config(engine, SimpleNamespace(omni_kv_config=named), tp_rank=0, tp_size=1)
    assert m.manager.config.kv_layout == LayoutSpec("flash")
    unnamed = {"connector_config": {"type": "memory"}, "need_send_cache": True}
    with caplog.at_level("WARNING"):
        m = OmniKVTransferManager.from_vllm_config(
            engine, SimpleNamespace(omni_kv_config=unnamed), tp_rank=0, tp_size=1
        )
    assert m.manager.config.kv_layout is None
    assert "name kv_layout in omni_kv_config" in caplog.text
