"""Mamba / gated-delta-net state on the worker side, without vLLM: a hybrid cache of a
full-attention group and a Mamba group (vLLM 0.32's raw state pages ``[blocks, 1, 1, bytes]``
int8 over a padded page: conv state bf16, then SSM state float32) is saved and loaded between
PageWorkers over the memory connector. The request's state block lands in the decode's state
block bit for bit, the attention pages in theirs; a state of other shapes, of another token
count (a prefill that computed the whole prompt) or from another TP size fails the request as
``layout``, a flipped byte as a checksum failure, with nothing written."""

from __future__ import annotations

import types

import pytest
import torch
from page_kit import load, memory_params, names, page_worker, publish, wait_for

from kvferry.adapters.torch_decode import decode_payload
from kvferry.app.vllm.group_pages import GroupLoadError
from kvferry.app.vllm.groups import FULL, MAMBA, GroupPages, GroupSpec
from kvferry.app.vllm.params import ConnectorSettings, parse_decode_params
from kvferry.app.vllm.scheduler import PageScheduler
from kvferry.app.vllm.state_pages import STATE_LAYOUT, StateLoadError, StateSpec, StateWriter, state_view, write_state
from kvferry.app.vllm.worker import LoadJob, PageWorker, SaveJob
from kvferry.core.errors import ConfigError, PayloadError

BLOCKS, BS, HEADS, HD = 24, 16, 2, 32
PAGE_BYTES = HEADS * BS * 2 * HD * 2  # one attention block of one layer, bf16: the pool's page
SPEC = StateSpec(((3, 96), (4, 16, 8)), ("bfloat16", "float32"))  # conv (kernel - 1, dims), ssm (heads, dim, state)
LAYER_GROUPS = (0, 1, 0, 1)  # attention, mamba, attention, mamba
STATES = (None, SPEC, None, SPEC)
TOKENS = 100  # the prompt; the prefill computes 99 (groups.state_prompt_tokens)
COMPUTED = TOKENS - 1
P_FULL, D_FULL = (3, 7, 1, 9, 11, 2, 5), (10, 12, 13, 15, 16, 17, 18)  # 7 pages of 99 tokens
P_STATE, OTHER_STATE, D_STATE = 14, 4, 21


def _caches(seed: int | None) -> dict[str, torch.Tensor]:
    """vLLM's caches: attention pages, and for a Mamba layer the raw state bytes of each block
    at the front of a page of the pool's size (``page_size_padded``), random state values."""
    g = torch.Generator().manual_seed(seed) if seed is not None else None
    out: dict[str, torch.Tensor] = {}
    for i, spec in enumerate(STATES):
        if spec is None:
            t = torch.zeros(BLOCKS, HEADS, BS, 2 * HD, dtype=torch.bfloat16)
            if g is not None:
                t.copy_(torch.randn(t.shape, generator=g))
            out[f"model.layers.{i}.self_attn.attn"] = t
            continue
        pool = torch.zeros(BLOCKS, PAGE_BYTES, dtype=torch.int8)
        raw = pool[:, : spec.nbytes].unsqueeze(1).unsqueeze(1)  # [blocks, 1, 1, bytes], strided
        if g is not None:
            view = state_view(raw, spec)
            for b in range(BLOCKS):
                for s in spec.split(view[b]):
                    s.copy_(torch.randn(s.shape, generator=g))
        out[f"model.layers.{i}.mixer"] = raw
    return out


def _worker(name: str, producer: bool, tp: int = 1, rank: int = 0) -> PageWorker:
    w = page_worker(name, rank, tp, producer, HEADS)
    w.layer_groups, w.layer_states = LAYER_GROUPS, STATES
    return w


def _save(name: str, num_tokens: int = COMPUTED, decode_tp: int = 1) -> tuple[PageWorker, dict[str, torch.Tensor]]:
    groups = (GroupPages(0, 0, P_FULL), GroupPages(1, 0, (P_STATE,)))
    p, c = _worker(name, True), _caches(seed=7)
    publish(p, c, SaveJob("r", "t", P_FULL, num_tokens, decode_tp, groups))
    return p, c


