"""The reference's payload codec, prefetch error and config dataclass (REFERENCE_API "Payload codec")."""

from __future__ import annotations

import dataclasses
import json
import struct
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvferry.adapters.torch_frames import TORCH_DTYPES, encode_bytes
from kvferry.app.compat.codec import KVCacheTransferData, KVPrefetchConsumeError, OmniKVCacheConfig
from kvferry.app.compat.kv_utils import slice_kv_tensor_heads
from kvferry.core.config import TransferConfig
from kvferry.core.errors import KVFerryError, PayloadError, TransferError

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
PROPS = settings(max_examples=30, deadline=None)


def random_tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Arbitrary bit patterns (NaNs, subnormals) of ``dtype``: bit-exactness is what matters."""
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = np.random.default_rng(seed).integers(0, 256, size=nbytes, dtype=np.uint8)
    return torch.from_numpy(raw).view(dtype).reshape(shape) if nbytes else torch.empty(shape, dtype=dtype)


def bits_equal(a: Any, b: Any) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(
            a.contiguous().reshape(-1).view(torch.uint8).cpu(), b.contiguous().reshape(-1).view(torch.uint8).cpu()
        )
    )


def raw_bytes(t: torch.Tensor) -> bytes:
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def reference_encode(
    rid: str,
    keys: list[Any],
    values: list[Any],
    bids: list[int],
    meta: dict,
    *,
    with_i: bool = True,
    extra: dict | None = None,
) -> bytes:
    """The reference's layout, built independently: compact JSON, keys then values, packed."""
    td: list[dict[str, Any]] = []
    chunks: list[bytes] = []
    offset = 0
    for kind, layers in (("key_cache", keys), ("value_cache", values)):
        for i, t in enumerate(layers):
            name = f"{kind}_{i}"
            if t is None:
                td.append({"n": name, "x": True})
                continue
            data = raw_bytes(t)
            desc = {
                "n": name,
                "i": i,
                "d": str(t.dtype).removeprefix("torch."),
                "s": list(t.shape),
                "o": offset,
                "b": len(data),
            }
            if not with_i:
                del desc["i"]
            td.append(desc)
            chunks.append(data)
            offset += len(data)
    header = {"rid": rid, "bids": bids, "meta": meta, "td": td, "nl": len(keys), **(extra or {})}
    text = json.dumps(header, separators=(",", ":")).encode()
    return struct.pack(">I", len(text)) + text + b"".join(chunks)


def sample() -> tuple[list[Any], list[Any]]:
    keys = [random_tensor(torch.bfloat16, (3, 2, 4), 1), None, random_tensor(torch.float16, (5, 1, 2), 2)]
    values = [random_tensor(torch.bfloat16, (3, 2, 4), 3), None, random_tensor(torch.int64, (1, 1, 1), 4)]
    return keys, values


def data(
    keys: list[Any], values: list[Any], rid: str = "req-1", bids: list[int] | None = None, meta: dict | None = None
) -> KVCacheTransferData:
    return KVCacheTransferData(
        rid,
        {"key_cache": keys, "value_cache": values},
        [4, 5] if bids is None else bids,
        meta if meta is not None else {"seq_len": 3, "note": "é"},
    )


# ------------------------------------------------------------------------------------ encoding
def test_is_a_dataclass_and_to_dict_gives_the_fields() -> None:
    keys, values = sample()
    d = data(keys, values)
    assert [f.name for f in dataclasses.fields(d)] == ["request_id", "layer_blocks", "block_ids", "metadata"]
    out = d.to_dict()
    assert set(out) == {"request_id", "layer_blocks", "block_ids", "metadata"}
    assert out["request_id"] == "req-1" and out["layer_blocks"] is d.layer_blocks
    assert out["block_ids"] is d.block_ids and out["metadata"] is d.metadata


def test_to_bytes_is_the_reference_layout_byte_for_byte() -> None:
    keys, values = sample()
    raw = data(keys, values).to_bytes()
    assert isinstance(raw, bytes)
    assert raw == reference_encode("req-1", keys, values, [4, 5], {"seq_len": 3, "note": "é"})


