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

:func:`describe_groups` reads vLLM's ``KVCacheConfig`` by attribute and spec class name, and
refuses at start (ConfigError naming the group, a layer and the spec type) every spec kvferry
does not move: Mamba / gated-delta-net state, chunked local attention, cross attention, ...
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
    "MOVED_SPECS",
    "GroupSpec",
    "GroupPages",
    "kept_first_page",
    "prompt_pages",
    "sent_pages",
    "freed_at_finish",
    "load_span",
    "describe_groups",
]

#: vLLM's null block: the id a sliding-window group's freed pages point at (never written).
NULL_BLOCK = 0
FULL = "full"
SLIDING_WINDOW = "sliding_window"
#: The KV cache spec classes kvferry moves, by vLLM class name, and how their groups keep pages.
MOVED_SPECS = {
    "FullAttentionSpec": FULL,
    "MLAAttentionSpec": FULL,
    "SlidingWindowSpec": SLIDING_WINDOW,
}


@attrs.frozen
class GroupSpec:
    """One KV cache group: ``kind`` (:data:`FULL` or :data:`SLIDING_WINDOW`), its block size,
    and for a sliding window its ``window`` and vLLM's ``extra_retained_tokens``."""

    index: int
    kind: str
    block_size: int
    window: int | None = None
    extra: int = 0
    layers: tuple[str, ...] = ()

    @property
    def label(self) -> str:
        return self.kind if self.window is None else f"{self.kind}:{self.window}"


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


def _window_first(spec: GroupSpec, num_tokens: int) -> int:
    """The first page the window of a prompt's last token reads (what a decode that computes
    that token keeps: :func:`kept_first_page` of ``num_tokens - 1``)."""
    return kept_first_page(max(0, num_tokens - 1), spec.block_size, spec.window, spec.extra)


def freed_at_finish(spec: GroupSpec, num_tokens: int) -> bool:
    """Whether the prefill's vLLM frees, when the request finishes after its prompt, a page
    :func:`sent_pages` sends (the page holding token ``num_tokens - window``)."""
    return _window_first(spec, num_tokens) < kept_first_page(num_tokens, spec.block_size, spec.window, spec.extra)


def sent_pages(spec: GroupSpec, block_ids: Sequence[int], num_tokens: int) -> GroupPages | None:
    """What a prefill sends of one group for a prompt of ``num_tokens`` tokens: its pages from
    the first the window of the prompt's last token reads (``kept_first_page(num_tokens - 1)``;
    0 for full attention) to the prompt's last. A null block inside that range (vLLM never
    leaves one there) moves the start past it, so every block sent holds the group's pages.
    None when the group holds fewer blocks than the prompt's pages."""
    last = prompt_pages(num_tokens, spec.block_size)
    if len(block_ids) < last:
        return None
    first = _window_first(spec, num_tokens)
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
    skip = 0
    while skip < len(block_ids) and block_ids[skip] == NULL_BLOCK:
        skip += 1
    blocks = tuple(int(b) for b in block_ids[skip:])
    if NULL_BLOCK in blocks:
        raise ValueError(f"null block after a real one in pages from {first_page}: {list(block_ids)}")
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


def _group_spec(index: int, group: Any) -> GroupSpec:
    spec: Any = getattr(group, "kv_cache_spec", None)
    layers = tuple(str(n) for n in getattr(group, "layer_names", ()) or ())
    kind_name = type(spec).__name__
    kind = MOVED_SPECS.get(kind_name)
    where = f"KV cache group {index} (layer {layers[0]!r})" if layers else f"KV cache group {index}"
    if kind is None:
        raise ConfigError(
            f"{where}: kv_cache_spec {kind_name}; kvferry moves {', '.join(sorted(MOVED_SPECS))} "
            f"(Mamba / linear-attention state and other specs are not moved)"
        )
    if getattr(group, "enable_kv_transfer", True) is False:
        raise ConfigError(f"{where}: enable_kv_transfer is False; kvferry moves every group's pages")
    block_size = int(spec.block_size)
    if kind == FULL:
        return GroupSpec(index, FULL, block_size, layers=layers)
    window = int(spec.sliding_window)
    extra = int(getattr(spec, "extra_retained_tokens", 0) or 0)
    return GroupSpec(index, SLIDING_WINDOW, block_size, window, extra, layers)


def describe_groups(kv_cache_config: Any) -> tuple[GroupSpec, ...]:
    """The groups of vLLM's ``KVCacheConfig`` (empty when it has none); ConfigError naming the
    group, a layer and the spec type for a spec kvferry does not move, and for groups of
    different block sizes (kvferry moves one page size per engine)."""
    groups = tuple(getattr(kv_cache_config, "kv_cache_groups", None) or ())
    specs = tuple(_group_spec(i, g) for i, g in enumerate(groups))
    sizes = {s.block_size for s in specs}
    if len(sizes) > 1:
        raise ConfigError(
            f"kv_cache_groups: block sizes {sorted(sizes)}; kvferry moves groups of one block size "
            f"({', '.join(f'group {s.index}: {s.block_size}' for s in specs)})"
        )
    return specs
