"""SPEC 3.2 / 6: a request's KV fields packed for collectives (msgpack side bytes + KV blobs)."""

from __future__ import annotations

import random
import struct

import msgpack
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvferry.adapters.side_codec import KVCacheLists, pack_request_kv, unpack_request_kv
from kvferry.adapters.torch_frames import TORCH_DTYPES, decode_payload, encode_bytes
from kvferry.core.errors import ConfigError, PayloadError
from kvferry.core.side_payload import SENDER_FAILED_MESSAGE, split_side_payload


def tensor(dtype_name: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    n = int(torch.tensor(shape, dtype=torch.int64).prod().item()) if shape else 1
    raw = torch.randint(0, 256, (n * TORCH_DTYPES[dtype_name].itemsize,), dtype=torch.uint8, generator=gen)
    return (
        raw.view(TORCH_DTYPES[dtype_name]).reshape(shape) if n else torch.empty(shape, dtype=TORCH_DTYPES[dtype_name])
    )


def join(frames) -> bytes:
    return b"".join(frames)


def same(a, b) -> bool:
    """Structural equality: tensors bit for bit, tuples read back as lists, KV objects by lists."""
    if isinstance(a, torch.Tensor):
        return (
            isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))
        )
    if isinstance(a, KVCacheLists):
        return isinstance(b, KVCacheLists) and same(a.key_cache, b.key_cache) and same(a.value_cache, b.value_cache)
    if isinstance(a, (list, tuple)):
        return isinstance(b, list) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return a == b and type(a) is type(b)


tensors = st.builds(
    tensor, st.sampled_from(sorted(TORCH_DTYPES)), st.lists(st.integers(0, 3), max_size=3).map(tuple), st.integers(0, 9)
)
kv_layers = st.lists(st.one_of(st.none(), tensors), max_size=4)
# SPEC 3.1 carries num_layers = len(key_cache) value slots, so the value list matches its length
_pair = lambda k, v: (k, (v + [None] * len(k))[: len(k)])  # noqa: E731
kv_objects = st.builds(lambda k, v: KVCacheLists(*_pair(k, v)), kv_layers, kv_layers)
kv_dicts = st.builds(lambda k, v: dict(zip(("key_cache", "value_cache"), _pair(k, v))), kv_layers, kv_layers)
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**64 - 1),
    st.floats(allow_nan=False),
    st.text(max_size=8),
    st.binary(max_size=8),
)
values = st.recursive(
    st.one_of(scalars, tensors, kv_objects, kv_dicts, st.sampled_from(list(TORCH_DTYPES.values()))),
    lambda inner: (
        st.lists(inner, max_size=3) | st.tuples(inner, inner) | st.dictionaries(st.text(max_size=5), inner, max_size=3)
    ),
    max_leaves=6,
)


@settings(max_examples=80, deadline=None)
@given(st.dictionaries(st.text(max_size=10), values, max_size=5), st.one_of(st.none(), kv_objects))
def test_fields_round_trip(fields: dict, primary) -> None:
    if primary is not None:
        fields = {**fields, "past_key_values": primary}
    out = unpack_request_kv(join(pack_request_kv(fields)))
    assert same(fields, out)


def _cfg_fields() -> dict:
    primary = KVCacheLists([tensor("bfloat16", (4, 2, 8), 1), None], [tensor("bfloat16", (4, 2, 8), 2), None])
    branch = KVCacheLists([tensor("bfloat16", (3, 2, 8), 3)], [tensor("bfloat16", (3, 2, 8), 4)])
    return {
        "kv_metadata": {"seq_len": 4, "tp_head_slice": {"applied": True}},
        "cfg_kv_roles": ["cfg_text"],
        "cfg_text_past_key_values": branch,
        "cfg_active_branch": "cfg_text",
        "past_key_values": primary,
    }


def test_primary_kv_is_the_first_blob_in_the_reference_format() -> None:
    fields = _cfg_fields()
    packed = join(pack_request_kv(fields, request_id="req-9"))
    side, blob = split_side_payload(packed)
    doc = msgpack.unpackb(side, raw=False, ext_hook=lambda code, raw: (code, raw))
    first = doc["blobs"][0]
    p = fields["past_key_values"]
    assert bytes(blob[:first]) == encode_bytes("req-9", p.key_cache, p.value_cache, [], {})
    assert decode_payload(blob[:first]).request_id == "req-9"
    assert doc["fields"]["past_key_values"] == (1, struct.pack(">I", 0))  # a placeholder, not data
    assert len(side) < 300  # the side bytes stay small: the KV travels as blobs


