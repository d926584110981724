"""Connectors written for the reference, plugged into kvferry unchanged (issue: drop-in).

What such a connector is handed by ``put`` (one bytes payload; a device uint8 tensor when it
says ``supports_raw_data`` and the KV is on a device; never kvferry's frames) and what its
``get`` may return (bytes-like, uint8 tensors, pool buffers, an already-decoded payload dict).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kvferry.app.compat import KVCacheTransferData, OmniKVCacheConfig, OmniKVTransferManager
from kvferry.app.manager import KVTransferManager
from kvferry.core.outcomes import ReceiveKind
from kvferry.core.ports import FramesPut

SPEC = {"block_ids": [3, 1, 5], "seq_len": 10}
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


class DictConnector:
    """A connector as the reference's tests write them: put/get over a dict, nothing else."""

    def __init__(self, transform: Any = None) -> None:
        self.store: dict[str, Any] = {}
        self.transform = transform or (lambda data: data)

    def put(self, from_stage: Any, to_stage: Any, put_key: str, data: Any) -> Any:
        self.store[put_key] = data
        return True, len(data) if isinstance(data, bytes) else 1, None

    def get(self, from_stage: Any, to_stage: Any, get_key: str, metadata: Any = None) -> Any:
        if get_key not in self.store:
            return None
        data = self.store.pop(get_key)
        return self.transform(data), 1


class RawDataConnector(DictConnector):
    supports_raw_data = True


def sender(kit, connector: Any, fake_time) -> OmniKVTransferManager:
    return OmniKVTransferManager(
        kit.sender_config(), connector=connector, tp_rank=0, tp_size=1, env={}, clock=fake_time, sleep=fake_time.sleep
    )


def receiver(kit, connector: Any, fake_time) -> OmniKVTransferManager:
    return OmniKVTransferManager(
        kit.receiver_config(recv_timeout=1.0),
        connector=connector,
        tp_rank=0,
        tp_size=1,
        env={},
        clock=fake_time,
        sleep=fake_time.sleep,
    )


def test_the_protocol_marks_kvferrys_connectors_only(memory_connector) -> None:
    assert isinstance(memory_connector, FramesPut)
    assert not isinstance(DictConnector(), FramesPut) and not isinstance(RawDataConnector(), FramesPut)


def test_a_reference_connector_gets_one_bytes_payload(kit, fake_time) -> None:
    model = kit.PagedModel()
    conn = DictConnector()
    with sender(kit, conn, fake_time) as s:
        assert s.handle_finished_requests_kv_transfer({"r1": SPEC}, model.rank_cache(), model.block_size, "float32")
    [(key, data)] = conn.store.items()
    assert key == "omni_0_to_1_kv_cache_r1" and type(data) is bytes
    decoded = KVCacheTransferData.from_bytes(data)
    kit.assert_kv_equal(decoded, *model.expected(SPEC["block_ids"], SPEC["seq_len"]))


def test_kvferrys_own_connector_keeps_frames(kit, memory_connector, fake_time) -> None:
    """The control: a FramesPut connector is given the frames (header + tensor views)."""
    model = kit.PagedModel()
    spy = kit.SpyConnector(memory_connector)
    with sender(kit, spy, fake_time) as s:
        s.handle_finished_requests_kv_transfer({"r1": SPEC}, model.rank_cache(), model.block_size, "float32")
    [(_, data)] = spy.puts
    assert isinstance(data, list) and len(data) > 1


def test_raw_data_connector_gets_bytes_for_cpu_kv(kit, fake_time) -> None:
    """The reference's ``to_gpu_tensor`` fails without device tensors and falls back to bytes."""
    model = kit.PagedModel()
    conn = RawDataConnector()
    with sender(kit, conn, fake_time) as s:
        s.handle_finished_requests_kv_transfer({"r1": SPEC}, model.rank_cache(), model.block_size, "float32")
    [data] = conn.store.values()
    assert type(data) is bytes


@CUDA
def test_raw_data_connector_gets_one_device_tensor(kit, fake_time) -> None:
    model = kit.PagedModel()
    conn = RawDataConnector()
    cache = [t.cuda() if isinstance(t, torch.Tensor) else tuple(x.cuda() for x in t) for t in model.rank_cache()]
    with sender(kit, conn, fake_time) as s:
        s.handle_finished_requests_kv_transfer({"r1": SPEC}, cache, model.block_size, "float32")
    [data] = conn.store.values()
    assert isinstance(data, torch.Tensor) and data.device.type == "cuda" and data.dtype == torch.uint8
    assert data.dim() == 1
    decoded = KVCacheTransferData.from_bytes(data.cpu().numpy().tobytes())
    kit.assert_kv_equal(decoded, *model.expected(SPEC["block_ids"], SPEC["seq_len"]))


@pytest.mark.parametrize(
    "transform",
    [
        lambda b: b,
        bytearray,
        memoryview,
        lambda b: torch.frombuffer(bytearray(b), dtype=torch.uint8),
        KVCacheTransferData.from_bytes,  # the connector decoded it itself
    ],
    ids=["bytes", "bytearray", "memoryview", "uint8-tensor", "decoded-dict"],
)
def test_receive_accepts_what_the_reference_accepts(kit, fake_time, transform) -> None:
    model = kit.PagedModel()
    conn = DictConnector(transform)
    with sender(kit, conn, fake_time) as s:
        s.handle_finished_requests_kv_transfer({"r1": SPEC}, model.rank_cache(), model.block_size, "float32")
    with receiver(kit, conn, fake_time) as r:
        data, size = r.receive_kv_cache_for_request("r1")
    assert data is not None and size == 1
    kit.assert_kv_equal(data, *model.expected(SPEC["block_ids"], SPEC["seq_len"]))


def test_a_decoded_dict_is_used_as_is(kit, fake_time) -> None:
    marker = torch.arange(6, dtype=torch.float32).reshape(3, 2, 1)
    decoded = {"request_id": "r1", "layer_blocks": {"key_cache": [marker], "value_cache": [marker + 1]}}
    conn = DictConnector()
    conn.store["omni_0_to_1_kv_cache_r1"] = decoded
    with receiver(kit, conn, fake_time) as r:
        data, _ = r.receive_kv_cache_for_request("r1")
    assert data is decoded and data["layer_blocks"]["key_cache"][0] is marker
    assert data["block_ids"] == [] and data["metadata"] == {}


@pytest.mark.parametrize("bad", [{"request_id": "r1"}, {"request_id": "r1", "layer_blocks": {"key_cache": 3}}])
def test_a_dict_without_layer_lists_is_a_decode_failure(kit, fake_time, bad) -> None:
    conn = DictConnector()
    conn.store["omni_0_to_1_kv_cache_r1"] = bad
    with receiver(kit, conn, fake_time) as r:
        assert r.receive_kv_cache_for_request("r1") == (None, 0)
        assert r.last_receive_outcome.kind is ReceiveKind.DECODE_FAILED


def test_typed_manager_gives_the_same_to_a_reference_connector(kit, fake_time) -> None:
    """Not only compat: kvferry's typed manager hands such a connector bytes too."""
    model = kit.PagedModel()
    conn = DictConnector()
    m = KVTransferManager(kit.sender_config(), connector=conn, clock=fake_time, sleep=fake_time.sleep)
    [outcome] = m.send_requests({"r1": SPEC}, model.rank_cache(), model.block_size, "float32")
    assert outcome.ok and type(next(iter(conn.store.values()))) is bytes
    assert isinstance(OmniKVCacheConfig(), OmniKVCacheConfig)
