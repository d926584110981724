"""vllm-omni's connector names in kvferry's managers (issue 22, item 1; docs/compat.md).

The rule under test: kvferry's own names build kvferry's connectors; vllm-omni's names
(``REFERENCE_CONNECTORS``) build vllm-omni's own class through its factory, with the config
vllm-omni's manager would give it, when ``vllm_omni`` is importable; otherwise, and for unknown
names, building a manager fails at once with a ConfigError naming ``connector_config.type`` and
the names that can be served. The real vllm-omni is used in tests/engines/reference/.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest

from kvferry.app.compat import OmniKVCacheConfig, OmniKVTransferManager
from kvferry.app.manager import KVTransferManager
from kvferry.app.registry import (
    REFERENCE_CONNECTORS,
    ConnectorRegistry,
    reference_connector_config,
)
from kvferry.app.wiring import build_manager
from kvferry.core.errors import ConfigError

VLLM_OMNI_HERE = importlib.util.find_spec("vllm_omni") is not None
needs_no_vllm_omni = pytest.mark.skipif(VLLM_OMNI_HERE, reason="vllm_omni is importable in this environment")

SPEC = {"block_ids": [3, 1, 5], "seq_len": 10}


class StoreConnector:
    """Stands in for a vllm-omni connector class: put/get/cleanup/health/close over a dict."""

    def __init__(self, store: dict[str, Any]) -> None:
        self.store = store

    def put(self, from_stage: Any, to_stage: Any, put_key: str, data: Any) -> Any:
        self.store[put_key] = bytes(data)
        return True, len(data), None

    def get(self, from_stage: Any, to_stage: Any, get_key: str, metadata: Any = None) -> Any:
        data = self.store.pop(get_key, None)
        return None if data is None else (data, len(data))

    def cleanup(self, request_id: str) -> None:
        self.store.pop(request_id, None)

    def health(self) -> dict[str, Any]:
        return {"ok": True}

    def close(self) -> None:
        pass


class FakeReference:
    """A stand-in for vllm-omni's factory: records ``(name, extra)`` and builds a StoreConnector."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, dict[str, Any]]] = []
        self.store: dict[str, Any] = {}

    def __call__(self, name: str, extra: dict[str, Any]) -> StoreConnector:
        self.calls.append((name, extra))
        return StoreConnector(self.store)


def registry_with(reference: Any = None, available: bool = True) -> ConnectorRegistry:
    return ConnectorRegistry(reference_factory=reference or FakeReference(), reference_available=lambda: available)


def omni_dict(role: str, connector: dict[str, Any]) -> dict[str, Any]:
    """One stage's ``omni_kv_config`` as vllm-omni's BAGEL pipeline writes it."""
    if role == "send":
        return {
            "connector_config": connector,
            "omni_from_stage": 0,
            "omni_to_stage": 1,
            "need_send_cache": True,
            "kv_transfer_criteria": {"type": "prefill_finished"},
        }
    return {"connector_config": connector, "stage_id": 1, "engine_input_source": [0], "need_recv_cache": True}


# ------------------------------------------------------------------------------- the table
def test_the_table_names_every_reference_registration_once() -> None:
    # read from vllm-omni 0.30.0's factory (tests/engines/reference compares with the package)
    assert set(REFERENCE_CONNECTORS) == {
        "SharedMemoryConnector",
        "MooncakeTransferEngineConnector",
        "MooncakeStoreConnector",
        "MooncakeConnector",
        "NixlConnector",
        "MoriTransferEngineConnector",
        "YuanrongConnector",
        "YuanrongTransferEngineConnector",
    }
    assert all(entry.name == name for name, entry in REFERENCE_CONNECTORS.items())
    assert {n for n, e in REFERENCE_CONNECTORS.items() if e.transfer_engine} == {
        "MooncakeTransferEngineConnector",
        "MoriTransferEngineConnector",
        "YuanrongTransferEngineConnector",
        "NixlConnector",
    }
    assert REFERENCE_CONNECTORS["MooncakeConnector"].alias_of == "MooncakeStoreConnector"
    assert not set(REFERENCE_CONNECTORS) & set(ConnectorRegistry().available())  # never shadows kvferry's


def test_served_by_says_whose_class_builds_a_name() -> None:
    here, absent = registry_with(available=True), registry_with(available=False)
    assert here.served_by("shm") == absent.served_by("shm") == "kvferry"
    assert here.served_by("SharedMemoryConnector") == "vllm-omni"
    assert absent.served_by("SharedMemoryConnector") == "none"
    assert here.served_by("carrier-pigeon") == "none"
    assert here.servable()[:5] == ("memory", "mooncake", "nixl", "shm", "zmq") and "NixlConnector" in here.servable()
    assert absent.servable() == ("memory", "mooncake", "nixl", "shm", "zmq")


# --------------------------------------------------------------------- building by the name
def test_a_reference_name_builds_the_reference_class_with_its_config() -> None:
    reference = FakeReference()
    conn = registry_with(reference).create({"type": "SharedMemoryConnector", "shm_threshold_bytes": 65536})
    assert isinstance(conn, StoreConnector)
    assert reference.calls == [("SharedMemoryConnector", {"shm_threshold_bytes": 65536})]  # no "type", as vllm-omni


