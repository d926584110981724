"""The benchmark's data: a synthetic paged KV cache, the naive baseline codec, and kvferry's
send/receive steps as the benchmark drives them.

The baseline is deliberately NOT library code: it is what a straightforward implementation
does (the seed style the library replaces): gather each layer with advanced indexing,
``.numpy().tobytes()`` every tensor (bf16 through an int16 view), ``b"".join`` one message in
the reference layout (``[u32 header_len][JSON header][data]``), send it with zmq's default
copying ``send``, sleep-poll the receiver (10 ms doubling to 500 ms) and decode with
``frombuffer`` views.

Sizes are bytes, times seconds.
"""

from __future__ import annotations

import json
import math
import random
import struct
import time
import warnings
import zlib
from collections.abc import Sequence
from typing import Any

import attrs
import torch

from kvferry.adapters.paged_cache import CacheGeometry, ExtractionPlan, ExtractionSkipped, plan_extraction
from kvferry.adapters.platform import HUGE_PAGE, HugePages, advise_huge_pages, huge_page_span
from kvferry.adapters.torch_frames import (
    DecodedKV,
    dest_spans,
    encode_frames,
    finish_payload_in,
    host_byte_view,
)
from kvferry.app.bench.model import Geometry
from kvferry.core.errors import ConfigError, TransferError
from kvferry.core.header import PayloadLayout, kv_tensor_specs, plan_layout

__all__ = [
    "PagedCache",
    "make_paged_cache",
    "plan_request",
    "layout_for",
    "cache_layers",
    "CACHE_VIEWS",
    "gather_payload_into",
    "encode_request",
    "payload_crc",
    "kv_crc",
    "baseline_extract",
    "baseline_encode",
    "baseline_decode",
    "baseline_poll_recv",
    "POLL_FIRST_S",
    "POLL_MAX_S",
]

POLL_FIRST_S = 0.010
POLL_MAX_S = 0.500
_TORCH_DTYPES = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
    "float64": torch.float64,
    "int8": torch.int8,
    "uint8": torch.uint8,
}
_FILL_TILE = 1 << 20  # int16 elements of the random tile the cache is filled from


@attrs.frozen(eq=False)
class PagedCache:
    """Per layer a ``[2, num_blocks, block_size, heads, head_dim]`` tensor (K/V on dim 0) and,
    per request, its block ids (scattered: a seeded permutation of the cache's blocks)."""

    geometry: Geometry
    layers: tuple[torch.Tensor, ...] = attrs.field(repr=False)
    block_ids: tuple[tuple[int, ...], ...]
    #: What moving the layers onto huge pages did (None: not asked).
    huge_pages: HugePages | None = None

    @property
    def num_blocks(self) -> int:
        return int(self.layers[0].shape[1])

    def describe_huge_pages(self) -> str | None:
        """One line: what moving the layers onto huge pages did (None: not asked)."""
        if self.huge_pages is None:
            return None
        layers_mb = sum(t.nbytes for t in self.layers) >> 20
        return (
            f"layers of {layers_mb} MB, each from a 2 MiB boundary in whole 2 MiB pages of its own: "
            f"{self.huge_pages.describe()}"
        )


def make_paged_cache(
    geometry: Geometry, requests: int, *, seed: int, spare_blocks: int = 8, huge_pages: bool = False
) -> PagedCache:
    """A cache holding ``requests`` requests of ``geometry`` plus ``spare_blocks`` unused blocks.

    Every byte is written (no lazily mapped zero pages) with a seeded pattern that differs from
    block to block, so a transfer that moves the wrong block is caught by a checksum. With
    ``huge_pages`` the written layers are then moved onto transparent huge pages (as kvferry's
    vLLM connector does with an engine's cache; :func:`~kvferry.adapters.platform.advise_huge_pages`),
    each layer allocated from a 2 MiB boundary and padded to whole 2 MiB pages: an engine's layer
    of gigabytes is on huge pages but for its two edge pages, while these layers of 8-64 MB
    would otherwise keep 3-25% of their bytes on 4 KiB pages (docs/benchmarks.md).
    """
    if requests < 1 or spare_blocks < 0:
        raise ConfigError("need requests >= 1 and spare_blocks >= 0")
    g = geometry
    per_request = g.blocks_per_request
    num_blocks = requests * per_request + spare_blocks
    dtype = _TORCH_DTYPES[g.dtype]
    gen = torch.Generator().manual_seed(seed)
    tile = torch.randint(-(1 << 14), 1 << 14, (_FILL_TILE,), dtype=torch.int16, generator=gen)
    layers = []
    for layer in range(g.layers):
        t = _layer_tensor((2, num_blocks, g.block_size, g.heads, g.head_dim), dtype, aligned=huge_pages)
        flat = t.view(-1).view(torch.uint8)
        flat = flat[: flat.numel() - flat.numel() % 2].view(torch.int16)
        for n, start in enumerate(range(0, flat.numel(), _FILL_TILE)):
            piece = flat[start : start + _FILL_TILE]
            torch.add(tile[: piece.numel()], (layer * 7919 + n) % 8191, out=piece)
        layers.append(t)
    order = list(range(num_blocks))
    random.Random(seed).shuffle(order)
    ids = tuple(tuple(order[r * per_request : (r + 1) * per_request]) for r in range(requests))
    huge = advise_huge_pages(layers, collapse=True) if huge_pages else None
    return PagedCache(g, tuple(layers), ids, huge)