def test_to_bytes_of_sliced_views_and_missing_lists() -> None:
    full = random_tensor(torch.float32, (2, 4, 3), 9)
    part = slice_kv_tensor_heads(full, 1, 2)  # a non-contiguous view, as a fan-out sender sends
    assert not part.is_contiguous()
    raw = KVCacheTransferData("r", {"key_cache": [part]}, [], {}).to_bytes()
    assert raw == reference_encode("r", [part.contiguous()], [], [], {})
    assert KVCacheTransferData("r", {}, [], {}).to_bytes() == reference_encode("r", [], [], [], {})


@pytest.mark.parametrize(
    "blocks,meta",
    [
        ({"key_cache": ["not a tensor"]}, {}),
        ({"key_cache": [torch.zeros(1, 1, 1, dtype=torch.uint16)]}, {}),
        ({"key_cache": [], "value_cache": [torch.zeros(1, 1, 1)]}, {}),
        ({}, {"x": object()}),
        ([1], {}),
    ],
)
def test_to_bytes_rejects_what_it_cannot_encode(blocks: Any, meta: dict) -> None:
    with pytest.raises(ValueError):
        KVCacheTransferData("r", blocks, [], meta).to_bytes()


def test_to_gpu_tensor_needs_a_device_tensor() -> None:
    keys, values = sample()
    with pytest.raises(RuntimeError, match="device"):
        data(keys, values).to_gpu_tensor()


# ------------------------------------------------------------------------------------ decoding
def check_decoded(out: dict, keys: list[Any], values: list[Any], rid: str, bids: list[int], meta: dict) -> None:
    assert set(out) == {"request_id", "layer_blocks", "block_ids", "metadata"}
    assert out["request_id"] == rid and out["block_ids"] == bids and out["metadata"] == meta
    assert type(out["block_ids"]) is list and type(out["metadata"]) is dict
    got_k, got_v = out["layer_blocks"]["key_cache"], out["layer_blocks"]["value_cache"]
    assert type(got_k) is list and len(got_k) == len(keys) and len(got_v) == len(keys)
    for got, want in zip(got_k, keys):
        assert bits_equal(got, want)
    for got, want in zip(got_v, values + [None] * (len(keys) - len(values))):
        assert bits_equal(got, want)


def test_hand_built_reference_payload_decodes() -> None:
    keys, values = sample()
    meta = {"seq_len": 3, "tp_head_slice": {"applied": True, "side": "sender"}}
    for raw in (
        reference_encode("ref", keys, values, [7], meta),
        reference_encode("ref", keys, values, [7], meta, with_i=False),  # older senders
        reference_encode("ref", keys, values, [7], meta, extra={"future": [1]}),
    ):  # unknown keys ignored
        check_decoded(KVCacheTransferData.from_bytes(raw), keys, values, "ref", [7], meta)


def test_fewer_value_layers_decode_as_none() -> None:
    keys = [random_tensor(torch.float32, (1, 2, 2), 5), random_tensor(torch.float32, (1, 2, 2), 6)]
    values = [random_tensor(torch.float32, (1, 2, 2), 7)]
    raw = data(keys, values).to_bytes()
    check_decoded(KVCacheTransferData.from_bytes(raw), keys, values, "req-1", [4, 5], {"seq_len": 3, "note": "é"})


layer = st.one_of(
    st.none(), st.tuples(st.sampled_from(sorted(TORCH_DTYPES)), st.integers(0, 3), st.integers(1, 3), st.integers(1, 3))
)


@PROPS
@given(
    st.lists(st.tuples(layer, layer), max_size=4),
    st.text(max_size=6),
    st.lists(st.integers(0, 2**40), max_size=4),
    st.integers(0, 2**31),
)
def test_round_trip_is_bit_exact(layers: list[tuple[Any, Any]], rid: str, bids: list[int], seed: int) -> None:
    def make(spec: Any, n: int) -> torch.Tensor | None:
        return None if spec is None else random_tensor(TORCH_DTYPES[spec[0]], spec[1:], seed + n)

    keys = [make(k, 2 * i) for i, (k, _) in enumerate(layers)]
    values = [make(v, 2 * i + 1) for i, (_, v) in enumerate(layers)]
    meta = {"seq_len": len(bids), "s": rid}
    raw = data(keys, values, rid, list(bids), meta).to_bytes()
    for form in (raw, bytearray(raw), memoryview(raw)):
        check_decoded(KVCacheTransferData.from_bytes(form), keys, values, rid, list(bids), meta)


