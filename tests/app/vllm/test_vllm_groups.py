"""Which pages of each KV cache group move (app/vllm/groups.py), as properties: the first page a
sliding-window group keeps is vLLM's rule (``get_num_skipped_tokens`` // block size), a prefill
sends exactly the pages its manager keeps, and a decode writes each of its non-null blocks from
the payload row of its page. tests/engines/vllm/test_hybrid_scheduler.py checks the same against
vLLM's own manager."""

from __future__ import annotations

import types

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvferry.app.vllm.groups import (
    FULL,
    MAMBA,
    NULL_BLOCK,
    SLIDING_WINDOW,
    GroupSpec,
    describe_groups,
    freed_at_finish,
    kept_first_page,
    load_span,
    prompt_pages,
    relaid_span,
    sent_pages,
    state_page,
    state_pages,
    state_prompt_tokens,
    window_first_page,
)
from kvferry.core.errors import ConfigError

tokens = st.integers(1, 2000)
block_sizes = st.sampled_from([1, 2, 4, 16, 32, 128])
windows = st.integers(1, 600)
extras = st.integers(0, 64)


def _held(spec: GroupSpec, num_tokens: int) -> list[int]:
    """A request's block ids of one group after ``num_tokens`` computed tokens, as vLLM's
    manager leaves them: one block per page (ids from 1), the pages before the kept one null."""
    pages = prompt_pages(num_tokens, spec.block_size)
    first = kept_first_page(num_tokens, spec.block_size, spec.window, spec.extra)
    return [NULL_BLOCK if p < first else 100 + p for p in range(pages)]


@given(tokens, block_sizes, windows, extras)
def test_the_kept_page_is_the_first_holding_a_token_the_window_keeps(n: int, bs: int, w: int, extra: int) -> None:
    first = kept_first_page(n, bs, w, extra)
    skipped = max(0, n - w + 1 - extra)  # tokens 0 .. skipped-1 are outside the next query's window
    # every page before ``first`` holds skipped tokens only; page ``first`` holds a kept token or
    # part of the skipped ones (vLLM frees whole pages only)
    assert first * bs <= skipped < (first + 1) * bs
    assert kept_first_page(n, bs, None, extra) == 0  # full attention keeps every page
    assert kept_first_page(n + 1, bs, w, extra) >= first  # the window only moves forward
    assert kept_first_page(n, bs, w, extra + 1) <= first  # retaining more keeps more


@given(tokens, block_sizes, st.one_of(st.none(), windows), extras, st.integers(1, 2000))
def test_a_prefill_sends_the_pages_the_last_tokens_window_reads(
    n: int, bs: int, w: int | None, extra: int, chunk: int
) -> None:
    """At the step that computes the prompt's last chunk (from token ``c``), vLLM's manager
    holds the pages kept after ``c`` tokens; the prefill sends those from the first page the
    window of the prompt's last token reads, which is what a decode that computes that token
    keeps."""
    kind = FULL if w is None else SLIDING_WINDOW
    spec = GroupSpec(1, kind, bs, w, extra if w is not None else 0)
    c = max(0, n - chunk)
    held = _held(spec, c)  # the chunk's blocks come after those
    held += [100 + p for p in range(len(held), prompt_pages(n, bs))]
    sent = sent_pages(spec, held, n)
    assert sent is not None and sent.group == 1
    decode_keeps = [100 + p for p in range(kept_first_page(n - 1, bs, w, spec.extra), prompt_pages(n, bs))]
    assert list(sent.block_ids) == decode_keeps
    assert NULL_BLOCK not in sent.block_ids and sent.first_page == kept_first_page(n - 1, bs, w, spec.extra)
    # once the request finishes, vLLM keeps from kept_first_page(n): the sent page below that,
    # if any, is the one the window of token n - 1 reads; the save must be out before that free
    finish_first = kept_first_page(n, bs, w, spec.extra)
    assert freed_at_finish(spec, n) == (sent.first_page < finish_first)
    assert finish_first - sent.first_page in (0, 1)
    if w is None:
        assert sent.first_page == 0 and len(sent.block_ids) == prompt_pages(n, bs)
    # a group that holds fewer blocks than the prompt's pages sends nothing
    assert sent_pages(spec, held[:-1], n) is None


