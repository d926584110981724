"""No silent refusal (issue 22, item 2): a request the sender cannot send is an error in the log
naming the request, the cache shape and the fix, a typed outcome, and a refusal marker under each
of its keys that a kvferry receiver turns into a ``refused`` outcome at once, instead of waiting
out ``recv_timeout`` (docs/wire-format.md, "Refusal marker")."""

from __future__ import annotations

import json
import logging
import struct
import threading
import time
from typing import Any

import torch

from kvferry.app.compat import KVCacheTransferData, OmniKVTransferManager
from kvferry.core.outcomes import ReceiveKind, SendReason
from kvferry.core.refusal import REFUSAL_KEY

#: vLLM CPU's cache shape in small: [blocks, heads, block_size, 2*head_dim], which FlashInfer's
#: and the packed layout fit as well (the issue's [4, 2, 128, 128] at block size 128)
BLOCKS, HEADS, BLOCK, HEAD_DIM, LAYERS = 6, 2, 4, 4, 3
SPEC = {"block_ids": [4, 1], "seq_len": 6}
KEY = "omni_0_to_1_kv_cache_r1"


def ambiguous_cache(seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(BLOCKS, HEADS, BLOCK, 2 * HEAD_DIM, generator=gen) for _ in range(LAYERS)]


def packed_expected(cache: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The packed layout read by hand: K the first half of the last dim, V the second."""
    ids = torch.tensor(SPEC["block_ids"])
    tokens = [c[ids].permute(0, 2, 1, 3).flatten(0, 1)[: SPEC["seq_len"]] for c in cache]
    return [t[..., :HEAD_DIM] for t in tokens], [t[..., HEAD_DIM:] for t in tokens]


def sender(kit, connector: Any, fake_time: Any, **overrides: Any) -> OmniKVTransferManager:
    return OmniKVTransferManager(
        kit.sender_config(**overrides),
        connector=connector,
        tp_rank=0,
        tp_size=1,
        clock=fake_time,
        sleep=fake_time.sleep,
    )


def receiver(
    kit, connector: Any, clock: Any = None, rank: int = 0, to_tp: int = 1, **kwargs: Any
) -> OmniKVTransferManager:
    """A receiving rank with recv_timeout 30 s (``clock``: an injected clock, else the real one)."""
    if clock is not None:
        kwargs.update(clock=clock, sleep=clock.sleep)
    return OmniKVTransferManager(
        kit.receiver_config(1, to_tp, recv_timeout=30.0), connector=connector, tp_rank=rank, tp_size=to_tp, **kwargs
    )


def test_an_ambiguous_cache_is_refused_loudly(kit, memory_connector, fake_time, caplog) -> None:
    with caplog.at_level(logging.ERROR, logger="kvferry"), sender(kit, memory_connector, fake_time) as s:
        processed = s.handle_finished_requests_kv_transfer({"r1": SPEC}, ambiguous_cache(), BLOCK, "float32")
    assert processed == ["r1"]  # processed, so the engine frees the blocks, as the reference does
    [outcome] = s.last_send_outcomes
    assert not outcome.ok and outcome.reason is SendReason.ERROR and outcome.refusal_keys == (KEY,)
    assert "omni_kv_config.kv_layout" in outcome.detail
    [record] = [r for r in caplog.records if r.levelno == logging.ERROR]
    line = record.getMessage()
    for part in ("request r1", "[6, 2, 4, 8] float32", "3 layers", "'flashinfer', 'packed', 'vllm_cpu'"):
        assert part in line, (part, line)
    assert "fix: name the layout: omni_kv_config.kv_layout" in line
    assert s.counters.get("send.failed.error") == 1


def test_a_kvferry_receiver_learns_of_the_refusal_at_once(kit, memory_connector, fake_time) -> None:
    """With recv_timeout 30 s on an injected clock: no poll sleep at all before the refused
    outcome; the control (a request never sent) waits the whole 30 s and times out."""
    store = kit.SpyConnector(memory_connector)  # non-blocking: every wait is a clock sleep
    with sender(kit, store, fake_time) as s:
        s.handle_finished_requests_kv_transfer({"r1": SPEC}, ambiguous_cache(), BLOCK, "float32")
    with receiver(kit, store, fake_time) as r:
        req = kit.make_request("r1")
        assert r.receive_kv_cache(req) is False and req.past_key_values is None
        outcome = r.last_receive_outcome
        assert outcome.kind is ReceiveKind.REFUSED and fake_time.elapsed == 0.0 and fake_time.sleeps == []
        assert "omni_kv_config.kv_layout" in outcome.detail and "error" in outcome.detail
        assert r.counters.get("recv.refused") == 1 and r.counters.errors == 1 and r.counters.timeouts == 0
        assert r.receive_kv_cache(kit.make_request("never-sent")) is False
        assert r.last_receive_outcome.kind is ReceiveKind.TIMED_OUT and fake_time.elapsed >= 30.0
    assert kit.pool_is_empty(memory_connector)  # the marker was read once, like a payload


def test_a_waiting_receiver_returns_long_before_its_deadline(kit, memory_connector) -> None:
    """Real clock, arrival notification: the receiver waits first (recv_timeout 30 s), the
    sender refuses; the receiver returns ``refused`` within a generous 5 s (a liveness bound,
    not a performance claim)."""
    outcome: list[Any] = []
    waiting = threading.Event()

    def receive() -> None:
        with receiver(kit, memory_connector) as r:
            waiting.set()
            r.receive_kv_cache_for_request("r1")
            outcome.append(r.last_receive_outcome)

    thread = threading.Thread(target=receive, name="refused-receiver", daemon=True)
    start = time.monotonic()
    thread.start()
    assert waiting.wait(10.0)
    with OmniKVTransferManager(kit.sender_config(), connector=memory_connector, tp_rank=0, tp_size=1) as s:
        s.handle_finished_requests_kv_transfer({"r1": SPEC}, ambiguous_cache(), BLOCK, "float32")
    thread.join(10.0)
    assert not thread.is_alive()
    assert outcome[0].kind is ReceiveKind.REFUSED
    assert time.monotonic() - start < 5.0 and outcome[0].seconds < 5.0


def test_every_key_of_a_fan_out_is_told(kit, memory_connector, fake_time) -> None:
    with OmniKVTransferManager(
        kit.sender_config(1, 2),
        connector=memory_connector,
        tp_rank=0,
        tp_size=1,
        clock=fake_time,
        sleep=fake_time.sleep,
    ) as s:
        s.handle_finished_requests_kv_transfer({"r1": SPEC}, ambiguous_cache(), BLOCK, "float32")
    assert s.last_send_outcomes[0].refusal_keys == ("r1_0_0_0_0", "r1_0_0_0_1")
    for rank in (0, 1):
        with receiver(kit, memory_connector, fake_time, rank=rank, to_tp=2) as r:
            r.receive_kv_cache_for_request("r1")
            assert r.last_receive_outcome.kind is ReceiveKind.REFUSED
    assert fake_time.sleeps == []


def test_named_layout_control_sends_the_kv(kit, memory_connector, fake_time) -> None:
    """The same cache with its layout named: sent and received bit for bit, no refusal."""
    cache = ambiguous_cache()
    with sender(kit, memory_connector, fake_time, kv_layout="packed") as s:
        s.handle_finished_requests_kv_transfer({"r1": SPEC}, cache, BLOCK, "float32")
    assert s.last_send_outcomes[0].ok and s.last_send_outcomes[0].refusal_keys == ()
    with receiver(kit, memory_connector, fake_time) as r:
        data, _ = r.receive_kv_cache_for_request("r1")
    assert r.last_receive_outcome.kind is ReceiveKind.RECEIVED
    kit.assert_kv_equal(data, *packed_expected(cache))
    other, _ = packed_expected(ambiguous_cache(seed=1))
    assert not kit.bits_equal(data["layer_blocks"]["key_cache"][0], other[0])


def test_the_marker_is_a_header_with_every_layer_absent(kit, fake_time) -> None:
    """What a reference decoder reads: a payload of ``nl`` absent layers (no tensor bytes)
    whose metadata says refused, why, and the fix."""
    store: dict[str, bytes] = {}

    class Bytes:  # a connector written for the reference: it gets one bytes payload
        def put(self, from_stage: Any, to_stage: Any, put_key: str, data: Any) -> Any:
            store[put_key] = data
            return True, len(data), None

        def get(self, from_stage: Any, to_stage: Any, get_key: str, metadata: Any = None) -> Any:
            return None

    with sender(kit, Bytes(), fake_time) as s:
        s.handle_finished_requests_kv_transfer({"r1": SPEC}, ambiguous_cache(), BLOCK, "float32")
    marker = store[KEY]
    (header_len,) = struct.unpack(">I", marker[:4])
    header = json.loads(marker[4 : 4 + header_len])
    assert header["nl"] == LAYERS and all(d.get("x") is True for d in header["td"]) and len(header["td"]) == 2 * LAYERS
    assert not marker[4 + header_len :].strip(b"\0")  # nothing after the header but padding
    decoded = KVCacheTransferData.from_bytes(marker)
    assert decoded["layer_blocks"] == {"key_cache": [None] * LAYERS, "value_cache": [None] * LAYERS}
    record = decoded["metadata"][REFUSAL_KEY]
    assert record["v"] == 1 and record["reason"] == "error"
    assert "[6, 2, 4, 8]" in record["detail"] and "omni_kv_config.kv_layout" in record["fix"]


def test_a_put_that_fails_is_told_where_the_marker_fits(kit, memory_connector_factory, fake_time) -> None:
    """The payload never fits the pool (too_large); the small marker does: the receiver is told."""
    conn = memory_connector_factory(pool_bytes=4096)
    stacked = [torch.randn(2, BLOCKS, BLOCK, HEADS, 64) for _ in range(2)]  # 12 KiB of KV for SPEC
    with sender(kit, conn, fake_time) as s:
        s.handle_finished_requests_kv_transfer({"r1": SPEC}, stacked, BLOCK, "float32")
    [outcome] = s.last_send_outcomes
    assert not outcome.ok and outcome.failed_keys == (KEY,) and outcome.refusal_keys == (KEY,)
    with receiver(kit, conn, fake_time) as r:
        r.receive_kv_cache_for_request("r1")
    assert r.last_receive_outcome.kind is ReceiveKind.REFUSED
    assert outcome.reason.value in r.last_receive_outcome.detail


def test_a_prefetched_refusal_is_not_waited_for_again(kit, memory_connector, fake_time) -> None:
    """The prefetch worker took the marker; consuming answers refused at once, and the
    synchronous fallback does not wait out recv_timeout for a payload that will never come."""
    spy = kit.BlockingSpyConnector(memory_connector)
    with sender(kit, memory_connector, fake_time) as s:
        s.handle_finished_requests_kv_transfer({"r1": SPEC}, ambiguous_cache(), BLOCK, "float32")
    m = receiver(kit, spy, fake_time, async_prefetch=True)
    try:
        m.start_prefetch({"request_id": "r1", "kv_sender_info": {"host": "127.0.0.1", "zmq_port": 50151}})
        assert m.wait_prefetch(10.0)
        req = kit.make_request("r1")
        assert m.consume_and_distribute_kv_cache(req) is False and req.past_key_values is None
        assert m.last_receive_outcome.kind is ReceiveKind.REFUSED
        assert len(spy.gets) == 1 and fake_time.elapsed == 0.0  # the worker's get only; no wait
    finally:
        m.close()


def test_the_log_names_what_the_engine_handed_over() -> None:
    from kvferry.app.refusals import cache_shape, fix_for

    assert (
        cache_shape([torch.zeros(4, 2, 128, 128, dtype=torch.bfloat16)] * 28)
        == "28 layers of [4, 2, 128, 128] bfloat16"
    )
    assert cache_shape([torch.zeros(2, 3), torch.zeros(4)]) == "2 layers of [2, 3] float32 (and 1 other shapes)"
    assert cache_shape({"layer.0": torch.zeros(1, dtype=torch.int8)}) == "1 layer of [1] int8"
    assert cache_shape([(torch.zeros(2), torch.zeros(3))]).startswith("1 layer of ([2] float32, [3] float32)")
    assert cache_shape([]) == "no layers" and "not a list" in cache_shape(None)
    assert "connector_config.pool_bytes" in fix_for(SendReason.POOL_FULL)
    assert "block ids" in fix_for(SendReason.NO_BLOCKS) and "kv_layout" in fix_for(SendReason.NO_PAYLOAD)
