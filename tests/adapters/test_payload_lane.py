"""A payload's native copies prepared once per cache (``adapters.payload_lane``).

Every payload a lane writes is compared byte for byte with the general path (spans and
``gather_all``) and, independently, with the request's blocks indexed by torch. The lane is
reused only where it fits: later requests of the cache (other blocks, other lengths), not a
cache that was replaced, not with more torch threads, not a template it did not check.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvferry.adapters import paged_gather
from kvferry.adapters.paged_cache import ExtractionPlan, gather_slices, plan_extraction
from kvferry.adapters.payload_lane import (
    LANE_KEY,
    SLICE_LANE_KEY,
    HeadSlices,
    PayloadLane,
    SliceLane,
    gather_payload,
    gather_slice_payloads,
)
from kvferry.adapters.torch_frames import dest_spans, dest_views
from kvferry.core.errors import ConfigError
from kvferry.core.header import PayloadLayout, kv_layout_template

needs_native = pytest.mark.skipif(
    not paged_gather.NATIVE_GATHER, reason="the native gather (kvferry.adapters._gather) is not built"
)


@pytest.fixture(autouse=True)
def one_torch_thread() -> Iterator[None]:
    """Torch on one thread, as the native copies are chosen (``NATIVE_MAX_THREADS``)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def flash_cache(layers: int, blocks: int, block: int, heads: int, dim: int, dtype: torch.dtype, seed: int) -> list:
    """``layers`` tensors ``[2, blocks, block, heads, dim]`` (K/V on dim 0) of random bytes."""
    g = torch.Generator().manual_seed(seed)
    itemsize = torch.empty((), dtype=dtype).element_size()
    shape = (2, blocks, block, heads, dim * itemsize)
    return [torch.randint(0, 256, shape, dtype=torch.uint8, generator=g).view(dtype) for _ in range(layers)]


def plan_of(cache: list, ids: list[int], seq_len: int, block: int, geometry=None, layout="flash") -> ExtractionPlan:
    plan = plan_extraction(
        cache, ids, seq_len, block, cache_dtype="x", request_id="r", layout=layout, geometry=geometry
    )
    assert isinstance(plan, ExtractionPlan)
    return plan


def payload_layout(plan: ExtractionPlan, template=None) -> PayloadLayout:
    if template is None:
        template = kv_layout_template(*plan.dtype_shapes())
    return template.layout(plan.request_id, plan.block_ids, {"seq_len": plan.seq_len})


def general(plan: ExtractionPlan, layout: PayloadLayout) -> torch.Tensor:
    out = torch.zeros(layout.total_nbytes, dtype=torch.uint8)
    spans = dest_spans(out, layout)
    plan.gather_all((spans[: plan.num_layers], spans[plan.num_layers :]))
    return out


def expected(cache: list, ids: list[int], seq_len: int, which: int) -> list[torch.Tensor]:
    """Each layer's K (``which`` 0) or V (1) tokens, read by torch indexing of the blocks."""
    out = []
    for layer in cache:
        blocks = layer[which]
        tokens = blocks[torch.tensor(ids)].reshape(-1, *blocks.shape[2:])
        out.append(tokens[:seq_len])
    return out


def check_against_cache(out: torch.Tensor, layout: PayloadLayout, cache: list, ids: list[int], seq_len: int) -> None:
    views = dest_views(out, layout)
    n = len(cache)
    for which in (0, 1):
        wants = expected(cache, ids, seq_len, which)
        for layer, (view, want) in enumerate(zip(views[which * n : (which + 1) * n], wants)):
            assert view is not None
            assert torch.equal(view.view(torch.uint8), want.contiguous().view(torch.uint8)), (which, layer)