def test_a_null_block_inside_the_range_moves_the_start_past_it() -> None:
    spec = GroupSpec(0, SLIDING_WINDOW, 4, 8)
    # 21 tokens, window 8: the last token's window reads from token 13, page 3; a (never seen)
    # null at page 3
    sent = sent_pages(spec, [0, 0, 0, 0, 9, 10], 21)
    assert sent is not None and (sent.first_page, sent.block_ids) == (4, (9, 10))
    sent = sent_pages(spec, [0, 0, 0, 7, 9, 10], 21)
    assert sent is not None and (sent.first_page, sent.block_ids) == (3, (7, 9, 10))


@given(st.integers(2, 2000), block_sizes, windows, extras, st.integers(0, 3))
def test_a_decode_writes_each_page_it_keeps_from_the_payload_row_of_that_page(
    n: int, bs: int, w: int, extra: int, lag: int
) -> None:
    """The decode's manager, allocating for the ``n - 1`` tokens it loads (a decode that keeps
    ``lag`` pages more fails), holds its own blocks; each non-null one gets the payload row of
    its page."""
    spec = GroupSpec(0, SLIDING_WINDOW, bs, w, extra)
    sent = sent_pages(spec, _held(spec, n - 1) + [900], n)  # the prefill's blocks at its last step
    assert sent is not None
    decode_first = kept_first_page(n - 1, bs, w, extra + lag * bs)
    pages = prompt_pages(n - 1, bs)
    local = [NULL_BLOCK if p < decode_first else 500 + p for p in range(pages)]
    if decode_first < sent.first_page:  # the decode keeps a page the prefill did not send
        with pytest.raises(ValueError, match="the prefill sent pages"):
            load_span(0, local, sent.first_page, len(sent.block_ids))
        return
    row, blocks = load_span(0, local, sent.first_page, len(sent.block_ids))
    assert blocks == tuple(500 + p for p in range(decode_first, pages))
    # row r of the payload is page sent.first_page + r: each block gets its own page
    assert [sent.first_page + row + i for i in range(len(blocks))] == [b - 500 for b in blocks]
    if lag == 0:  # same window: all of it from row 0 (the last page too, unless token n - 1 starts it)
        assert row == 0 and len(blocks) in (len(sent.block_ids), len(sent.block_ids) - 1)


def test_load_span_refuses_a_null_after_a_real_block_and_reads_from_a_first_page() -> None:
    with pytest.raises(ValueError, match="null block after a real one"):
        load_span(0, [0, 5, 0, 6], 0, 4)
    assert load_span(3, [0, 7, 8], 3, 3) == (1, (7, 8))
    assert load_span(2, [0, 0], 0, 4) == (0, ())


# ----------------------------------------------------------- a decode of another block size
any_block_sizes = st.sampled_from([1, 2, 3, 16, 32, 48, 64, 96, 128, 256])


def _decode_blocks(n_loaded: int, bs: int, w: int | None, extra: int) -> list[int]:
    """The decode's blocks of one group after allocating for ``n_loaded`` tokens (vLLM's rule):
    one block per page (ids from 500), the pages before the kept one null."""
    first = kept_first_page(n_loaded, bs, w, extra)
    return [NULL_BLOCK if p < first else 500 + p for p in range(prompt_pages(n_loaded, bs))]