def _job(num_tokens: int = COMPUTED, upto: int = COMPUTED, prefill_tp: int = 1) -> LoadJob:
    params = memory_params(
        tokens=num_tokens, block_size=BS, layers=4, prefill_tp=prefill_tp, decode_tp=1, engine_id="e"
    )
    groups = (GroupPages(0, 0, D_FULL), GroupPages(1, 0, (D_STATE,)))
    return LoadJob("r", parse_decode_params(params), D_FULL, 0, groups=groups, upto_tokens=upto)


def test_the_state_block_and_the_pages_move_bit_for_bit() -> None:
    name = f"vllm-state-{next(names)}"
    p, src = _save(name)
    d = _worker(name, False)
    try:
        dst = _caches(seed=None)
        d.register(dst)
        assert load(d, _job()) == ({"r"}, set()) and d.failed_loads() == set()
        [record] = d.recent_loads
        assert record.ok and record.nbytes == 2 * 7 * PAGE_BYTES + 2 * SPEC.nbytes
        for i, name_ in enumerate(dst):
            if STATES[i] is None:
                assert torch.equal(dst[name_][list(D_FULL)], src[name_][list(P_FULL)])
                continue
            got, sent = state_view(dst[name_], SPEC), state_view(src[name_], SPEC)
            assert torch.equal(got[D_STATE], sent[P_STATE])  # the state's bytes, bit for bit
            for a, b in zip(SPEC.split(got[D_STATE]), SPEC.split(sent[P_STATE])):  # conv, then ssm
                assert a.dtype == b.dtype and torch.equal(a, b)
            # control: another request's state block (and the other layer's) holds other bytes
            assert not torch.equal(got[D_STATE], sent[OTHER_STATE])
            assert not torch.equal(got[D_STATE], state_view(src[f"model.layers.{4 - i}.mixer"], SPEC)[P_STATE])
            assert not got[[b for b in range(BLOCKS) if b != D_STATE]].any()  # only that block written
            # the padding after the state in each page is not the state's: never written
            assert not dst[name_].as_strided((BLOCKS, PAGE_BYTES), (PAGE_BYTES, 1))[:, SPEC.nbytes :].any()
    finally:
        d.close()
        p.close()


def test_a_state_of_the_whole_prompt_fails_the_load_as_layout() -> None:
    """A prefill that computed all ``n`` tokens sent the state after ``n``; the decode, which
    computes the last token itself from ``n - 1``, refuses it (it cannot be rewound)."""
    name = f"vllm-state-{next(names)}"
    p, _ = _save(name, num_tokens=TOKENS)
    d = _worker(name, False)
    try:
        dst = _caches(seed=None)
        d.register(dst)
        loaded, errors = load(d, _job(num_tokens=TOKENS, upto=COMPUTED))
        assert errors == set() and d.failed_loads() == {"r"}  # the request, never blocks
        assert d.stats.peek().get("failures_layout") == 1
        assert not state_view(dst["model.layers.1.mixer"], SPEC).any()
    finally:
        d.close()
        p.close()


def test_state_moves_between_equal_tp_sizes_only() -> None:
    name = f"vllm-state-{next(names)}"
    d = _worker(name, False)
    try:
        d.register(_caches(seed=None))
        assert load(d, _job(prefill_tp=2)) == ({"r"}, set()) and d.failed_loads() == {"r"}
        assert d.stats.peek().get("failures_layout") == 1
    finally:
        d.close()
    p = _worker(name, True)
    try:
        c = _caches(seed=7)
        p.register(c)
        p.begin_step([SaveJob("r", "t", P_FULL, COMPUTED, 2, (GroupPages(0, 0, P_FULL), GroupPages(1, 0, (14,))))])
        p.end_step()
        wait_for(lambda: p.stats.peek().get("failures_put", 0) == 1)  # the first state layer fails the save
        wait_for(lambda: p.finished({"r"})[0] == {"r"})  # its blocks are given back all the same
        assert p.stats.peek().get("requests_sent", 0) == 0
    finally:
        p.close()


