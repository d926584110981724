"""Extraction of a request's KV from a paged cache (SPEC 4): layouts, validation, gathers."""

from __future__ import annotations

import logging

import attrs
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kvferry.adapters as adapters_layer
from kvferry.adapters import paged_cache, paged_gather
from kvferry.adapters.paged_cache import (
    CacheGeometry,
    ExtractedKV,
    ExtractionPlan,
    ExtractionSkipped,
    block_runs,
    extract_request,
    normalize_layer_kv,
    plan_extraction,
    token_split,
    valid_block_ids,
)
from kvferry.core.errors import ConfigError
from kvferry.core.layouts import layout_spec

PROPERTY = settings(max_examples=60, deadline=None)
LAYOUTS = ("dim0", "dim1", "packed", "tuple", "list")
#: The layout name each test layout is extracted with (``packed`` has vllm_cpu's shape: named).
NAMES = {"dim0": "flash", "dim1": "flashinfer", "packed": "packed", "tuple": "tuple", "list": "tuple"}
TORCH_METHODS = ("auto", "index", "runs", "staged")
#: Every gather method; "native" (the optional C extension) is skipped where it is not built.
METHODS = (
    *TORCH_METHODS,
    pytest.param(
        "native",
        marks=pytest.mark.skipif(
            not paged_gather.NATIVE_GATHER, reason="the native gather (kvferry.adapters._gather) is not built"
        ),
    ),
)
#: Names of paged_gather that paged_cache and the layer need not re-export.
GATHER_ONLY = {
    "STRIDED_MAX_RUNS",
    "NATIVE_GATHER",
    "NATIVE_MAX_THREADS",
    "NATIVE_MIN_PIECE",
    "STREAM_MIN_BYTES",
    "native_isa",
    "MAX_SPLIT",
    "split_stride",
    "gather_split",
}
DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn)
LOGGER = "kvferry.adapters.paged_cache"


def random_blocks(num_blocks, block_size, heads, head_dim, dtype=torch.float32, seed=0, device="cpu"):
    """Random bit patterns (any dtype, NaNs included): compare bytes, never values."""
    g = torch.Generator().manual_seed(seed)
    itemsize = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (num_blocks, block_size, heads, head_dim * itemsize), dtype=torch.uint8, generator=g)
    return raw.view(dtype).to(device)


def make_layer(layout, key, value):
    """Lay out per-block K and V (``[blocks, block_size, heads, head_dim]``) as a cache would."""
    if layout == "dim0":
        return torch.stack([key, value])
    if layout == "dim1":
        return torch.stack([key, value], dim=1)
    if layout == "packed":  # [blocks, heads, block_size, 2*head_dim]
        return torch.cat([key, value], dim=-1).transpose(1, 2).contiguous()
    if layout == "tuple":
        return (key, value)
    return [key, value]


def naive(blocks, ids, seq_len):
    """The reference meaning: concatenate the valid blocks, truncate to seq_len."""
    picked = [blocks[b] for b in ids if 0 <= b < blocks.shape[0]]
    return torch.cat(picked)[:seq_len] if picked else None


def same_bits(a, b):
    return (
        a.shape == b.shape
        and a.dtype == b.dtype
        and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))
    )


# ---------------------------------------------------------------- pure helpers


@PROPERTY
@given(st.lists(st.integers(-3, 40), max_size=40))
def test_block_runs_reassemble_ids_and_are_maximal(ids):
    runs = block_runs(ids)
    assert [src + i for _, src, n in runs for i in range(n)] == ids
    assert [dst for dst, _, _ in runs] == [sum(n for _, _, n in runs[:k]) for k in range(len(runs))]
    for (_, s1, n1), (_, s2, _) in zip(runs, runs[1:]):
        assert s1 + n1 != s2  # adjacent runs could not have been merged


@PROPERTY
@given(st.integers(0, 50), st.integers(0, 33), st.integers(0, 2000))
def test_token_split_accounts_for_every_token(blocks, block_tokens, seq_len):
    tokens, full, tail = token_split(blocks, block_tokens, seq_len)
    if block_tokens == 0:
        assert (tokens, full, tail) == (0, 0, 0)
        return
    assert tokens == min(seq_len, blocks * block_tokens)
    assert tokens == full * block_tokens + tail and 0 <= tail < block_tokens
    assert full + (1 if tail else 0) <= blocks