@needs_native
@settings(max_examples=40, deadline=None)
@given(
    layers=st.integers(1, 3),
    block=st.sampled_from([4, 16]),
    heads=st.sampled_from([1, 2]),
    dim=st.sampled_from([32, 64, 128]),
    dtype=st.sampled_from([torch.bfloat16, torch.float32]),
    requests=st.lists(
        st.tuples(st.lists(st.integers(0, 11), min_size=1, max_size=6), st.integers(0, 15)), min_size=2, max_size=4
    ),
)
def test_a_lane_writes_what_the_general_path_writes_for_every_request_of_its_cache(
    layers, block, heads, dim, dtype, requests
) -> None:
    """Requests of one cache, each with its own blocks and length (a partial last block or
    not): the first makes the lane, every one is served by it, and each payload is the general
    path's and the blocks' own bytes."""
    cache = flash_cache(layers, 12, block, heads, dim, dtype, seed=len(requests))
    lanes: dict = {}
    geometry, lane = None, None
    for ids, cut in requests:
        seq_len = max(1, len(ids) * block - cut % block)  # a partial last block when cut % block
        plan = plan_of(cache, ids, seq_len, block, geometry=geometry)
        geometry = plan.geometry
        layout = payload_layout(plan)
        out = torch.zeros(layout.total_nbytes, dtype=torch.uint8)
        gather_payload(plan, out, layout, lanes)
        assert torch.equal(out[layout.data_start :], general(plan, layout)[layout.data_start :])
        check_against_cache(out, layout, cache, ids, seq_len)
        if lane is None:
            lane = lanes[LANE_KEY]
        assert list(lanes) == [LANE_KEY] and lanes[LANE_KEY] is lane  # the first request's lane serves all
        assert lane.reads(plan)


@needs_native
def test_a_lane_is_reused_only_for_the_blocks_it_was_made_over() -> None:
    """A replaced cache (same shapes, new tensors) gets a new geometry, new views and so a new
    lane in the old one's place; its bytes come from the new cache, not the old one's addresses."""
    ids, seq_len = [3, 1, 4], 40
    old = flash_cache(2, 8, 16, 2, 64, torch.bfloat16, seed=1)
    new = flash_cache(2, 8, 16, 2, 64, torch.bfloat16, seed=2)
    lanes: dict = {}
    first = plan_of(old, ids, seq_len, 16)
    template = kv_layout_template(*first.dtype_shapes())
    layout = payload_layout(first, template)
    gather_payload(first, torch.zeros(layout.total_nbytes, dtype=torch.uint8), layout, lanes)
    before = lanes[LANE_KEY]
    second = plan_of(new, ids, seq_len, 16, geometry=first.geometry)
    assert second.geometry is not first.geometry and not before.reads(second)
    layout2 = payload_layout(second, template)
    out = torch.zeros(layout2.total_nbytes, dtype=torch.uint8)
    gather_payload(second, out, layout2, lanes)
    assert list(lanes) == [LANE_KEY] and lanes[LANE_KEY] is not before
    check_against_cache(out, layout2, new, ids, seq_len)
    assert not torch.equal(out, general(first, layout))  # the old cache's bytes differ: a control


@needs_native
def test_with_more_torch_threads_no_lane_is_kept_and_the_bytes_are_the_same(monkeypatch) -> None:
    cache = flash_cache(2, 8, 16, 2, 64, torch.bfloat16, seed=3)
    plan = plan_of(cache, [5, 0, 2], 35, 16)
    layout = payload_layout(plan)
    lanes: dict = {}
    monkeypatch.setattr(paged_gather, "NATIVE_MAX_THREADS", 0)  # every torch thread count is "more"
    out = torch.zeros(layout.total_nbytes, dtype=torch.uint8)
    gather_payload(plan, out, layout, lanes)
    assert lanes == {}
    check_against_cache(out, layout, cache, [5, 0, 2], 35)


