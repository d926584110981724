"""MLA pages without vLLM: a cache shaped and written as vLLM's CPU_MLA backend writes it
(``[num_blocks, 1, block_size, kv_lora_rank + qk_rope_head_dim]``, each token's latent at slot
``block * block_size + row`` of the flat ``[-1, latent]`` view), gathered into a payload,
checked and written into another cache's blocks."""

from __future__ import annotations

import pytest
import torch
from page_kit import load, memory_params, names, page_worker, publish, wait_for

from kvferry.adapters.torch_decode import decode_payload
from kvferry.app.vllm.pages import (
    MLA_PAGE_LAYOUT,
    PAGE_LAYOUT,
    PageGeometry,
    PageWriter,
    block_runs,
    check_payload,
    needs_relay,
    recv_slices,
    send_slices,
    write_pages,
    write_relaid,
)
from kvferry.app.vllm.params import parse_decode_params
from kvferry.app.vllm.worker import LoadJob, PageWorker, SaveJob
from kvferry.core.errors import ConfigError, PayloadError
from kvferry.core.routing import latent_source

BLOCKS, BS, RANK, ROPE = 12, 16, 512, 64
LATENT = RANK + ROPE
LAYERS = 2


def _cpu_mla_cache(
    tokens: int, block_ids: list[int], seed: int, bs: int = BS, blocks: int = BLOCKS
) -> tuple[torch.Tensor, torch.Tensor]:
    """A zero cache and ``tokens`` random latents written into ``block_ids`` the way CPU_MLA's
    ``do_kv_cache_update`` does (``kv_c_normed`` then ``k_pe`` at each slot). Returns (cache,
    latents ``[tokens, LATENT]``)."""
    g = torch.Generator().manual_seed(seed)
    kv_c = torch.randn(tokens, RANK, generator=g).to(torch.bfloat16)
    k_pe = torch.randn(tokens, 1, ROPE, generator=g).to(torch.bfloat16)
    cache = torch.zeros(blocks, 1, bs, LATENT, dtype=torch.bfloat16)
    slots = torch.cat([b * bs + torch.arange(bs) for b in block_ids])[:tokens]
    flat = cache.view(-1, LATENT)
    flat[slots, :RANK] = kv_c
    flat[slots, RANK:] = k_pe.squeeze(1)
    return cache, torch.cat((kv_c, k_pe.squeeze(1)), dim=1)


def _tokens(cache: torch.Tensor, block_ids: list[int], tokens: int) -> torch.Tensor:
    """The latents of ``tokens`` tokens in ``block_ids``, read per slot (as the decode kernel does)."""
    bs = cache.shape[-2]
    slots = torch.cat([b * bs + torch.arange(bs) for b in block_ids])[:tokens]
    return cache.reshape(-1, LATENT)[slots]


def _payload(
    writer: PageWriter, layer: torch.Tensor, block_ids: list[int], layer_idx: int = 0, num_tokens: int = 0
) -> torch.Tensor:
    meta = {
        "layout": PAGE_LAYOUT,
        "layer": layer_idx,
        "num_tokens": num_tokens,
        "block_size": writer.geometry.block_size,
    }
    layout = writer.layout("t1", block_ids, 1, meta)
    buf = torch.empty(layout.total_nbytes, dtype=torch.uint8)
    writer.gather(layer, torch.tensor(block_ids, dtype=torch.long), 0, 1, buf, layout)
    return buf