@given(
    st.integers(2, 2000),
    any_block_sizes,
    any_block_sizes,
    st.one_of(st.none(), windows),
    extras,
    st.integers(0, 1),
)
def test_a_prefill_sends_every_token_a_decode_of_another_block_size_keeps(
    n: int, bs_p: int, bs_d: int, w: int | None, extra: int, more: int
) -> None:
    """For any two block sizes: the tokens the prefill sends (its pages from
    window_first_page) cover every token of every block the decode keeps, among the ``n - 1``
    tokens it loads (or ``n``: a decode that loads more keeps no earlier page), and the decode
    finds each of them (relaid_span)."""
    extra = extra if w is not None else 0
    spec = GroupSpec(1, FULL if w is None else SLIDING_WINDOW, bs_p, w, extra)
    held = [100 + p for p in range(prompt_pages(n, bs_p))]  # a prompt computed in one step
    sent = sent_pages(spec, held, n, bs_d)
    assert sent is not None and sent.first_page == window_first_page(n, bs_p, w, extra, bs_d)
    assert list(sent.block_ids) == held[sent.first_page :]
    have = range(sent.first_page * bs_p, prompt_pages(n, bs_p) * bs_p)  # tokens in the payload
    loaded = n - 1 + more
    local = _decode_blocks(loaded, bs_d, w, extra)
    kept_tokens = [t for p, b in enumerate(local) if b != NULL_BLOCK for t in range(p * bs_d, (p + 1) * bs_d)]
    assert all(t in have for t in kept_tokens if t < loaded)
    page, blocks = relaid_span(0, local, bs_d, (sent.first_page, len(sent.block_ids), bs_p), n)
    assert blocks == tuple(b for b in local if b != NULL_BLOCK)
    assert page == len(local) - len(blocks)
    # the fewest: the prefill's next page does not hold the decode's first kept token
    kept0 = kept_first_page(n - 1, bs_d, w, extra) * bs_d
    assert sent.first_page * bs_p <= kept0 < (sent.first_page + 1) * bs_p
    if bs_d == bs_p:  # one block size: the rule of one block size
        assert sent.first_page == kept_first_page(n - 1, bs_p, w, extra)
    if w is None:
        assert sent.first_page == 0
    # hold_step: every sent page below the one vLLM keeps after n tokens is freed at finish
    assert freed_at_finish(spec, n, bs_d) == (sent.first_page < kept_first_page(n, bs_p, w, extra))
    assert freed_at_finish(spec, n, bs_p) == freed_at_finish(spec, n)


@given(st.integers(2, 2000), any_block_sizes, any_block_sizes, windows, extras, st.integers(1, 2000))
def test_a_chunked_prefill_sends_the_decodes_window_or_the_load_fails(
    n: int, bs_p: int, bs_d: int, w: int, extra: int, chunk: int
) -> None:
    """A prefill whose last chunk starts at token ``c`` holds the pages kept after ``c`` tokens:
    it sends the decode's window when it still holds its first page (always for ``c`` 0), else
    the decode's load fails (ValueError, a ``layout`` failure), never a wrong token."""
    spec = GroupSpec(1, SLIDING_WINDOW, bs_p, w, extra)
    c = max(0, n - chunk)
    held = _held(spec, c)
    held += [100 + p for p in range(len(held), prompt_pages(n, bs_p))]
    sent = sent_pages(spec, held, n, bs_d)
    assert sent is not None and NULL_BLOCK not in sent.block_ids
    first = window_first_page(n, bs_p, w, extra, bs_d)
    local = _decode_blocks(n - 1, bs_d, w, extra)
    span = (sent.first_page, len(sent.block_ids), bs_p)
    if kept_first_page(c, bs_p, w, extra) <= first:
        assert sent.first_page == first
        assert relaid_span(0, local, bs_d, span, n)[1] == tuple(b for b in local if b != NULL_BLOCK)
    else:
        assert sent.first_page > first
        if any(b != NULL_BLOCK for b in local) and sent.first_page * bs_p > local.count(NULL_BLOCK) * bs_d:
            with pytest.raises(ValueError, match="the prefill sent tokens"):
                relaid_span(0, local, bs_d, span, n)


