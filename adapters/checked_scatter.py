"""Received pages written into a paged cache with their checksum checked in the same read.

A vLLM load copies each received tensor's pages into the cache's blocks. Checking the tensor's
CRC-32C first and copying after reads every byte twice; :func:`scatter_checked` reads it once:
the native ``copy_crc32c`` copies the pages chunk by chunk and runs the CRC over each stretch
of the source while it is still in the first-level cache (docs/reliability.md). The cost of
that order: a tensor that fails its check has already been written into the request's own
new blocks. The caller then fails the whole load, so vLLM never reads those blocks: it
recomputes them (``kv_load_failure_policy`` ``recompute``) or ends the request (``fail``).

The fused path runs only where its result is exact (CPU tensors, the cache tensor's own bytes
writable, the native routine loaded, a ``crc32c`` payload); :func:`scatter_checked` returns
False otherwise, and the caller verifies first and copies after, as before. Where each page
goes is given as byte offsets and strides (the cache geometry's, computed once), not as torch
views: building views costs more than checking the bytes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from kvferry.adapters.checksums import CHECKSUMS, FUSED_COPY, copy_crc32c
from kvferry.adapters.torch_decode import checksum_mismatch, host_byte_view

__all__ = ["scatter_spans", "writable_bytes", "scatter_checked"]


def scatter_spans(
    runs: Sequence[tuple[int, int, int]],
    block_stride: int,
    head_stride: int,
    heads: int,
    base: int,
) -> list[tuple[int, int, int]]:
    """``(offset, stride, count)`` spans (bytes) that place a run of pages, each ``heads``
    chunks of one head, at ``base + block * block_stride + head * head_stride`` for the blocks
    of ``runs`` (:func:`kvferry.app.vllm.pages.block_runs`: ``(first block, position,
    length)``), in the order the pages lie in the source. Heads that tile their blocks with one
    stride (``heads * head_stride == block_stride``, or one head) make one span per run."""
    spans: list[tuple[int, int, int]] = []
    for block, _at, length in runs:
        at = base + block * block_stride
        if heads == 1:
            spans.append((at, block_stride, length))
        elif heads * head_stride == block_stride:
            spans.append((at, head_stride, length * heads))
        else:
            spans.extend((at + k * block_stride, head_stride, heads) for k in range(length))
    return spans


def writable_bytes(t: torch.Tensor) -> memoryview | None:
    """A writable byte view of a contiguous CPU tensor's own memory, or None (never a copy).
    Costly (tens of microseconds): take it once per cache tensor."""
    if t.device.type != "cpu" or not t.is_contiguous() or t.requires_grad:
        return None
    try:
        flat = t.view(-1).view(torch.uint8).numpy()
    except (RuntimeError, TypeError, ValueError):
        return None
    if flat.__array_interface__["data"][0] != t.data_ptr() or not flat.flags.writeable:
        return None
    return flat.data


def scatter_checked(
    out: memoryview,
    src: torch.Tensor,
    first_page: int,
    runs: Sequence[tuple[int, int, int]],
    place: tuple[int, int, int],
    check: tuple[str, str, int],
) -> bool:
    """Write pages ``src[first_page : first_page + n]`` (``src``: a received tensor ``[pages,
    heads, region]``) into a cache tensor's bytes ``out`` (:func:`writable_bytes`) for the
    blocks of ``runs``, checking ``src``'s whole checksum ``check = (algorithm, tensor name,
    expected)`` in the same read. ``place = (base, block stride, head stride)`` in bytes: the
    first head of block ``b`` goes to ``out[base + b * block stride]``, head ``h`` of it
    ``h * head stride`` further. True when done (PayloadError naming the tensor on a mismatch,
    the pages written); False when this cannot run here, nothing written."""
    algorithm, name, expected = check
    if not FUSED_COPY or algorithm != "crc32c" or src.dim() != 3:
        return False
    if src.device.type != "cpu" or not src.is_contiguous():
        return False
    es = src.element_size()
    heads, pages = int(src.shape[1]), int(src.shape[0])
    chunk = int(src.shape[2]) * es
    page = heads * chunk
    n = sum(length for _block, _at, length in runs)
    if first_page < 0 or first_page + n > pages or not chunk:
        return False
    base, block_stride, head_stride = place
    spans = scatter_spans(runs, block_stride, head_stride, heads, base)
    whole: Any = host_byte_view(src)
    crc32c = CHECKSUMS["crc32c"]
    value = crc32c(whole[: first_page * page], 0) if first_page else 0
    value = copy_crc32c(out, whole[first_page * page : (first_page + n) * page], chunk, spans, value)
    if first_page + n < pages:
        value = crc32c(whole[(first_page + n) * page :], value)
    if value != expected:
        raise checksum_mismatch(algorithm, name, expected, value)
    return True
