"""Distribution corner cases: the object fallback and counting consensus drops."""

from __future__ import annotations

import threading
import types

import pytest
import torch

from kvferry.adapters.collectives import InProcessWorld
from kvferry.app import distribute
from kvferry.app.compat import OmniKVCacheConfig, OmniKVTransferManager
from kvferry.app.manager import KVCache, StageGroups
from kvferry.app.registry import create_connector
from kvferry.core.errors import ConfigError
from kvferry.core.outcomes import ReceiveKind


def _run_ranks(n: int, fn, timeout: float = 20.0) -> dict[int, object]:
    results: dict[int, object] = {}
    errors: list[BaseException] = []

    def body(rank: int) -> None:
        try:
            results[rank] = fn(rank)
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    assert not any(t.is_alive() for t in threads), "a rank hung"
    assert not errors, errors
    return results


def test_unpackable_fields_travel_through_the_object_fallback() -> None:
    """When packing fails, followers still get the KV (and its tensors) as a data-only object."""
    kv = KVCache([torch.arange(12, dtype=torch.float32).reshape(3, 2, 2)], [torch.ones(3, 2, 2)])
    # integer map keys: msgpack carries them, the side-payload packer refuses them
    fields = {"past_key_values": kv, "kv_metadata": {"seq_len": 3}, "cfg_branch_map": {1: "cfg_text"}}
    with pytest.raises(ConfigError):
        distribute.pack_request_kv(fields)
    world = InProcessWorld(3)

    def rank(r: int):
        got = distribute.broadcast_fields(
            world.group(r), fields if r == 0 else None, 0, timeout_s=10, request_id="req", kv_factory=KVCache
        )
        return got

    out = _run_ranks(3, rank)
    for r in (1, 2):
        got = out[r]
        assert isinstance(got["past_key_values"], KVCache)
        assert torch.equal(got["past_key_values"].key_cache[0], kv.key_cache[0])
        assert torch.equal(got["past_key_values"].value_cache[0], kv.value_cache[0])
        assert got["kv_metadata"] == {"seq_len": 3}
        assert got["cfg_branch_map"] == {1: "cfg_text"}


def test_consensus_drop_is_counted_as_its_own_outcome() -> None:
    """A rank that received but whose TP peer missed reports DROPPED_BY_CONSENSUS (SPEC 9.1)."""
    conn = create_connector({"type": "memory"})
    sender_cfg = OmniKVCacheConfig(
        connector_config={"type": "memory"}, from_stage=0, to_stage=1, need_send_cache=True, from_tp=2, to_tp=2
    )
    cache = [torch.randn(2, 8, 4, 2, 4)]
    # only sender rank 0 sends: receiver rank 1's key never arrives
    sender = OmniKVTransferManager(sender_cfg, connector=conn, tp_rank=0, tp_size=2)
    sender.handle_finished_requests_kv_transfer({"r": {"block_ids": [1, 2], "seq_len": 6}}, cache, 4, "float32")
    world = InProcessWorld(2)
    recv_cfg = OmniKVCacheConfig(
        connector_config={"type": "memory"},
        stage_id=1,
        engine_input_source=[0],
        need_recv_cache=True,
        recv_timeout=0.3,
        from_tp=2,
        to_tp=2,
    )

    def rank(r: int):
        g = world.group(r)
        m = OmniKVTransferManager(recv_cfg, connector=conn, tp_rank=r, tp_size=2, groups=StageGroups(world=g, tp=g))
        req = types.SimpleNamespace(request_id="r", sampling_params=types.SimpleNamespace())
        ok = m.receive_multi_kv_cache_distributed(req)
        return ok, m.last_receive_outcome.kind, m.counters.get("recv.dropped_by_consensus"), req.past_key_values

    out = _run_ranks(2, rank)
    assert out[0][0] is False and out[1][0] is False
    assert out[0][1] is ReceiveKind.DROPPED_BY_CONSENSUS and out[0][2] == 1
    assert out[1][1] is ReceiveKind.TIMED_OUT and out[1][2] == 0
    assert out[0][3] is None and out[1][3] is None
    conn.close()
