"""SPEC 7 configuration: the omni_kv_config dict, model-config and vllm-config forms."""

from __future__ import annotations

import types

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvferry.core.config import (
    DEFAULT_RECV_TIMEOUT_S,
    TransferConfig,
    connector_config_from_kv_transfer,
    extract_omni_kv_config,
)
from kvferry.core.errors import ConfigError

PROPERTY = settings(max_examples=100, deadline=None)

FULL = {
    "connector_config": {"type": "zmq", "zmq_port": 40000, "nested": {"a": [1, 2]}},
    "omni_from_stage": 0,
    "omni_to_stage": 1,
    "stage_id": 1,
    "engine_input_source": [0],
    "need_send_cache": False,
    "need_recv_cache": True,
    "recv_timeout": 12.5,
    "rank_mapping": {"from_tp": 2, "to_tp": 4},
    "enable_kv_async_prefetch": True,
    "kv_prefetch_min_free_mem_ratio": 0.25,
    "some_engine_key": "ignored",
}


def test_defaults_match_reference_dataclass() -> None:
    cfg = TransferConfig.from_omni_kv_config({})
    assert cfg.reference_fields() == {
        "connector_config": None,
        "from_stage": None,
        "to_stage": None,
        "stage_id": None,
        "engine_input_source": [],
        "need_recv_cache": False,
        "need_send_cache": False,
        "recv_timeout": 30.0,
        "from_tp": 1,
        "to_tp": 1,
        "enable_kv_async_prefetch": False,
        "kv_prefetch_min_free_mem_ratio": 0.0,
    }
    assert cfg.base_port == 50051 and cfg.replica_id == 0
    assert cfg.connector_type is None and not cfg.is_empty
    assert DEFAULT_RECV_TIMEOUT_S == 30.0


def test_every_key_is_read() -> None:
    cfg = TransferConfig.from_omni_kv_config(FULL)
    assert cfg.connector_type == "zmq"
    assert cfg.connector_dict() == FULL["connector_config"]
    assert (cfg.from_stage, cfg.to_stage, cfg.stage_id) == (0, 1, 1)
    assert cfg.engine_input_source == (0,)
    assert (cfg.need_send_cache, cfg.need_recv_cache) == (False, True)
    assert cfg.recv_timeout == 12.5
    assert (cfg.from_tp, cfg.to_tp) == (2, 4)
    assert cfg.enable_kv_async_prefetch is True
    assert cfg.kv_prefetch_min_free_mem_ratio == 0.25
    assert cfg.base_port == 40000


def test_connector_config_is_a_private_read_only_copy() -> None:
    source = {"type": "shm", "nested": {"x": 1}}
    cfg = TransferConfig.from_omni_kv_config({"connector_config": source})
    source["nested"]["x"] = 2
    assert cfg.connector_config["nested"]["x"] == 1
    with pytest.raises(TypeError):
        cfg.connector_config["type"] = "zmq"  # type: ignore[index]
    fresh = cfg.connector_dict()
    fresh["nested"]["x"] = 3
    assert cfg.connector_config["nested"]["x"] == 1
    assert TransferConfig.from_omni_kv_config({"connector_config": {}}).connector_config is None


@pytest.mark.parametrize(
    ("change", "key"),
    [
        ({"connector_config": "zmq"}, "connector_config"),
        ({"connector_config": {"zmq_port": 1}}, "connector_config.type"),
        ({"connector_config": {"type": ""}}, "connector_config.type"),
        ({"connector_config": {"type": 3}}, "connector_config.type"),
        ({"connector_config": {"type": "zmq", "zmq_port": 0}}, "connector_config.zmq_port"),
        ({"connector_config": {"type": "zmq", "zmq_port": "abc"}}, "connector_config.zmq_port"),
        ({"connector_config": {"type": "zmq", "zmq_port": 70000}}, "connector_config.zmq_port"),
        ({"connector_config": {"type": "zmq", "zmq_port": "${UNSET_PORT_VAR}"}}, "UNSET_PORT_VAR"),
        ({"omni_from_stage": 1.5}, "omni_from_stage"),
        ({"omni_from_stage": True}, "omni_from_stage"),
        ({"omni_from_stage": -1}, "omni_from_stage"),
        ({"omni_to_stage": [1]}, "omni_to_stage"),
        ({"omni_to_stage": " "}, "omni_to_stage"),
        ({"stage_id": {}}, "stage_id"),
        ({"engine_input_source": 0}, "engine_input_source"),
        ({"engine_input_source": "0"}, "engine_input_source"),
        ({"engine_input_source": [0, None]}, r"engine_input_source\[1\]"),
        ({"engine_input_source": [2.0]}, r"engine_input_source\[0\]"),
        ({"need_send_cache": "yes"}, "need_send_cache"),
        ({"need_send_cache": 1}, "need_send_cache"),
        ({"need_recv_cache": "false"}, "need_recv_cache"),
        ({"recv_timeout": -1}, "recv_timeout"),
        ({"recv_timeout": "30"}, "recv_timeout"),
        ({"recv_timeout": float("nan")}, "recv_timeout"),
        ({"recv_timeout": float("inf")}, "recv_timeout"),
        ({"recv_timeout": True}, "recv_timeout"),
        ({"rank_mapping": [2, 4]}, "rank_mapping"),
        ({"rank_mapping": {"from_tp": 0}}, "rank_mapping.from_tp"),
        ({"rank_mapping": {"from_tp": "two"}}, "rank_mapping.from_tp"),
        ({"rank_mapping": {"to_tp": -2}}, "rank_mapping.to_tp"),
        ({"rank_mapping": {"to_tp": 2.5}}, "rank_mapping.to_tp"),
        ({"rank_mapping": {"to_tp": True}}, "rank_mapping.to_tp"),
        ({"enable_kv_async_prefetch": "on"}, "enable_kv_async_prefetch"),
        ({"kv_prefetch_min_free_mem_ratio": 1.5}, "kv_prefetch_min_free_mem_ratio"),
        ({"kv_prefetch_min_free_mem_ratio": -0.1}, "kv_prefetch_min_free_mem_ratio"),
        ({"kv_prefetch_min_free_mem_ratio": "0.1"}, "kv_prefetch_min_free_mem_ratio"),
    ],
)
def test_invalid_values_name_the_key(change: dict, key: str) -> None:
    with pytest.raises(ConfigError, match=key):
        TransferConfig.from_omni_kv_config({**FULL, **change})


