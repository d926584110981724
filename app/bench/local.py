"""In-process measurements of ``kvferry bench``: memcpy, extraction, codecs, checksums.

Each function returns :class:`~kvferry.app.bench.model.Stat` values in seconds: ``reps`` timed
repetitions after ``warmup`` untimed ones, ``time.perf_counter`` around exactly the work named
(and, for the ``*_cpu`` figures, ``time.process_time``: CPU time, which a busy machine's other
work inflates far less than wall time).
Destination buffers are allocated and touched once, before timing, and reused.
"""

from __future__ import annotations

import ctypes
import time
from collections.abc import Callable
from typing import Any

import torch

from kvferry.adapters.checksums import DEFAULT_CHECKSUM
from kvferry.adapters.platform import advise_huge_pages
from kvferry.adapters.torch_frames import decode_payload, encode_frames
from kvferry.app.bench.model import Stat
from kvferry.app.bench.payload import (
    PagedCache,
    baseline_decode,
    baseline_encode,
    baseline_extract,
    gather_payload_into,
    kv_crc,
    layout_for,
    payload_crc,
    plan_request,
)
from kvferry.core.errors import TransferError

__all__ = [
    "MEMCPY_AHEAD",
    "placed",
    "memcpy_buffers",
    "timed",
    "timed_pairs",
    "memcpy_step",
    "measure_memcpy",
    "measure_local",
]


def timed(fn: Callable[[], Any], reps: int, warmup: int, clock: Callable[[], float] = time.perf_counter) -> Stat:
    """Run ``fn`` ``warmup`` times untimed, then ``reps`` times timed by ``clock`` (wall time;
    ``time.process_time`` for this process's CPU time)."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(reps):
        start = clock()
        fn()
        samples.append(clock() - start)
    return Stat.of(samples)


def timed_pairs(limit: Callable[[], float], fn: Callable[[], Any], reps: int, warmup: int) -> tuple[Stat, Stat]:
    """``limit()`` (one repetition of the limit, returning its seconds) and ``fn`` alternating:
    ``warmup`` untimed pairs, then ``reps`` timed ones; (the limit's Stat, ``fn``'s Stat), their
    samples in pair order."""
    for _ in range(warmup):
        limit()
        fn()
    limits, samples = [], []
    for _ in range(reps):
        limits.append(limit())
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return Stat.of(limits), Stat.of(samples)


#: Where the memcpy limit's destination lies past its source within a 4 KiB page (bytes). A
#: copy whose destination lies a few cache lines past its source in a page stalls on 4K
#: aliasing (docs/extraction.md); glibc's memcpy of 235 MB measured (AMD EPYC Zen 3, huge
#: pages, medians of 7) 13.2-13.6 ms at 0 and 1024-4032 bytes, 60.9 ms at 64, 63.8 at 128, 46.7
#: at 256, 33.8 at 512. Two buffers of torch's own usually both start 64 bytes into a page (0
#: apart), but not always: one run of ``kvferry bench --runs 3`` timed memcpy at 61 ms in every
#: repetition, every ratio over it 4x too kind. The limit is the machine's copy at its best, so
#: its buffers are placed: the source on a page boundary, the destination this far past one.
MEMCPY_AHEAD = 2048


def placed(nbytes: int, offset: int, fill: int) -> torch.Tensor:
    """``nbytes`` of uint8 filled with ``fill`` (every page touched), starting ``offset`` bytes
    past a 4 KiB page boundary: a slice of a larger tensor."""
    raw = torch.full((nbytes + 2 * 4096,), fill, dtype=torch.uint8)
    skip = (offset - raw.data_ptr()) % 4096
    return raw[skip : skip + nbytes]


def memcpy_buffers(nbytes: int, huge_pages: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The limit's source and destination, touched, the destination :data:`MEMCPY_AHEAD`
    bytes past the source within a page; with ``huge_pages`` on huge pages as the caches it is
    compared with (:func:`kvferry.adapters.platform.advise_huge_pages`)."""
    src = placed(nbytes, 0, 3)
    dst = placed(nbytes, MEMCPY_AHEAD, 0)
    if huge_pages:
        advise_huge_pages([src, dst], collapse=True)
    return src, dst


def memcpy_step(nbytes: int, huge_pages: bool = False) -> Callable[[], float]:
    """One repetition of the memcpy limit per call (the buffers of :func:`measure_memcpy`,
    allocated and touched once): returns its seconds."""
    src, dst = memcpy_buffers(nbytes, huge_pages)
    s, d = src.data_ptr(), dst.data_ptr()

    def step(buffers: tuple[torch.Tensor, torch.Tensor] = (src, dst)) -> float:  # keeps both alive
        start = time.perf_counter()
        ctypes.memmove(d, s, nbytes)
        return time.perf_counter() - start

    step()
    if not torch.equal(src[-4096:], dst[-4096:]):
        raise TransferError("memcpy check failed")
    return step