def test_decoded_tensors_are_views_of_the_input() -> None:
    t = torch.arange(12, dtype=torch.float32).reshape(2, 3, 2)
    buf = bytearray(data([t], [t + 1]).to_bytes())
    out = KVCacheTransferData.from_bytes(buf)
    key = out["layer_blocks"]["key_cache"][0]
    start = np.frombuffer(buf, dtype=np.uint8).__array_interface__["data"][0]
    assert start <= key.data_ptr() < start + len(buf)
    index = buf.find(raw_bytes(t))
    buf[index : index + 4] = struct.pack("<f", 42.0)  # write through the buffer ...
    assert key[0, 0, 0].item() == 42.0  # ... and the decoded tensor sees it


def test_kvferry_extended_payloads_decode_too() -> None:
    keys, values = sample()
    raw = encode_bytes("k", keys, values, [1], {"a": 1}, align=64, checksums="crc32")
    assert raw != reference_encode("k", keys, values, [1], {"a": 1})
    check_decoded(KVCacheTransferData.from_bytes(raw), keys, values, "k", [1], {"a": 1})


def corrupt_cases() -> list[Any]:
    keys, values = sample()
    good = reference_encode("r", keys, values, [1], {})
    header_len = struct.unpack(">I", good[:4])[0]
    return [
        b"",
        b"\x00\x00",
        b"\xff\xff\xff\xff{}",
        good[:-1],
        good[:10],
        struct.pack(">I", 2) + b"[]",
        struct.pack(">I", 4) + b"nope",
        good[:4] + b"\xff" * header_len + good[4 + header_len :],
        reference_encode("r", [torch.zeros(2)], [], [], {}).replace(b'"d":"float32"', b'"d":"float99"'),
        "a string",
    ]


@pytest.mark.parametrize("raw", corrupt_cases())
def test_malformed_input_raises_payload_error(raw: Any) -> None:
    with pytest.raises(PayloadError):
        KVCacheTransferData.from_bytes(raw)
    assert issubclass(PayloadError, ValueError)


def test_from_bytes_device_on_a_host_tensor() -> None:
    keys, values = sample()
    packed = torch.frombuffer(bytearray(data(keys, values).to_bytes()), dtype=torch.uint8)
    out = KVCacheTransferData.from_bytes_device(packed)
    check_decoded(out, keys, values, "req-1", [4, 5], {"seq_len": 3, "note": "é"})
    key = out["layer_blocks"]["key_cache"][0]
    assert packed.data_ptr() <= key.data_ptr() < packed.data_ptr() + packed.numel()
    assert KVCacheTransferData.from_bytes_gpu is KVCacheTransferData.from_bytes_device
    strided = torch.zeros(2 * packed.numel(), dtype=torch.uint8)
    strided[::2] = packed
    check_decoded(
        KVCacheTransferData.from_bytes_device(strided[::2]), keys, values, "req-1", [4, 5], {"seq_len": 3, "note": "é"}
    )


@pytest.mark.parametrize(
    "bad", [b"bytes", torch.zeros(4, dtype=torch.float32), torch.zeros(2, 2, dtype=torch.uint8), None]
)
def test_from_bytes_device_needs_a_1d_uint8_tensor(bad: Any) -> None:
    with pytest.raises(ValueError, match="1-D uint8"):
        KVCacheTransferData.from_bytes_device(bad)


@CUDA
def test_device_round_trip() -> None:
    keys, values = sample()
    dev_keys = [None if t is None else t.cuda() for t in keys]
    dev_values = [None if t is None else t.cuda() for t in values]
    d = data(dev_keys, dev_values)
    packed = d.to_gpu_tensor()
    assert packed.is_cuda and packed.dtype == torch.uint8 and packed.dim() == 1
    assert bytes(packed.cpu().numpy()) == data(keys, values).to_bytes() == d.to_bytes()
    out = KVCacheTransferData.from_bytes_gpu(packed)
    assert all(t is None or t.is_cuda for t in out["layer_blocks"]["key_cache"])
    check_decoded(out, keys, values, "req-1", [4, 5], {"seq_len": 3, "note": "é"})


