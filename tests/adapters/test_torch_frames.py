"""SPEC 3.1 on tensors: bit-exact round trips, reference layout, zero-copy frames and views."""

from __future__ import annotations

import json
import random
import struct
import warnings

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvferry.adapters.connectors.pool_buffer import PooledBuffer
from kvferry.adapters.torch_frames import (
    TORCH_DTYPES,
    decode_payload,
    dest_views,
    dtype_name,
    encode_bytes,
    encode_device_tensor,
    encode_frames,
    finish_payload_in,
    merge_heads,
    merge_layers,
    plan_tensors,
    slice_heads,
    slice_layers,
    write_payload_into,
)
from kvferry.core.errors import ConfigError, PayloadError, RoutingError
from kvferry.core.header import DTYPE_ITEMSIZE

DTYPES = sorted(TORCH_DTYPES)
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def random_tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    """Arbitrary bit patterns (NaNs, subnormals, odd bools) of ``dtype``: bit-exactness matters."""
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    raw = np.random.default_rng(seed).integers(0, 256, size=nbytes, dtype=np.uint8)
    return torch.from_numpy(raw).view(dtype).reshape(shape)


def same_bits(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    if a is None or b is None:
        return a is None and b is None
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


def address(buf) -> int:
    return np.frombuffer(buf, dtype=np.uint8).__array_interface__["data"][0] if len(memoryview(buf)) else 0


class Pool:
    """A pool-buffer stand-in: ``.tensor`` plus an idempotent ``release`` that counts calls."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor, self.released = tensor, 0

    def release(self) -> None:
        self.released += 1


# ----------------------------------------------------------------------------------- dtypes
def test_allow_list_matches_torch_itemsizes() -> None:
    assert set(DTYPES) == set(DTYPE_ITEMSIZE)  # this torch has every allow-listed dtype
    for name, dtype in TORCH_DTYPES.items():
        assert dtype.itemsize == DTYPE_ITEMSIZE[name] and dtype_name(dtype) == name
    with pytest.raises(ConfigError, match="allow-list"):
        dtype_name(torch.uint16)


INPUT_KINDS = [
    "bytes",
    "bytearray",
    "memoryview",
    "cpu_tensor",
    "offset_tensor",
    "pool",
    "tied",
    "tied_offset",
    "frames",
    "rechunked",
]


def as_input(kind: str, encoded, rng: random.Random):
    joined = b"".join(encoded.frames)
    if kind == "bytes":
        return joined
    if kind == "bytearray":
        return bytearray(joined)
    if kind == "memoryview":
        return memoryview(bytearray(joined))
    if kind == "cpu_tensor":
        return torch.frombuffer(bytearray(joined), dtype=torch.uint8)
    if kind == "offset_tensor":  # a slot at an odd offset of a larger buffer: every run misaligned
        return torch.frombuffer(bytearray(b"x" + joined), dtype=torch.uint8)[1:]
    if kind == "pool":
        return Pool(torch.frombuffer(bytearray(joined), dtype=torch.uint8))
    if kind in ("tied", "tied_offset"):  # a pool's tied buffer: the decoder reads its host_bytes
        skip = 1 if kind == "tied_offset" else 0  # at an odd address: every run misaligned
        region = torch.frombuffer(bytearray(b"x" * skip + joined), dtype=torch.uint8)[skip:]
        buffer = PooledBuffer.tied(region, on_release=lambda: None)
        assert buffer.host_bytes is not None and len(buffer.host_bytes) == len(joined)
        return buffer
    if kind == "frames":
        return list(encoded.frames)
    cuts = sorted(rng.sample(range(1, len(joined)), min(6, len(joined) - 1)))
    return [joined[a:b] for a, b in zip([0, *cuts], [*cuts, len(joined)])]


@pytest.mark.parametrize("kind", INPUT_KINDS)
@pytest.mark.parametrize("name", DTYPES)
def test_every_dtype_round_trips_bit_exact(name: str, kind: str) -> None:
    dtype = TORCH_DTYPES[name]
    keys = [random_tensor(dtype, (5, 2, 3), 1), None, random_tensor(dtype, (0, 2, 3), 2)]
    values = [random_tensor(dtype, (5, 2, 3), 3), random_tensor(dtype, (), 4), None]
    for align, checksums in ((1, None), (64, "crc32")):
        encoded = encode_frames("rid-é", keys, values, [4, 2], {"dtype": name}, align=align, checksums=checksums)
        decoded = decode_payload(as_input(kind, encoded, random.Random(align)))
        assert decoded.request_id == "rid-é" and decoded.block_ids == (4, 2) and decoded.num_layers == 3
        assert decoded.metadata == {"dtype": name} and decoded.nbytes == encoded.nbytes
        assert all(same_bits(a, b) for a, b in zip(keys, decoded.key_cache))
        assert all(same_bits(a, b) for a, b in zip(values, decoded.value_cache))


layer = st.one_of(
    st.none(),
    st.tuples(
        st.sampled_from(DTYPES), st.lists(st.integers(0, 4), min_size=1, max_size=3).map(tuple), st.integers(0, 99)
    ),
)


@settings(max_examples=60, deadline=None)
@given(st.lists(layer, max_size=12), st.lists(layer, max_size=12), st.sampled_from([1, 4, 64]), st.randoms())
def test_arbitrary_layer_sets_round_trip_through_any_chunking(keys, values, align, rng) -> None:
    values = values[: len(keys)]
    make = lambda spec: None if spec is None else random_tensor(TORCH_DTYPES[spec[0]], spec[1], spec[2])  # noqa: E731
    k, v = [make(s) for s in keys], [make(s) for s in values]
    encoded = encode_frames("r", k, v, [], {}, align=align)
    joined = b"".join(encoded.frames)
    assert len(joined) == encoded.nbytes == encoded.layout.total_nbytes
    kinds = ("bytes", "cpu_tensor", "offset_tensor", "tied", "tied_offset", "frames", "rechunked")
    for kind in kinds if len(joined) > 1 else ("bytes",):
        decoded = decode_payload(as_input(kind, encoded, rng))
        assert all(same_bits(a, b) for a, b in zip(k, decoded.key_cache))
        expect_v = v + [None] * (len(k) - len(v))
        assert all(same_bits(a, b) for a, b in zip(expect_v, decoded.value_cache))


# ------------------------------------------------------------------- the reference's layout
def reference_layout(rid: str, keys, values, bids, meta) -> bytes:
    """The reference sender's bytes, built independently: compact JSON, packed tensors."""
    descs, blobs, offset = [], [], 0
    for cache, tensors in (("key_cache", keys), ("value_cache", values)):
        for i, t in enumerate(tensors):
            if t is None:
                descs.append({"n": f"{cache}_{i}", "x": True})
                continue
            raw = t.contiguous().view(torch.uint8).numpy().tobytes()
            dtype = str(t.dtype).replace("torch.", "")
            descs.append({"n": f"{cache}_{i}", "i": i, "d": dtype, "s": list(t.shape), "o": offset, "b": len(raw)})
            blobs.append(raw)
            offset += len(raw)
    header = json.dumps({"rid": rid, "bids": bids, "meta": meta, "td": descs, "nl": len(keys)}, separators=(",", ":"))
    body = header.encode("utf-8")
    return struct.pack(">I", len(body)) + body + b"".join(blobs)


def reference_style_decode(raw: bytes) -> dict:
    """What the reference decoder does: read o/b spans, ignore keys it does not know."""
    header_len = struct.unpack(">I", raw[:4])[0]
    header = json.loads(raw[4 : 4 + header_len])
    data = raw[4 + header_len :]
    out = {"key_cache": [None] * header["nl"], "value_cache": [None] * header["nl"]}
    for info in header["td"]:
        if info.get("x"):
            continue
        chunk = bytearray(data[info["o"] : info["o"] + info["b"]])
        t = torch.frombuffer(chunk, dtype=torch.uint8).view(getattr(torch, info["d"])).reshape(info["s"])
        out["key_cache" if info["n"].startswith("key") else "value_cache"][info["i"]] = t
    return out


def _model_like_kv(layers: int = 3, tokens: int = 7):
    keys = [random_tensor(torch.bfloat16, (tokens, 2, 8), i) for i in range(layers)]
    values = [random_tensor(torch.bfloat16, (tokens, 2, 8), 100 + i) for i in range(layers)]
    keys[1] = values[1] = None
    meta = {"block_size": 16, "num_layers": layers, "dtype": "bfloat16", "seq_len": tokens, "name": "ünï"}
    return keys, values, meta


def test_align_1_without_extensions_reproduces_the_reference_bytes() -> None:
    keys, values, meta = _model_like_kv()
    expected = reference_layout("req-1", keys, values, [0, 5, 9], meta)
    assert encode_bytes("req-1", keys, values, [0, 5, 9], meta, align=1, version=False) == expected
    frames = encode_frames("req-1", keys, values, [0, 5, 9], meta, align=1, version=False).frames
    assert b"".join(frames) == expected
    decoded = decode_payload(expected)
    assert all(same_bits(a, b) for a, b in zip(keys, decoded.key_cache))
    ref = decoded.to_reference_dict()
    assert set(ref) == {"request_id", "layer_blocks", "block_ids", "metadata"}
    assert ref["block_ids"] == [0, 5, 9] and ref["metadata"] == meta
    assert isinstance(ref["layer_blocks"]["key_cache"], list) and ref["layer_blocks"]["key_cache"][1] is None


def test_kvferry_extensions_stay_decodable_by_a_reference_style_decoder() -> None:
    keys, values, meta = _model_like_kv()
    raw = encode_bytes("req-1", keys, values, [1], meta, align=64, checksums="crc32", version=True)
    ref = reference_style_decode(raw)
    assert all(same_bits(a, b) for a, b in zip(keys, ref["key_cache"]))
    assert all(same_bits(a, b) for a, b in zip(values, ref["value_cache"]))


def test_frames_concatenate_to_encode_bytes_for_every_alignment() -> None:
    keys, values, meta = _model_like_kv()
    for align in (1, 8, 64, 4096, 8192):
        encoded = encode_frames("r", keys, values, [], meta, align=align)
        assert b"".join(encoded.frames) == encode_bytes("r", keys, values, [], meta, align=align)
        for span in encoded.layout.spans:
            assert span is None or span[0] % align == 0


def test_tensors_numpy_refuses_are_encoded_from_their_values() -> None:
    base = random_tensor(torch.float32, (3, 4), 7)
    cases = {
        "neg bit": (torch._neg_view(base), -base),
        "conj bit": (torch.complex(base, base).conj(), torch.complex(base, -base)),
        "requires grad": (base.clone().requires_grad_(), base),
        "not contiguous": (base.t(), base.t().contiguous()),
        "bf16 not contiguous": (base.bfloat16().t(), base.bfloat16().t().contiguous()),
        "0-d": (base[0, 0], base[0, 0].clone()),
        "empty": (base[:0], base[:0].clone()),
    }
    for name, (tensor, value) in cases.items():
        got = decode_payload(encode_bytes("r", [tensor], [None], [], {})).key_cache[0]
        assert same_bits(got, value.detach().resolve_conj()), name


def test_a_repeated_signature_reuses_its_layout_and_checks_stay() -> None:
    keys, values, meta = _model_like_kv()
    first = encode_frames("a", keys, values, [1], meta)
    again = encode_frames("bb", keys, values, [2, 3], {})
    assert again.layout.header.tensors is first.layout.header.tensors  # planned once
    assert decode_payload(list(again.frames)).request_id == "bb"
    decoded = [decode_payload(b"".join(e.frames)) for e in (first, again)]
    assert all(same_bits(a, b) for a, b in zip(decoded[0].key_cache, decoded[1].key_cache))
    encode_frames("r", keys, values, [], meta, align=1)
    for bad in (True, 3, 1.0):  # not mistaken for a cached align=1
        with pytest.raises(ConfigError, match="align"):
            encode_frames("r", keys, values, [], meta, align=bad)
    with pytest.raises(ConfigError, match="tensors or None"):
        encode_frames("r", [keys[0], "x"], [], [], {})
    with pytest.raises(ConfigError, match="allow-list"):
        encode_frames("r", [torch.zeros(2, dtype=torch.uint16)], [], [], {})


def test_a_model_layout_decodes_as_views_of_one_storage() -> None:
    keys = [random_tensor(torch.bfloat16, (6, 2, 8), i) for i in range(4)]
    values = [random_tensor(torch.bfloat16, (6, 2, 8), 10 + i) for i in range(4)]
    raw = torch.frombuffer(bytearray(encode_bytes("r", keys, values, [], {})), dtype=torch.uint8)
    for _ in range(2):  # the second decode reuses the grouping
        decoded = decode_payload(raw)
        for got, want in zip([*decoded.key_cache, *decoded.value_cache], keys + values):
            assert same_bits(got, want) and got.is_contiguous()
            assert got.untyped_storage().data_ptr() == raw.untyped_storage().data_ptr()
    decoded.value_cache[3][0, 0, 0] = 0  # a view: writes reach the buffer
    assert decode_payload(raw).value_cache[3][0, 0, 0].item() == 0


# ------------------------------------------------------------------------------- zero copy
def test_encode_of_a_large_payload_copies_no_tensor_bytes() -> None:
    # ~235 MB: 28 layers of K and V, 4096 tokens x 8 heads x 128 dims of bfloat16 (8 MiB each)
    keys = [torch.empty(4096, 8, 128, dtype=torch.bfloat16) for _ in range(14)]
    values = [torch.empty(4096, 8, 128, dtype=torch.bfloat16) for _ in range(14)]
    encoded = encode_frames("big", keys, values, list(range(256)), {"seq_len": 4096})
    assert encoded.nbytes > 230_000_000
    tensor_frames = [f for f in encoded.frames if len(memoryview(f)) == 4096 * 8 * 128 * 2]
    assert [address(f) for f in tensor_frames] == [t.data_ptr() for t in keys + values]
    assert sum(len(memoryview(f)) for f in encoded.frames) == encoded.nbytes
    assert len(encoded.frames[0]) < 16_384  # only the header is new memory


@pytest.mark.parametrize("kind", ["bytes", "bytearray", "cpu_tensor", "pool", "frames"])
def test_decoded_tensors_are_views_of_the_source(kind: str) -> None:
    keys, values, meta = _model_like_kv()
    encoded = encode_frames("r", keys, values, [], meta)
    source = as_input(kind, encoded, random.Random(0))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # read-only bytes must not warn
        decoded = decode_payload(source)
    if kind == "frames":
        regions = [(address(f), address(f) + len(memoryview(f))) for f in source]
    else:
        buf = source.tensor if kind == "pool" else source
        base = buf.data_ptr() if isinstance(buf, torch.Tensor) else address(buf)
        regions = [(base, base + encoded.nbytes)]
    for t in [*decoded.key_cache, *decoded.value_cache]:
        if t is not None:
            assert any(lo <= t.data_ptr() and t.data_ptr() + t.nbytes <= hi for lo, hi in regions)
    if kind == "pool":
        assert source.released == 0  # decoding never releases the pool buffer


def test_writable_source_shares_memory_with_decoded_tensors() -> None:
    t = torch.arange(12, dtype=torch.int32).reshape(3, 4)
    buf = bytearray(encode_bytes("r", [t], [None], [], {}))
    decoded = decode_payload(buf)
    decoded.key_cache[0][0, 0] = 77
    assert decode_payload(buf).key_cache[0][0, 0].item() == 77


# -------------------------------------------------------------------- reserved destinations
def test_gather_into_dest_views_then_finish_equals_encode_bytes() -> None:
    keys, values, meta = _model_like_kv()
    for checksums in (None, "crc32"):
        layout, tensors = plan_tensors("r", keys, values, [3], meta, align=64, checksums=checksums)
        pool = torch.full((layout.total_nbytes + 256,), 0xAB, dtype=torch.uint8)
        for start in (64, 3):  # aligned and misaligned slots of a pool
            dest = pool[start : start + layout.total_nbytes]
            for view, tensor in zip(dest_views(dest, layout), tensors):
                if view is not None:
                    view.copy_(tensor)  # extraction gathers straight into the destination
            expected = encode_bytes("r", keys, values, [3], meta, align=64, checksums=checksums)
            final = finish_payload_in(dest, layout)
            assert bytes(dest.numpy()) == expected
            assert final.header_bytes == bytes(dest[: final.data_start].numpy())
            # through the caller's byte view of the same bytes (a pool reservation's host_bytes)
            dest[: final.data_start] = 0
            whole = pool.numpy().data
            assert finish_payload_in(dest, layout, whole[start : start + layout.total_nbytes]) == final
            assert bytes(dest.numpy()) == expected
            # a view that is not the buffer's size is not trusted: the buffer's own is read
            dest[: final.data_start] = 0
            finish_payload_in(dest, layout, memoryview(bytearray(layout.total_nbytes + 1)))
            assert bytes(dest.numpy()) == expected


def test_write_payload_into_checks_its_arguments() -> None:
    keys, values, meta = _model_like_kv()
    layout, tensors = plan_tensors("r", keys, values, [], meta)
    dest = torch.empty(layout.total_nbytes, dtype=torch.uint8)
    write_payload_into(dest, layout, tensors)
    assert bytes(dest.numpy()) == encode_bytes("r", keys, values, [], meta)
    with pytest.raises(ConfigError):
        write_payload_into(torch.empty(layout.total_nbytes - 1, dtype=torch.uint8), layout, tensors)
    with pytest.raises(ConfigError):
        write_payload_into(dest, layout, tensors[:-1])
    with pytest.raises(ConfigError):
        write_payload_into(dest, layout, [None if t is None else t.float() for t in tensors])
    with pytest.raises(RuntimeError, match="device"):
        encode_device_tensor("r", keys, values, [], meta)


# ----------------------------------------------------------------------------- malformed
def test_checksum_mismatch_names_the_tensor_and_can_be_skipped() -> None:
    keys, values, meta = _model_like_kv()
    encoded = encode_frames("r", keys, values, [], meta, checksums="crc32")
    raw = bytearray(b"".join(encoded.frames))
    start, _ = encoded.layout.spans[len(keys)]  # value_cache_0
    raw[start] ^= 1
    with pytest.raises(PayloadError, match="value_cache_0"):
        decode_payload(raw)
    assert decode_payload(raw, verify=False).value_cache[0] is not None


@pytest.mark.parametrize(
    "bad",
    [
        torch.zeros(4, 4, dtype=torch.uint8),
        torch.zeros(8, dtype=torch.float32),
        torch.zeros(16, dtype=torch.uint8)[::2],
        3,
        [b"\x00", 5],
        [],
    ],
)
def test_bad_containers_raise_payload_error(bad) -> None:
    with pytest.raises(PayloadError):
        decode_payload(bad)


def test_mutated_payloads_raise_only_payload_error() -> None:
    rng = random.Random(5)
    keys, values, meta = _model_like_kv(layers=2, tokens=2)
    raw = encode_bytes("r", keys, values, [1], meta, align=8)
    header_end = 4 + struct.unpack(">I", raw[:4])[0]
    errors = 0
    for i in range(600):
        mutated = bytearray(raw[: rng.randrange(len(raw) + 1)] if i % 4 == 0 else raw)
        if i % 4:
            mutated[rng.randrange(header_end)] = rng.getrandbits(8)
        chunks = [bytes(mutated)] if i % 2 else [bytes(mutated[:7]), bytes(mutated[7:])]
        try:
            decode_payload(chunks)
        except PayloadError:
            errors += 1
    assert errors > 300


# ------------------------------------------------------------------------------ head slices
@settings(max_examples=80, deadline=None)
@given(st.integers(1, 4), st.integers(1, 4), st.integers(0, 5), st.integers(1, 3))
def test_slice_then_merge_reproduces_the_tensor(k: int, heads_per_slice: int, tokens: int, dim: int) -> None:
    t = random_tensor(torch.float16, (tokens, k * heads_per_slice, dim), k)
    parts = [slice_heads(t, i, k) for i in range(k)]
    assert all(p.shape[1] == heads_per_slice for p in parts)
    assert same_bits(merge_heads(parts), t)
    assert same_bits(merge_layers([slice_layers([t, None], i, k) for i in range(k)])[0], t)


def test_slice_and_merge_edge_cases() -> None:
    t = torch.zeros(2, 4, 3)
    assert slice_heads(None, 0, 2) is None
    assert slice_heads("not a tensor", 0, 2) == "not a tensor"
    for args in ((torch.zeros(4), 0, 2), (t, 0, 0), (t, -1, 2), (t, 2, 2), (t, 0, 3)):
        with pytest.raises(RoutingError):
            slice_heads(*args)
        with pytest.raises(ValueError):  # what the reference raised
            slice_heads(*args)
    assert merge_heads([None, None]) is None and merge_heads([]) is None
    assert merge_heads([None, t]) is t
    assert merge_heads(["a", "b"]) == "a"
    with pytest.raises(RoutingError):
        merge_heads([t, torch.zeros(3, 4, 3)])
    assert slice_layers(None, 0, 1) == []
    merged = merge_layers([[t], [t, None], None])
    assert len(merged) == 2 and merged[0].shape == (2, 8, 3) and merged[1] is None


# ------------------------------------------------------------------------------------ GPU
@pytest.mark.gpu
@CUDA
@pytest.mark.parametrize("align", [1, 64])
def test_device_tensor_round_trip(align: int) -> None:
    keys, values, meta = _model_like_kv()
    dev_keys = [None if t is None else t.cuda() for t in keys]
    dev_values = [None if t is None else t.cuda() for t in values]
    packed = encode_device_tensor("r", dev_keys, dev_values, [1], meta, align=align, checksums="crc32")
    assert packed.is_cuda and packed.dtype == torch.uint8
    assert bytes(packed.cpu().numpy()) == encode_bytes("r", keys, values, [1], meta, align=align, checksums="crc32")
    decoded = decode_payload(packed)
    assert all(same_bits(a, None if b is None else b.cpu()) for a, b in zip(keys, decoded.key_cache))
    for t in decoded.key_cache:
        if t is not None:
            assert t.is_cuda
            if align == 64:  # aligned payloads decode as views of the device buffer
                assert packed.data_ptr() <= t.data_ptr() < packed.data_ptr() + packed.numel()
    decoded = decode_payload(Pool(packed))
    assert all(same_bits(a, None if b is None else b.cpu()) for a, b in zip(values, decoded.value_cache))


def test_the_pool_buffer_check_agrees_with_the_protocol() -> None:
    from kvferry.adapters.connectors.pool_buffer import PooledBuffer
    from kvferry.adapters.torch_decode import _is_pool_buffer
    from kvferry.core.ports import PoolBuffer

    with_both = type("WithBoth", (), {"tensor": None, "release": lambda self: None})
    tensor_only = type("TensorOnly", (), {"tensor": None})
    release_only = type("ReleaseOnly", (), {"release": lambda self: None})
    pooled = PooledBuffer(torch.zeros(3, dtype=torch.uint8), on_release=lambda: None)
    cases = [pooled, with_both(), tensor_only(), release_only(), object(), b"x", torch.zeros(2), [b"a"]]
    assert [_is_pool_buffer(c) for c in cases] == [isinstance(c, PoolBuffer) for c in cases]
    assert [isinstance(c, PoolBuffer) for c in cases][:2] == [True, True]  # control: both kinds occur


def test_a_tied_buffer_and_a_reserved_region_are_read_without_a_numpy_view(monkeypatch) -> None:
    """The small request's path asks torch for no numpy view: a tied pool buffer decodes (and
    passes the refusal-marker check) through its ``host_bytes``, and a payload's header is
    written into a reservation through the caller's view. With the view absent, the same calls
    do ask torch (the control: the patch below does catch them)."""
    from kvferry.app.receive import _header_only

    keys, values, meta = _model_like_kv(tokens=200)  # more tensor bytes than a marker's padding
    raw = encode_bytes("r", keys, values, [3], meta)
    tied = PooledBuffer.tied(torch.frombuffer(bytearray(raw), dtype=torch.uint8), on_release=lambda: None)
    layout, tensors = plan_tensors("r", keys, values, [3], meta)
    dest = torch.zeros(layout.total_nbytes, dtype=torch.uint8)
    for view, tensor in zip(dest_views(dest, layout), tensors):
        if view is not None:
            view.copy_(tensor)
    host = dest.numpy().data

    def refuse(self: torch.Tensor) -> None:
        raise AssertionError("a numpy view was asked for")

    monkeypatch.setattr(torch.Tensor, "numpy", refuse)
    assert not _header_only(tied)
    decoded = decode_payload(tied)
    assert all(same_bits(a, b) for a, b in zip(keys, decoded.key_cache))
    finish_payload_in(dest, layout, host)
    with pytest.raises(AssertionError, match="numpy view"):
        decode_payload(tied.tensor)
    with pytest.raises(AssertionError, match="numpy view"):
        finish_payload_in(dest, layout)
    monkeypatch.undo()
    assert bytes(dest.numpy()) == raw
