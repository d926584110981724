"""The optional native gather (``kvferry.adapters._gather``, method ``"native"``).

Bit-exact against the naive concatenation for every streaming-store kernel this CPU has, with
streaming on and off, every dtype size (1, 2, 4, 8 bytes), scattered and duplicated ids, a
partial last block, head slices and destinations at unaligned offsets; the block-layout helper
(:func:`paged_gather._pieces`) against the byte offsets torch computes; misuse; and the fallback
when the extension is missing or switched off.
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import threading
import time

import attrs
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvferry.adapters import paged_gather
from kvferry.adapters.paged_cache import gather_slices, plan_extraction
from kvferry.core.errors import ConfigError

needs_native = pytest.mark.skipif(
    not paged_gather.NATIVE_GATHER, reason="the native gather (kvferry.adapters._gather) is not built"
)
ISAS = ("avx512f", "avx2", "sse2", "memcpy")
#: One dtype per element size: 1, 2, 4 and 8 bytes.
DTYPES = (torch.float8_e4m3fn, torch.bfloat16, torch.float32, torch.float64)
BLOCK, HEADS = 5, 4
#: Bytes per head. 256: whole 128-byte steps (head slices of 512 B, whole blocks of 5 KiB take
#: the short path when aligned); 600: unaligned tails, whole blocks of 2-4 pages (12,000 B);
#: 1000: whole blocks over 4 pages (20,000 B). Every piece streams when asked (>= 256 B).
HEAD_BYTES = (256, 600, 1000)
IDS_CASES = (
    ([6, 0, 3, 3, 9, 1, 7], 33),  # scattered, a duplicate, partial last block (3 of 5)
    ([2, 3, 4], 15),  # one run of whole blocks
    ([4], 2),
)  # only a partial block


def random_blocks(num_blocks, head_dim, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    itemsize = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (num_blocks, BLOCK, HEADS, head_dim * itemsize), dtype=torch.uint8, generator=g)
    return raw.view(dtype)


#: The layout name each test layout is extracted with (``packed`` has vllm_cpu's shape: named).
NAMES = {"dim0": "flash", "dim1": "flashinfer", "packed": "packed", "tuple": "tuple"}


def make_layer(layout, key, value):
    if layout == "dim0":
        return torch.stack([key, value])
    if layout == "dim1":
        return torch.stack([key, value], dim=1)
    if layout == "packed":
        return torch.cat([key, value], dim=-1).transpose(1, 2).contiguous()
    return (key, value)


def same_bits(a, b):
    return a.shape == b.shape and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


@pytest.fixture(params=("avx512f", "avx2", "sse2", "cached"))
def kernel(request, monkeypatch):
    """Streaming stores with each kernel this CPU has, or cached stores (plain memcpy)."""
    native = paged_gather._native
    if native is None:
        pytest.skip("the native gather is not built")
    if request.param == "cached":
        monkeypatch.setattr(paged_gather, "STREAM_MIN_BYTES", 1 << 62)
    else:
        monkeypatch.setattr(paged_gather, "STREAM_MIN_BYTES", 0)
        if not native.set_isa(request.param):
            pytest.skip(f"this CPU has no {request.param}")
    yield request.param
    native.set_isa(None)


@pytest.mark.parametrize("head_bytes", HEAD_BYTES)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_native_gather_is_bit_exact(kernel, dtype, head_bytes):
    itemsize = torch.empty((), dtype=dtype).element_size()
    head_dim = head_bytes // itemsize
    key = random_blocks(10, head_dim, dtype, seed=1)
    value = random_blocks(10, head_dim, dtype, seed=2)
    for layout in ("dim0", "dim1", "packed"):  # a (key, value) tuple reads like dim0
        for ids, seq_len in IDS_CASES:
            plan = plan_extraction(
                [make_layer(layout, key, value)], ids, seq_len, BLOCK, cache_dtype=str(dtype), layout=NAMES[layout]
            )
            for start, stop in ((0, HEADS), (1, 3), (3, 4)):
                gather = plan.tensor(0, "value")  # keys take the same path
                gather = attrs.evolve(gather, blocks=gather.blocks.narrow(2, start, stop - start))
                expected = torch.cat([value[b, :, start:stop] for b in ids])[:seq_len]
                for offset in (0, 5):  # elements: 5 is misaligned for 16/32/64-byte stores
                    pool = torch.full((gather.nbytes + (offset + 3) * itemsize,), 0xA5, dtype=torch.uint8)
                    at = offset * itemsize
                    out = pool[at : at + gather.nbytes].view(dtype).view(gather.shape)
                    gather.gather_into(out, method="native")
                    where = (layout, ids, start, stop, offset)
                    assert same_bits(out, expected), where
                    assert bool((pool[:at] == 0xA5).all()), where
                    assert bool((pool[at + gather.nbytes :] == 0xA5).all()), where


@needs_native
def test_large_scattered_gather_streams_the_same_bytes(monkeypatch):
    """A bench-sized tensor (4 MiB, 16 KiB blocks) with the default threshold: streamed."""
    assert paged_gather.STREAM_MIN_BYTES <= 4 << 20
    cache = torch.randint(-(2**15), 2**15, (2, 272, 16, 4, 128), dtype=torch.int16).view(torch.bfloat16)
    ids = torch.randperm(272, generator=torch.Generator().manual_seed(3))[:256].tolist()
    plan = plan_extraction([cache], ids, 4090, 16, cache_dtype="bfloat16")
    keys, values = (
        [torch.empty(plan.keys[0].shape, dtype=torch.bfloat16)],
        [torch.empty(plan.values[0].shape, dtype=torch.bfloat16)],
    )
    plan.gather_all((keys, values), method="native")
    assert plan.keys[0].nbytes >= paged_gather.STREAM_MIN_BYTES
    assert same_bits(keys[0], torch.cat([cache[0, b] for b in ids])[:4090])
    assert same_bits(values[0], torch.cat([cache[1, b] for b in ids])[:4090])


@st.composite
def block_views(draw):
    """A ``[blocks, ...]`` view as a cache layout or a slice of one produces: a permuted,
    narrowed, maybe step-sliced tensor."""
    rank = draw(st.integers(2, 6))
    shape = draw(st.lists(st.integers(1, 4), min_size=rank, max_size=rank))
    base = torch.arange(max(1, int(torch.tensor(shape).prod())), dtype=torch.int32).view(shape)
    view = base.permute(*draw(st.permutations(range(rank))))
    for dim in range(1, rank):
        size = view.shape[dim]
        start = draw(st.integers(0, size - 1))
        length = draw(st.integers(1, size - start))
        step = draw(st.sampled_from((1, 1, 2)))
        view = view.narrow(dim, start, length)[(slice(None),) * dim + (slice(None, None, step),)]
    return view


@settings(max_examples=300, deadline=None)
@given(block_views())
def test_pieces_reproduce_the_byte_offsets_of_a_block(view):
    """``_pieces`` describes exactly the bytes of ``view[0]`` in row-major order, or is None
    only when the block has more than three dimensions that cannot be merged."""
    itemsize = view.element_size()
    pieces = paged_gather._pieces(tuple(view.shape[1:]), tuple(view.stride()[1:]), itemsize)
    block = view[0]
    offsets = torch.zeros(block.shape, dtype=torch.int64)
    for dim, (size, stride) in enumerate(zip(block.shape, block.stride())):
        shape = [1] * block.dim()
        shape[dim] = size
        offsets = offsets + torch.arange(size).view(shape) * stride * itemsize
    expected = [o + b for o in offsets.flatten().tolist() for b in range(itemsize)]
    if pieces is None:
        assert sum(1 for n in block.shape if n != 1) >= 4
        return
    d0, s0, d1, s1, d2, s2, piece = pieces
    described = [
        a * s0 + b * s1 + c * s2 + i for a in range(d0) for b in range(d1) for c in range(d2) for i in range(piece)
    ]
    assert described == expected


@settings(max_examples=200, deadline=None)
@given(block_views(), st.integers(0, 3), st.integers(0, 2))
def test_a_gather_on_a_site_is_what_the_constructor_builds(view, seq_extra, drop):
    """``TensorGather.on_site`` (a plan's gathers over a cache geometry's block sites) gives
    exactly the gather the constructor gives: every field, derived ones included, for whole and
    partial last blocks and a site whose layout cache already holds other tails."""
    ids = tuple(range(view.shape[0]))
    full = max(0, len(ids) - 1 - min(drop, len(ids) - 1))
    tail = min(seq_extra, max(0, view.shape[1] - 1)) if view.dim() > 1 else 0
    index = paged_gather.BlockIds(ids[:full])
    runs = ((0, 0, full),) if full else ()
    tokens = full * view.shape[1] + tail
    picked = ids[: full + (1 if tail else 0)]
    site = paged_gather.BlockSite(view)
    for other_tail in range(3):  # the site's per-tail layouts are kept apart
        site.layout(other_tail)
    made = paged_gather.TensorGather(3, "value", view, picked, tokens, full, tail, index, runs)
    got = paged_gather.TensorGather.on_site(site, 3, "value", picked, tokens, full, tail, index, runs)
    mine, theirs = attrs.asdict(got, recurse=False), attrs.asdict(made, recurse=False)
    assert mine.keys() == theirs.keys()
    for name, value in mine.items():
        if isinstance(value, (torch.Tensor, paged_gather.BlockIds)):  # blocks and index: the very ones given
            assert value is theirs[name], name
        else:
            assert value == theirs[name], name


@needs_native
@pytest.mark.parametrize("ids", [[7, 1, 5], [5, 1, 7]], ids=["whole-block", "partial-block"])
def test_ids_outside_the_blocks_raise_before_any_byte_moves(ids):
    cache = torch.arange(2 * 8 * 2 * 64, dtype=torch.float32).view(2, 8, 2, 1, 64)
    gather = plan_extraction([cache], ids, 5, 2, cache_dtype="float32").keys[0]
    short = attrs.evolve(gather, blocks=gather.blocks.narrow(0, 0, 6))  # block 7 is gone
    out = torch.full(short.shape, -1.0)
    with pytest.raises(IndexError):
        short.gather_into(out, method="native")
    assert bool((out == -1).all())


@needs_native
@pytest.mark.parametrize("sliced", [False, True], ids=["whole-request", "head-slices"])
def test_a_bad_id_in_a_later_layer_raises_before_any_layer_is_written(sliced):
    """A request's native copies are all prepared (every id checked) before the first runs:
    a block id out of range in its last layer leaves every destination as it was."""
    caches = [torch.arange(2 * 8 * 2 * 2 * 64, dtype=torch.float32).view(2, 8, 2, 2, 64) + i for i in range(3)]
    plan = plan_extraction(caches, [5, 1, 7], 5, 2, cache_dtype="float32")
    last = plan.values[2]
    short = attrs.evolve(last, blocks=last.blocks.narrow(0, 0, 6))  # block 7 (the partial one) is gone
    plan = attrs.evolve(plan, values=(*plan.values[:2], short))
    if sliced:
        from kvferry.app.send import slice_plan_heads

        plans = [slice_plan_heads(plan, j, 2) for j in range(2)]
    else:
        plans = [plan]
    dests = [tuple([torch.full(g.shape, -1.0) for g in gathers] for gathers in (p.keys, p.values)) for p in plans]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # where "auto" takes the native copies (torch's would move bytes first)
    try:
        with pytest.raises(IndexError):
            if sliced:
                gather_slices(plans, dests)
            else:
                plan.gather_all(dests[0])
    finally:
        torch.set_num_threads(threads)
    assert all(bool((view == -1).all()) for d in dests for views in d for view in views)
    # control: with the last layer whole, the same call writes every destination
    good = plan_extraction(caches, [5, 1, 7], 5, 2, cache_dtype="float32")
    gplans = [slice_plan_heads(good, j, 2) for j in range(2)] if sliced else [good]
    if sliced:
        gather_slices(gplans, dests)
    else:
        good.gather_all(dests[0])
    assert not any(bool((view == -1).any()) for d in dests for views in d for view in views)


def test_the_extension_checks_every_id_before_copying():
    native = paged_gather._native
    if native is None:
        pytest.skip("the native gather is not built")
    index = torch.tensor([1, 5], dtype=torch.int64)
    with pytest.raises(IndexError):  # dst and src are null: any copy would crash
        native.gather(0, 0, index.data_ptr(), 2, 3, 0, 1, 0, 1, 0, 1, 0, 8, True)
    with pytest.raises(IndexError):
        native.gather(0, 0, 0, 4, 3, 0, 1, 0, 1, 0, 1, 0, 8, True)


@needs_native
def test_native_misuse_is_a_config_error():
    cpu = torch.zeros(2, 6, 4, 2, 64)
    gather = plan_extraction([cpu], [1, 2], 8, 4, cache_dtype="float32").keys[0]
    with pytest.raises(ConfigError):
        gather.choose_method(torch.device("meta"), "native")  # destination elsewhere
    meta = plan_extraction([torch.empty(2, 6, 4, 2, 64, device="meta")], [1, 2], 8, 4, cache_dtype="float32").keys[0]
    with pytest.raises(ConfigError):
        meta.choose_method(torch.device("meta"), "native")  # cache elsewhere
    # every dimension of a block strided on its own: more than three levels of pieces
    odd = torch.zeros(6, 3, 3, 3, 3, 2)[..., 0].transpose(1, 3)
    far = attrs.evolve(gather, blocks=odd)
    assert far._layout is None
    with pytest.raises(ConfigError):
        far.gather_into(torch.zeros(far.shape), method="native")
    assert far.choose_method(torch.device("cpu")) in ("index", "runs")


@needs_native
def test_auto_picks_native_on_one_thread_for_pieces_of_enough_bytes():
    threads = torch.get_num_threads()
    cache = torch.zeros(2, 40, 4, 4, 8)  # 32-byte heads, 128-byte tokens, 512-byte blocks
    plan = plan_extraction([cache], list(range(0, 40, 2)), 80, 4, cache_dtype="float32")
    gather = plan.keys[0]
    one_head = attrs.evolve(gather, blocks=gather.blocks.narrow(2, 1, 1))  # 32-byte pieces
    try:
        torch.set_num_threads(1)
        assert gather.choose_method(torch.device("cpu")) == "native"
        assert attrs.evolve(gather, blocks=gather.blocks.narrow(2, 0, 2)).choose_method(torch.device("cpu")) == "native"
        assert one_head._layout.full[-1] == 32 < paged_gather.NATIVE_MIN_PIECE
        assert one_head.choose_method(torch.device("cpu")) == "index"
        torch.set_num_threads(2)
        assert gather.choose_method(torch.device("cpu")) == "index"
    finally:
        torch.set_num_threads(threads)


def test_without_the_extension_torch_copies_and_native_is_a_config_error(monkeypatch):
    monkeypatch.setattr(paged_gather, "_native", None)
    monkeypatch.setattr(paged_gather, "NATIVE_GATHER", False)
    threads = torch.get_num_threads()
    key = random_blocks(6, 8, torch.bfloat16, seed=5)
    plan = plan_extraction([(key, key)], [4, 0, 2], 12, BLOCK, cache_dtype="bfloat16")
    assert paged_gather.native_isa() is None
    try:
        torch.set_num_threads(1)
        assert plan.keys[0].choose_method(torch.device("cpu")) == "index"
    finally:
        torch.set_num_threads(threads)
    with pytest.raises(ConfigError, match="not built"):
        plan.gather_into(0, "key", torch.empty(plan.keys[0].shape, dtype=torch.bfloat16), method="native")
    keys, _ = plan.materialize()
    assert same_bits(keys[0], torch.cat([key[b] for b in (4, 0, 2)])[:12])


def test_the_environment_switch_leaves_the_extension_unloaded():
    code = (
        "import sys, torch\n"
        "from kvferry.adapters import paged_gather as pg\n"
        "from kvferry.adapters.paged_cache import extract_request\n"
        "k = torch.arange(6 * 4 * 2 * 64, dtype=torch.float32).view(6, 4, 2, 64)\n"
        "kv = extract_request([(k, k)], [3, 1], 7, 4, cache_dtype='float32')\n"
        "ok = torch.equal(kv.key_cache[0], torch.cat([k[3], k[1]])[:7])\n"
        "print(pg.NATIVE_GATHER, pg.native_isa(), 'kvferry.adapters._gather' in sys.modules, ok)\n"
    )
    env = {**os.environ, "KVFERRY_NATIVE_GATHER": "0"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60, check=True)
    assert done.stdout.split() == ["False", "None", "False", "True"]


@needs_native
def test_isa_names_and_switching():
    native = paged_gather._native
    assert paged_gather.native_isa() in ISAS
    try:
        assert native.set_isa("memcpy") is True and native.isa() == "memcpy"
        assert native.set_isa("no-such-isa") is False and native.isa() == "memcpy"
    finally:
        native.set_isa(None)
    assert native.isa() in ISAS


# --------------------------------------------------------------- one pass over head slices
def _two_layer_plans(dtype, seed):
    """``(layout, ids, plan)`` of a two-layer cache of 256-byte heads (keys seeded ``seed``,
    values ``seed + 1``) for every layout and every :data:`IDS_CASES` case."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    key = random_blocks(10, 256 // itemsize, dtype, seed=seed)
    value = random_blocks(10, 256 // itemsize, dtype, seed=seed + 1)
    for layout in ("dim0", "dim1", "packed", "tuple"):
        for ids, seq_len in IDS_CASES:
            plan = plan_extraction(
                [make_layer(layout, key, value)] * 2, ids, seq_len, BLOCK, cache_dtype=str(dtype), layout=NAMES[layout]
            )
            yield layout, ids, plan


def _sliced(plan, slices):
    from kvferry.app.send import slice_plan_heads

    return [slice_plan_heads(plan, j, slices) for j in range(slices)]


def _dests(plan):
    def fresh(g):
        return None if g is None else torch.full(g.shape, 0, dtype=g.dtype)

    return [fresh(g) for g in plan.keys], [fresh(g) for g in plan.values]


@pytest.fixture(params=[1, 2], ids=["one-thread", "two-threads"])
def split_calls(request, monkeypatch):
    """torch on 1 thread ("auto" picks native, so the split gather runs) or 2 (slice by
    slice); yields the list of the split gather's calls."""
    calls = []
    native = paged_gather._native
    if native is not None:
        monkeypatch.setattr(paged_gather, "_native", _Counting(native, calls))
    threads = torch.get_num_threads()
    torch.set_num_threads(request.param)
    try:
        yield calls, request.param
    finally:
        torch.set_num_threads(threads)


class _Counting:
    def __init__(self, inner, calls):
        self._inner, self._calls = inner, calls

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def gather_split(self, *args):
        self._calls.append(len(args[0]))
        return self._inner.gather_split(*args)


@pytest.mark.parametrize("slices", [1, 2, 4])
@pytest.mark.parametrize("copies", [1, 2, 3])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_gather_slices_writes_what_each_slice_gathers_alone(kernel, split_calls, dtype, copies, slices):
    """``gather_slices`` (the native split gather when it applies) == each slice's own gather,
    for every layout, scattered/duplicated ids and a partial last block; with ``copies``
    destinations per slice (a replicated head, or a latent, for several receivers) every copy
    is. One thread takes one split call per tensor for every slice and copy."""
    from kvferry.adapters.paged_cache import gather_slices

    calls, threads = split_calls
    for layout, ids, plan in _two_layer_plans(dtype, seed=3):
        parts = _sliced(plan, slices)
        together = [_dests(p) for p in parts for _ in range(copies)]
        gather_slices(parts, together, copies)
        for d, got in enumerate(together):
            alone = _dests(parts[d // copies])
            parts[d // copies].gather_all(alone)
            for a, b in zip(alone[0] + alone[1], got[0] + got[1]):
                assert same_bits(a, b), (layout, ids, slices, d)
    # one thread: every tensor with whole blocks went through one split call for all destinations
    split = slices * copies > 1
    assert (set(calls) == ({slices * copies} if split else set())) if threads == 1 else calls == []


@needs_native
def test_equal_consecutive_slices_take_the_split_gather_and_others_do_not():
    cache = random_blocks(10, 128, torch.bfloat16, seed=5)
    plan = plan_extraction([make_layer("dim0", cache, cache)], [3, 1, 4], 12, BLOCK, cache_dtype="bfloat16")
    halves = [g.keys[0] for g in _sliced(plan, 2)]
    assert paged_gather.split_stride(halves) == 2 * 128 * 2  # two heads of 128 bf16 further on
    assert paged_gather.split_stride(halves[::-1]) is None  # not in increasing order
    assert paged_gather.split_stride(halves[:1]) is None
    uneven = attrs.evolve(halves[1], blocks=plan.keys[0].blocks.narrow(2, 2, 1))
    assert paged_gather.split_stride([halves[0], uneven]) is None


@needs_native
def test_split_gather_checks_every_id_and_its_destinations():
    native = paged_gather._native
    index = torch.tensor([1, 5], dtype=torch.int64)
    with pytest.raises(IndexError):  # null addresses: any copy would crash
        native.gather_split((0, 0), 8, 0, index.data_ptr(), 2, 3, 0, 1, 0, 1, 0, 1, 0, 8, True)
    with pytest.raises(ValueError):
        native.gather_split((), 8, 0, 0, 0, 3, 0, 1, 0, 1, 0, 1, 0, 8, True)
    with pytest.raises(ValueError):
        native.gather_split(tuple([0] * 65), 8, 0, 0, 0, 3, 0, 1, 0, 1, 0, 1, 0, 8, True)


@needs_native
@pytest.mark.parametrize("slices", [2, 4])
def test_a_bench_sized_split_gather_reads_whole_pages_and_writes_the_same_bytes(split_calls, slices, monkeypatch):
    """16 KiB blocks (4 heads x 128 bf16 x 16 tokens), streamed: the splits tile every block,
    so the split gather takes its page-at-a-time kernel; the bytes equal each slice's own."""

    monkeypatch.setattr(paged_gather, "STREAM_MIN_BYTES", 0)
    calls, threads = split_calls
    cache = torch.randint(-(2**15), 2**15, (2, 300, 16, 4, 128), dtype=torch.int16).view(torch.bfloat16)
    ids = torch.randperm(300, generator=torch.Generator().manual_seed(7))[:256].tolist()
    plan = plan_extraction([cache, cache], ids, 4090, 16, cache_dtype="bfloat16")
    _split_equals_each_alone(plan, slices, "native")
    assert (calls == [slices] * 4) if threads == 1 else calls == []


def _split_equals_each_alone(plan, slices, method):
    """``gather_slices`` of ``plan``'s head slices gives each slice what its own gather
    (``method``) gives; returns what was written together."""
    from kvferry.adapters.paged_cache import gather_slices

    parts = _sliced(plan, slices)
    together = [_dests(p) for p in parts]
    gather_slices(parts, together)
    for part, got in zip(parts, together):
        alone = _dests(part)
        part.gather_all(alone, method=method)
        assert all(same_bits(a, b) for a, b in zip(alone[0] + alone[1], got[0] + got[1]))
    return together


#: Tokens per block whose blocks (4 heads x 128 bf16 = 1 KiB a token) are 4 and 8 KiB (one and
#: two pages: whole blocks copied 8 and 4 at a time), 16 KiB (one 4-page stretch), 20 KiB (a
#: stretch and one page more) and 36 KiB (two stretches and one page).
STRETCH_TOKENS = (4, 8, 16, 20, 36)


@pytest.mark.parametrize("tokens", STRETCH_TOKENS)
@pytest.mark.parametrize("offset", [0, 16], ids=["aligned", "unaligned"])
def test_whole_blocks_of_4_page_stretches_copy_the_same_bytes(kernel, tokens, offset):
    """Whole blocks, 64-byte aligned or not, in 4-page stretches or with a page more: the
    streaming kernels' loop for whole 4-page blocks (16 KiB, aligned) and their general one
    (the rest) write exactly the blocks' bytes, in id order, and nothing past the end."""
    cache = torch.randint(-(2**15), 2**15, (2, 40, tokens, 4, 128), dtype=torch.int16).view(torch.bfloat16)
    ids = torch.randperm(40, generator=torch.Generator().manual_seed(tokens))[:23].tolist()
    plan = plan_extraction([cache], ids, 23 * tokens, tokens, cache_dtype="bfloat16")
    size = plan.keys[0].nbytes
    pool = torch.full((offset + size + 64,), 0xA5, dtype=torch.uint8)
    dest = pool[offset : offset + size].view(torch.bfloat16).view(plan.keys[0].shape)
    value = torch.empty(plan.values[0].shape, dtype=torch.bfloat16)
    plan.gather_all(([dest], [value]), method="native")
    assert same_bits(dest, torch.cat([cache[0, b] for b in ids]))
    assert same_bits(value, torch.cat([cache[1, b] for b in ids]))
    assert bool((pool[offset + size :] == 0xA5).all()) and bool((pool[:offset] == 0xA5).all())


def _page_aligned(nbytes: int) -> torch.Tensor:
    """``nbytes`` of uint8 starting on a 4 KiB boundary (a slice of a larger buffer)."""
    raw = torch.empty(nbytes + 4096, dtype=torch.uint8)
    skip = -raw.data_ptr() % 4096
    return raw[skip : skip + nbytes]


#: How far a destination lies past its page-aligned source within a page: each order of steps
#: the streaming kernels pick from it (adapters/_gather.c, kvf_ahead, kvf_order): forward four
#: pages at a time (0 and 3904-4095), backward (1-383 and, where a group is not all paired,
#: 384-511), two groups of four stepped together (384-3903), and the edges of each band.
AHEAD = (0, 32, 64, 256, 352, 384, 480, 512, 2048, 3872, 3904, 4032, 4064)


@pytest.mark.parametrize("tokens", STRETCH_TOKENS)
@pytest.mark.parametrize("ahead", AHEAD)
def test_whole_blocks_copy_the_same_bytes_wherever_the_destination_lies_in_a_page(kernel, tokens, ahead):
    """Whole page-aligned blocks (4 and 8 KiB: 8 or 4 at a time; 16, 20 and 36 KiB: 4-page
    stretches and a rest) into a destination ``ahead`` bytes past them within a page: every
    order the kernels pick to keep a store from stalling the next loads writes exactly the
    blocks' bytes, in id order, and nothing outside the destination."""
    block = tokens * 4 * 128 * 2
    blocks = 24
    cache = _page_aligned(2 * blocks * block).view(torch.int16)
    cache.copy_(
        torch.randint(-(2**15), 2**15, cache.shape, dtype=torch.int16, generator=torch.Generator().manual_seed(ahead))
    )
    cache = cache.view(torch.bfloat16).view(2, blocks, tokens, 4, 128)
    ids = torch.randperm(blocks, generator=torch.Generator().manual_seed(tokens))[:17].tolist()
    plan = plan_extraction([cache], ids, 17 * tokens, tokens, cache_dtype="bfloat16")
    size = plan.keys[0].nbytes
    pool = _page_aligned(ahead + size + 4096)
    pool.fill_(0xA5)
    dest = pool[ahead : ahead + size].view(torch.bfloat16).view(plan.keys[0].shape)
    assert (dest.data_ptr() - cache.data_ptr()) % 4096 == ahead
    value = torch.empty(plan.values[0].shape, dtype=torch.bfloat16)
    plan.gather_all(([dest], [value]), method="native")
    assert same_bits(dest, torch.cat([cache[0, b] for b in ids]))
    assert same_bits(value, torch.cat([cache[1, b] for b in ids]))
    assert bool((pool[ahead + size :] == 0xA5).all()) and bool((pool[:ahead] == 0xA5).all())


@pytest.mark.parametrize("tokens", STRETCH_TOKENS)
@pytest.mark.parametrize("slices", [2, 4])
def test_split_blocks_of_4_page_stretches_and_a_rest_write_each_slice(kernel, split_calls, tokens, slices):
    """Blocks whose rows are the slices side by side (the tiled split kernel), one copy each:
    its loop over whole 4-page stretches and the general loop for the page after them give
    each slice what the slice's own gather by index gives (on one thread through one split
    call per tensor)."""
    calls, threads = split_calls
    cache = torch.randint(-(2**15), 2**15, (2, 40, tokens, 4, 128), dtype=torch.int16).view(torch.bfloat16)
    ids = torch.randperm(40, generator=torch.Generator().manual_seed(tokens + slices))[:23].tolist()
    plan = plan_extraction([cache], ids, 23 * tokens, tokens, cache_dtype="bfloat16")
    together = _split_equals_each_alone(plan, slices, "index")
    assert not same_bits(together[0][0][0], together[1][0][0])  # control: the slices differ
    assert calls == ([slices] * 2 if threads == 1 else [])


# ------------------------------------------- copies: one read of a slice for several receivers
def _copied_twice_on_one_thread(plan, views, cache, ids):
    """Gather ``plan``'s one layer into two copies (``views``: copy 0's keys and values, then
    copy 1's) on one thread, where "auto" picks the native gather, and check each copy holds
    the blocks ``ids`` of ``cache`` in id order."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert plan.keys[0].choose_method(views[0].device) == "native"
        gather_slices([plan], [([views[0]], [views[1]]), ([views[2]], [views[3]])], 2)
    finally:
        torch.set_num_threads(threads)
    for c in (0, 2):
        assert same_bits(views[c], torch.cat([cache[0, b] for b in ids])), c
        assert same_bits(views[c + 1], torch.cat([cache[1, b] for b in ids])), c


@pytest.mark.parametrize("tokens", (16, 20))
@pytest.mark.parametrize("aheads", [(0, 0), (64, 2048), (2048, 2048), (2048, 4032), (480, 3904)])
def test_whole_blocks_copied_twice_wherever_the_copies_lie_in_a_page(kernel, tokens, aheads):
    """One slice into two destinations (an MLA latent for two receivers), two blocks at a time,
    with each copy ``aheads[c]`` bytes past the page-aligned blocks within a page: where either
    copy lies within a few lines past a block the kernels copy stretch by stretch instead
    (adapters/_gather.c, kvf_ahead); both orders write each copy's blocks in id order and
    nothing outside it."""
    block = tokens * 4 * 128 * 2
    cache = _page_aligned(2 * 24 * block).view(torch.int16)
    cache.copy_(torch.randint(-(2**15), 2**15, cache.shape, dtype=torch.int16))
    cache = cache.view(torch.bfloat16).view(2, 24, tokens, 4, 128)
    ids = torch.randperm(24, generator=torch.Generator().manual_seed(tokens))[:17].tolist()
    plan = plan_extraction([cache], ids, 17 * tokens, tokens, cache_dtype="bfloat16")
    size = plan.keys[0].nbytes
    pools = [_page_aligned(4096 + size + 4096) for _ in range(4)]
    views = []
    for n, pool in enumerate(pools):  # copy 0's keys and values, then copy 1's
        pool.fill_(0xA5)
        ahead = aheads[n // 2]
        views.append(pool[ahead : ahead + size].view(torch.bfloat16).view(plan.keys[0].shape))
        assert (views[-1].data_ptr() - cache.data_ptr()) % 4096 == ahead
    _copied_twice_on_one_thread(plan, views, cache, ids)
    for n, pool in enumerate(pools):
        start = aheads[n // 2]
        assert bool((pool[:start] == 0xA5).all()) and bool((pool[start + size :] == 0xA5).all())


@pytest.mark.parametrize("tokens", STRETCH_TOKENS)
@pytest.mark.parametrize("offset", [0, 16], ids=["aligned", "unaligned"])
def test_whole_blocks_copied_twice_write_each_copy(kernel, tokens, offset):
    """One slice (the whole block, as an MLA latent is for every receiver) into two
    destinations, by the native gather: blocks of a 4-page stretch (and a page more), copied
    two blocks at a time into destinations aligned for the kernel's stores, and the others
    (blocks of 1, 2 or 9 pages; destinations 16 bytes past a 64-byte boundary, unless the
    stores are 16 bytes wide) through the general walk: each copy holds the blocks in id order,
    23 of them (the last one alone), and nothing past its end is written."""
    cache = torch.randint(-(2**15), 2**15, (2, 40, tokens, 4, 128), dtype=torch.int16).view(torch.bfloat16)
    ids = torch.randperm(40, generator=torch.Generator().manual_seed(tokens + 1))[:23].tolist()
    plan = plan_extraction([cache], ids, 23 * tokens, tokens, cache_dtype="bfloat16")
    size = plan.keys[0].nbytes
    pools = [torch.full((64 + size + 64,), 0xA5, dtype=torch.uint8) for _ in range(4)]

    def place(pool):
        start = 64 - pool.data_ptr() % 64 + offset  # 64-byte aligned, or 16 bytes past it
        return pool[start : start + size].view(torch.bfloat16).view(plan.keys[0].shape)

    views = [place(pool) for pool in pools]
    _copied_twice_on_one_thread(plan, views, cache, ids)
    for pool, view in zip(pools, views):
        end = view.data_ptr() - pool.data_ptr() + size
        assert bool((pool[end:] == 0xA5).all())


@needs_native
@pytest.mark.parametrize("copies", [1, 2, 4])
@pytest.mark.parametrize("tokens", [8, 16, 36])
def test_a_bench_sized_replicated_split_gather_writes_each_copy(split_calls, copies, tokens, monkeypatch):
    """Blocks split in 2 (the tiled kernel), each slice into ``copies`` destinations (64-byte
    aligned, as pool regions are): 8 and 16 KiB blocks (copied four and two blocks at a time)
    and 36 KiB ones (two 4-page stretches of a block together, then the rest), 255 of them (the
    last blocks alone): every copy is the slice's own gather, and a destination past another's
    end is left alone."""
    from kvferry.adapters.paged_cache import gather_slices

    monkeypatch.setattr(paged_gather, "STREAM_MIN_BYTES", 0)
    calls, threads = split_calls
    cache = torch.randint(-(2**15), 2**15, (2, 300, tokens, 4, 128), dtype=torch.int16).view(torch.bfloat16)
    ids = torch.randperm(300, generator=torch.Generator().manual_seed(11))[:255].tolist()
    plan = plan_extraction([cache], ids, 255 * tokens - 6, tokens, cache_dtype="bfloat16")
    parts = _sliced(plan, 2)
    size = parts[0].keys[0].nbytes
    pool = torch.full((2 * copies * 2 * (size + 64),), 0x5A, dtype=torch.uint8)
    views, at = [], 0
    for _ in range(2 * copies):
        pair = []
        for g in (parts[0].keys[0], parts[0].values[0]):
            pair.append(pool[at : at + size].view(torch.bfloat16).view(g.shape))
            at += size + 64
        views.append(([pair[0]], [pair[1]]))
    gather_slices(parts, views, copies)
    for d, got in enumerate(views):
        alone = _dests(parts[d // copies])
        parts[d // copies].gather_all(alone, method="index")
        assert same_bits(alone[0][0], got[0][0]) and same_bits(alone[1][0], got[1][0]), d
    gaps = torch.cat([pool[s + size : s + size + 64] for s in range(0, at, size + 64)])
    assert bool((gaps == 0x5A).all())
    if threads == 1 and copies * 2 > 1:
        assert calls == [2 * copies] * 2


@needs_native
def test_split_gather_refuses_destinations_that_are_not_whole_copies():
    native = paged_gather._native
    with pytest.raises(ValueError, match="replicas"):
        native.gather_split((0, 0, 0), 8, 0, 0, 0, 3, 0, 1, 0, 1, 0, 1, 0, 8, True, 2)
    with pytest.raises(ValueError, match="replicas"):
        native.gather_split((0, 0), 8, 0, 0, 0, 3, 0, 1, 0, 1, 0, 1, 0, 8, True, 0)
    from kvferry.adapters.paged_cache import gather_slices

    cache = random_blocks(10, 128, torch.bfloat16, seed=5)
    plan = plan_extraction([make_layer("dim0", cache, cache)], [3, 1], 10, BLOCK, cache_dtype="bfloat16")
    with pytest.raises(ConfigError, match="copies"):
        gather_slices([plan], [_dests(plan)] * 3, 2)


# ------------------------------------------------------------------------- the GIL during a copy
def _ticks_inside(call, margin_s=0.001):
    """Run ``call`` in this thread while another Python thread stamps the clock as fast as it
    can; the stamps in the middle half of ``call``'s window (at least ``margin_s`` from either
    end, more than the GIL's switch interval, set to 0.1 ms here) and the window's length in
    seconds. The middle half, not the whole: on a busy host this thread may wait milliseconds
    for a core to take the GIL back after ``call``, and the other thread's stamps of that wait
    would be counted inside the window."""
    stamps: list[float] = []
    running, stop = threading.Event(), threading.Event()

    def spin():
        running.set()
        while not stop.is_set():
            stamps.append(time.perf_counter())

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-4)
    thread = threading.Thread(target=spin, daemon=True)
    thread.start()
    try:
        assert running.wait(10)
        start = time.perf_counter()
        call()
        end = time.perf_counter()
    finally:
        stop.set()
        thread.join(10)
        sys.setswitchinterval(old)
    margin = max(margin_s, (end - start) / 4)
    return sum(start + margin < s < end - margin for s in stamps), end - start


@needs_native
def test_a_large_gather_lets_other_python_threads_run():
    """A native copy of 128 MiB runs without the GIL (an engine's other threads keep running
    while its KV is extracted): the other thread's stamps fall inside the copy. Control: a copy
    of the same size that holds the GIL (``bytes()`` of a bytearray) has none inside."""
    cache = torch.zeros((2, 8200, 16, 4, 128), dtype=torch.bfloat16)
    ids = torch.randperm(8200, generator=torch.Generator().manual_seed(5))[:8192].tolist()
    plan = plan_extraction([cache], ids, 8192 * 16, 16, cache_dtype="bfloat16")
    out = torch.empty(plan.keys[0].shape, dtype=torch.bfloat16)
    plan.keys[0].gather_into(out, method="native")  # warm: pages touched
    inside, window = _ticks_inside(lambda: plan.keys[0].gather_into(out, method="native"))
    assert window > 0.004 and inside > 0, (inside, window)
    held, kept = bytearray(out.numel() * 2), []  # kept: the copy is freed outside the window
    inside, window = _ticks_inside(lambda: kept.append(bytes(held)))
    assert window > 0.004 and inside == 0, (inside, window)


# ------------------------------------------------------------------ spans of a payload region
def _payload_regions(plans, copies, start):
    """One pool per destination, filled with 0xAB, with the payload of its plan at ``start``
    (64: aligned, 3: every wider dtype misaligned); ``(regions, layouts)``."""
    from kvferry.app.bench.payload import layout_for

    layouts = [layout_for(p) for p in plans for _ in range(copies)]
    pools = [torch.full((lay.total_nbytes + 128,), 0xAB, dtype=torch.uint8) for lay in layouts]
    return [pool[start : start + lay.total_nbytes] for pool, lay in zip(pools, layouts)], layouts


def _places(make, regions, layouts, num_layers):
    out = [make(r, lay) for r, lay in zip(regions, layouts)]
    return [(p[:num_layers], p[num_layers:]) for p in out]


@pytest.mark.parametrize("start", [64, 3])
@pytest.mark.parametrize(("slices", "copies"), [(1, 1), (2, 1), (2, 2)])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_spans_of_a_region_receive_the_payload_views_receive(split_calls, dtype, slices, copies, start):
    """A payload gathered into its region through :func:`dest_spans` (no view per tensor; the
    native gather writes through the address, torch's methods through a view made when they
    run) is byte for byte the payload gathered through :func:`dest_views`, header included, for
    every layout, scattered ids, a partial last block, head slices and copies, aligned and
    misaligned regions, and with torch on one thread (native) or two (torch's copies). The
    control: a region left unwritten keeps its 0xAB bytes, which no payload here has."""
    from kvferry.adapters.torch_frames import dest_spans, dest_views, finish_payload_in

    itemsize = torch.empty((), dtype=dtype).element_size()
    for layout, ids, plan in _two_layer_plans(dtype, seed=11):
        parts = _sliced(plan, slices) if slices > 1 else [plan]
        got = {}
        for make in (dest_views, dest_spans):
            regions, layouts = _payload_regions(parts, copies, start)
            places = _places(make, regions, layouts, plan.num_layers)
            if len(places) == 1:
                parts[0].gather_all(places[0])
            else:
                gather_slices(parts, places, copies)
            for region, lay in zip(regions, layouts):
                finish_payload_in(region, lay)
            got[make.__name__] = [bytes(r.numpy()) for r in regions]
        assert got["dest_spans"] == got["dest_views"], (layout, ids)
        spans = dest_spans(*_payload_regions(parts[:1], 1, start)[0], layouts[0])
        data = [s for s in spans if s is not None]
        if start == 3 and itemsize > 1:  # misaligned for the dtype: views, as dest_views makes
            assert all(isinstance(s, torch.Tensor) for s in data)
        else:
            assert all(isinstance(s, paged_gather.HostSpan) for s in data)
        blank = _payload_regions(parts[:1], 1, start)[0][0]
        assert bytes(blank.numpy())[-64:] == b"\xab" * 64 != got["dest_spans"][0][-64:]


def test_a_span_of_another_shape_or_dtype_is_refused_before_any_byte_moves():
    """``check_out`` holds a span to the gather's shape and dtype as it holds a view; a span's
    view is where its address says."""
    key = random_blocks(10, 128, torch.bfloat16, seed=13)
    plan = plan_extraction([make_layer("dim0", key, key)], [3, 1], 8, BLOCK, cache_dtype="bfloat16")
    gather = plan.keys[0]
    pool = torch.full((2 * gather.nbytes + 128,), 0xAB, dtype=torch.uint8)
    for shape, dtype in (((7, HEADS, 128), torch.bfloat16), (gather.shape, torch.float16)):
        with pytest.raises(ConfigError, match="destination span"):
            plan.gather_all(([paged_gather.HostSpan(pool, 64, dtype, shape)], [None]))
    assert torch.all(pool == 0xAB)
    k = paged_gather.HostSpan(pool, 64, torch.bfloat16, gather.shape)
    v = paged_gather.HostSpan(pool, 64 + gather.nbytes, torch.bfloat16, gather.shape)
    plan.gather_all(([k], [v]))
    assert k.data_ptr() == pool.data_ptr() + 64 == k.tensor().data_ptr()
    for span, g in ((k, plan.keys[0]), (v, plan.values[0])):
        assert same_bits(span.tensor(), g.gather_into(torch.empty(g.shape, dtype=g.dtype)))
    assert torch.all(pool[:64] == 0xAB) and torch.all(pool[64 + 2 * gather.nbytes :] == 0xAB)


@pytest.mark.parametrize(
    ("buffer", "offset", "shape"),
    [
        (torch.zeros(100, dtype=torch.uint8), 0, (51,)),  # 102 bytes
        (torch.zeros(100, dtype=torch.uint8), 2, (50,)),
        (torch.zeros(100, dtype=torch.uint8), -2, (4,)),
        (torch.zeros(100, dtype=torch.uint8), 0, (-1, 4)),
        (torch.zeros(50, dtype=torch.int16), 0, (10,)),  # not bytes
        (torch.zeros(10, 10, dtype=torch.uint8), 0, (10,)),  # not 1-D
        (torch.zeros(200, dtype=torch.uint8)[::2], 0, (10,)),  # not contiguous
    ],
)
def test_a_span_that_could_write_outside_its_buffer_is_refused_when_made(buffer, offset, shape):
    with pytest.raises(ConfigError):
        paged_gather.HostSpan(buffer, offset, torch.int16, shape)
    assert paged_gather.HostSpan(torch.zeros(100, dtype=torch.uint8), 0, torch.int16, (50,)).tensor().numel() == 50


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 2**40), max_size=40))
def test_block_ids_lie_at_their_address_as_int64_and_make_the_torch_index_once(ids) -> None:
    """What the native gather reads at :meth:`BlockIds.address` is the ids, one int64 each
    (read back independently through ctypes); the torch methods' tensor holds the same values,
    int64 on the device, made on first use and kept; a tensor given instead is converted by
    value (a contiguous int64 one kept as the torch index itself)."""
    made = paged_gather.BlockIds(ids)
    assert len(made) == len(ids) and made.ids == tuple(ids) and made.is_cpu
    if ids:
        assert list((ctypes.c_int64 * len(ids)).from_address(made.address())) == ids
    tensor = made.tensor()
    assert tensor.dtype == torch.int64 and tensor.tolist() == ids and made.tensor() is tensor
    given_tensor = torch.tensor(ids, dtype=torch.int64)
    converted = paged_gather.block_ids_of(given_tensor)
    assert converted.ids == tuple(ids) and converted.tensor() is given_tensor
    small = [i % 2**31 for i in ids]
    narrow = paged_gather.block_ids_of(torch.tensor(small, dtype=torch.int32))
    assert narrow.ids == tuple(small) and narrow.tensor().dtype == torch.int64
    assert narrow.same_ids(paged_gather.BlockIds(small))
    assert paged_gather.block_ids_of(made) is made
    assert not made.same_ids(paged_gather.BlockIds([*ids, 1]))