# ------------------------------------------------------------------------------- prefetch error
def test_prefetch_consume_error() -> None:
    err = KVPrefetchConsumeError("apply failed", request_id="r1")
    assert isinstance(err, RuntimeError) and isinstance(err, TransferError) and isinstance(err, KVFerryError)
    assert err.request_id == "r1" and str(err) == "apply failed"
    assert KVPrefetchConsumeError().request_id is None
    with pytest.raises(RuntimeError):
        raise KVPrefetchConsumeError("x")


# --------------------------------------------------------------------------------------- config
def test_config_defaults_are_the_references() -> None:
    expected = {
        "connector_config": None,
        "from_stage": None,
        "to_stage": None,
        "stage_id": None,
        "engine_input_source": None,
        "need_recv_cache": False,
        "need_send_cache": False,
        "recv_timeout": 30.0,
        "from_tp": 1,
        "to_tp": 1,
        "enable_kv_async_prefetch": False,
        "kv_prefetch_min_free_mem_ratio": 0.0,
    }
    assert [f.name for f in dataclasses.fields(OmniKVCacheConfig)] == list(expected)
    assert dataclasses.asdict(OmniKVCacheConfig()) == expected
    cfg = OmniKVCacheConfig(from_stage=0, to_stage=1)
    cfg.connector_config = {"type": "zmq"}  # mutable, as the manager needs
    assert cfg.connector_config == {"type": "zmq"}


def full_config() -> OmniKVCacheConfig:
    return OmniKVCacheConfig(
        connector_config={"type": "zmq", "zmq_port": 50100},
        from_stage=0,
        to_stage=1,
        stage_id=1,
        engine_input_source=[0],
        need_recv_cache=True,
        need_send_cache=False,
        recv_timeout=5.0,
        from_tp=2,
        to_tp=4,
        enable_kv_async_prefetch=True,
        kv_prefetch_min_free_mem_ratio=0.25,
    )


def test_to_transfer_config_and_back() -> None:
    cfg = full_config()
    tc = cfg.to_transfer_config(env={})
    assert isinstance(tc, TransferConfig)
    assert (tc.from_stage, tc.to_stage, tc.stage_id, tc.engine_input_source) == (0, 1, 1, (0,))
    assert (tc.from_tp, tc.to_tp, tc.recv_timeout, tc.base_port, tc.replica_id) == (2, 4, 5.0, 50100, 0)
    assert tc.need_recv_cache and not tc.need_send_cache and tc.enable_kv_async_prefetch
    assert tc.kv_prefetch_min_free_mem_ratio == 0.25 and tc.connector_dict() == cfg.connector_config
    back = OmniKVCacheConfig.from_transfer_config(tc)
    assert back == cfg and back.connector_config is not cfg.connector_config
    assert OmniKVCacheConfig.from_transfer_config(OmniKVCacheConfig().to_transfer_config(env={})) == OmniKVCacheConfig()


def test_to_transfer_config_reads_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = full_config()
    cfg.connector_config = {"type": "zmq", "zmq_port": "${KV_BASE_PORT}"}
    monkeypatch.setenv("KV_BASE_PORT", "51000")
    monkeypatch.setenv("VLLM_OMNI_REPLICA_ID", "3")
    tc = cfg.to_transfer_config()  # default: os.environ, read at call time
    assert (tc.base_port, tc.replica_id) == (51000, 3)
    assert cfg.to_transfer_config(env={"KV_BASE_PORT": "52000"}).base_port == 52000
    monkeypatch.delenv("KV_BASE_PORT")
    with pytest.raises(ValueError, match="KV_BASE_PORT"):
        cfg.to_transfer_config()


@pytest.mark.parametrize(
    "change,key",
    [
        ({"from_tp": 0}, "rank_mapping.from_tp"),
        ({"recv_timeout": -1.0}, "recv_timeout"),
        ({"need_recv_cache": "yes"}, "need_recv_cache"),
        ({"kv_prefetch_min_free_mem_ratio": 2.0}, "kv_prefetch_min_free_mem_ratio"),
        ({"connector_config": {"zmq_port": 1}}, "connector_config.type"),
    ],
)
def test_invalid_values_name_the_key(change: dict, key: str) -> None:
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        dataclasses.replace(full_config(), **change).to_transfer_config(env={})
