"""vLLM's KV cache groups as kvferry moves them, without torch or vLLM: which pages of each group
a prefill sends and where a decode writes them.

vLLM's hybrid KV cache manager gives every group of layers (one per attention type: full
attention, sliding window, ...) its own block table; all groups draw their blocks from one pool
of pages of one size, so each layer's cache tensor is indexed by block id whatever its group.
A request holds, per group, one block per page of its tokens; a sliding-window group replaces
the pages that fall out of the window by vLLM's null block (id 0) and frees them.

Which pages a group keeps is vLLM's rule (``SlidingWindowManager.get_num_skipped_tokens`` and
``remove_skipped_blocks`` in vLLM 0.32): after ``n`` computed tokens, the first ``max(0, n -
window + 1 - extra_retained_tokens)`` tokens are skipped and every whole page of them is freed,
so the first page kept is that number of tokens divided by the block size
(:func:`kept_first_page`).

A hybrid decode loads all but the prompt's last token and computes that one itself: vLLM, after
a load of the whole prompt, recomputes the last token anyway, and its manager, allocating for
``n`` tokens, would have dropped the page holding token ``n - window``, which that token's window
reads whenever ``n - window + 1`` is a multiple of the block size (measured: a 79-token prompt,
window 48, block size 32, gave other tokens). For ``n - 1`` tokens it keeps that page. So the
prefill sends, per group, its pages from ``kept_first_page(n - 1)`` to the prompt's last
(:func:`sent_pages`), and the decode, whose own manager keeps the same pages for ``n - 1``
tokens, writes each of its non-null blocks from the page it holds (:func:`load_span`). The
prefill's vLLM frees the page below ``kept_first_page(n)`` when the request finishes, right
after its last step: when that page is sent (:func:`freed_at_finish`) the save must be out by
the end of that step.

A decode may run another block size than the prefill (each instance's groups of pages of tokens
share one): the decode re-blocks each group's pages per token (:func:`relaid_span`). The tokens
a sliding-window decode keeps are decided by its own block size: its pages from
``kept_first_page(n - 1, decode_block_size)``, i.e. from token ``kept * decode_block_size``,
which may lie below the prefill's first kept page. So the prefill sends from its page holding
that token (:func:`window_first_page`), for the decode block size it is told
(``decode_block_size`` in the request's ``kv_transfer_params`` or the connector's extra config;
its own when not told). Such a send may reach more than one page below ``kept_first_page(n)``;
``hold_step`` covers them all (:func:`freed_at_finish`). The prefill still holds that page when
``kept_first_page(c)`` of the ``c`` tokens it computed before its last step is not past it (its
manager frees the pages below that at the step): always for a prompt computed in one step. A
chunked prefill whose last chunk starts later (one shorter than about the decode's block size
less the prefill's) has freed it: :func:`sent_pages` starts past the null block, and the
decode's load fails (``layout``), so ``kv_load_failure_policy`` applies.

:func:`describe_groups` reads vLLM's ``KVCacheConfig`` by attribute and spec class name, and
refuses at start (ConfigError naming the group, a layer and the spec type) every spec kvferry
does not move: chunked local attention, cross attention, ...

A Mamba / gated-delta-net group (``MambaSpec``) holds no pages of tokens but the request's
recurrent state (conv and SSM/temporal state tensors) in one block. vLLM's kernels read and
write the state of a request whose ``t`` tokens are computed in its block ``(t - 1) //
block_size`` (``mamba_get_block_table_tensor``; in mode ``none`` the block size is the model's
length, so that is block 0): :func:`state_page`. A recurrent state cannot be rewound one token,
and the decode computes the prompt's last token itself (above), so the state it needs is the
one after ``n - 1`` tokens: the prefill computes the prompt without its last token
(:func:`state_prompt_tokens`, vLLM's own P/D rule for Mamba models) and sends that state's one
block; the decode, loading ``n - 1`` tokens, writes it into its block for ``n - 1`` tokens
(:func:`state_pages`, both sides). Mamba groups keep no pages of tokens, so their block size
(the model's length in mode ``none``) is not the other groups' and is left out of the
one-block-size rule.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs

from kvferry.core.errors import ConfigError

__all__ = [
    "NULL_BLOCK",
    "FULL",
    "SLIDING_WINDOW",
    "MAMBA",
    "MOVED_SPECS",
    "MAMBA_MODES",
    "GroupSpec",
    "GroupPages",
    "kept_first_page",
    "window_first_page",
    "prompt_pages",
    "sent_pages",
    "freed_at_finish",
    "load_span",
    "relaid_span",
    "state_page",
    "state_pages",
    "state_prompt_tokens",
    "describe_groups",
]

#: vLLM's null block: the id a sliding-window group's freed pages point at (never written).
NULL_BLOCK = 0
FULL = "full"
SLIDING_WINDOW = "sliding_window"
#: A Mamba / gated-delta-net group: the request's recurrent state in one block.
MAMBA = "mamba"
#: vLLM's ``mamba_cache_mode`` values kvferry moves (``align`` and ``all`` keep prefill
#: checkpoints and move blocks in place: not moved; refused at start).
MAMBA_MODES = ("none",)
#: The KV cache spec classes kvferry moves, by vLLM class name, and how their groups keep pages.
MOVED_SPECS = {
    "FullAttentionSpec": FULL,
    "MLAAttentionSpec": FULL,
    "SlidingWindowSpec": SLIDING_WINDOW,
    "MambaSpec": MAMBA,
}


@attrs.frozen
class GroupSpec:
    """One KV cache group: ``kind`` (:data:`FULL`, :data:`SLIDING_WINDOW` or :data:`MAMBA`),
    its block size, for a sliding window its ``window`` and vLLM's ``extra_retained_tokens``,
    for a Mamba group vLLM's ``mamba_cache_mode`` (``mode``)."""

    index: int
    kind: str
    block_size: int
    window: int | None = None
    extra: int = 0
    layers: tuple[str, ...] = ()
    mode: str | None = None

    @property
    def label(self) -> str:
        if self.kind == MAMBA:
            return f"{self.kind}:{self.mode}"
        return self.kind if self.window is None else f"{self.kind}:{self.window}"

    @property
    def state(self) -> bool:
        """A group of recurrent state (one block per request), not of pages of tokens."""
        return self.kind == MAMBA