def measure_memcpy(
    nbytes: int, reps: int, warmup: int, clock: Callable[[], float] = time.perf_counter, huge_pages: bool = False
) -> Stat:
    """Single-thread ``memcpy`` (``ctypes.memmove``) of ``nbytes`` into a reused, touched buffer
    (timed by ``clock``, see :func:`timed`; ``huge_pages``: both buffers on huge pages)."""
    src, dst = memcpy_buffers(nbytes, huge_pages)
    s, d = src.data_ptr(), dst.data_ptr()
    stat = timed(lambda: ctypes.memmove(d, s, nbytes), reps, warmup, clock)
    if not torch.equal(src[-4096:], dst[-4096:]):
        raise TransferError("memcpy check failed")
    return stat


def measure_local(
    cache: PagedCache, reps: int, warmup: int, limit: Callable[[], float] | None = None
) -> dict[str, Any]:
    """Extraction, kvferry encode/decode (with and without checksums, ``DEFAULT_CHECKSUM``) and the baseline's
    encode/decode, all for request 0 of ``cache``; with ``limit`` (:func:`memcpy_step`), the
    extraction alternates with it (figures ``extraction`` and ``extraction_limit``). Returns
    ``{"stats": {...}, "checks": {...}, "payload_nbytes": int}``; the checks compare crc32s of
    what each path produced."""
    stats: dict[str, Stat] = {}
    checks: dict[str, bool] = {}
    plan = plan_request(cache, 0, request_id="bench-local")
    layout = layout_for(plan)
    dest = torch.zeros(layout.total_nbytes, dtype=torch.uint8)

    def extract() -> None:  # planning included (from the kept geometry, as the send path plans)
        p = plan_request(cache, 0, request_id="bench-local", geometry=plan.geometry)
        gather_payload_into(p, layout, dest)

    if limit is None:
        stats["extraction"] = timed(extract, reps, warmup)
    else:
        stats["extraction_limit"], stats["extraction"] = timed_pairs(limit, extract, reps, warmup)
    stats["extraction_cpu"] = timed(extract, reps, 0, time.process_time)  # CPU time, beside the wall
    keys, values = plan.materialize()
    expected = kv_crc(keys, values)
    base_keys, base_values = baseline_extract(cache, 0)
    checks["extraction"] = payload_crc(decode_payload(dest)) == expected
    checks["baseline_extraction"] = kv_crc(base_keys, base_values) == expected

    meta, bids = plan.metadata, plan.block_ids

    def encode() -> Any:
        return encode_frames("bench-local", keys, values, bids, meta)

    def decode() -> Any:
        return decode_payload(dest)

    stats["kvferry_encode"] = timed(encode, reps, warmup)
    stats["kvferry_decode"] = timed(decode, reps, warmup)
    frames = list(encode().frames)
    stats["kvferry_decode_frames"] = timed(lambda: decode_payload(frames), reps, warmup)
    stats["kvferry_codec"] = timed(lambda: (encode(), decode()), reps, warmup)
    checks["codec"] = payload_crc(decode_payload(frames)) == expected

    def encode_ck() -> Any:  # the checksum kvferry writes by default where asked for one
        return encode_frames("bench-local", keys, values, bids, meta, checksums=DEFAULT_CHECKSUM)

    ck_frames = list(encode_ck().frames)
    ck_layout = layout_for(plan, checksums=DEFAULT_CHECKSUM)
    ck_dest = torch.zeros(ck_layout.total_nbytes, dtype=torch.uint8)
    gather_payload_into(plan, ck_layout, ck_dest)
    stats["checksum_encode"] = timed(encode_ck, reps, warmup)
    stats["checksum_decode"] = timed(lambda: decode_payload(ck_dest, verify=True), reps, warmup)
    stats["checksum_gather_finish"] = timed(lambda: gather_payload_into(plan, ck_layout, ck_dest), reps, warmup)
    checks["checksum"] = payload_crc(decode_payload(ck_frames, verify=True)) == expected

    def base_encode() -> bytes:
        return baseline_encode("bench-local", base_keys, base_values, bids, meta)

    stats["baseline_encode"] = timed(base_encode, reps, warmup)
    blob = base_encode()
    stats["baseline_decode"] = timed(lambda: baseline_decode(blob), reps, warmup)
    stats["baseline_extract"] = timed(lambda: baseline_extract(cache, 0), reps, warmup)
    checks["baseline_codec"] = kv_crc(*baseline_decode(blob)) == expected
    return {"stats": stats, "checks": checks, "payload_nbytes": layout.total_nbytes}