def test_valid_block_ids_drop_out_of_range_and_keep_order_and_duplicates():
    assert valid_block_ids([5, -1, 2, 9, 2, 0, 10], 10) == (5, 2, 9, 2, 0)


# ---------------------------------------------------------------- normalisation


@pytest.mark.parametrize("layout", LAYOUTS)
def test_normalize_every_layout_gives_views_of_k_and_v(layout):
    key, value = random_blocks(5, 4, 3, 8, seed=1), random_blocks(5, 4, 3, 8, seed=2)
    layer = make_layer(layout, key, value)
    k, v = normalize_layer_kv(layer, req_id="r", layer_idx=0, block_size=4)
    assert same_bits(k, key) and same_bits(v, value)
    storage = (layer[0] if isinstance(layer, (tuple, list)) else layer).untyped_storage()
    assert k.untyped_storage().data_ptr() == storage.data_ptr()  # a view, no copy


def test_packed_is_recognised_only_with_a_matching_block_size(caplog):
    layer = make_layer("packed", random_blocks(5, 4, 3, 8), random_blocks(5, 4, 3, 8, seed=1))
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert normalize_layer_kv(layer, req_id="r", layer_idx=3) is None
        assert normalize_layer_kv(layer, req_id="r", layer_idx=3, block_size=8) is None
    assert "r" in caplog.text and "layer 3" in caplog.text


def test_packed_is_checked_before_the_stacked_forms():
    # 2 blocks, 2 heads: also fits [2, blocks, ...] and [blocks, 2, ...]; packed wins.
    key, value = random_blocks(2, 4, 2, 8, seed=1), random_blocks(2, 4, 2, 8, seed=2)
    k, v = normalize_layer_kv(make_layer("packed", key, value), block_size=4)
    assert same_bits(k, key) and same_bits(v, value)


def test_two_blocks_with_kv_on_dim1_read_as_kv_on_dim0():
    """The documented ambiguity: ``[2, 2, ...]`` is read with K/V on dim 0 (checked first)."""
    layer = random_blocks(2, 2, 4, 3, seed=3)  # [2, 2, 4, 3] plus a trailing dim below
    layer = layer.unsqueeze(-1)
    k, v = normalize_layer_kv(layer, block_size=None)
    assert same_bits(k, layer[0]) and same_bits(v, layer[1])


@pytest.mark.parametrize(
    "bad",
    [
        torch.zeros(3, 4, 2, 8),  # neither dim 0 nor dim 1 is 2
        torch.zeros(2, 4),  # rank under 3
        (torch.zeros(2, 4, 2, 8),) * 3,  # 3-tuple
        (torch.zeros(2, 4, 2, 8), "not-a-tensor"),  # non-tensor entry
        (torch.zeros(4), torch.zeros(4, 2)),  # key under 2-D
        42,
        None,
    ],
)
def test_unsupported_layers_are_none_with_a_warning(bad, caplog):
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert normalize_layer_kv(bad, req_id="req-7", layer_idx=5, block_size=16) is None
    assert "req-7" in caplog.text and "layer 5" in caplog.text


# ---------------------------------------------------------------- planning


def cache(layout="dim0", layers=2, num_blocks=10, block_size=4, heads=2, head_dim=8, dtype=torch.float32):
    ks = [random_blocks(num_blocks, block_size, heads, head_dim, dtype, seed=2 * i) for i in range(layers)]
    vs = [random_blocks(num_blocks, block_size, heads, head_dim, dtype, seed=2 * i + 1) for i in range(layers)]
    return [make_layer(layout, k, v) for k, v in zip(ks, vs)], ks, vs


def test_block_ids_outside_the_range_are_dropped_and_duplicates_keep_order(caplog):
    layers, ks, vs = cache()
    ids = [7, -1, 3, 10, 3, 99, 0]
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        plan = plan_extraction(layers, ids, 1000, 4, cache_dtype="float32", request_id="r1")
    assert caplog.text.count("dropped 3 of 7") == 1  # once per request, not per layer
    assert plan.keys[0].block_ids == (7, 3, 3, 0) and plan.block_ids == tuple(ids)
    keys, values = plan.materialize()
    assert same_bits(keys[1], naive(ks[1], ids, 1000)) and keys[1].shape == (16, 2, 8)
    assert same_bits(values[0], naive(vs[0], ids, 1000))