@pytest.mark.parametrize("kind", ["bytes", "cpu_tensor", "frames"])
def test_inputs_and_zero_copy(kind: str) -> None:
    fields = _cfg_fields()
    frames = pack_request_kv(fields)
    joined = bytearray(join(frames))
    source = {"bytes": joined, "cpu_tensor": torch.frombuffer(joined, dtype=torch.uint8), "frames": frames}[kind]
    out = unpack_request_kv(source)
    assert same(fields, out)
    if kind != "frames":
        base = torch.frombuffer(joined, dtype=torch.uint8).data_ptr()
        k = out["past_key_values"].key_cache[0]
        assert base <= k.data_ptr() < base + len(joined)  # a view of the received buffer


@pytest.mark.parametrize(
    "raw", [b"", SENDER_FAILED_MESSAGE, struct.pack(">i", -5) + b"xx", torch.empty(0, dtype=torch.uint8)]
)
def test_sender_failed_unpacks_to_none(raw) -> None:
    assert unpack_request_kv(raw) is None


def test_values_the_codec_cannot_carry_are_config_errors_naming_the_field() -> None:
    with pytest.raises(ConfigError, match=r"meta\.when"):
        pack_request_kv({"meta": {"when": object()}})
    with pytest.raises(ConfigError, match="msgpack"):
        pack_request_kv({"big": 2**70})
    with pytest.raises(ConfigError, match="non-string key"):
        pack_request_kv({"meta": {1: 2}})
    with pytest.raises(ConfigError, match="past_key_values"):
        pack_request_kv({"past_key_values": KVCacheLists(["not a tensor"], [])})
    with pytest.raises(ConfigError, match="deeper"):
        deep: list = []
        for _ in range(40):
            deep = [deep]
        pack_request_kv({"deep": deep})


def _side(doc, blob: bytes = b"") -> bytes:
    side = msgpack.packb(doc, use_bin_type=True)
    return struct.pack(">i", len(side)) + side + blob


@pytest.mark.parametrize(
    "raw",
    [
        b"\x00\x00\x00\x02\xc1\xc1",
        _side([1, 2]),
        _side({"v": 2, "blobs": [], "fields": {}}),
        _side({"v": 1, "blobs": [3], "fields": {}}),
        _side({"v": 1, "blobs": [-1], "fields": {}}, b""),
        _side({"v": 1, "blobs": [], "fields": []}),
        _side({"v": 1, "blobs": [], "fields": {"a": msgpack.ExtType(99, b"")}}),
        _side({"v": 1, "blobs": [], "fields": {"a": msgpack.ExtType(1, b"\x00\x00\x00\x00")}}),
        _side({"v": 1, "blobs": [], "fields": {"a": msgpack.ExtType(4, b"float128")}}),
        _side({"v": 1, "blobs": [], "fields": {"a": msgpack.ExtType(4, b"\xff")}}),
        _side({"v": 1, "blobs": [5], "fields": {"a": msgpack.ExtType(3, b"\x00\x00\x00\x00")}}, b"12345"),
        torch.zeros(2, 2, dtype=torch.uint8),
    ],
)
def test_malformed_side_payloads_raise_payload_error(raw) -> None:
    with pytest.raises(PayloadError):
        unpack_request_kv(raw)


def test_mutations_give_only_payload_error_or_a_miss() -> None:
    rng = random.Random(3)
    packed = join(pack_request_kv(_cfg_fields()))
    side_end = 4 + struct.unpack(">i", packed[:4])[0]
    outcomes = {"ok": 0, "miss": 0, "error": 0}
    for i in range(500):
        mutated = bytearray(packed[: rng.randrange(len(packed))] if i % 5 == 0 else packed)
        if i % 5:
            mutated[rng.randrange(side_end + 64)] = rng.getrandbits(8)
        try:
            out = unpack_request_kv(bytes(mutated))
        except PayloadError:
            outcomes["error"] += 1
            continue
        outcomes["miss" if out is None else "ok"] += 1
    assert outcomes["error"] > 200, outcomes


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_device_buffer_unpacks_on_the_device() -> None:
    fields = _cfg_fields()
    packed = torch.frombuffer(bytearray(join(pack_request_kv(fields))), dtype=torch.uint8).cuda()
    out = unpack_request_kv(packed)
    assert out["past_key_values"].key_cache[0].is_cuda
    assert same(fields["past_key_values"].key_cache[0], out["past_key_values"].key_cache[0].cpu())
    assert unpack_request_kv(torch.frombuffer(bytearray(SENDER_FAILED_MESSAGE), dtype=torch.uint8).cuda()) is None
