"""Hybrid KV cache groups between a prefill and a decode of other block sizes, on the worker side
without vLLM: a full-attention group and a 48-token sliding-window group (layers alternating),
saved from a prefill cache of one block size, loaded into a decode cache of another over the
memory connector. Both caches are written from per-token truth through the CPU kernel's page
order (``tokens_to_vllm_pages``); the decode's pages are read back per token.

The prefill's save plan is the scheduler's rule (groups.sent_pages for the decode's block size),
the decode's blocks are vLLM's for the ``n - 1`` tokens it loads (the pages before its window
null). Two requests move side by side, each the other's control."""

from __future__ import annotations

import pytest
import torch
from page_kit import memory_params, names, page_worker, wait_for

from kvferry.adapters.kv_layouts import tokens_to_vllm_pages, vllm_pages_to_tokens
from kvferry.app.vllm.groups import (
    FULL,
    NULL_BLOCK,
    SLIDING_WINDOW,
    GroupPages,
    GroupSpec,
    kept_first_page,
    prompt_pages,
    sent_pages,
)
from kvferry.app.vllm.params import parse_decode_params
from kvferry.app.vllm.worker import LoadJob, PageWorker, SaveJob

HEADS, HD, WINDOW, TOKENS = 2, 32, 48, 100
LAYER_GROUPS = (0, 1, 0, 1)  # full, sliding window, full, sliding window
LAYOUT, ISA = "vllm_cpu:vec/LBHNC", "vec"
REQUESTS = ("r", "o")


def _truth(seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer, each token's K and V ``[TOKENS, HEADS, HD]``."""
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(TOKENS, HEADS, HD, generator=g).bfloat16(), torch.randn(TOKENS, HEADS, HD, generator=g).bfloat16())
        for _ in LAYER_GROUPS
    ]


def _worker(name: str, producer: bool, **extra: object) -> PageWorker:
    w = page_worker(name, 0, 1, producer, HEADS, **extra)
    w.kernel_isa, w.cache_layout, w.layer_groups = ISA, LAYOUT, LAYER_GROUPS
    return w


def _specs(bs: int) -> tuple[GroupSpec, GroupSpec]:
    return GroupSpec(0, FULL, bs), GroupSpec(1, SLIDING_WINDOW, bs, WINDOW)


def _block_ids(bs: int, request: int) -> tuple[list[int], list[int]]:
    """Each group's blocks of a request, one per page of the prompt: unique over the pool (one
    pool for both groups and both requests), in no order."""
    pages = prompt_pages(TOKENS, bs)
    ids = [1 + i for i in range(4 * pages)][::-1]  # reversed: the order matters
    mine = ids[request * 2 * pages : (request + 1) * 2 * pages]
    return mine[:pages], mine[pages:]


def _save(name: str, p_bs: int, d_bs: int | None, truths: list) -> PageWorker:
    """The prefill: both requests' tokens in its pages, each request saved by the scheduler's
    plan for a decode of ``d_bs`` (None: not told, its own)."""
    blocks = 4 * prompt_pages(TOKENS, p_bs) + 1
    caches = {
        f"model.layers.{i}.self_attn.attn": torch.zeros(blocks, HEADS, p_bs, 2 * HD, dtype=torch.bfloat16)
        for i in range(len(LAYER_GROUPS))
    }
    jobs = []
    for r, truth in enumerate(truths):
        per_group = _block_ids(p_bs, r)
        for cache, (k, v), group in zip(caches.values(), truth, LAYER_GROUPS):
            kp, vp = tokens_to_vllm_pages(k, v, block_size=p_bs, isa=ISA)
            regions = cache.view(blocks, HEADS, 2, p_bs * HD)
            regions[per_group[group], :, 0], regions[per_group[group], :, 1] = kp, vp
        groups = tuple(sent_pages(spec, ids, TOKENS, d_bs) for spec, ids in zip(_specs(p_bs), per_group))
        assert all(g is not None for g in groups)
        jobs.append(SaveJob(REQUESTS[r], f"t{r}", groups[0].block_ids, TOKENS, 1, groups))  # type: ignore[union-attr]
    p = _worker(name, True)
    p.register(caches)
    p.begin_step(jobs)
    for layer_name, t in caches.items():
        p.save_layer(layer_name, t)
    p.end_step()
    wait_for(lambda: p.finished(set(REQUESTS))[0] == set(REQUESTS) or p.pending_saves == 0)
    return p


