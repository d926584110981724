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
    NULL_BLOCK,
    SLIDING_WINDOW,
    GroupSpec,
    describe_groups,
    freed_at_finish,
    kept_first_page,
    load_span,
    prompt_pages,
    sent_pages,
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


@pytest.mark.parametrize("name", ["MambaSpec", "ChunkedLocalAttentionSpec", "CrossAttentionSpec", "RSWASpec"])
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