@needs_native
def test_a_lane_does_not_fit_a_buffer_a_plan_or_a_template_it_cannot_serve() -> None:
    """``reads`` only for plans over its views; ``fits`` only for a buffer that holds the
    payload at an aligned data start and a template whose spans and shapes the plan's
    tensors fill (checked the general path's way the first time)."""
    cache = flash_cache(2, 8, 16, 2, 64, torch.bfloat16, seed=4)
    plan = plan_of(cache, [1, 2], 32, 16)
    layout = payload_layout(plan)
    out = torch.zeros(layout.total_nbytes + 8, dtype=torch.uint8)
    lane = PayloadLane.of(plan)
    assert lane is not None and lane.reads(plan) and lane.fits(plan, out, layout)
    assert not lane.fits(plan, out[: layout.total_nbytes - 1], layout)  # too short
    assert not lane.fits(plan, out[1:], layout)  # the data start misaligned for bf16
    shorter = plan_of(cache, [1, 2], 20, 16, geometry=plan.geometry)  # 20 tokens: not this template
    assert lane.reads(shorter)
    with pytest.raises(ConfigError):  # the general path's own complaint: shapes do not match
        lane.fits(shorter, out, layout)
    assert not lane.reads(plan.head_slice(0, 2))  # other views of the cache (one head of two)


@needs_native
def test_a_head_slice_and_an_mla_latent_take_the_path_that_fits_them() -> None:
    """A head-sliced plan (strided views, no geometry) and an MLA latent (no values) are written
    as the general path writes them, lane or not."""
    cache = flash_cache(2, 8, 16, 4, 64, torch.bfloat16, seed=5)
    plan = plan_of(cache, [6, 2, 7], 45, 16).head_slice(1, 2)
    layout = payload_layout(plan)
    out = torch.zeros(layout.total_nbytes, dtype=torch.uint8)
    gather_payload(plan, out, layout, {})
    assert torch.equal(out[layout.data_start :], general(plan, layout)[layout.data_start :])
    g = torch.Generator().manual_seed(6)
    latent = [torch.randint(0, 256, (8, 16, 576 * 2), dtype=torch.uint8, generator=g).view(torch.bfloat16)]
    mla = plan_of(latent, [4, 1], 30, 16, layout="mla")
    assert mla.values == (None,)
    layout = payload_layout(mla)
    out = torch.zeros(layout.total_nbytes, dtype=torch.uint8)
    lanes: dict = {}
    gather_payload(mla, out, layout, lanes)
    assert list(lanes) == [LANE_KEY]
    assert torch.equal(out[layout.data_start :], general(mla, layout)[layout.data_start :])
    want = latent[0][torch.tensor([4, 1])].reshape(-1, 576)[:30]
    (key_view, _) = dest_views(out, layout)
    assert key_view is not None and torch.equal(key_view.view(torch.uint8), want.contiguous().view(torch.uint8))