def test_non_mapping_config_is_an_error() -> None:
    with pytest.raises(ConfigError, match="omni_kv_config"):
        TransferConfig.from_omni_kv_config(["not", "a", "dict"])  # type: ignore[arg-type]


def test_lenient_forms_the_reference_accepted() -> None:
    cfg = TransferConfig.from_omni_kv_config(
        {
            "rank_mapping": {"from_tp": "2", "to_tp": " 4 "},
            "recv_timeout": 0,
            "omni_from_stage": "llm",
            "omni_to_stage": "dit",
            "rank_mapping_extra": 1,
            "need_send_cache": None,
            "recv_timeout_extra": None,
            "rank_mapping ": None,
        }
    )
    assert (cfg.from_tp, cfg.to_tp, cfg.recv_timeout) == (2, 4, 0.0)
    assert cfg.send_stages == ("llm", "dit")
    assert TransferConfig.from_omni_kv_config({"rank_mapping": None}).from_tp == 1
    assert TransferConfig.from_omni_kv_config({"recv_timeout": None}).recv_timeout == 30.0


def test_base_port_and_replica_come_from_the_env_passed_in() -> None:
    env = {"KV_BASE_PORT": "46000", "VLLM_OMNI_REPLICA_ID": "3"}
    cfg = TransferConfig.from_omni_kv_config({"connector_config": {"type": "zmq", "zmq_port": "${KV_BASE_PORT}"}}, env)
    assert (cfg.base_port, cfg.replica_id) == (46000, 3)
    for raw in ("-2", "x", ""):
        assert TransferConfig.from_omni_kv_config({}, {"VLLM_OMNI_REPLICA_ID": raw}).replica_id == 0
    assert TransferConfig.from_omni_kv_config({"connector_config": {"type": "shm"}}).base_port == 50051


@pytest.mark.parametrize(
    ("d", "expected"),
    [
        ({"engine_input_source": [3, 1], "stage_id": 5, "omni_from_stage": 0}, 3),
        ({"engine_input_source": [], "stage_id": 5, "omni_from_stage": 0}, 4),
        ({"stage_id": "5", "omni_from_stage": 0}, 0),
        ({"stage_id": "dit", "omni_from_stage": "llm"}, "llm"),
        ({}, None),
    ],
)
def test_recv_from_stage(d: dict, expected: object) -> None:
    assert TransferConfig.from_omni_kv_config(d).recv_from_stage == expected


def test_send_and_recv_stages() -> None:
    cfg = TransferConfig.from_omni_kv_config(FULL)
    assert cfg.send_stages == ("0", "1")
    assert cfg.recv_stages == ("0", "1")
    assert TransferConfig.from_omni_kv_config({"omni_from_stage": 0}).send_stages == (None, None)
    assert TransferConfig.from_omni_kv_config({"stage_id": 0}).recv_stages == ("-1", "0")
    assert TransferConfig.from_omni_kv_config({"omni_from_stage": 2}).recv_stages == (None, None)


@PROPERTY
@given(st.integers(1, 16), st.integers(1, 16), st.integers(1, 16))
def test_effective_tp(from_tp: int, to_tp: int, detected: int) -> None:
    cfg = TransferConfig.from_omni_kv_config({"rank_mapping": {"from_tp": from_tp, "to_tp": to_tp}})
    got = cfg.effective_tp(detected)
    if from_tp == 1 and to_tp == 1:
        assert got == (detected, detected)
    else:
        assert got == (from_tp, to_tp)