def _decode_groups(d_bs: int, request: int) -> tuple[GroupPages, GroupPages]:
    """The decode's blocks of each group for the ``TOKENS - 1`` tokens it loads (vLLM's rule)."""
    pages = prompt_pages(TOKENS - 1, d_bs)
    base = 200 + request * 2 * pages
    full = tuple(base + p for p in range(pages))
    kept = kept_first_page(TOKENS - 1, d_bs, WINDOW)
    swa = tuple(NULL_BLOCK if p < kept else base + pages + p for p in range(pages))
    return GroupPages(0, 0, full), GroupPages(1, 0, swa)


def _load(name: str, p_bs: int, d_bs: int) -> tuple[PageWorker, dict[str, torch.Tensor]]:
    blocks = 200 + 4 * prompt_pages(TOKENS, d_bs) + 3
    dst = {
        f"model.layers.{i}.self_attn.attn": torch.zeros(blocks, HEADS, d_bs, 2 * HD, dtype=torch.bfloat16)
        for i in range(len(LAYER_GROUPS))
    }
    d = _worker(name, False)
    d.register(dst)
    jobs = []
    for r, rid in enumerate(REQUESTS):
        params = memory_params(
            tokens=TOKENS,
            block_size=p_bs,
            layers=len(LAYER_GROUPS),
            prefill_tp=1,
            decode_tp=1,
            engine_id="e",
            transfer_id=f"t{r}",
        )
        groups = _decode_groups(d_bs, r)
        jobs.append(LoadJob(rid, parse_decode_params(params), groups[0].block_ids, 0, groups=groups))
    d.start_loads(jobs)
    got: set[str] = set()
    wait_for(lambda: got.update(d.finished(set())[1]) or got == set(REQUESTS))
    return d, dst


def _tokens(cache: torch.Tensor, blocks: tuple[int, ...], bs: int) -> tuple[torch.Tensor, torch.Tensor]:
    regions = cache[list(blocks)].view(len(blocks), HEADS, 2, bs * HD)
    n = len(blocks) * bs
    return vllm_pages_to_tokens(regions[:, :, 0], regions[:, :, 1], block_size=bs, num_tokens=n, isa=ISA)


