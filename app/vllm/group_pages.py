"""One KV cache group's received pages written into a decode's blocks (vLLM's hybrid manager).

A hybrid payload is one layer's pages of its group from ``first_page`` on (metadata ``group``
and ``first_page``, set by :class:`~kvferry.app.vllm.saver.PageSaver`); the load job holds the
group's local blocks from the job's first page (:class:`~kvferry.app.vllm.records.LoadJob`
``groups``). :func:`write_group_pages` checks the payload is this layer's group's, finds the
rows for the decode's non-null blocks (:func:`kvferry.app.vllm.groups.load_span`) and writes
them page for page. Pages of another block size or layout (the prefill's ``block_size``,
``cache_layout``, ``isa``) are re-laid per token (:func:`~kvferry.app.vllm.pages.write_relaid`)
into the decode's non-null blocks, which must find every token they hold in the payload
(:func:`kvferry.app.vllm.groups.relaid_span`); the loader says whether this cache can be re-laid
(``relay``).
"""

from __future__ import annotations

from typing import Any

import torch

from kvferry.adapters.torch_decode import verify_deferred
from kvferry.app.vllm.groups import GroupPages, load_span, relaid_span
from kvferry.app.vllm.pages import PageGeometry, block_runs, check_payload, needs_relay, write_pages, write_relaid
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
    relay: bool = False,
) -> int:
    """Write ``layer``'s payload (of KV cache group ``group``) into ``target``'s blocks, those
    of pages below ``needed_pages`` (the prefill's prompt); ``heads``: the slice's head count
    and the receiving head range; ``cache``: this cache's layout label and kernel ISA. Returns
    the bytes written. PayloadError for a corrupt payload, GroupLoadError for one that is not
    this group's or lacks a page to write. Checksums decoding deferred are checked as
    :func:`~kvferry.app.vllm.pages.write_pages` checks them (in its copy, with ``layer_bytes``),
    or here when no page of the payload is written. ``relay``: pages of another block size or
    layout may be re-laid into this cache (else GroupLoadError)."""
    num_heads, recv_start, recv_stop = heads
    meta = decoded.metadata or {}
    if meta.get("group") != group:
        theirs = meta.get("group")
        raise GroupLoadError(f"layer {layer_idx}: payload of KV cache group {theirs!r}, this layer's is {group}")
    sent_first = meta.get("first_page")
    if isinstance(sent_first, bool) or not isinstance(sent_first, int) or sent_first < 0:
        raise PayloadError(f"layer {layer_idx}: payload first_page {sent_first!r}")
    relaid = needs_relay(meta, geometry, *cache)
    if relaid and not relay:
        raise GroupLoadError(
            f"layer {layer_idx}: the prefill's pages (block_size {meta.get('block_size')}, "
            f"{meta.get('cache_layout')}) differ from this cache's, whose page order kvferry cannot re-lay"
        )
    check_payload(decoded, geometry, layer_idx, num_heads, 0)
    ids = target.block_ids[: max(0, needed_pages - target.first_page)]
    if relaid:
        return _write_relaid_group(layer, geometry, decoded, layer_idx, group, target.first_page, ids, heads, cache)
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


def _write_relaid_group(
    layer: torch.Tensor,
    geometry: PageGeometry,
    decoded: Any,
    layer_idx: int,
    group: int,
    first_page: int,
    ids: Any,
    heads: tuple[int, int, int],
    cache: tuple[str | None, str | None],
) -> int:
    """:func:`write_group_pages` for pages of another block size or layout: each token of the
    decode's non-null blocks from the payload's pages that hold it."""
    meta = decoded.metadata or {}
    src_bs, num_tokens = meta.get("block_size"), meta.get("num_tokens")
    for name, value in (("block_size", src_bs), ("num_tokens", num_tokens)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise PayloadError(f"layer {layer_idx}: payload {name} {value!r}")
    assert isinstance(src_bs, int) and isinstance(num_tokens, int)
    sent = (int(meta["first_page"]), int(decoded.key_cache[0].shape[0]), src_bs)
    try:
        start, blocks = relaid_span(first_page, ids, geometry.block_size, sent, num_tokens)
    except ValueError as exc:
        raise GroupLoadError(f"layer {layer_idx} (group {group}): {exc}") from exc
    verify_deferred(decoded)  # re-laid tokens: the payload is checked whole before they are written
    if not blocks:
        return 0
    index = torch.tensor(blocks, dtype=torch.long)
    try:
        return write_relaid(layer, geometry, *cache, decoded, index, start, heads[1], heads[2], src_offset=sent[0])
    except PayloadError as exc:
        raise GroupLoadError(f"layer {layer_idx} (group {group}): {exc}") from exc