@pytest.mark.parametrize("seq_len, tokens", [(1, 1), (6, 6), (8, 8), (11, 11), (12, 12), (500, 12)])
def test_truncation_to_seq_len(seq_len, tokens):
    layers, ks, _ = cache()
    result = extract_request(layers, [2, 5, 1], seq_len, 4, cache_dtype="float32")
    assert result.key_cache[0].shape == (tokens, 2, 8)
    assert same_bits(result.key_cache[0], naive(ks[0], [2, 5, 1], seq_len))


def test_mismatched_key_and_value_block_counts_use_the_shared_range(caplog):
    key, value = random_blocks(6, 4, 2, 8, seed=1), random_blocks(4, 4, 2, 8, seed=2)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        result = extract_request([(key, value)], [5, 1, 3, 4], 100, 4, cache_dtype="x", request_id="rm")
    assert "key has 6 blocks, value 4" in caplog.text and "rm" in caplog.text
    assert same_bits(result.key_cache[0], naive(key, [1, 3], 100))
    assert same_bits(result.value_cache[0], naive(value, [1, 3], 100))


def test_skipped_layers_are_absent_and_reported(caplog):
    layers, ks, vs = cache(layers=3)
    layers[1] = torch.zeros(3, 3)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        plan = plan_extraction(layers, [1, 2], 8, 4, cache_dtype="float32", request_id="rs")
    assert "request rs layer 1 skipped" in caplog.text
    assert plan.keys[1] is None and plan.values[1] is None and plan.num_layers == 3
    assert [(s.layer, s.reason) for s in plan.skipped_layers] == [(1, "unsupported_layout")]
    keys, values = plan.materialize()
    assert keys[1] is None and values[1] is None
    assert same_bits(keys[2], naive(ks[2], [1, 2], 8)) and same_bits(values[0], naive(vs[0], [1, 2], 8))
    assert plan.dtype_shapes() == ([("float32", (8, 2, 8)), None, ("float32", (8, 2, 8))],) * 2


def test_all_layers_empty_produces_no_payload(caplog):
    layers, _, _ = cache()
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        out_of_range = plan_extraction(layers, [10, 11], 8, 4, cache_dtype="x", request_id="re")
        unusable = plan_extraction([None, 3], [0], 8, 4, cache_dtype="x", request_id="re")
        zero_tokens = extract_request(layers, [0], 0, 4, cache_dtype="x", request_id="re")
    for result in (out_of_range, unusable, zero_tokens):
        assert isinstance(result, ExtractionSkipped) and not result
        assert result.reason == "all_layers_empty" and result.request_id == "re"
    assert {s.reason for s in out_of_range.skipped_layers} == {"no_valid_blocks"}
    assert {s.reason for s in zero_tokens.skipped_layers} == {"no_tokens"}
    assert "every layer is empty" in caplog.text
    assert plan_extraction([], [0], 8, 4, cache_dtype="x").reason == "no_layers"


@pytest.mark.parametrize("ids", [[], None, torch.tensor([], dtype=torch.int64)])
def test_no_block_ids_is_skipped_with_a_warning(ids, caplog):
    layers, _, _ = cache()
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        result = extract_request(layers, ids, 8, 4, cache_dtype="x", request_id="rn")
    assert isinstance(result, ExtractionSkipped) and result.reason == "no_block_ids"
    assert "rn" in caplog.text and "no block ids" in caplog.text


def test_metadata_carries_the_required_keys_then_custom_ones():
    layers, _, _ = cache(layers=3)
    layers[2] = "junk"
    plan = plan_extraction(
        layers,
        torch.tensor([1, 2]),
        7,
        4,
        cache_dtype="bfloat16",
        custom_metadata={"model": "m", "seq_len": 7},
        request_id="rq",
    )
    assert plan.metadata == {"block_size": 4, "num_layers": 3, "dtype": "bfloat16", "seq_len": 7, "model": "m"}
    assert list(plan.metadata) == ["block_size", "num_layers", "dtype", "seq_len", "model"]
    plan.metadata["block_size"] = 99  # a fresh dict each time
    assert plan.metadata["block_size"] == 4
    result = extract_request(layers, [1, 2], 7, 4, cache_dtype=torch.float16)
    assert isinstance(result, ExtractedKV) and result.metadata["dtype"] == "torch.float16"
    assert result.block_ids == (1, 2) and len(result.layer_blocks()["key_cache"]) == 3


