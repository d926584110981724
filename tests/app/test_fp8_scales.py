"""FP8 caches through the manager: bytes bit for bit, scales with them (per layer, per head cut
and merged with the heads, per block), on in-memory connectors."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kvferry.app.manager import KVTransferManager
from kvferry.core.config import TransferConfig

BLOCK, BLOCKS, LAYERS, DIM, HEADS = 4, 6, 2, 8, 4
SPEC = {"block_ids": [4, 1, 2], "seq_len": 10}


def _fp8_cache(seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    shape = (BLOCKS, BLOCK, HEADS, DIM)
    return [
        tuple(torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8).view(torch.float8_e4m3fn) for _ in "kv")
        for _ in range(LAYERS)
    ]


def _head_scale(which: str, layer: int, head: int) -> float:
    return float(torch.tensor(0.01 * (1 + layer) + 0.001 * head + (0.5 if which == "v" else 0), dtype=torch.float32))


def _cfg(role: str, s: int, t: int) -> TransferConfig:
    common: dict[str, Any] = dict(
        connector_config={"type": "memory"},
        from_stage=0,
        to_stage=1,
        from_tp=s,
        to_tp=t,
        num_kv_heads=HEADS,
        kv_layout="tuple",
    )
    if role == "sender":
        return TransferConfig(need_send_cache=True, **common)
    return TransferConfig(need_recv_cache=True, stage_id=1, recv_timeout=2.0, **common)


def _rank_heads(tp: int, rank: int) -> list[int]:
    per = HEADS // tp
    return list(range(rank * per, (rank + 1) * per))


@pytest.mark.parametrize("granularity", ["layer", "head", "block"])
@pytest.mark.parametrize(("s", "t"), [(1, 1), (2, 4), (4, 2), (1, 2)])
def test_fp8_bytes_and_scales_arrive_together(memory_connector_factory, fake_time, granularity, s, t) -> None:
    full = _fp8_cache()
    block_scales = [torch.arange(BLOCKS, dtype=torch.float32) / 7 + layer for layer in range(LAYERS)]
    conn = memory_connector_factory()
    for rank in range(s):
        mine = _rank_heads(s, rank)
        cache = [(k[:, :, mine].contiguous(), v[:, :, mine].contiguous()) for k, v in full]
        if granularity == "layer":
            scales = {"granularity": "layer", "k_scale": [0.25, 0.125], "v_scale": [0.5, 1.5]}
        elif granularity == "head":
            scales = {
                "granularity": "head",
                "k_scale": [[_head_scale("k", ly, h) for h in mine] for ly in range(LAYERS)],
                "v_scale": [[_head_scale("v", ly, h) for h in mine] for ly in range(LAYERS)],
            }
        else:
            scales = {"granularity": "block", "k_scale": block_scales, "v_scale": [b * 2 for b in block_scales]}
        sender = KVTransferManager(
            _cfg("sender", s, t), tp_rank=rank, tp_size=s, connector=conn, clock=fake_time, sleep=fake_time.sleep
        )
        [outcome] = sender.send_requests({"r": SPEC}, cache, BLOCK, "float8_e4m3fn", kv_scales=scales)
        assert outcome.ok, outcome
    for rank in range(t):
        mine = _rank_heads(t, rank)
        receiver = KVTransferManager(
            _cfg("receiver", s, t), tp_rank=rank, tp_size=t, connector=conn, clock=fake_time, sleep=fake_time.sleep
        )
        result = receiver.receive("r")
        assert result.ok, result.outcome
        blocks = result.payload["layer_blocks"]
        for layer, (k, v) in enumerate(full):
            for got, src in ((blocks["key_cache"][layer], k), (blocks["value_cache"][layer], v)):
                want = src[SPEC["block_ids"]].reshape(-1, HEADS, DIM)[: SPEC["seq_len"], mine]
                assert got.dtype == torch.float8_e4m3fn
                assert torch.equal(got.view(torch.uint8), want.contiguous().view(torch.uint8))
        scales = result.kv_scales
        assert scales is not None and scales == result.payload["metadata"]["kv_scales"]
        if granularity == "layer":
            assert scales == {"granularity": "layer", "k_scale": [0.25, 0.125], "v_scale": [0.5, 1.5]}
        elif granularity == "head":  # exactly this rank's heads, bit for bit
            assert scales["k_scale"] == [[_head_scale("k", ly, h) for h in mine] for ly in range(LAYERS)]
            assert scales["v_scale"] == [[_head_scale("v", ly, h) for h in mine] for ly in range(LAYERS)]
        else:  # the request's blocks, in order
            assert scales["k_scale"] == [
                [float(block_scales[ly][b]) for b in SPEC["block_ids"]] for ly in range(LAYERS)
            ]
        result.release()


def test_bad_scales_fail_the_send_naming_the_field(memory_connector, fake_time) -> None:
    sender = KVTransferManager(_cfg("sender", 1, 1), connector=memory_connector, clock=fake_time, sleep=fake_time.sleep)
    cache = _fp8_cache()
    [outcome] = sender.send_requests(
        {"r": SPEC},
        cache,
        BLOCK,
        "float8_e4m3fn",
        kv_scales={"granularity": "layer", "k_scale": [1.0], "v_scale": [1.0]},
    )
    assert not outcome.ok and "kv_scales.k_scale has 1 layers, the cache 2" in outcome.detail
    [outcome] = sender.send_requests(
        {"r": SPEC}, cache, BLOCK, "float8_e4m3fn", kv_scales={"granularity": "block", "k_scale": [[1.0], [1.0]]}
    )
    assert not outcome.ok and "does not cover block ids" in outcome.detail


def _reference_style_decode(raw: bytes) -> tuple[dict[str, Any], dict[str, bytes]]:
    """How the reference's decoder reads a payload (SPEC 3.1): u32 big-endian header length, a
    JSON header, each tensor only through its ``o``/``b`` span; unknown keys ignored."""
    import json
    import struct

    (length,) = struct.unpack(">I", raw[:4])
    header = json.loads(raw[4 : 4 + length])
    data = raw[4 + length :]
    tensors = {d["n"]: data[d["o"] : d["o"] + d["b"]] for d in header["td"] if not d.get("x")}
    return header, tensors


def test_the_reference_decoder_still_reads_an_fp8_payload_with_scales(fake_time) -> None:
    from kvferry.app.registry import create_connector

    conn = create_connector({"type": "memory", "pool_bytes": 8 << 20})
    try:
        full = _fp8_cache(1)
        sender = KVTransferManager(_cfg("sender", 1, 1), connector=conn, clock=fake_time, sleep=fake_time.sleep)
        scales = {"granularity": "layer", "k_scale": [0.1, 0.2], "v_scale": [0.3, 0.4]}
        [outcome] = sender.send_requests({"r": SPEC}, full, BLOCK, "float8_e4m3fn", kv_scales=scales)
        assert outcome.ok
        got = conn.get(from_stage="0", to_stage="1", get_key=outcome.keys[0])
        data, _ = got
        raw = bytes(data.tensor.numpy()) if hasattr(data, "tensor") else bytes(data)
        header, tensors = _reference_style_decode(raw)
        assert header["meta"]["kv_scales"] == {"granularity": "layer", **{k: scales[k] for k in ("k_scale", "v_scale")}}
        want = full[1][0][SPEC["block_ids"]].reshape(-1, HEADS, DIM)[: SPEC["seq_len"]]
        assert tensors["key_cache_1"] == want.contiguous().view(torch.uint8).numpy().tobytes()
        if hasattr(data, "release"):
            data.release()
    finally:
        conn.close()