def test_a_mamba_layer_whose_bytes_are_not_its_spec_is_refused_at_register() -> None:
    w = _worker(f"vllm-state-{next(names)}", False)
    c = _caches(seed=None)
    c["model.layers.3.mixer"] = torch.zeros(BLOCKS, 1, 1, SPEC.nbytes - 2, dtype=torch.int8)
    with pytest.raises(ConfigError, match=r"layer 'model.layers.3.mixer': 2622 bytes of state per block"):
        w.register(c)
    c["model.layers.3.mixer"] = torch.zeros(BLOCKS, 4, dtype=torch.float32)
    with pytest.raises(ConfigError, match=r"model.layers.3.mixer.*\[num_blocks, 1, 1, bytes\]"):
        w.register(c)


# ------------------------------------------------------------------------- one payload, directly
def _payload(spec: StateSpec, block: torch.Tensor, **meta: object) -> torch.Tensor:
    writer = StateWriter(checksums="crc32")
    base = {"layer": 1, "num_tokens": COMPUTED, "group": 1, "first_page": 0, **meta}
    layout = writer.layout("t", [0], spec, base)
    dest = torch.empty(layout.total_nbytes, dtype=torch.uint8)
    writer.gather(block.unsqueeze(0) if block.dim() == 1 else block, torch.tensor([0]), dest, layout)
    return dest


def _state(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (1, SPEC.nbytes), generator=g, dtype=torch.uint8)


def test_write_state_checks_layout_tokens_block_and_checksum_before_writing() -> None:
    target = GroupPages(1, 0, (5,))
    sent = _state(1)
    view = torch.zeros(8, SPEC.nbytes, dtype=torch.uint8)

    def write(data: torch.Tensor, spec: StateSpec = SPEC, tokens: int = COMPUTED, group: int = 1) -> int:
        decoded = decode_payload(data, defer_verify=True)
        assert decoded.metadata["layout"] == STATE_LAYOUT
        return write_state(view, spec, decoded, 1, group, target, tokens)

    with pytest.raises(StateLoadError, match=r"layer 1: the prefill's state is .*bfloat16"):
        write(_payload(SPEC, sent), spec=StateSpec(((3, 96), (4, 16, 4), (2,)), ("bfloat16", "float32", "int8")))
    with pytest.raises(StateLoadError, match="has seen 100 tokens, this load brings 99"):
        write(_payload(SPEC, sent, num_tokens=TOKENS))
    with pytest.raises(StateLoadError, match="block 2 of its table"):
        write(_payload(SPEC, sent, first_page=2))
    with pytest.raises(GroupLoadError, match="group 0"):
        write(_payload(SPEC, sent, group=0))
    flipped = _payload(SPEC, sent)
    flipped[-1] ^= 0x01  # the state's last byte (the payload ends with the state tensor)
    with pytest.raises(PayloadError, match="mismatch"):
        write(flipped)
    assert not view.any()  # nothing written by any of them
    assert write(_payload(SPEC, sent)) == SPEC.nbytes
    assert torch.equal(view[5], sent[0]) and not view[[0, 1, 2, 3, 4, 6, 7]].any()
    assert not torch.equal(view[5], _state(2)[0])  # control: another state differs


# ------------------------------------------------------------------------ the prefill's prompt
def _request(n: int, params: dict | None, max_tokens: int = 16) -> types.SimpleNamespace:
    ids = list(range(1, n + 1))
    return types.SimpleNamespace(
        request_id="q",
        prompt_token_ids=ids,
        _all_token_ids=list(ids),
        num_prompt_tokens=n,
        max_tokens=max_tokens,
        kv_transfer_params=params,
    )


def _scheduler(threshold: int = 0, groups: tuple[GroupSpec, ...] | None = None) -> PageScheduler:
    settings = ConnectorSettings.from_extra_config({"kv_recompute_threshold": threshold})
    default = (GroupSpec(0, MAMBA, 1024, mode="none"), GroupSpec(1, FULL, 16))
    return PageScheduler(settings, "e", 16, 4, 1, producer=True, consumer=False, groups=groups or default)