def test_effective_tp_rejects_bad_detected_size() -> None:
    with pytest.raises(ConfigError, match="detected_tp_size"):
        TransferConfig().effective_tp(0)


@pytest.mark.parametrize(
    ("change", "collector", "expected"),
    [
        ({}, False, True),
        ({}, True, False),
        ({"need_recv_cache": False}, False, False),
        ({"enable_kv_async_prefetch": False}, False, False),
        ({"connector_config": {"type": "shm", "memory_pool_device": "cuda:0"}}, False, False),
        ({"connector_config": {"type": "shm", "memory_pool_device": "CPU"}}, False, True),
    ],
)
def test_async_prefetch_force_disabled(change: dict, collector: bool, expected: bool) -> None:
    cfg = TransferConfig.from_omni_kv_config({**FULL, **change})
    assert cfg.async_prefetch(has_cfg_collector=collector) is expected


def test_notes_flag_incoherent_configs() -> None:
    assert TransferConfig.from_omni_kv_config(FULL).notes() == ()
    notes = TransferConfig.from_omni_kv_config({"need_send_cache": True}).notes()
    assert any("omni_from_stage" in n for n in notes) and any("connector_config" in n for n in notes)
    assert TransferConfig.empty("nothing here").notes() == ("KV transfer disabled: nothing here",)


def test_direct_construction_validates() -> None:
    cfg = TransferConfig(from_stage=0, to_stage=1, from_tp=2, engine_input_source=[0])
    assert cfg.engine_input_source == (0,)
    assert cfg == TransferConfig(from_stage=0, to_stage=1, from_tp=2, engine_input_source=(0,))
    hash(cfg)
    for kwargs, key in [
        (dict(from_tp=0), "from_tp"),
        (dict(from_tp="2"), "from_tp"),
        (dict(need_recv_cache=None), "need_recv_cache"),
        (dict(base_port=0), "base_port"),
        (dict(base_port="50051"), "base_port"),
        (dict(replica_id=-1), "replica_id"),
        (dict(stage_id=-3), "stage_id"),
        (dict(recv_timeout=-1.0), "recv_timeout"),
        (dict(connector_config={"x": 1}), "connector_config.type"),
    ]:
        with pytest.raises(ConfigError, match=key):
            TransferConfig(**kwargs)


# ---------------------------------------------------------------------------------------------
# model-config and vllm-config forms (duck-typed objects)


def test_from_model_config() -> None:
    model = types.SimpleNamespace(omni_kv_config=FULL)
    assert TransferConfig.from_model_config(model) == TransferConfig.from_omni_kv_config(FULL)
    empty = TransferConfig.from_model_config(types.SimpleNamespace(omni_kv_config="nope"))
    assert empty.is_empty and "omni_kv_config" in empty.empty_reason
    assert not empty.need_send_cache and not empty.need_recv_cache
    assert TransferConfig.from_model_config(object()).is_empty
    assert extract_omni_kv_config(model) is FULL
    assert extract_omni_kv_config(None) is None


def test_from_vllm_config_prefers_the_model_config() -> None:
    model = types.SimpleNamespace(omni_kv_config=FULL)
    vllm = types.SimpleNamespace(kv_transfer_config=types.SimpleNamespace(omni_connector_config={"type": "shm"}))
    assert TransferConfig.from_vllm_config(vllm, model).connector_type == "zmq"


@pytest.mark.parametrize(
    "kv_transfer",
    [
        types.SimpleNamespace(omni_connector_config={"type": "shm", "size": 1}),
        types.SimpleNamespace(
            omni_connector_config={}, kv_connector_extra_config={"omni_connector_config": {"type": "shm", "size": 1}}
        ),
        types.SimpleNamespace(kv_connector_extra_config={"omni_connector_config": {"type": "shm", "size": 1}}),
        {"omni_connector_config": {"type": "shm", "size": 1}},
    ],
)
def test_from_vllm_config_kv_transfer_forms(kv_transfer: object) -> None:
    vllm = types.SimpleNamespace(kv_transfer_config=kv_transfer)
    cfg = TransferConfig.from_vllm_config(vllm, types.SimpleNamespace())
    assert cfg.connector_dict() == {"type": "shm", "size": 1}
    assert not cfg.is_empty and cfg.send_stages == (None, None)


@pytest.mark.parametrize(
    "kv_transfer",
    [
        None,
        types.SimpleNamespace(),
        types.SimpleNamespace(omni_connector_config={}),
        types.SimpleNamespace(kv_connector_extra_config={"omni_connector_config": {}}),
        types.SimpleNamespace(kv_connector_extra_config="x"),
    ],
)
def test_from_vllm_config_nothing_configured(kv_transfer: object) -> None:
    cfg = TransferConfig.from_vllm_config(types.SimpleNamespace(kv_transfer_config=kv_transfer), None)
    assert cfg.is_empty and "omni_connector_config" in cfg.empty_reason
    assert connector_config_from_kv_transfer(kv_transfer) is None
