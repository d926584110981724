"""One rule for a rank's connector config: the manager's and the vLLM connector's agree."""

from __future__ import annotations

import pytest

from kvferry.app.manager import KVTransferManager
from kvferry.app.registry import SERVING_CONNECTORS, connector_role_config
from kvferry.app.vllm.params import ConnectorSettings
from kvferry.core.config import TransferConfig


@pytest.mark.parametrize("kind", sorted(SERVING_CONNECTORS))
def test_a_sender_binds_its_rank_port_on_the_host_and_a_receiver_forgets_senders(kind: str) -> None:
    cfg = {"type": kind, "zmq_port": 50051, "sender_host": "h", "sender_port": 9, "port": 1}
    sender = connector_role_config(cfg, role="sender", sender_port=50167, host="127.0.0.2")
    assert sender["role"] == "sender" and sender["port"] == 50167 and sender["host"] == "127.0.0.2"
    assert "zmq_port" not in sender
    receiver = connector_role_config(cfg, role="receiver", sender_port=None, host="127.0.0.2")
    assert receiver["role"] == "receiver"
    assert not {"port", "sender_host", "sender_port", "zmq_port"} & set(receiver)
    assert cfg == {"type": kind, "zmq_port": 50051, "sender_host": "h", "sender_port": 9, "port": 1}  # not modified
    named = connector_role_config({"type": kind, "host": "10.0.0.5"}, role="sender", sender_port=5, host="x")
    assert named["host"] == "10.0.0.5"  # the config's own host wins


def test_other_connectors_pass_unchanged() -> None:
    cfg = {"type": "memory", "shared_name": "s"}
    assert connector_role_config(cfg, role="sender", sender_port=5, host="h") == cfg


@pytest.mark.parametrize("kind", sorted(SERVING_CONNECTORS))
def test_the_manager_and_the_vllm_connector_give_a_prefill_rank_the_same_config(kind: str) -> None:
    """The two ways in (an omni_kv_config, a vLLM extra config) once disagreed on shm's host."""
    settings = ConnectorSettings.from_extra_config({"connector": {"type": kind}, "base_port": 40000})
    vllm_cfg = settings.sender_config(tp_rank=1, tp_size=2)
    config = TransferConfig.from_omni_kv_config(
        {
            "connector_config": {"type": kind, "zmq_port": 40000},
            "omni_from_stage": 0,
            "omni_to_stage": 1,
            "need_send_cache": True,
            "rank_mapping": {"from_tp": 2, "to_tp": 2},
        }
    )
    manager = KVTransferManager(config, tp_rank=1, tp_size=2, bind_host=settings.host)
    manager_cfg = manager._connector_config("sender")
    assert manager_cfg is not None
    for key in ("role", "port", "host", "type"):
        assert vllm_cfg[key] == manager_cfg[key], key