@pytest.mark.parametrize(
    "kwargs",
    [
        {"seq_len": -1},
        {"block_size": 0},
        {"block_size": 2.0},
        {"block_ids": [1, "2"]},
        {"block_ids": [1.0]},
        {"block_ids": torch.tensor([1.0])},
        {"custom_metadata": [("a", 1)]},
    ],
)
def test_bad_arguments_are_config_errors(kwargs):
    args = {"block_ids": [0], "seq_len": 4, "block_size": 4, **kwargs}
    with pytest.raises(ConfigError):
        plan_extraction(cache()[0], cache_dtype="x", **args)


# ---------------------------------------------------------------- gathering


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("offset", [0, 2, 4, 6, 8])
def test_gather_into_writes_in_place_into_a_slice_of_a_bigger_buffer(method, offset):
    layers, ks, vs = cache(layout="dim1", dtype=torch.bfloat16)
    ids, seq_len = [4, 5, 6, 1, 8], 18
    plan = plan_extraction(layers, ids, seq_len, 4, cache_dtype="bfloat16")
    nbytes = plan.keys[1].nbytes
    pool = torch.full((offset + nbytes + 16,), 0xAB, dtype=torch.uint8)
    view = pool[offset : offset + nbytes].view(torch.bfloat16).view(plan.keys[1].shape)
    out = plan.gather_into(1, "key", view, method=method)
    assert out is view and out.data_ptr() == pool.data_ptr() + offset
    assert same_bits(view, naive(ks[1], ids, seq_len))
    assert bool((pool[:offset] == 0xAB).all()) and bool((pool[offset + nbytes :] == 0xAB).all())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_dtype_and_layout_is_bit_exact(dtype, layout):
    layers, ks, vs = cache(layout=layout, layers=2, num_blocks=7, dtype=dtype)
    ids, seq_len = [6, 0, 1, 2, 9, 3], 15
    result = extract_request(layers, ids, seq_len, 4, cache_dtype=str(dtype), layout=NAMES[layout])
    for i in range(2):
        assert same_bits(result.key_cache[i], naive(ks[i], ids, seq_len))
        assert same_bits(result.value_cache[i], naive(vs[i], ids, seq_len))
        assert result.key_cache[i].is_contiguous()
        assert result.key_cache[i].untyped_storage().data_ptr() != ks[i].untyped_storage().data_ptr()


def test_gather_all_fills_views_and_checks_them_all_before_writing():
    layers, ks, vs = cache(layers=3)
    layers[1] = None
    plan = plan_extraction(layers, [3, 1], 6, 4, cache_dtype="float32")
    keys = [torch.zeros(6, 2, 8), None, torch.zeros(6, 2, 8)]
    values = [torch.zeros(6, 2, 8), None, torch.zeros(6, 2, 8)]
    plan.gather_all((keys, values))
    assert same_bits(keys[2], naive(ks[2], [3, 1], 6)) and same_bits(values[0], naive(vs[0], [3, 1], 6))
    fresh = [torch.zeros(6, 2, 8), None, torch.zeros(6, 2, 8)]
    for bad in (
        [torch.zeros(6, 2, 8), None, torch.zeros(6, 2, 7)],  # wrong shape, last
        [torch.zeros(6, 2, 8), torch.zeros(6, 2, 8), torch.zeros(6, 2, 8)],  # absent
        [torch.zeros(6, 2, 8), None],
    ):  # too short
        with pytest.raises(ConfigError):
            plan.gather_all((fresh, bad))
        assert not fresh[0].any()  # nothing written before the check failed
    with pytest.raises(ConfigError):
        plan.gather_all((fresh,))


def test_gather_into_misuse_is_a_config_error():
    layers, _, _ = cache(layers=2)
    layers[0] = None
    plan = plan_extraction(layers, [1, 2], 8, 4, cache_dtype="float32")
    good = torch.empty(8, 2, 8)
    for args in [
        (0, "key", good),
        (2, "key", good),
        (1, "kv", good),
        (1, "key", torch.empty(8, 2, 8, dtype=torch.float16)),
        (1, "key", torch.empty(8, 8, 2).transpose(1, 2)),
        (1, "key", "not a tensor"),
    ]:
        with pytest.raises(ConfigError):
            plan.gather_into(*args)
    with pytest.raises(ConfigError):
        plan.gather_into(1, "key", good, method="fast")
    plan.gather_into(1, "key", good)


@pytest.fixture
def torch_policy(monkeypatch):
    """The torch methods' "auto" policy, as without the native gather."""
    monkeypatch.setattr(paged_gather, "NATIVE_GATHER", False)