@pytest.mark.parametrize(("p_bs", "d_bs"), [(32, 64), (64, 32), (16, 48)])
def test_each_group_is_reblocked_into_the_decodes_blocks_token_for_token(p_bs: int, d_bs: int) -> None:
    name = f"hybrid-blocks-{next(names)}"
    truths = [_truth(5), _truth(6)]
    p = _save(name, p_bs, d_bs, truths)
    d, dst = _load(name, p_bs, d_bs)
    try:
        assert d.failed_loads() == set() and d.load_errors() == set()
        pages = prompt_pages(TOKENS - 1, d_bs)
        kept = kept_first_page(TOKENS - 1, d_bs, WINDOW)
        page_bytes = HEADS * d_bs * 2 * HD * 2
        for rec in d.recent_loads:  # every page of the full layers, the window's of the others
            assert rec.ok and rec.nbytes == (2 * pages + 2 * (pages - kept)) * page_bytes, rec
        written: set[int] = set()
        for r, truth in enumerate(truths):
            full, swa = _decode_groups(d_bs, r)
            for (layer_name, cache), (k, v), group in zip(dst.items(), truth, LAYER_GROUPS):
                blocks = full.block_ids if group == 0 else swa.block_ids[kept:]
                first = 0 if group == 0 else kept * d_bs  # the first token the decode keeps
                stop = min(TOKENS, pages * d_bs)  # the decode's last page may hold the prompt's last token
                got_k, got_v = _tokens(cache, blocks, d_bs)
                assert torch.equal(got_k[: stop - first], k[first:stop]), (layer_name, r)
                assert torch.equal(got_v[: stop - first], v[first:stop]), (layer_name, r)
                assert not got_k[stop - first :].any()  # past the prompt: zero
                # control: the other request's tokens are not these
                other_k, _ = truths[1 - r][list(dst).index(layer_name)]
                assert not torch.equal(got_k[: stop - first], other_k[first:stop])
                written.update(blocks)
        for layer_name, cache in dst.items():  # nothing else written
            assert not cache[[b for b in range(cache.shape[0]) if b not in written]].any(), layer_name
        own = kept_first_page(TOKENS - 1, p_bs, WINDOW) * p_bs  # the prefill's own window's first token
        # 32 -> 64: the decode keeps from token 0, below the prefill's own window (token 32)
        assert (kept * d_bs < own) == ((p_bs, d_bs) == (32, 64))
    finally:
        d.close()
        p.close()


def test_a_prefill_not_told_the_decodes_block_size_fails_the_load_not_blocks() -> None:
    """A prefill of 16-token pages sends its own window (from token 48); a decode of 32-token
    pages keeps from token 32: its load fails (``layout``), per request (vLLM's
    ``failed_recving``), and nothing of the window group is written."""
    name = f"hybrid-blocks-{next(names)}"
    p = _save(name, 16, None, [_truth(5), _truth(6)])
    d, dst = _load(name, 16, 32)
    try:
        assert d.failed_loads() == set(REQUESTS) and d.load_errors() == set()
        assert d.stats.peek().get("failures_layout") == 2
        assert not any(rec.ok for rec in d.recent_loads)
    finally:
        d.close()
        p.close()


def test_a_prefill_told_the_decodes_block_size_by_its_settings_sends_its_window() -> None:
    """``decode_block_size`` in the extra config (a request's ``kv_transfer_params`` override it):
    the prefill scheduler's save plan starts the window group at the decode's first kept token."""
    from kvferry.app.vllm.params import ConnectorSettings, parse_prefill_params
    from kvferry.app.vllm.scheduler import PageScheduler

    for extra, params, want in (
        ({"decode_block_size": 32}, {}, 2),  # 16-token pages from token 32
        ({}, {"decode_block_size": 32}, 2),
        ({"decode_block_size": 64}, {"decode_block_size": 32}, 2),  # the request's wins
        ({}, {}, 3),  # not told: its own rule (token 48)
    ):
        assert parse_prefill_params({"do_remote_decode": True, **params}) is not None
        settings = ConnectorSettings.from_extra_config({**extra, "kv_recompute_threshold": 0})
        ids = [list(range(1, 8)), list(range(11, 18))]

        class _Req:
            request_id, num_prompt_tokens, num_computed_tokens = "r", TOKENS, 0
            kv_transfer_params = {"do_remote_decode": True, **params}

        s = PageScheduler(
            settings,
            "e",
            16,
            len(LAYER_GROUPS),
            1,
            producer=True,
            consumer=False,
            groups=_specs(16),
            group_block_ids_of=lambda rid: ids,
        )
        s.track(_Req())
        [save] = s.build_plan({"r": TOKENS}).saves
        assert save.groups[1].first_page == want and save.groups[1].block_ids == tuple(ids[1][want:])
        assert save.groups[0].block_ids == tuple(ids[0])
        # vLLM keeps from page 3 (53 // 16) at finish: a save from page 2 holds its step
        assert save.hold_step == (want < 3)