def test_an_mla_cache_is_one_latent_region_per_block() -> None:
    cache = torch.zeros(BLOCKS, 1, BS, LATENT, dtype=torch.bfloat16)
    g = PageGeometry.of([cache, cache.clone()], latent=True)
    assert (g.latent, g.heads, g.block_size, g.head_size, g.region, g.tensors) == (True, 1, BS, LATENT, BS * LATENT, 1)
    assert g.payload_layout == MLA_PAGE_LAYOUT
    (pages,) = g.page_tensors(cache)
    assert pages.shape == (BLOCKS, 1, BS * LATENT) and pages.data_ptr() == cache.data_ptr()
    with pytest.raises(ConfigError, match="no K and V regions"):
        g.regions(cache)
    # the same tensor read as a dense cache would be two half-latent "regions": not what MLA is
    dense = PageGeometry.of([cache])
    assert (dense.latent, dense.head_size, dense.tensors) == (False, LATENT // 2, 2)
    with pytest.raises(ConfigError, match=r"\[num_blocks, 1, block_size, latent\]"):
        PageGeometry.of([torch.zeros(BLOCKS, 2, BS, LATENT)], latent=True)
    with pytest.raises(ConfigError, match="differs from layer 0"):
        PageGeometry.of([cache, torch.zeros(BLOCKS, 1, BS, 288, dtype=torch.bfloat16)], latent=True)


def test_latent_pages_move_into_other_blocks_token_for_token() -> None:
    tokens, src_blocks, dst_blocks = 40, [7, 2, 9], [0, 1, 5]
    cache, latents = _cpu_mla_cache(tokens, src_blocks, seed=1)
    geometry = PageGeometry.of([cache], latent=True)
    writer = PageWriter(geometry, checksums="crc32c")
    decoded = decode_payload(_payload(writer, cache, src_blocks))
    assert decoded.metadata["layout"] == MLA_PAGE_LAYOUT and decoded.metadata["kv_latent"] is True
    assert decoded.value_cache[0] is None and decoded.key_cache[0].shape == (3, 1, BS * LATENT)
    check_payload(decoded, geometry, 0, 1, 3)

    dest = torch.zeros_like(cache)
    index = torch.tensor(dst_blocks, dtype=torch.long)
    n = write_pages(dest, geometry, decoded, index, 0, 0, 1, block_runs(dst_blocks))
    assert n == 3 * BS * LATENT * 2  # the latent pages alone: no V half
    assert torch.equal(_tokens(dest, dst_blocks, tokens), latents)
    untouched = [b for b in range(BLOCKS) if b not in dst_blocks]
    assert not dest[untouched].any()
    # control: the same blocks of the source cache are other tokens' latents (zero here)
    assert not torch.equal(_tokens(cache, dst_blocks, tokens), latents)

    # a load that starts after a local prefix (page 1 on) writes only the pages it is given
    later = torch.zeros_like(cache)
    write_pages(later, geometry, decoded, torch.tensor([4, 3]), 1, 0, 1, None)
    assert torch.equal(later[4], cache[2]) and torch.equal(later[3], cache[9]) and not later[[0, 1, 2]].any()


def test_check_payload_refuses_what_is_not_this_caches_latent_pages() -> None:
    cache, _ = _cpu_mla_cache(20, [3, 4], seed=2)
    geometry = PageGeometry.of([cache], latent=True)
    decoded = decode_payload(_payload(PageWriter(geometry), cache, [3, 4], layer_idx=1))
    check_payload(decoded, geometry, 1, 1, 2)
    with pytest.raises(PayloadError, match="is for layer 1"):
        check_payload(decoded, geometry, 0, 1, 2)
    with pytest.raises(PayloadError, match=r"expected \[>= 3, 1, 9216\]"):
        check_payload(decoded, geometry, 1, 1, 3)
    other = PageGeometry.of([cache.float()], latent=True)
    with pytest.raises(PayloadError, match="latent pages are bfloat16, this cache is float32"):
        check_payload(decoded, other, 1, 1, 2)
    # a dense cache's payload is not a latent's, nor the other way round
    dense = PageGeometry.of([torch.zeros(BLOCKS, 1, BS, LATENT, dtype=torch.bfloat16)])
    with pytest.raises(PayloadError, match=f"payload layout '{MLA_PAGE_LAYOUT}', expected '{PAGE_LAYOUT}'"):
        check_payload(decoded, dense, 1, 1, 2)
    dense_payload = decode_payload(_payload(PageWriter(dense), cache, [3, 4], layer_idx=1))
    with pytest.raises(PayloadError, match=f"payload layout '{PAGE_LAYOUT}', expected '{MLA_PAGE_LAYOUT}'"):
        check_payload(dense_payload, geometry, 1, 1, 2)
    # a stated block size other than this cache's: the pages must be that size's (re-blocked on write)
    decoded.metadata["block_size"] = 32
    with pytest.raises(PayloadError, match=r"expected \[>= 2, 1, 18432\] \(block_size 32"):
        check_payload(decoded, geometry, 1, 1, 2)
    decoded.metadata["block_size"] = 0
    with pytest.raises(PayloadError, match="payload block_size 0"):
        check_payload(decoded, geometry, 1, 1, 2)
    decoded.metadata["block_size"] = BS
    decoded.metadata["kv_latent"] = False
    with pytest.raises(PayloadError, match="kv_latent: true"):
        check_payload(decoded, geometry, 1, 1, 2)


@pytest.mark.parametrize(("prefill_tp", "decode_tp"), [(1, 1), (1, 2), (2, 1), (2, 4), (4, 2), (8, 1)])
def test_every_decode_rank_reads_the_whole_latent_from_its_one_prefill_rank(prefill_tp: int, decode_tp: int) -> None:
    # total_heads is the model's query-side count and must not matter for a latent
    for heads in (1, 3, 16):
        sent = {
            (sl.source_rank, sl.target_rank, sl.head_start, sl.head_stop)
            for rank in range(prefill_tp)
            for sl in send_slices(prefill_tp, decode_tp, heads, rank, latent=True)
        }
        reads = {
            (sl.source_rank, sl.target_rank, sl.head_start, sl.head_stop)
            for rank in range(decode_tp)
            for sl in recv_slices(prefill_tp, decode_tp, heads, rank, latent=True)
        }
        assert sent == reads == {(latent_source(prefill_tp, decode_tp, t), t, 0, 1) for t in range(decode_tp)}


# ----------------------------------------------------------------------------------- workers
def _worker(name: str, rank: int, tp: int, producer: bool) -> PageWorker:
    # total_kv_heads is what vLLM says for the model; a latent ignores it
    w = page_worker(name, rank, tp, producer, 16)
    w.latent, w.cache_layout = True, "mla/LBNHC"
    return w


def _layers(tokens: int, block_ids: list[int], seed: int) -> dict[str, torch.Tensor]:
    return {f"model.layers.{i}.self_attn.attn": _cpu_mla_cache(tokens, block_ids, seed + i)[0] for i in range(LAYERS)}


@pytest.mark.parametrize(("prefill_tp", "decode_tp"), [(1, 1), (1, 2), (2, 1), (2, 2)])
def test_each_decode_rank_gets_the_whole_latent_from_its_one_prefill_rank(prefill_tp: int, decode_tp: int) -> None:
    name, tokens = f"vllm-mla-{next(names)}", 40
    p_blocks, d_blocks = [3, 7, 1], (10, 2, 5)
    prefills, sources = [], []
    for rank in range(prefill_tp):
        p = _worker(name, rank, prefill_tp, True)
        # every rank holds the whole latent; each rank's own copy differs here (another seed), so
        # the decode's pages say which prefill rank they came from
        caches = _layers(tokens, p_blocks, seed=10 * (rank + 1))
        publish(p, caches, SaveJob("r", "t", tuple(p_blocks), tokens, decode_tp))
        assert p.geometry is not None and p.geometry.latent and p.geometry.heads == 1
        prefills.append(p)
        sources.append(caches)
    decodes = []
    try:
        params = memory_params(
            tokens=tokens, block_size=BS, layers=LAYERS, prefill_tp=prefill_tp, decode_tp=decode_tp, engine_id="e"
        )
        for rank in range(decode_tp):
            d = _worker(name, rank, decode_tp, False)
            dst = {n: torch.zeros(BLOCKS, 1, BS, LATENT, dtype=torch.bfloat16) for n in sources[0]}
            d.register(dst)
            decodes.append(d)
            _, errors = load(d, LoadJob("r", parse_decode_params(params), d_blocks, 0))
            assert errors == set()
            [record] = d.recent_loads
            assert record.ok and record.nbytes == LAYERS * 3 * BS * LATENT * 2  # latent pages only, once
            src = sources[latent_source(prefill_tp, decode_tp, rank)]
            for layer_name, layer in dst.items():
                assert torch.equal(layer[list(d_blocks)], src[layer_name][p_blocks])
                others = [c for i, c in enumerate(sources) if i != latent_source(prefill_tp, decode_tp, rank)]
                for other in others:  # control: another prefill rank's copy is other bytes
                    assert not torch.equal(layer[list(d_blocks)], other[layer_name][p_blocks])
                assert not layer[[b for b in range(BLOCKS) if b not in d_blocks]].any()
    finally:
        for w in decodes + prefills:
            w.close()


def test_a_latent_cache_needs_one_latent_head_per_layer() -> None:
    w = _worker(f"vllm-mla-{next(names)}", 0, 1, False)
    with pytest.raises(ConfigError, match=r"\[num_blocks, 1, block_size, latent\]"):
        w.register({"a": torch.zeros(BLOCKS, 2, BS, LATENT)})


# ------------------------------------------------------------------------------ re-blocking
@pytest.mark.parametrize(("src_bs", "dst_bs"), [(16, 32), (32, 16), (16, 64), (64, 16), (48, 32)])
@pytest.mark.parametrize("tokens", [1, 40, 95])
def test_latent_pages_of_another_block_size_are_reblocked_token_for_token(
    src_bs: int, dst_bs: int, tokens: int
) -> None:
    src_blocks = [5, 1, 7, 3, 0, 2][: -(-tokens // src_bs)]
    cache, latents = _cpu_mla_cache(tokens, src_blocks, seed=3, bs=src_bs, blocks=8)
    decoded = decode_payload(
        _payload(PageWriter(PageGeometry.of([cache], latent=True)), cache, src_blocks, num_tokens=tokens)
    )
    dest = torch.full((8, 1, dst_bs, LATENT), 7.0, dtype=torch.bfloat16)  # not zero: every written byte shows
    geometry = PageGeometry.of([dest], latent=True)
    assert needs_relay(decoded.metadata, geometry, "mla/LBHNC", None)
    check_payload(decoded, geometry, 0, 1, len(src_blocks))
    dst_blocks = [6, 4, 1, 0, 2, 3, 5][: -(-tokens // dst_bs)]
    n = write_relaid(dest, geometry, "mla/LBHNC", None, decoded, torch.tensor(dst_blocks), 0, 0, 1)
    assert n == len(dst_blocks) * dst_bs * LATENT * 2
    assert torch.equal(_tokens(dest, dst_blocks, tokens), latents)
    # the tail of the last local page past the prompt is zero; blocks not given are untouched
    tail = dest[dst_blocks[-1], 0].reshape(dst_bs, LATENT)[tokens - (len(dst_blocks) - 1) * dst_bs :]
    assert not tail.any()
    assert (dest[[b for b in range(8) if b not in dst_blocks]] == 7).all()
    # control: the sender's blocks read with this cache's block size are not the tokens
    if tokens > min(src_bs, dst_bs):
        read_as_is = cache.reshape(-1, LATENT).view(-1, dst_bs, LATENT)
        assert not torch.equal(read_as_is[: len(dst_blocks)].reshape(-1, LATENT)[:tokens], latents)


def test_a_reblocked_load_after_a_local_prefix_writes_only_its_pages() -> None:
    tokens, src_blocks = 90, [2, 0, 4, 1, 3, 5]  # 16-token pages on the sender
    cache, latents = _cpu_mla_cache(tokens, src_blocks, seed=4, bs=16, blocks=6)
    decoded = decode_payload(
        _payload(PageWriter(PageGeometry.of([cache], latent=True)), cache, src_blocks, num_tokens=tokens)
    )
    dest = torch.zeros(4, 1, 32, LATENT, dtype=torch.bfloat16)
    geometry = PageGeometry.of([dest], latent=True)
    write_relaid(dest, geometry, "mla/LBHNC", None, decoded, torch.tensor([3, 0]), 1, 0, 1)  # local pages 1, 2
    assert torch.equal(_tokens(dest, [1, 3, 0], tokens)[32:], latents[32:])
    assert not dest[[1, 2]].any()
    # vLLM's own 3-D MLA cache shape is the same bytes
    flat = dest.squeeze(1).clone()
    assert PageGeometry.of([flat], latent=True) == geometry


def test_reblocking_refuses_latent_pages_that_do_not_hold_the_tokens() -> None:
    cache, _ = _cpu_mla_cache(40, [0, 1, 2], seed=5, bs=16, blocks=3)
    decoded = decode_payload(
        _payload(PageWriter(PageGeometry.of([cache], latent=True)), cache, [0, 1, 2], num_tokens=40)
    )
    geometry = PageGeometry.of([torch.zeros(2, 1, 32, LATENT, dtype=torch.bfloat16)], latent=True)
    decoded.metadata["num_tokens"] = -1
    with pytest.raises(PayloadError, match="cannot be re-blocked into this cache's"):
        write_relaid(torch.zeros(2, 1, 32, LATENT), geometry, "mla/LBHNC", None, decoded, torch.tensor([0, 1]), 0, 0, 1)


@pytest.mark.parametrize(("prefill_bs", "decode_bs"), [(16, 32), (64, 16)])
def test_workers_of_other_block_sizes_move_latents_token_for_token(prefill_bs: int, decode_bs: int) -> None:
    name, tokens = f"vllm-mla-{next(names)}", 70
    p_blocks = [9, 2, 5, 0, 7][: -(-tokens // prefill_bs)]
    d_blocks = (3, 1, 8, 0, 6)[: -(-tokens // decode_bs)]
    p = _worker(name, 0, 1, True)
    caches = {
        f"model.layers.{i}.self_attn.attn": _cpu_mla_cache(tokens, p_blocks, 20 + i, bs=prefill_bs, blocks=BLOCKS)
        for i in range(LAYERS)
    }
    p.register({n: c for n, (c, _) in caches.items()})
    p.begin_step([SaveJob("r", "t", tuple(p_blocks), tokens, 1)])
    p.end_step()
    wait_for(lambda: p.finished({"r"})[0] == {"r"})
    d = _worker(name, 0, 1, False)
    try:
        dst = {n: torch.zeros(BLOCKS, 1, decode_bs, LATENT, dtype=torch.bfloat16) for n in caches}
        d.register(dst)
        params = memory_params(
            tokens=tokens, block_size=prefill_bs, layers=LAYERS, prefill_tp=1, decode_tp=1, engine_id="e"
        )
        d.start_loads([LoadJob("r", parse_decode_params(params), d_blocks, 0)])
        got: set[str] = set()
        wait_for(lambda: got.update(d.finished(set())[1]) or "r" in got)
        assert d.load_errors() == set() and d.stats.take().get("load_failures", {}) in ({}, None)
        [record] = d.recent_loads
        assert record.ok
        for layer_name, (_, latents) in caches.items():
            assert torch.equal(_tokens(dst[layer_name], list(d_blocks), tokens), latents)
            other = caches[next(n for n in caches if n != layer_name)][1]
            assert not torch.equal(_tokens(dst[layer_name], list(d_blocks), tokens), other)  # control
    finally:
        d.close()
        p.close()