def test_a_window_for_a_decode_of_larger_pages_starts_earlier() -> None:
    # 100 tokens, window 48: a decode loading 99 skips 52 tokens; of 32-token pages it keeps from
    # page 1 (token 32), so a 16-token prefill sends from its page 2, not 3 (its own rule)
    assert window_first_page(100, 16, 48, 0, 32) == 2
    assert window_first_page(100, 16, 48) == kept_first_page(99, 16, 48) == 3
    # of 16-token pages a 32-token prefill's decode keeps from page 3 (token 48): its page 1
    assert window_first_page(100, 32, 48, 0, 16) == 1
    spec = GroupSpec(1, SLIDING_WINDOW, 16, 48)
    assert freed_at_finish(spec, 100, 32) and not freed_at_finish(spec, 100)  # page 2 < 53 // 16


def test_relaid_span_checks_tokens_not_pages() -> None:
    # decode pages of 32 from page 1 (tokens 32..98 of a 99-token load); prefill pages of 16 from 2
    assert relaid_span(0, [0, 7, 8, 9], 32, (2, 5, 16), 99) == (1, (7, 8, 9))
    with pytest.raises(ValueError, match="tokens 32..98 are needed"):
        relaid_span(0, [0, 7, 8, 9], 32, (3, 4, 16), 99)
    with pytest.raises(ValueError, match="null block after a real one"):
        relaid_span(0, [0, 7, 0], 32, (0, 7, 16), 99)
    assert relaid_span(2, [0, 0], 32, (0, 7, 16), 99) == (4, ())


# ------------------------------------------------------------------------------- vLLM's specs
def _spec(name: str, **fields: object) -> object:
    return type(name, (), {})() if not fields else type(name, (), dict(fields))()


def _config(*groups: tuple[object, list[str]]) -> object:
    return types.SimpleNamespace(
        kv_cache_groups=[types.SimpleNamespace(kv_cache_spec=s, layer_names=names) for s, names in groups]
    )


def test_describe_groups_reads_full_and_sliding_window_groups() -> None:
    full = _spec("FullAttentionSpec", block_size=16)
    swa = _spec("SlidingWindowSpec", block_size=16, sliding_window=48, extra_retained_tokens=0)
    got = describe_groups(_config((full, ["l.0", "l.2"]), (swa, ["l.1", "l.3"])))
    assert got == (
        GroupSpec(0, FULL, 16, layers=("l.0", "l.2")),
        GroupSpec(1, SLIDING_WINDOW, 16, 48, 0, ("l.1", "l.3")),
    )
    assert describe_groups(None) == () and describe_groups(_config()) == ()


@pytest.mark.parametrize("name", ["ChunkedLocalAttentionSpec", "CrossAttentionSpec", "RSWASpec"])
def test_a_spec_kvferry_does_not_move_is_refused_naming_group_layer_and_type(name: str) -> None:
    full = _spec("FullAttentionSpec", block_size=16)
    other = _spec(name, block_size=16)
    with pytest.raises(ConfigError) as info:
        describe_groups(_config((full, ["l.0"]), (other, ["model.layers.1.mixer"])))
    msg = str(info.value)
    assert "KV cache group 1" in msg and "model.layers.1.mixer" in msg and name in msg
    assert "FullAttentionSpec" in msg and "SlidingWindowSpec" in msg  # what is supported


def test_groups_of_different_block_sizes_are_refused() -> None:
    a = _spec("FullAttentionSpec", block_size=16)
    b = _spec("SlidingWindowSpec", block_size=32, sliding_window=64)
    with pytest.raises(ConfigError, match=r"block sizes \[16, 32\]"):
        describe_groups(_config((a, ["x"]), (b, ["y"])))


def test_a_group_not_for_transfer_is_refused() -> None:
    cfg = _config((_spec("FullAttentionSpec", block_size=16), ["x"]))
    cfg.kv_cache_groups[0].enable_kv_transfer = False  # type: ignore[attr-defined]
    with pytest.raises(ConfigError, match="enable_kv_transfer"):
        describe_groups(cfg)


# ------------------------------------------------------------------------- Mamba state groups
def _state_table(num_tokens: int, bs: int) -> list[int]:
    """A Mamba group's block table after ``num_tokens`` tokens (mode ``none``: one block per
    ``block_size`` tokens, the model's length, so one block; ids from 300)."""
    return [300 + p for p in range(prompt_pages(max(1, num_tokens), bs))]