def test_a_prefill_for_a_remote_decode_computes_all_but_the_last_token_once() -> None:
    req = _request(100, {"do_remote_decode": True})
    s = _scheduler()
    s.new_request(req)
    assert req.num_prompt_tokens == 99 and req.prompt_token_ids == list(range(1, 100))
    assert req._all_token_ids == list(range(1, 100)) and req.max_tokens == 1
    s.new_request(req)  # a preempted request comes back: not cut again
    assert req.num_prompt_tokens == 99 and len(req.prompt_token_ids) == 99
    # controls: not for a remote decode, shorter than the threshold, a 1-token prompt, no Mamba group
    for req, s in (
        (_request(100, None), _scheduler()),
        (_request(100, {"do_remote_prefill": True}), _scheduler()),
        (_request(100, {"do_remote_decode": True}), _scheduler(threshold=768)),
        (_request(1, {"do_remote_decode": True}), _scheduler()),
        (
            _request(100, {"do_remote_decode": True}),
            _scheduler(groups=(GroupSpec(0, FULL, 16), GroupSpec(1, FULL, 16))),
        ),
    ):
        n = req.num_prompt_tokens
        s.new_request(req)
        assert req.num_prompt_tokens == n and len(req.prompt_token_ids) == n and req.max_tokens == 16


def test_the_state_moves_between_caches_of_other_block_sizes() -> None:
    """A prefill of 16-token pages, a decode of 32-token pages (another pool page size): the
    attention group is re-blocked per token (the CPU kernel's page order), the state block moves
    bit for bit (it holds no pages of tokens: one block whatever the block size)."""
    from kvferry.adapters.kv_layouts import vllm_pages_to_tokens

    name = f"vllm-state-{next(names)}"
    d_bs = 32
    d_page = HEADS * d_bs * 2 * HD * 2
    d_full = (10, 12, 13, 15)  # 4 pages of 32 hold the 99 tokens loaded
    p, src = _worker(name, True), _caches(seed=7)
    p.kernel_isa, p.cache_layout = "vec", "vllm_cpu:vec/LBHNC"
    publish(p, src, SaveJob("r", "t", P_FULL, COMPUTED, 1, (GroupPages(0, 0, P_FULL), GroupPages(1, 0, (P_STATE,)))))
    d = _worker(name, False)
    d.kernel_isa, d.cache_layout = "vec", "vllm_cpu:vec/LBHNC"
    try:
        dst: dict[str, torch.Tensor] = {}
        for i, spec in enumerate(STATES):
            if spec is None:
                dst[f"model.layers.{i}.self_attn.attn"] = torch.zeros(BLOCKS, HEADS, d_bs, 2 * HD, dtype=torch.bfloat16)
            else:
                pool = torch.zeros(BLOCKS, d_page, dtype=torch.int8)
                dst[f"model.layers.{i}.mixer"] = pool[:, : spec.nbytes].unsqueeze(1).unsqueeze(1)
        d.register(dst)
        params = memory_params(tokens=COMPUTED, block_size=BS, layers=4, prefill_tp=1, decode_tp=1, engine_id="e")
        groups = (GroupPages(0, 0, d_full), GroupPages(1, 0, (D_STATE,)))
        job = LoadJob("r", parse_decode_params(params), d_full, 0, groups=groups, upto_tokens=COMPUTED)
        assert load(d, job) == ({"r"}, set()) and d.failed_loads() == set()
        [record] = d.recent_loads
        assert record.ok and record.nbytes == 2 * 4 * d_page + 2 * SPEC.nbytes
        for i, name_ in enumerate(dst):
            if STATES[i] is None:

                def tokens(cache: torch.Tensor, blocks: tuple[int, ...], bs: int) -> torch.Tensor:
                    r = cache[list(blocks)].view(len(blocks), HEADS, 2, bs * HD)
                    k, _ = vllm_pages_to_tokens(r[:, :, 0], r[:, :, 1], block_size=bs, num_tokens=COMPUTED, isa="vec")
                    return k

                assert torch.equal(tokens(dst[name_], d_full, d_bs), tokens(src[name_], P_FULL, BS))
                continue
            got, sent = state_view(dst[name_], SPEC), state_view(src[name_], SPEC)
            assert torch.equal(got[D_STATE], sent[P_STATE])
            assert not torch.equal(got[D_STATE], sent[OTHER_STATE])  # control: another request's block
            assert not got[[b for b in range(BLOCKS) if b != D_STATE]].any()
    finally:
        d.close()
        p.close()