def test_auto_method_policy_by_device_and_fragmentation(torch_policy):
    """CPU: index. Another device: few runs copy run by run, many use one index kernel.
    Cross-device: few runs copy straight into the destination, many are staged."""
    meta = torch.empty(2, 40, 4, 2, 8, device="meta")  # stands in for an accelerator cache
    few = list(range(0, 8)) + list(range(20, 28))  # 2 runs
    many = list(range(0, 40, 2))  # 20 runs
    cpu_plan = plan_extraction([torch.empty(meta.shape)], many, 80, 4, cache_dtype="x")
    assert cpu_plan.keys[0].choose_method(torch.device("cpu")) == "index"
    cases = {
        (tuple(few), "meta"): "runs",
        (tuple(many), "meta"): "index",
        (tuple(few), "cpu"): "runs",
        (tuple(many), "cpu"): "staged",
    }
    for (ids, out_device), expected in cases.items():
        gather = plan_extraction([meta], list(ids), 1000, 4, cache_dtype="x").keys[0]
        assert gather.choose_method(torch.device(out_device)) == expected
        assert gather.choose_method(torch.device(out_device), "runs") == "runs"
    with pytest.raises(ConfigError):
        gather.choose_method(torch.device("cpu"), "index")


@pytest.mark.parametrize(
    "layout, ids, expected",
    [
        ("dim0", list(range(0, 16)), "index"),  # whole contiguous blocks: always index
        ("packed", list(range(0, 16)), "runs"),  # strided blocks, 1 run
        ("packed", [0, 1, 5, 6, 10, 11, 20, 21], "runs"),  # 4 runs
        ("packed", list(range(0, 40, 2)), "index"),  # 20 runs
        ("sliced", list(range(0, 16)), "runs"),  # head slice, 1 run
        ("sliced", list(range(0, 40, 2)), "index"),
    ],
)
def test_auto_on_cpu_copies_few_runs_of_strided_blocks_run_by_run(layout, ids, expected, torch_policy):
    layers, _, _ = cache(layout="packed" if layout == "packed" else "dim0", layers=1, num_blocks=40, heads=4)
    gather = plan_extraction(
        layers, ids, 1000, 4, cache_dtype="x", layout="packed" if layout == "packed" else "flash"
    ).keys[0]
    if layout == "sliced":
        gather = attrs.evolve(gather, blocks=gather.blocks.narrow(2, 2, 2))
    assert gather.strided == (layout != "dim0")
    assert gather.choose_method(torch.device("cpu")) == expected


def test_a_cache_that_requires_grad_is_gathered_without_autograd():
    key = random_blocks(4, 4, 2, 8).requires_grad_()
    result = extract_request([(key, key)], [2, 0], 7, 4, cache_dtype="float32")
    assert not result.key_cache[0].requires_grad
    assert same_bits(result.key_cache[0], naive(key.detach(), [2, 0], 7))


@st.composite
def geometries(draw):
    layout = draw(st.sampled_from(LAYOUTS))
    num_blocks = draw(st.integers(1, 12))
    block_size = draw(st.integers(1, 6))
    heads = draw(st.integers(1, 3))
    head_dim = draw(st.integers(1, 5))
    dtype = draw(st.sampled_from(DTYPES))
    ids = draw(st.lists(st.integers(-2, num_blocks + 1), min_size=1, max_size=10))
    seq_len = draw(st.integers(0, (len(ids) + 1) * block_size))
    return layout, num_blocks, block_size, heads, head_dim, dtype, ids, seq_len


@pytest.mark.parametrize("method", METHODS)
@PROPERTY
@given(geometries(), st.integers(0, 3))
def test_extraction_equals_naive_concatenation(method, geometry, offset_units):
    layout, num_blocks, block_size, heads, head_dim, dtype, ids, seq_len = geometry
    key = random_blocks(num_blocks, block_size, heads, head_dim, dtype, seed=1)
    value = random_blocks(num_blocks, block_size, heads, head_dim, dtype, seed=2)
    plan = plan_extraction(
        [make_layer(layout, key, value)], ids, seq_len, block_size, cache_dtype=str(dtype), layout=NAMES[layout]
    )
    expected_k, expected_v = naive(key, ids, seq_len), naive(value, ids, seq_len)
    if expected_k is None or expected_k.shape[0] == 0:
        assert isinstance(plan, ExtractionSkipped) and plan.reason == "all_layers_empty"
        return
    assert isinstance(plan, ExtractionPlan) and plan.nbytes == 2 * expected_k.numel() * key.element_size()
    itemsize = key.element_size()
    for which, expected in (("key", expected_k), ("value", expected_v)):
        # a destination at an arbitrary element offset inside a shared buffer
        pool = torch.zeros((offset_units + expected.numel() + 3) * itemsize, dtype=torch.uint8)
        start = offset_units * itemsize
        dest = pool[start : start + expected.numel() * itemsize].view(dtype).view(expected.shape)
        plan.gather_into(0, which, dest, method=method)
        assert same_bits(dest, expected)
        assert not pool[:start].any() and not pool[start + expected.numel() * itemsize :].any()


