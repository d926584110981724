"""One KV cache group's received pages written into a decode's blocks (vLLM's hybrid manager).

A hybrid payload is one layer's pages of its group from ``first_page`` on (metadata ``group``
and ``first_page``, set by :class:`~kvferry.app.vllm.saver.PageSaver`); the load job holds the
group's local blocks from the job's first page (:class:`~kvferry.app.vllm.records.LoadJob`
``groups``). :func:`write_group_pages` checks the payload is this layer's group's, finds the
rows for the decode's non-null blocks (:func:`kvferry.app.vllm.groups.load_span`) and writes
them page for page. Hybrid pages are never re-blocked or re-laid: both sides run one block
size and one layout.
"""

from __future__ import annotations

from typing import Any

import torch

from kvferry.adapters.torch_decode import verify_deferred
from kvferry.app.vllm.groups import GroupPages, load_span
from kvferry.app.vllm.pages import PageGeometry, block_runs, check_payload, needs_relay, write_pages
from kvferry.core.errors import PayloadError

__all__ = ["GroupLoadError", "write_group_pages"]


class GroupLoadError(PayloadError):
    """A hybrid payload that does not fit this decode's group (another group, missing pages)."""


def write_group_pages(
    layer: torch.Tensor,
    geometry: PageGeometry,
    decoded: Any,
    layer_idx: int,
    group: int,
    target: GroupPages,
    needed_pages: int,
    heads: tuple[int, int, int],
    cache: tuple[str | None, str | None] = (None, None),
    layer_bytes: memoryview | None = None,
) -> int:
    """Write ``layer``'s payload (of KV cache group ``group``) into ``target``'s blocks, those
    of pages below ``needed_pages`` (the prefill's prompt); ``heads``: the slice's head count
    and the receiving head range; ``cache``: this cache's layout label and kernel ISA. Returns
    the bytes written. PayloadError for a corrupt payload, GroupLoadError for one that is not
    this group's or lacks a page to write. Checksums decoding deferred are checked as
    :func:`~kvferry.app.vllm.pages.write_pages` checks them (in its copy, with ``layer_bytes``),
    or here when no page of the payload is written."""
    num_heads, recv_start, recv_stop = heads
    meta = decoded.metadata or {}
    if meta.get("group") != group:
        theirs = meta.get("group")
        raise GroupLoadError(f"layer {layer_idx}: payload of KV cache group {theirs!r}, this layer's is {group}")
    sent_first = meta.get("first_page")
    if isinstance(sent_first, bool) or not isinstance(sent_first, int) or sent_first < 0:
        raise PayloadError(f"layer {layer_idx}: payload first_page {sent_first!r}")
    if needs_relay(meta, geometry, *cache):
        raise GroupLoadError(
            f"layer {layer_idx}: the prefill's pages (block_size {meta.get('block_size')}, "
            f"{meta.get('cache_layout')}) differ from this cache's; hybrid groups move page for page"
        )
    check_payload(decoded, geometry, layer_idx, num_heads, 0)
    ids = target.block_ids[: max(0, needed_pages - target.first_page)]
    try:
        row, blocks = load_span(target.first_page, ids, sent_first, int(decoded.key_cache[0].shape[0]))
    except ValueError as exc:
        raise GroupLoadError(f"layer {layer_idx} (group {group}): {exc}") from exc
    if not blocks:
        if getattr(decoded, "unverified", None):
            verify_deferred(decoded)  # nothing to write: the payload is checked all the same
        return 0
    index = torch.tensor(blocks, dtype=torch.long)
    return write_pages(layer, geometry, decoded, index, row, recv_start, recv_stop, block_runs(blocks), layer_bytes)