def _layer_tensor(shape: tuple[int, ...], dtype: torch.dtype, *, aligned: bool) -> torch.Tensor:
    """An uninitialised layer; ``aligned``: starting on a huge page and padded to whole huge
    pages (its own storage), so every byte of it can be on huge pages."""
    if not aligned:
        return torch.empty(shape, dtype=dtype)
    nbytes = math.prod(shape) * dtype.itemsize
    pages = -(-nbytes // HUGE_PAGE)
    raw = torch.empty((pages + 1) * HUGE_PAGE, dtype=torch.uint8)  # a page more: room to align
    span = huge_page_span(raw.data_ptr(), raw.numel())
    assert span is not None and span[1] >= pages * HUGE_PAGE  # pages + 1 pages of bytes hold pages whole ones
    skip = span[0] - raw.data_ptr()
    return raw[skip : skip + nbytes].view(dtype).view(shape)


#: Views of a bench cache other rows send: ``latent`` (each layer's K half read as an MLA latent
#: ``[num_blocks, block_size, heads*head_dim]``, contiguous, the same bytes as one K cache).
CACHE_VIEWS = ("latent",)


def cache_layers(cache: PagedCache, view: str | None = None) -> list[torch.Tensor]:
    """The cache's layers as ``view`` (None: as they are; see :data:`CACHE_VIEWS`); views, no copy."""
    if view is None:
        return list(cache.layers)
    g = cache.geometry
    if view == "latent":
        return [t[0].view(t.shape[1], g.block_size, g.heads * g.head_dim) for t in cache.layers]
    raise ConfigError(f"unknown cache view {view!r} (known: {', '.join(CACHE_VIEWS)})")


def _head_view(layer: torch.Tensor, heads: tuple[int, int] | None) -> torch.Tensor:
    return layer if heads is None else layer[:, :, :, heads[0] : heads[1]]


def plan_request(
    cache: PagedCache,
    request: int,
    *,
    request_id: str,
    heads: tuple[int, int] | None = None,
    view: str | None = None,
    geometry: CacheGeometry | None = None,
) -> ExtractionPlan:
    """kvferry's extraction plan for request ``request`` (optionally only heads
    ``heads[0]:heads[1]``, read through strided views of the cache: still one copy; ``view``: a
    :data:`CACHE_VIEWS` view, ``latent`` planned as an MLA cache), from ``geometry`` (an earlier
    plan's, as the send path keeps it) when it still fits."""
    g = cache.geometry
    if view == "latent":
        plan = plan_extraction(
            cache_layers(cache, view), cache.block_ids[request], g.tokens, g.block_size, cache_dtype=g.dtype,
            request_id=request_id, layout="mla", geometry=geometry,
        )  # fmt: skip
        if isinstance(plan, ExtractionSkipped):
            raise ConfigError(f"benchmark request {request} produced no payload: {plan.detail}")
        return plan
    plan = plan_extraction(
        [_head_view(t, heads) for t in cache_layers(cache, view)],
        cache.block_ids[request],
        g.tokens,
        g.block_size,
        cache_dtype=g.dtype,
        request_id=request_id,
        geometry=geometry,
    )
    if isinstance(plan, ExtractionSkipped):
        raise ConfigError(f"benchmark request {request} produced no payload: {plan.detail}")
    return plan


def layout_for(plan: ExtractionPlan, *, checksums: str | None = None) -> PayloadLayout:
    """The wire layout of ``plan``'s payload (aligned, versioned), before any byte moves."""

    def spec(gather: Any) -> tuple[str, tuple[int, ...]] | None:
        return None if gather is None else (str(gather.dtype).removeprefix("torch."), gather.shape)

    num_layers, specs = kv_tensor_specs([spec(k) for k in plan.keys], [spec(v) for v in plan.values])
    return plan_layout(plan.request_id, plan.block_ids, plan.metadata, num_layers, specs, checksums=checksums)


def gather_payload_into(plan: ExtractionPlan, layout: PayloadLayout, dest: torch.Tensor) -> PayloadLayout:
    """Gather ``plan`` straight into ``dest`` (1-D uint8) laid out as ``layout``, as the send
    path gathers into a reserved region (:func:`dest_spans`); write the header."""
    views = dest_spans(dest, layout)
    n = plan.num_layers
    plan.gather_all((views[:n], views[n:]))
    return finish_payload_in(dest, layout)


def encode_request(plan: ExtractionPlan, *, checksums: str | None = None) -> tuple[list[Any], int]:
    """Materialise (one gather copy into fresh tensors) and encode to zero-copy frames."""
    keys, values = plan.materialize()
    encoded = encode_frames(plan.request_id, keys, values, plan.block_ids, plan.metadata, checksums=checksums)
    return list(encoded.frames), encoded.nbytes


def kv_crc(keys: Sequence[torch.Tensor | None], values: Sequence[torch.Tensor | None]) -> int:
    """crc32 over every tensor's bytes, keys then values (absent layers skipped)."""
    crc = 0
    for t in [*keys, *values]:
        if t is not None:
            crc = zlib.crc32(host_byte_view(t), crc)
    return crc & 0xFFFFFFFF


def payload_crc(decoded: DecodedKV) -> int:
    return kv_crc(decoded.key_cache, decoded.value_cache)


# ----------------------------------------------------------------------------- the baseline
def baseline_extract(cache: PagedCache, request: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per layer ``cache[k][block_ids].flatten(0, 1)[:tokens]`` (one fresh gathered tensor)."""
    g = cache.geometry
    index = torch.tensor(cache.block_ids[request], dtype=torch.int64)
    keys, values = [], []
    for layer in cache.layers:
        keys.append(layer[0][index].flatten(0, 1)[: g.tokens].contiguous())
        values.append(layer[1][index].flatten(0, 1)[: g.tokens].contiguous())
    return keys, values


def _to_bytes(t: torch.Tensor) -> bytes:
    if t.dtype == torch.bfloat16:  # numpy has no bf16: go through a same-width integer view
        t = t.view(torch.int16)
    return t.numpy().tobytes()


def baseline_encode(
    request_id: str,
    keys: Sequence[torch.Tensor],
    values: Sequence[torch.Tensor],
    block_ids: Sequence[int],
    metadata: dict,
) -> bytes:
    """``tobytes`` per tensor and one ``b"".join`` in the reference layout (packed, no padding)."""
    blobs, descs, offset = [], [], 0
    for kind, tensors in (("key_cache", keys), ("value_cache", values)):
        for layer, t in enumerate(tensors):
            data = _to_bytes(t)
            descs.append(
                {
                    "n": f"{kind}_{layer}",
                    "i": layer,
                    "d": str(t.dtype).removeprefix("torch."),
                    "s": list(t.shape),
                    "o": offset,
                    "b": len(data),
                }
            )
            blobs.append(data)
            offset += len(data)
    header = json.dumps(
        {"rid": request_id, "bids": list(block_ids), "meta": metadata, "td": descs, "nl": len(keys)},
        separators=(",", ":"),
    ).encode()
    return b"".join([struct.pack(">I", len(header)), header, *blobs])


def baseline_decode(blob: bytes) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """``frombuffer`` views of ``blob`` (keys, values)."""
    (header_len,) = struct.unpack(">I", blob[:4])
    header = json.loads(blob[4 : 4 + header_len])
    start = 4 + header_len
    keys: list[Any] = [None] * header["nl"]
    values: list[Any] = [None] * header["nl"]
    for d in header["td"]:
        dtype = _TORCH_DTYPES[d["d"]]
        if not d["b"]:
            (keys if d["n"].startswith("key") else values)[d["i"]] = torch.empty(d["s"], dtype=dtype)
            continue
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # read-only bytes: views only read
            t = torch.frombuffer(blob, dtype=dtype, offset=start + d["o"], count=d["b"] // dtype.itemsize).view(d["s"])
        (keys if d["n"].startswith("key") else values)[d["i"]] = t
    return keys, values


def baseline_poll_recv(socket: Any, deadline: float, on_first_miss: Any = None) -> bytes:
    """Receive one message (copying) by polling: 10 ms sleeps doubling to 500 ms.

    ``on_first_miss()`` is called once, after the first poll found nothing (the receiver is
    then in its polling schedule, as a waiting receiver is). Raises TransferError when
    ``deadline`` (``time.monotonic()`` seconds) passes first.
    """
    import zmq

    delay = POLL_FIRST_S
    missed = False
    while True:
        try:
            return socket.recv(flags=zmq.NOBLOCK)
        except zmq.Again:
            if time.monotonic() >= deadline:
                raise TransferError("baseline receiver: nothing arrived before the deadline") from None
            if not missed and on_first_miss is not None:
                on_first_miss()
            missed = True
            time.sleep(delay)  # the baseline's own polling (what the library replaces)
            delay = min(delay * 2, POLL_MAX_S)