@st.composite
def head_slices(draw):
    layout, num_blocks, block_size, _, head_dim, dtype, ids, seq_len = draw(geometries())
    heads = draw(st.integers(1, 6))
    start = draw(st.integers(0, heads - 1))
    stop = draw(st.integers(start + 1, heads))
    return layout, num_blocks, block_size, heads, head_dim, dtype, ids, seq_len, start, stop


@pytest.mark.parametrize("method", METHODS)
@PROPERTY
@given(head_slices())
def test_head_sliced_gathers_equal_naive_concatenation_of_the_slice(method, geometry):
    """What the fan-out sender does (``app.send.slice_plan_heads``): narrow dim 2 (heads) of
    every block view; the gather reads strided blocks and must still be bit-exact."""
    layout, num_blocks, block_size, heads, head_dim, dtype, ids, seq_len, start, stop = geometry
    key = random_blocks(num_blocks, block_size, heads, head_dim, dtype, seed=3)
    value = random_blocks(num_blocks, block_size, heads, head_dim, dtype, seed=4)
    plan = plan_extraction(
        [make_layer(layout, key, value)], ids, seq_len, block_size, cache_dtype=str(dtype), layout=NAMES[layout]
    )
    if isinstance(plan, ExtractionSkipped):
        return
    for which, blocks in (("key", key), ("value", value)):
        gather = plan.tensor(0, which)
        sliced = attrs.evolve(gather, blocks=gather.blocks.narrow(2, start, stop - start))
        assert sliced.shape == (gather.tokens, stop - start, head_dim)
        assert sliced.nbytes == gather.nbytes * (stop - start) // heads
        out = torch.zeros(sliced.shape, dtype=dtype)
        sliced.gather_into(out, method=method)
        assert same_bits(out, naive(blocks[:, :, start:stop], ids, seq_len))


def gather_fields(gather):
    """Every field of a gather, comparable across plans: the blocks by place and geometry (the
    very view of the cache), the index (each plan's own) by its ids, device and the tensor the
    torch methods read."""
    out = {}
    for name, value in attrs.asdict(gather, recurse=False).items():
        if name == "index":
            tensor = value.tensor()
            value = (value.device, value.ids, tensor.dtype, tensor.device, tensor.is_contiguous(), tensor.tolist())
        elif isinstance(value, torch.Tensor):
            value = (value.data_ptr(), tuple(value.shape), value.stride(), value.dtype)
        out[name] = value
    return out


def same_plans(a, b):
    assert type(a) is type(b)
    if isinstance(a, ExtractionSkipped):
        assert a == b
        return
    assert (a.request_id, a.block_ids, a.seq_len, a.metadata, a.skipped_layers) == (
        b.request_id, b.block_ids, b.seq_len, b.metadata, b.skipped_layers,
    )  # fmt: skip
    for mine, theirs in zip(a.tensors(), b.tensors(), strict=True):
        assert (mine is None) == (theirs is None)
        if mine is not None:
            assert gather_fields(mine) == gather_fields(theirs)


@st.composite
def requests_of_one_cache(draw):
    """A cache geometry (``geometries``) and several requests of it: ``(ids, seq_len)`` each."""
    layout, num_blocks, block_size, heads, head_dim, dtype, ids, seq_len = draw(geometries())
    more = draw(
        st.lists(
            st.tuples(st.lists(st.integers(-2, num_blocks + 1), max_size=10), st.integers(0, 12 * block_size)),
            max_size=4,
        )
    )
    layers = draw(st.integers(1, 3))
    return layout, num_blocks, block_size, heads, head_dim, dtype, layers, [(ids, seq_len), *more]


