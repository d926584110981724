"""Host memory the zmq connector reuses: page-aligned pools and the receiver's buffer pool.

Why: a fresh buffer per payload page-faults every 4 KiB page on first write (about 244 faults
per MB; a gather into it runs at about a third of the speed of one into touched memory). Both
sides of the zmq connector therefore keep one pool each, allocated once and reused:

- :func:`host_pool` allocates one page-aligned 1-D ``uint8`` numpy array. numpy asks the kernel
  for transparent huge pages on large arrays, so even a first touch faults once per 2 MiB
  where the kernel allows it. Pages are touched on first use (or at once with ``touch``) and
  stay mapped for the pool's life: after warm-up, writes into the pool fault nothing.
- :class:`RecvPool` is the receiver's pool: a region of it (best fit, lowest offset first, so
  the same touched pages come back) receives each streamed payload, and is *lent* to the
  caller as a writable memoryview. The region returns to the pool when that view and
  everything made from it (``torch.frombuffer`` tensors, their views, numpy arrays) are
  garbage: the caller keeps its tensors as long as it likes, nothing needs releasing, and
  memory can never be reused while something still reads it. When no region fits (the pool
  is full of payloads still held, or a payload is larger than the pool) the caller falls back
  to libzmq's own frames.

- :func:`as_frames` reads what ``put`` was given (bytes-like objects, tensors, lists of them)
  as flat byte views, without copying, before ``put`` copies them into the send pool.

Thread-safe (one lock per pool). Sizes are bytes.
"""

from __future__ import annotations

import collections
import sys
import threading
import weakref
from typing import Any

import attrs
import numpy as np

from kvferry.adapters.connectors.zmq.protocol import MAX_PAYLOAD_FRAMES
from kvferry.core.errors import ConfigError
from kvferry.core.pool import Region, RegionAllocator

__all__ = ["PAGE_BYTES", "host_pool", "RecvPool", "as_frames"]

#: Alignment of a pool's first byte.
PAGE_BYTES = 4096


def host_pool(nbytes: int, *, touch: bool = False) -> np.ndarray:
    """A page-aligned, writable 1-D ``uint8`` array of ``nbytes``; every page written once
    when ``touch`` (pre-faulted), else mapped lazily on first use."""
    raw = np.empty(nbytes + PAGE_BYTES, dtype=np.uint8)
    start = -raw.ctypes.data % PAGE_BYTES
    pool = raw[start : start + nbytes]
    if touch:
        pool.fill(0)
    return pool


@attrs.define(eq=False)
class RecvPool:
    """A receiver's reused buffers: ``capacity`` bytes (0: no pool), mapped on first use.

    :meth:`lend` hands out a region as a writable memoryview; the region goes back to the pool
    when the view and every object made from it are garbage (whichever thread drops the last
    one, even inside a garbage collection: the finalizer only queues the region, which the next
    ``lend`` or ``stats`` frees under the lock). Counters: ``recv_pool_hits``,
    ``recv_pool_fallbacks`` (no region fit), ``recv_pool_in_use`` bytes, ``recv_pool_peak``
    (the furthest byte used, i.e. the pages touched so far).
    """

    capacity: int
    alignment: int = 64
    _storage: np.ndarray | None = attrs.field(init=False, default=None)
    _allocator: RegionAllocator | None = attrs.field(init=False, default=None)
    _lock: threading.Lock = attrs.field(init=False, factory=threading.Lock)
    _returned: collections.deque[tuple[RegionAllocator, Region]] = attrs.field(init=False, factory=collections.deque)
    _closed: bool = attrs.field(init=False, default=False)
    _hits: int = attrs.field(init=False, default=0)
    _fallbacks: int = attrs.field(init=False, default=0)
    _peak: int = attrs.field(init=False, default=0)

    def lend(self, nbytes: int) -> memoryview | None:
        """A writable view of exactly ``nbytes`` of the pool, or None (no pool, closed, too
        large, or full of regions still in use)."""
        with self._lock:
            self._take_back_locked()
            if self._closed or self.capacity < self.alignment:
                self._fallbacks += 1
                return None
            if self._allocator is None:
                self._storage = host_pool(self.capacity)
                self._allocator = RegionAllocator(self.capacity, self.alignment)
            storage, allocator = self._storage, self._allocator
            assert storage is not None  # made and dropped with the allocator
            region = allocator.allocate(nbytes)
            if region is None:
                self._fallbacks += 1
                return None
            self._hits += 1
            self._peak = max(self._peak, region.end)
            array = storage[region.offset : region.offset + nbytes]  # owns this loan
        give_back = weakref.finalize(array, self._returned.append, (allocator, region))
        give_back.atexit = False
        return array.data

    def _take_back_locked(self) -> None:
        while self._returned:
            allocator, region = self._returned.popleft()
            if allocator is self._allocator:  # not a region of a pool closed since
                allocator.free(region)

    def stats(self) -> dict[str, int]:
        with self._lock:
            self._take_back_locked()
            in_use = self._allocator.used_bytes if self._allocator is not None else 0
            return {
                "recv_pool_bytes": self.capacity,
                "recv_pool_hits": self._hits,
                "recv_pool_fallbacks": self._fallbacks,
                "recv_pool_in_use": in_use,
                "recv_pool_peak": self._peak,
            }

    def close(self) -> None:
        """Lend nothing more. Views still held stay valid (each keeps the memory alive)."""
        with self._lock:
            self._closed = True
            self._allocator = None
            self._storage = None
            self._returned.clear()


# --------------------------------------------------------------------------- put data -> frames


def _flat(buffer: Any, what: str) -> memoryview:
    try:
        view = memoryview(buffer)
    except TypeError:
        raise ConfigError(f"{what} is a {type(buffer).__name__}, not a bytes-like buffer") from None
    if not view.c_contiguous:
        raise ConfigError(f"{what} is not contiguous")
    if view.ndim == 1 and view.format == "B":
        return view
    return view.cast("B") if view.ndim else view.cast("B", (view.nbytes,))


def _tensor_frame(tensor: Any, what: str) -> memoryview:
    torch = sys.modules["torch"]
    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous().reshape(-1)
    if t.dtype != torch.uint8:
        t = t.view(torch.uint8)
    return _flat(t.numpy(), what)


def _is_tensor(obj: Any) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(obj, torch.Tensor)


def as_frames(data: Any) -> tuple[tuple[memoryview, ...], tuple[int, ...]]:
    """Payload data -> (frames, their byte sizes), without copying CPU data.

    Accepts a bytes-like object, a tensor (normally 1-D ``uint8``; device tensors are copied
    to the CPU), or a list/tuple of those (frames whose concatenation is the payload).
    Anything else, a non-contiguous buffer, or more than 65536 frames: ConfigError.
    """
    if isinstance(data, (list, tuple)):
        if len(data) > MAX_PAYLOAD_FRAMES:
            raise ConfigError(f"payload has {len(data)} frames; at most {MAX_PAYLOAD_FRAMES}")
        items = list(data)
    else:
        items = [data]
    frames = []
    for index, item in enumerate(items):
        what = f"payload frame {index}"
        if _is_tensor(item):
            frames.append(_tensor_frame(item, what))
        elif isinstance(item, (str, dict, list, tuple)) or item is None:
            raise ConfigError(f"{what} is a {type(item).__name__}, not a bytes-like buffer")
        else:
            frames.append(_flat(item, what))
    return tuple(frames), tuple(f.nbytes for f in frames)
