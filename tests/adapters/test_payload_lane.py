"""A payload's native copies prepared once per cache and template (``adapters.payload_lane``).

Every payload a lane writes is compared byte for byte with the general path (spans and
``gather_all``) and, independently, with the request's blocks indexed by torch. The lane is
reused only where it fits: a second request of the same shape with other blocks, a cache that
was replaced, more torch threads, another template.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvferry.adapters import paged_gather
from kvferry.adapters.paged_cache import ExtractionPlan, plan_extraction
from kvferry.adapters.payload_lane import PayloadLane, gather_payload
from kvferry.adapters.torch_frames import dest_spans, dest_views
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
    ids=st.lists(st.integers(0, 11), min_size=1, max_size=6),
    cut=st.integers(0, 15),
    other=st.lists(st.integers(0, 11), min_size=1, max_size=6),
)
def test_a_lane_writes_what_the_general_path_writes_and_serves_the_next_request(
    layers, block, heads, dim, dtype, ids, cut, other
) -> None:
    cache = flash_cache(layers, 12, block, heads, dim, dtype, seed=len(ids) + cut)
    seq_len = max(1, len(ids) * block - cut % block)  # a partial last block when cut % block
    lanes: dict = {}
    first = plan_of(cache, ids, seq_len, block)
    template = kv_layout_template(*first.dtype_shapes())
    layout = payload_layout(first, template)
    out = torch.zeros(layout.total_nbytes, dtype=torch.uint8)
    gather_payload(first, out, layout, lanes)
    assert torch.equal(out[layout.data_start :], general(first, layout)[layout.data_start :])
    check_against_cache(out, layout, cache, ids, seq_len)
    assert len(lanes) == 1
    (lane,) = lanes.values()
    # the next request of the same shape: other blocks, the same template and cache views
    other = (other * len(ids))[: len(ids)]
    second = plan_of(cache, other, seq_len, block, geometry=first.geometry)
    layout2 = payload_layout(second, template)
    out2 = torch.zeros(layout2.total_nbytes, dtype=torch.uint8)
    gather_payload(second, out2, layout2, lanes)
    assert list(lanes.values()) == [lane]  # served by the same lane
    check_against_cache(out2, layout2, cache, other, seq_len)
    assert torch.equal(out2[layout2.data_start :], general(second, layout2)[layout2.data_start :])


@needs_native
def test_a_lane_is_reused_only_for_the_blocks_it_was_made_over() -> None:
    """A replaced cache (same shapes, new tensors) gets a new geometry, new views and so a new
    lane; its bytes come from the new cache, not the old one's addresses."""
    ids, seq_len = [3, 1, 4], 40
    old = flash_cache(2, 8, 16, 2, 64, torch.bfloat16, seed=1)
    new = flash_cache(2, 8, 16, 2, 64, torch.bfloat16, seed=2)
    lanes: dict = {}
    first = plan_of(old, ids, seq_len, 16)
    template = kv_layout_template(*first.dtype_shapes())
    layout = payload_layout(first, template)
    gather_payload(first, torch.zeros(layout.total_nbytes, dtype=torch.uint8), layout, lanes)
    (before,) = lanes.values()
    second = plan_of(new, ids, seq_len, 16, geometry=first.geometry)
    assert second.geometry is not first.geometry
    out = torch.zeros(layout.total_nbytes, dtype=torch.uint8)
    gather_payload(second, out, payload_layout(second, template), lanes)
    (after,) = lanes.values()
    assert after is not before
    check_against_cache(out, payload_layout(second, template), new, ids, seq_len)
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
def test_another_template_or_selection_does_not_take_a_lane() -> None:
    """A lane answers ``fits`` only for its own template, and a plan reading its views with the
    same split into whole blocks and tail."""
    cache = flash_cache(2, 8, 16, 2, 64, torch.bfloat16, seed=4)
    plan = plan_of(cache, [1, 2], 32, 16)
    layout = payload_layout(plan)
    out = torch.zeros(layout.total_nbytes, dtype=torch.uint8)
    lane = PayloadLane.of(plan, out, layout)
    assert lane is not None and lane.fits(plan, out, layout)
    shorter = plan_of(cache, [1, 2], 20, 16, geometry=plan.geometry)  # a tail: another shape
    assert not lane.fits(shorter, out, payload_layout(shorter))
    same_shapes = payload_layout(plan)  # an equal template made again: not this lane's
    assert not lane.fits(plan, out, same_shapes)
    assert not lane.fits(plan, out[1:], layout)  # a buffer too short, and misaligned
    sliced = plan.head_slice(0, 2)  # other views of the cache (one head of two)
    assert not lane.fits(sliced, out, layout)


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
    assert len(lanes) == 1
    assert torch.equal(out[layout.data_start :], general(mla, layout)[layout.data_start :])
    want = latent[0][torch.tensor([4, 1])].reshape(-1, 576)[:30]
    (key_view, _) = dest_views(out, layout)
    assert key_view is not None and torch.equal(key_view.view(torch.uint8), want.contiguous().view(torch.uint8))