def random_layers(layout, num_blocks, block_size, heads, head_dim, dtype, num_layers):
    """``num_layers`` layers of ``layout``, each of its own random key and value blocks."""
    return [
        make_layer(
            layout,
            random_blocks(num_blocks, block_size, heads, head_dim, dtype, seed=2 * n),
            random_blocks(num_blocks, block_size, heads, head_dim, dtype, seed=2 * n + 1),
        )
        for n in range(num_layers)
    ]


@PROPERTY
@given(requests_of_one_cache())
def test_a_plan_from_a_kept_geometry_is_the_plan_read_afresh(case):
    """Every request of a cache planned with the geometry an earlier plan kept gives the very plan
    a fresh read gives (every gather field, skips and metadata); so do its head slices. Control:
    the geometry is reused (same object), not read again."""
    layout, num_blocks, block_size, heads, head_dim, dtype, num_layers, requests = case
    layers = random_layers(layout, num_blocks, block_size, heads, head_dim, dtype, num_layers)
    kwargs = {"cache_dtype": str(dtype), "layout": NAMES[layout]}
    kept = None
    for n, (ids, seq_len) in enumerate(requests):
        fresh = plan_extraction(layers, ids, seq_len, block_size, request_id=f"r{n}", **kwargs)
        planned = plan_extraction(layers, ids, seq_len, block_size, request_id=f"r{n}", geometry=kept, **kwargs)
        same_plans(planned, fresh)
        if isinstance(planned, ExtractionPlan):
            if kept is not None:
                assert planned.geometry is kept
            kept = planned.geometry
            assert fresh.geometry is not kept
            for slices in (d for d in (2, 3) if heads % d == 0):
                for offset in range(slices):
                    own = attrs.evolve(fresh, geometry=None).head_slice(offset, slices)  # narrowed on its own
                    same_plans(planned.head_slice(offset, slices), own)
                    same_plans(planned.head_slice(offset, slices), planned.head_slice(offset, slices))


@PROPERTY
@given(requests_of_one_cache())
def test_a_uniform_cache_is_planned_as_the_per_layer_loop_plans_it(case):
    """A cache whose layers all hold the same blocks (``CacheGeometry.uniform``) makes one
    selection for every tensor; the plan is the one the per-layer loop makes (the same geometry
    with ``uniform`` cleared), every field, skip and warning-worthy id drop alike. Control: the
    geometry is uniform, the cleared one is not."""
    layout, num_blocks, block_size, heads, head_dim, dtype, num_layers, requests = case
    layers = random_layers(layout, num_blocks, block_size, heads, head_dim, dtype, num_layers)
    kwargs = {"cache_dtype": str(dtype), "layout": NAMES[layout]}
    uniform = CacheGeometry.of(layers, block_size, layout_spec(NAMES[layout], "layout"))
    looped = CacheGeometry.of(layers, block_size, layout_spec(NAMES[layout], "layout"))
    object.__setattr__(looped, "uniform", None)  # frozen: the per-layer loop's geometry
    assert uniform.uniform == num_blocks and looped.uniform is None
    for n, (ids, seq_len) in enumerate(requests):
        one = plan_extraction(layers, ids, seq_len, block_size, request_id=f"r{n}", geometry=uniform, **kwargs)
        each = plan_extraction(layers, ids, seq_len, block_size, request_id=f"r{n}", geometry=looped, **kwargs)
        same_plans(one, each)


def test_a_cache_with_layers_of_different_block_counts_is_not_uniform():
    """Layers of different block counts leave ``uniform`` None (each layer then selects its own
    blocks, and ids past a short layer's blocks are dropped for it alone)."""
    spec = layout_spec("flash", "layout")
    a = torch.stack([random_blocks(6, 4, 2, 8, seed=1), random_blocks(6, 4, 2, 8, seed=2)])
    b = torch.stack([random_blocks(5, 4, 2, 8, seed=3), random_blocks(5, 4, 2, 8, seed=4)])
    assert CacheGeometry.of([a, a], 4, spec).uniform == 6
    assert CacheGeometry.of([a, b], 4, spec).uniform is None
    plan = plan_extraction([a, b], [5, 1], 8, 4, cache_dtype="float32", layout="flash")
    assert plan.keys[0].block_ids == (5, 1) and plan.keys[1].block_ids == (1,)