@attrs.frozen
class GroupPages:
    """Pages ``first_page .. first_page + len(block_ids) - 1`` of one group, in ``block_ids``."""

    group: int
    first_page: int
    block_ids: tuple[int, ...]


def prompt_pages(num_tokens: int, block_size: int) -> int:
    """Pages that hold ``num_tokens`` tokens."""
    return -(-num_tokens // block_size)


def kept_first_page(num_tokens: int, block_size: int, window: int | None = None, extra: int = 0) -> int:
    """The first page a group still holds after ``num_tokens`` computed tokens: 0 for full
    attention (``window`` None), else the whole pages of the ``max(0, num_tokens - window + 1
    - extra)`` tokens vLLM's sliding-window manager skips (and frees)."""
    if window is None:
        return 0
    skipped = max(0, num_tokens - window + 1 - extra)
    return skipped // block_size


def window_first_page(
    num_tokens: int, block_size: int, window: int | None, extra: int = 0, decode_block_size: int | None = None
) -> int:
    """The first page (of this prefill's ``block_size`` tokens) a prefill sends of a group for a
    prompt of ``num_tokens`` tokens, so that a decode of ``decode_block_size`` tokens a page
    (None: this ``block_size``), loading all but the last token, finds every token of each page
    it keeps: that decode keeps its pages from ``kept_first_page(num_tokens - 1,
    decode_block_size)``, whose first token is ``kept * decode_block_size``; the prefill sends
    from its page holding that token. 0 for full attention (``window`` None). With equal block
    sizes it is ``kept_first_page(num_tokens - 1)``. A decode that loads more tokens keeps its
    pages from that page or a later one (:func:`kept_first_page` only grows with the tokens)."""
    bs = block_size if decode_block_size is None else decode_block_size
    kept = kept_first_page(max(0, num_tokens - 1), bs, window, extra)
    return kept * bs // block_size


def _window_first(spec: GroupSpec, num_tokens: int, decode_block_size: int | None = None) -> int:
    """The first page :func:`sent_pages` sends (:func:`window_first_page`)."""
    return window_first_page(num_tokens, spec.block_size, spec.window, spec.extra, decode_block_size)


def freed_at_finish(spec: GroupSpec, num_tokens: int, decode_block_size: int | None = None) -> bool:
    """Whether the prefill's vLLM frees, when the request finishes after its prompt, a page
    :func:`sent_pages` sends for a decode of ``decode_block_size`` (the pages below
    ``kept_first_page(num_tokens)``: with equal block sizes the one holding token ``num_tokens
    - window``, with a larger decode block size possibly more)."""
    first = _window_first(spec, num_tokens, decode_block_size)
    return first < kept_first_page(num_tokens, spec.block_size, spec.window, spec.extra)


def state_page(num_tokens: int, block_size: int) -> int:
    """The block (index in the request's block table) of a Mamba group that holds the state
    after ``num_tokens`` computed tokens: ``(num_tokens - 1) // block_size`` (vLLM's
    ``mamba_get_block_table_tensor``; 0 for no token)."""
    return max(0, num_tokens - 1) // block_size


def state_pages(spec: GroupSpec, block_ids: Sequence[int], num_tokens: int) -> GroupPages | None:
    """A Mamba group's one block holding the state after ``num_tokens`` tokens, as the page
    :func:`state_page` says; None when the group holds no block there (or vLLM's null block)."""
    page = state_page(num_tokens, spec.block_size)
    if page >= len(block_ids) or int(block_ids[page]) == NULL_BLOCK:
        return None
    return GroupPages(spec.index, page, (int(block_ids[page]),))


def state_prompt_tokens(num_prompt_tokens: int) -> int:
    """The prompt a prefill computes for a decode with recurrent state: all but its last token
    (the decode computes that one from the state after ``n - 1`` tokens); a 1-token prompt
    stays whole (the decode then loads nothing)."""
    return num_prompt_tokens - 1 if num_prompt_tokens > 1 else num_prompt_tokens


def sent_pages(
    spec: GroupSpec, block_ids: Sequence[int], num_tokens: int, decode_block_size: int | None = None
) -> GroupPages | None:
    """What a prefill sends of one group for a prompt of ``num_tokens`` tokens: its pages from
    the first the window of the prompt's last token reads on a decode of ``decode_block_size``
    (None: this group's block size; :func:`window_first_page`; 0 for full attention) to the
    prompt's last. A null block inside that range (vLLM never
    leaves one there) moves the start past it, so every block sent holds the group's pages.
    None when the group holds fewer blocks than the prompt's pages. A Mamba group: its state
    after the ``num_tokens`` tokens computed (:func:`state_pages`)."""
    if spec.state:
        return state_pages(spec, block_ids, num_tokens)
    last = prompt_pages(num_tokens, spec.block_size)
    if len(block_ids) < last:
        return None
    first = _window_first(spec, num_tokens, decode_block_size)
    blocks = [int(b) for b in block_ids[first:last]]
    for i in range(len(blocks) - 1, -1, -1):
        if blocks[i] == NULL_BLOCK:
            first, blocks = first + i + 1, blocks[i + 1 :]
            break
    return GroupPages(spec.index, first, tuple(blocks))


def load_span(
    first_page: int, block_ids: Sequence[int], sent_first: int, sent_count: int
) -> tuple[int, tuple[int, ...]]:
    """Where a decode writes one group's payload: its blocks for pages ``first_page ..`` are
    ``block_ids``; the payload holds the prefill's pages ``sent_first .. sent_first +
    sent_count - 1``. Returns ``(row, blocks)``: the non-null blocks (null ones lead: pages
    this decode's window dropped) and the payload row of the first of them. ValueError when a
    null block follows a real one or a page to write is not in the payload."""
    skip, blocks = _real_blocks(first_page, block_ids)
    if not blocks:
        return 0, ()
    start = first_page + skip
    row = start - sent_first
    if row < 0 or row + len(blocks) > sent_count:
        raise ValueError(
            f"pages {start}..{start + len(blocks) - 1} are needed, the prefill sent pages "
            f"{sent_first}..{sent_first + sent_count - 1}"
        )
    return row, blocks


def _real_blocks(first_page: int, block_ids: Sequence[int]) -> tuple[int, tuple[int, ...]]:
    """``(skip, blocks)``: how many null blocks lead ``block_ids`` (pages a window dropped) and
    the real blocks after them; ValueError when a null block follows a real one."""
    skip = 0
    while skip < len(block_ids) and block_ids[skip] == NULL_BLOCK:
        skip += 1
    blocks = tuple(int(b) for b in block_ids[skip:])
    if NULL_BLOCK in blocks:
        raise ValueError(f"null block after a real one in pages from {first_page}: {list(block_ids)}")
    return skip, blocks


def relaid_span(
    first_page: int,
    block_ids: Sequence[int],
    block_size: int,
    sent: tuple[int, int, int],
    num_tokens: int,
) -> tuple[int, tuple[int, ...]]:
    """:func:`load_span` for a payload of pages of another block size (re-blocked per token on
    write): this decode's blocks for its pages ``first_page ..`` (``block_size`` tokens each)
    are ``block_ids``; the payload holds the prefill's pages ``sent_first .. sent_first +
    sent_count - 1`` of ``src_block_size`` tokens (``sent``) of a prompt of ``num_tokens``.
    Returns ``(page, blocks)``: the non-null blocks (null ones lead) and this decode's page of
    the first of them. ValueError when a null block follows a real one or a token those
    blocks hold (up to the prompt's end) is not in the payload."""
    sent_first, sent_count, src_block_size = sent
    skip, blocks = _real_blocks(first_page, block_ids)
    start = first_page + skip
    stop_token = min(num_tokens, (start + len(blocks)) * block_size)
    if not blocks or stop_token <= start * block_size:
        return start, ()
    have = (sent_first * src_block_size, (sent_first + sent_count) * src_block_size)
    need = (start * block_size, stop_token)
    if need[0] < have[0] or need[1] > have[1]:
        raise ValueError(
            f"tokens {need[0]}..{need[1] - 1} are needed (pages {start}.. of {block_size}), the prefill sent "
            f"tokens {have[0]}..{have[1] - 1} (pages {sent_first}..{sent_first + sent_count - 1} of "
            f"{src_block_size}; a prefill sends a window for the decode_block_size it is told)"
        )
    return start, blocks


def _group_spec(index: int, group: Any) -> GroupSpec:
    spec: Any = getattr(group, "kv_cache_spec", None)
    layers = tuple(str(n) for n in getattr(group, "layer_names", ()) or ())
    kind_name = type(spec).__name__
    kind = MOVED_SPECS.get(kind_name)
    where = f"KV cache group {index} (layer {layers[0]!r})" if layers else f"KV cache group {index}"
    if kind is None:
        raise ConfigError(
            f"{where}: kv_cache_spec {kind_name}; kvferry moves {', '.join(sorted(MOVED_SPECS))} "
            f"(linear-attention state, chunked local and cross attention and other specs are not moved)"
        )
    if getattr(group, "enable_kv_transfer", True) is False:
        raise ConfigError(f"{where}: enable_kv_transfer is False; kvferry moves every group's pages")
    block_size = int(spec.block_size)
    if kind == MAMBA:
        return _mamba_spec(index, spec, where, block_size, layers)
    if kind == FULL:
        return GroupSpec(index, FULL, block_size, layers=layers)
    window = int(spec.sliding_window)
    extra = int(getattr(spec, "extra_retained_tokens", 0) or 0)
    return GroupSpec(index, SLIDING_WINDOW, block_size, window, extra, layers)


def _mamba_spec(index: int, spec: Any, where: str, block_size: int, layers: tuple[str, ...]) -> GroupSpec:
    mode = str(getattr(spec, "mamba_cache_mode", "none"))
    if mode not in MAMBA_MODES:
        raise ConfigError(
            f"{where}: kv_cache_spec MambaSpec with mamba_cache_mode {mode!r}; kvferry moves Mamba state "
            f"in mode {', '.join(MAMBA_MODES)} (prefix caching off)"
        )
    spec_blocks = int(getattr(spec, "num_speculative_blocks", 0) or 0)
    if spec_blocks:
        raise ConfigError(
            f"{where}: kv_cache_spec MambaSpec with num_speculative_blocks {spec_blocks}; kvferry moves "
            f"Mamba state without speculative decoding"
        )
    return GroupSpec(index, MAMBA, block_size, layers=layers, mode=mode)


def describe_groups(kv_cache_config: Any) -> tuple[GroupSpec, ...]:
    """The groups of vLLM's ``KVCacheConfig`` (empty when it has none); ConfigError naming the
    group, a layer and the spec type for a spec kvferry does not move, and for groups of
    different block sizes (kvferry moves one page size per engine; a Mamba group's block size,
    which holds no pages of tokens, is left out)."""
    groups = tuple(getattr(kv_cache_config, "kv_cache_groups", None) or ())
    specs = tuple(_group_spec(i, g) for i, g in enumerate(groups))
    sizes = {s.block_size for s in specs if not s.state}
    if len(sizes) > 1:
        raise ConfigError(
            f"kv_cache_groups: block sizes {sorted(sizes)}; kvferry moves groups of one block size "
            f"({', '.join(f'group {s.index}: {s.block_size}' for s in specs if not s.state)})"
        )
    return specs