@given(st.integers(1, 4000), st.sampled_from([1, 16, 64, 2048, 4096]))
def test_the_state_block_is_the_one_vllms_kernels_read_for_the_tokens_computed(n: int, bs: int) -> None:
    """vLLM reads and writes the state of a request of ``t`` computed tokens in its block
    ``(t - 1) // block_size`` (mamba_get_block_table_tensor; block 0 in mode ``none``, whose
    block size is the model's length): the last block of a table of ``ceil(t / bs)`` blocks."""
    assert state_page(n, bs) == (n - 1) // bs == prompt_pages(n, bs) - 1
    if n <= bs:
        assert state_page(n, bs) == 0
    assert state_page(0, bs) == 0


@given(st.integers(1, 4000), st.sampled_from([16, 64, 2048, 4096]), st.integers(0, 3))
def test_the_prefill_sends_the_state_the_decode_writes_for_the_same_tokens(n: int, bs: int, lag: int) -> None:
    """The prefill computes all but the prompt's last token and sends the block holding that
    state; the decode, loading those ``n - 1`` tokens, writes it into its own block for them; a
    prefill that computed the whole prompt states another token count (the loader refuses it)."""
    spec = GroupSpec(2, MAMBA, bs, mode="none")
    computed = state_prompt_tokens(n)
    assert computed == (n - 1 if n > 1 else 1)
    sent = sent_pages(spec, _state_table(computed, bs), computed)
    assert sent is not None and sent.group == 2 and len(sent.block_ids) == 1
    assert sent.first_page == state_page(computed, bs) and sent.block_ids == (300 + sent.first_page,)
    assert not freed_at_finish(spec, computed)  # a state block is held until the request is sent
    decode = [700 + p for p in range(prompt_pages(n, bs))]  # the decode allocates for the whole prompt
    got = state_pages(spec, decode, computed)
    assert got is not None and got.first_page == sent.first_page and got.block_ids == (700 + sent.first_page,)
    # a table too short, or vLLM's null block there, sends nothing
    assert state_pages(spec, [], computed) is None
    nulls = [NULL_BLOCK] * (sent.first_page + 1)
    assert state_pages(spec, nulls, computed) is None
    if lag and n > 1 + lag:  # the state after other token counts is not the same block's in general
        other = state_pages(spec, decode, computed - lag)
        assert other is not None and other.first_page == state_page(computed - lag, bs)


def test_describe_groups_reads_a_mamba_group_of_its_own_block_size() -> None:
    full = _spec("FullAttentionSpec", block_size=16)
    mamba = _spec("MambaSpec", block_size=4096, mamba_cache_mode="none", num_speculative_blocks=0)
    got = describe_groups(_config((full, ["l.0"]), (mamba, ["l.1.mixer", "l.2.mixer"])))
    assert got == (
        GroupSpec(0, FULL, 16, layers=("l.0",)),
        GroupSpec(1, MAMBA, 4096, layers=("l.1.mixer", "l.2.mixer"), mode="none"),
    )
    assert got[1].state and not got[0].state and got[1].label == "mamba:none"


@pytest.mark.parametrize(
    ("fields", "key"),
    [
        ({"mamba_cache_mode": "align"}, "mamba_cache_mode 'align'"),
        ({"num_speculative_blocks": 2}, "num_speculative_blocks 2"),
    ],
)
def test_a_mamba_group_kvferry_does_not_move_is_refused_naming_group_layer_and_key(
    fields: dict[str, object], key: str
) -> None:
    spec = _spec("MambaSpec", **{"block_size": 4096, "mamba_cache_mode": "none", "num_speculative_blocks": 0, **fields})
    with pytest.raises(ConfigError) as info:
        describe_groups(_config((_spec("FullAttentionSpec", block_size=16), ["l.0"]), (spec, ["l.1.mixer"])))
    msg = str(info.value)
    assert "KV cache group 1" in msg and "l.1.mixer" in msg and "MambaSpec" in msg and key in msg