# ------------------------------------------------------------------------- head slices
def slice_payloads(plan: ExtractionPlan, slots: tuple, copies: int) -> tuple[list, list[PayloadLayout]]:
    """Each slot's sliced plan, and one layout per destination (plan-major)."""
    plans = [plan.head_slice(*slot) for slot in slots]
    layouts = [payload_layout(plans[d // copies]) for d in range(len(slots) * copies)]
    return plans, layouts


def general_slices(plans: list, layouts: list[PayloadLayout], copies: int) -> list[torch.Tensor]:
    """The general path's bytes: ``gather_slices`` of the sliced plans into each layout's spans."""
    outs = [torch.zeros(layout.total_nbytes, dtype=torch.uint8) for layout in layouts]
    views = [dest_spans(out, layout) for out, layout in zip(outs, layouts)]
    n = plans[0].num_layers
    gather_slices(plans, [(v[:n], v[n:]) for v in views], copies)
    return outs


def counted(plan: ExtractionPlan, slots: tuple, made: list) -> HeadSlices:
    """``plan``'s head slices ``slots``, each slice planned appending its slot to ``made``."""

    def slicer(whole: ExtractionPlan, offset: int, count: int) -> ExtractionPlan:
        made.append((offset, count))
        return whole.head_slice(offset, count)

    return HeadSlices(plan, slots, slicer)


def expected_heads(cache: list, ids: list[int], seq_len: int, which: int, heads: tuple[int, int]) -> list:
    return [t[:, heads[0] : heads[1]] for t in expected(cache, ids, seq_len, which)]


@needs_native
@settings(max_examples=40, deadline=None)
@given(
    layers=st.integers(1, 3),
    block=st.sampled_from([4, 16]),
    heads=st.sampled_from([2, 4, 8]),
    dim=st.sampled_from([32, 64, 128]),
    dtype=st.sampled_from([torch.bfloat16, torch.float32]),
    split=st.sampled_from([(2, 1), (4, 1), (2, 2), (1, 2), (1, 3)]),
    requests=st.lists(
        st.tuples(st.lists(st.integers(0, 11), min_size=1, max_size=6), st.integers(0, 15)), min_size=2, max_size=4
    ),
)
def test_a_slice_lane_writes_what_the_general_path_writes_for_every_request_of_its_cache(
    layers, block, heads, dim, dtype, split, requests
) -> None:
    """The head slices of requests of one cache (``split``: slices, copies of each), each with
    its own blocks and length, each slice's template kept by length (as a sender keeps them):
    the first makes the slice lane, every one is served by it, only a request of a new length
    has its slices planned (to check their templates), and every destination holds the
    general path's bytes and its heads of the blocks, by torch."""
    slices, copies = split
    if heads % slices:
        return
    cache = flash_cache(layers, 12, block, heads, dim, dtype, seed=len(requests) + heads)
    slots = tuple((j, slices) for j in range(slices)) if slices > 1 else ((0, 1),)
    lanes: dict = {}
    templates: dict[int, list] = {}
    geometry, lane = None, None
    for ids, cut in requests:
        seq_len = max(1, len(ids) * block - cut % block)
        plan = plan_of(cache, ids, seq_len, block, geometry=geometry)
        geometry = plan.geometry
        plans = [plan.head_slice(*slot) for slot in slots]
        new_length = seq_len not in templates
        if new_length:
            templates[seq_len] = [kv_layout_template(*p.dtype_shapes()) for p in plans]
        layouts = [payload_layout(plan, templates[seq_len][d // copies]) for d in range(len(slots) * copies)]
        outs = [torch.zeros(layout.total_nbytes, dtype=torch.uint8) for layout in layouts]
        made: list = []
        gather_slice_payloads(counted(plan, slots, made), outs, layouts, copies, lanes)
        assert made == (list(slots) if new_length else []), (seq_len, made)
        wants = general_slices(plans, layouts, copies)
        width = heads // slices
        for d, (out, want, layout) in enumerate(zip(outs, wants, layouts)):
            assert torch.equal(out[layout.data_start :], want[layout.data_start :]), d
            j = d // copies
            views = dest_views(out, layout)
            for which in (0, 1):
                tokens = expected_heads(cache, ids, seq_len, which, (j * width, (j + 1) * width))
                for layer, want_t in enumerate(tokens):
                    got = views[which * layers + layer]
                    assert torch.equal(got.view(torch.uint8), want_t.contiguous().view(torch.uint8)), (d, which, layer)
        if lane is None:
            lane = lanes[SLICE_LANE_KEY]
        served = counted(plan, slots, made)
        assert lanes[SLICE_LANE_KEY] is lane and lane.serves(served, copies)
        assert lane.fits(served, outs, layouts) and made == (list(slots) if new_length else [])  # the lane wrote


@needs_native
def test_a_slice_lane_serves_only_its_cache_its_slices_and_one_thread() -> None:
    """Another cache (same shapes), other slices, another copy count or more torch threads
    are not served by a lane made for one; a request it does serve, in a buffer it cannot
    write to as the general path would (short, misaligned), takes the general path."""
    ids, seq_len = [3, 1, 4], 40
    cache = flash_cache(2, 8, 16, 4, 64, torch.bfloat16, seed=1)
    other = flash_cache(2, 8, 16, 4, 64, torch.bfloat16, seed=2)
    slots = ((0, 2), (1, 2))
    plan = plan_of(cache, ids, seq_len, 16)
    plans, layouts = slice_payloads(plan, slots, 1)
    sliced = HeadSlices(plan, slots)
    lane = SliceLane.of(sliced, 1)
    assert lane is not None
    assert lane.serves(HeadSlices(plan, slots), 1)
    moved = plan_of(other, ids, seq_len, 16, geometry=plan.geometry)
    assert moved.geometry is not plan.geometry
    assert not lane.serves(HeadSlices(moved, slots), 1)
    assert not lane.serves(HeadSlices(plan, ((0, 4), (1, 4))), 1)
    assert not lane.serves(HeadSlices(plan, slots), 2)
    torch.set_num_threads(2)
    try:
        assert not lane.serves(HeadSlices(plan, slots), 1)
        assert SliceLane.of(HeadSlices(plan, slots), 1) is None
    finally:
        torch.set_num_threads(1)
    outs = [torch.zeros(layout.total_nbytes, dtype=torch.uint8) for layout in layouts]
    assert lane.fits(sliced, outs, layouts)
    short = [torch.zeros(layout.total_nbytes - 1, dtype=torch.uint8) for layout in layouts]
    assert not lane.fits(sliced, short, layouts)
    skewed = [torch.zeros(layout.total_nbytes + 1, dtype=torch.uint8)[1:] for layout in layouts]
    assert not lane.fits(sliced, skewed, layouts)
    # control: the general path writes the skewed buffers (unaligned spans: torch copies)
    gather_slice_payloads(sliced, skewed, layouts, 1, {})
    wants = general_slices(plans, layouts, 1)
    for got, want, layout in zip(skewed, wants, layouts):
        assert torch.equal(got[layout.data_start :], want[layout.data_start :])


@needs_native
def test_a_slice_lane_checks_each_template_the_general_paths_way_and_reads_only_its_views() -> None:
    """A template met for the first time with a request's token count is checked as the general
    path checks it (its complaint raised for one the slices do not fill); a plan of the lane's
    geometry whose tensor reads other blocks (put together by hand) is not served, and its
    slices are written from the blocks it reads."""
    import attrs as attrs_

    cache = flash_cache(2, 8, 16, 4, 64, torch.bfloat16, seed=7)
    other = flash_cache(2, 8, 16, 4, 64, torch.bfloat16, seed=8)
    slots = ((0, 2), (1, 2))
    plan = plan_of(cache, [1, 2], 32, 16)
    _, layouts = slice_payloads(plan, slots, 1)
    lane = SliceLane.of(HeadSlices(plan, slots), 1)
    assert lane is not None
    outs = [torch.zeros(layout.total_nbytes, dtype=torch.uint8) for layout in layouts]
    assert lane.fits(HeadSlices(plan, slots), outs, layouts)
    shorter = plan_of(cache, [1, 2], 20, 16, geometry=plan.geometry)  # 20 tokens: not these templates
    made: list = []
    short_slices = counted(shorter, slots, made)
    assert lane.serves(short_slices, 1) and made == []  # served from the whole plan: nothing sliced
    with pytest.raises(ConfigError):  # the general path's own complaint: shapes do not match
        lane.fits(short_slices, outs, layouts)
    assert made == [slots[0]]  # the template checked against the slice's own plan
    foreign = plan_of(other, [1, 2], 32, 16)
    mixed = attrs_.evolve(plan, keys=(foreign.keys[0], *plan.keys[1:]))  # layer 0's keys from `other`
    assert not lane.serves(HeadSlices(mixed, slots), 1)
    lanes = {SLICE_LANE_KEY: lane}
    written = [torch.zeros(layout.total_nbytes, dtype=torch.uint8) for layout in layouts]
    gather_slice_payloads(HeadSlices(mixed, slots), written, layouts, 1, lanes)
    for j, (out, layout) in enumerate(zip(written, layouts)):
        got = dest_views(out, layout)[0]  # layer 0's keys
        want = expected_heads(other, [1, 2], 32, 0, (2 * j, 2 * j + 2))[0]
        assert got is not None and torch.equal(got.view(torch.uint8), want.contiguous().view(torch.uint8))
        mine = expected_heads(cache, [1, 2], 32, 0, (2 * j, 2 * j + 2))[0]
        assert not torch.equal(got.view(torch.uint8), mine.contiguous().view(torch.uint8))  # a control