@pytest.mark.parametrize("name", sorted(n for n, e in REFERENCE_CONNECTORS.items() if e.transfer_engine))
def test_transfer_engine_names_get_stages_role_and_the_ranks_port(name) -> None:
    reference = FakeReference()
    registry = registry_with(reference)
    base = {"type": name, "zmq_port": 50051, "host": "127.0.0.1"}
    sender = KVTransferManager(
        OmniKVCacheConfig(
            connector_config=dict(base), from_stage=0, to_stage=1, need_send_cache=True
        ).to_transfer_config({}),
        tp_rank=1,
        tp_size=2,
        connector_factory=registry.create,
    )
    receiver = KVTransferManager(
        OmniKVCacheConfig(connector_config=dict(base), stage_id=1, need_recv_cache=True).to_transfer_config({}),
        connector_factory=registry.create,
    )
    assert sender.send_connector() is not None and receiver.recv_connector() is not None
    (_, sent), (_, got) = reference.calls
    # the sender's own port: base + 100 + rank*16 + stage (SPEC 2.3), what vllm-omni's manager gives it
    assert sent == {
        "zmq_port": 50051 + 100 + 16,
        "host": "127.0.0.1",
        "from_stage": "0",
        "to_stage": "1",
        "role": "sender",
    }
    assert got["role"] == "receiver" and got["from_stage"] == "0" and got["to_stage"] == "1"
    assert got.get("zmq_port") == (None if name == "NixlConnector" else 50051)  # NIXL would listen on it


def test_other_names_pass_their_config_unchanged() -> None:
    cfg = {"type": "SharedMemoryConnector", "zmq_port": 50051}
    out = reference_connector_config(cfg, role="sender", from_stage=0, to_stage=1, sender_port=50151)
    assert out == cfg and out is not cfg
    kvf = reference_connector_config({"type": "shm"}, role="sender", from_stage=0, to_stage=1, sender_port=50151)
    assert kvf == {"type": "shm"}


def test_kv_moves_between_managers_configured_by_a_reference_name(kit, fake_time) -> None:
    """The same deploy config on both stages; the KV that arrives is the sender's."""
    reference = FakeReference()
    registry = registry_with(reference)
    model = kit.PagedModel()
    connector = {"type": "SharedMemoryConnector"}
    options: dict[str, Any] = dict(
        tp_rank=0, tp_size=1, env={}, clock=fake_time, sleep=fake_time.sleep, connector_factory=registry.create
    )
    with (
        OmniKVTransferManager(OmniKVCacheConfig(**_fields(omni_dict("send", connector))), **options) as s,
        OmniKVTransferManager(OmniKVCacheConfig(**_fields(omni_dict("recv", connector))), **options) as r,
    ):
        assert s.handle_finished_requests_kv_transfer({"r1": SPEC}, model.rank_cache(), model.block_size, "float32")
        assert [o.ok for o in s.last_send_outcomes] == [True]
        data, size = r.receive_kv_cache_for_request("r1")
        assert data is not None and size > 0
        kit.assert_kv_equal(data, *model.expected(SPEC["block_ids"], SPEC["seq_len"]))
        other_keys, _ = kit.PagedModel(seed=1).expected(SPEC["block_ids"], SPEC["seq_len"])
        assert not kit.bits_equal(data["layer_blocks"]["key_cache"][0], other_keys[0])  # the data was used
    assert [name for name, _ in reference.calls] == ["SharedMemoryConnector", "SharedMemoryConnector"]


def _fields(d: dict[str, Any]) -> dict[str, Any]:
    return {
        "connector_config": d["connector_config"],
        "from_stage": d.get("omni_from_stage"),
        "to_stage": d.get("omni_to_stage"),
        "stage_id": d.get("stage_id"),
        "engine_input_source": d.get("engine_input_source", []),
        "need_send_cache": d.get("need_send_cache", False),
        "need_recv_cache": d.get("need_recv_cache", False),
    }


# ----------------------------------------------------------------------- failing at start
@needs_no_vllm_omni
@pytest.mark.parametrize("role", ["send", "recv"])
def test_without_vllm_omni_a_reference_name_fails_at_start(role) -> None:
    omni = omni_dict(role, {"type": "SharedMemoryConnector"})
    model_config = type("ModelConfig", (), {"omni_kv_config": omni})()
    for build in (
        lambda: OmniKVTransferManager.from_od_config(model_config, env={}),
        lambda: OmniKVTransferManager.from_vllm_config(object(), model_config, env={}),
        lambda: build_manager(omni, env={}),
    ):
        with pytest.raises(ConfigError) as caught:
            build()
        message = str(caught.value)
        assert "connector_config.type 'SharedMemoryConnector'" in message
        assert "vllm_omni is not importable" in message and "available: memory, mooncake, nixl, shm, zmq" in message


@pytest.mark.parametrize("role", ["send", "recv"])
def test_an_unknown_name_fails_at_start_naming_the_key(role) -> None:
    omni = omni_dict(role, {"type": "CarrierPigeonConnector"})
    with pytest.raises(ConfigError, match=r"CarrierPigeonConnector.*connector_config\.type.*available: memory"):
        OmniKVTransferManager.from_od_config(type("ModelConfig", (), {"omni_kv_config": omni})(), env={})
    with pytest.raises(ConfigError, match=r"connector_config\.type"):
        build_manager(omni, env={})


def test_an_unservable_name_is_not_checked_where_the_engine_gives_the_connector(kit) -> None:
    omni = omni_dict("send", {"type": "SharedMemoryConnector"})
    conn = StoreConnector({})
    manager = OmniKVTransferManager.from_od_config(
        type("ModelConfig", (), {"omni_kv_config": omni})(), env={}, connector=conn, tp_rank=0, tp_size=1
    )
    assert manager.connector is conn
    manager.close()


def test_a_stage_that_moves_no_kv_is_not_checked() -> None:
    quiet = {"connector_config": {"type": "CarrierPigeonConnector"}, "omni_from_stage": 0, "omni_to_stage": 1}
    manager = OmniKVTransferManager.from_od_config(type("ModelConfig", (), {"omni_kv_config": quiet})(), env={})
    manager.close()