def test_a_geometry_that_no_longer_fits_is_read_again():
    """The kept geometry is not used for another tensor of the same shape, a tensor moved to other
    storage (``set_``), another layout or layer count (or block size): the plan reads the layers
    it is given, and gathers what they hold."""
    key, value = random_blocks(6, 4, 2, 8, seed=1), random_blocks(6, 4, 2, 8, seed=2)
    layers = [torch.stack([key, value])]
    ids, seq_len = [3, 1, 4], 10
    kept = plan_extraction(layers, ids, seq_len, 4, cache_dtype="float32", layout="flash").geometry
    assert (
        plan_extraction(layers, ids, seq_len, 4, cache_dtype="float32", layout="flash", geometry=kept).geometry is kept
    )

    other_key, other_value = random_blocks(6, 4, 2, 8, seed=3), random_blocks(6, 4, 2, 8, seed=4)
    moved = torch.stack([key, value])
    moved.set_(torch.stack([other_key, other_value]))  # the same tensor object, other storage
    cases = {
        "another tensor": ([torch.stack([other_key, other_value])], 4, "flash", other_key),
        "set_": ([moved], 4, "flash", other_key),
        "layout": ([(key, value)], 4, "tuple", key),
        "more layers": ([*layers, *layers], 4, "flash", key),
    }
    for name, (stack, block_size, layout, expected_key) in cases.items():
        plan = plan_extraction(stack, ids, seq_len, block_size, cache_dtype="float32", layout=layout, geometry=kept)
        assert plan.geometry is not kept, name
        out = torch.empty(plan.keys[0].shape)
        plan.gather_into(0, "key", out)
        assert same_bits(out, naive(expected_key, ids, seq_len)), name
    assert kept.fits(layers, 4, kept.layout) and not kept.fits(layers, 2, kept.layout)


def test_head_slices_that_cannot_be_made_are_routing_errors():
    """Heads the slices do not divide, and a tensor without a head dimension, refuse slicing
    with RoutingError naming the tensor (the geometry keeps the error, not a view)."""
    from kvferry.core.errors import RoutingError

    key, value = random_blocks(6, 4, 3, 8, seed=1), random_blocks(6, 4, 3, 8, seed=2)
    plan = plan_extraction([torch.stack([key, value])], [1, 2], 8, 4, cache_dtype="float32", layout="flash")
    for _ in range(2):  # the second time from the kept slice
        with pytest.raises(RoutingError, match="key_cache_0: head count 3 is not divisible by num_slices 2"):
            plan.head_slice(0, 2)
    flat = plan_extraction([(key[:, :, 0, 0], value[:, :, 0, 0])], [1, 2], 8, 4, cache_dtype="float32")  # 2-D blocks
    with pytest.raises(RoutingError, match="key_cache_0: cannot slice heads"):
        flat.head_slice(0, 2)


def test_every_public_name_is_importable_from_paged_cache_and_the_layer():
    for name in paged_gather.__all__:
        assert hasattr(paged_gather, name)
        if name not in GATHER_ONLY or hasattr(adapters_layer, name):
            assert getattr(paged_cache, name) is getattr(paged_gather, name)
    for name in paged_cache.__all__:
        assert hasattr(paged_cache, name)
        if name != "STRIDED_MAX_RUNS":
            assert getattr(adapters_layer, name) is getattr(paged_cache, name), name


# ---------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("method", TORCH_METHODS)
def test_cuda_cache_to_cuda_and_to_host_destinations(layout, method):
    key = random_blocks(40, 16, 4, 128, torch.bfloat16, seed=1, device="cuda")
    value = random_blocks(40, 16, 4, 128, torch.bfloat16, seed=2, device="cuda")
    ids, seq_len = [3, 4, 5, 6, 20, 21, 1, 39, 0], 137
    plan = plan_extraction(
        [make_layer(layout, key, value)], ids, seq_len, 16, cache_dtype="bfloat16", layout=NAMES[layout]
    )
    expected = naive(key.cpu(), ids, seq_len)
    on_device = torch.empty(expected.shape, dtype=torch.bfloat16, device="cuda")
    plan.gather_into(0, "key", on_device, method=method)
    host = torch.empty(expected.shape, dtype=torch.bfloat16)
    if method != "index":
        plan.gather_into(0, "key", host, method=method)
    else:
        with pytest.raises(ConfigError):
            plan.gather_into(0, "key", host, method=method)
        plan.gather_into(0, "key", host)
    torch.cuda.synchronize()
    assert same_bits(on_device.cpu(), expected) and same_bits(host, expected)
    keys, values = plan.materialize(method=method)
    assert keys[0].device.type == "cuda" and same_bits(values[0].cpu(), naive(value.cpu(), ids, seq_len))
