"""Device memory and stream helpers (CUDA when present, harmless CPU fallbacks otherwise), and
free loopback ports for the sender ports of a stage.

CPU semantics (documented decisions):

- :func:`memory_info` for a CPU device reads ``MemAvailable`` / ``MemTotal`` from
  ``/proc/meminfo`` (host memory is what a CPU-side prefetch consumes). Where that file is
  missing or unreadable, the result is "unknown": ``free_ratio`` is 1.0 so a prefetch gate
  never blocks on a number it cannot know, and ``known`` is False.
- Streams are CUDA-only: on CPU :func:`new_stream` returns None, :func:`use_stream` is a no-op
  context and :func:`synchronize` returns at once.

torch is imported lazily, so importing this module costs nothing.
"""

from __future__ import annotations

import contextlib
import logging
import socket
from collections.abc import Iterable, Iterator
from typing import Any

import attrs

from kvferry.core.addressing import kv_port
from kvferry.core.errors import BindError

__all__ = [
    "free_port",
    "free_base_port",
    "tune_host_allocator",
    "HUGE_PAGE",
    "THP_ENABLED",
    "thp_mode",
    "HugePages",
    "huge_page_span",
    "advise_huge_pages",
    "MemoryInfo",
    "PROC_MEMINFO",
    "cuda_available",
    "default_device",
    "as_device",
    "memory_info",
    "host_memory_info",
    "new_stream",
    "use_stream",
    "synchronize",
]

logger = logging.getLogger(__name__)

PROC_MEMINFO = "/proc/meminfo"


@attrs.frozen
class MemoryInfo:
    """Free and total memory of one device, in bytes. ``known`` is False for a guess."""

    free_bytes: int
    total_bytes: int
    device: str = "cpu"
    known: bool = True

    @property
    def free_ratio(self) -> float:
        """``free / total`` in [0, 1]; 1.0 when the total is unknown (0)."""
        if self.total_bytes <= 0:
            return 1.0
        return min(1.0, max(0.0, self.free_bytes / self.total_bytes))


def _torch() -> Any:
    import torch

    return torch


def cuda_available() -> bool:
    """True when torch sees at least one CUDA device."""
    torch = _torch()
    return bool(torch.cuda.is_available())


def default_device() -> Any:
    """``cuda:<current>`` when CUDA is available, else ``cpu`` (a ``torch.device``)."""
    torch = _torch()
    if cuda_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def as_device(device: Any = None) -> Any:
    """A ``torch.device`` from None (:func:`default_device`), a string or a device."""
    torch = _torch()
    if device is None:
        return default_device()
    return device if isinstance(device, torch.device) else torch.device(device)


def host_memory_info(path: str = PROC_MEMINFO) -> MemoryInfo:
    """Host memory from ``/proc/meminfo`` (``MemAvailable``, ``MemTotal``; kB -> bytes).

    Unreadable or malformed -> ``MemoryInfo(0, 0, known=False)`` whose ratio is 1.0.
    """
    values: dict[str, int] = {}
    try:
        with open(path, encoding="ascii", errors="replace") as f:
            for line in f:
                name, _, rest = line.partition(":")
                parts = rest.split()
                if name in ("MemAvailable", "MemTotal", "MemFree") and parts and parts[0].isdigit():
                    values[name] = int(parts[0]) * 1024
    except OSError as exc:
        logger.debug("cannot read %s: %s", path, exc)
        return MemoryInfo(0, 0, "cpu", known=False)
    total = values.get("MemTotal", 0)
    free = values.get("MemAvailable", values.get("MemFree", 0))
    if total <= 0:
        return MemoryInfo(0, 0, "cpu", known=False)
    return MemoryInfo(min(free, total), total, "cpu")


def memory_info(device: Any = None) -> MemoryInfo:
    """Free/total bytes of ``device`` (default: :func:`default_device`).

    CUDA: ``torch.cuda.mem_get_info``; a failure there is logged and reported as unknown
    (ratio 1.0). CPU and other devices: :func:`host_memory_info`.
    """
    torch = _torch()
    dev = as_device(device)
    if dev.type == "cuda":
        try:
            free, total = torch.cuda.mem_get_info(dev)
        except (RuntimeError, AssertionError) as exc:
            logger.warning("cannot read memory of %s: %s", dev, exc)
            return MemoryInfo(0, 0, str(dev), known=False)
        return MemoryInfo(int(free), int(total), str(dev))
    return host_memory_info()


def new_stream(device: Any = None) -> Any:
    """A new CUDA stream on ``device``, or None on CPU (and other non-CUDA devices)."""
    torch = _torch()
    dev = as_device(device)
    if dev.type != "cuda":
        return None
    return torch.cuda.Stream(device=dev)


@contextlib.contextmanager
def use_stream(stream: Any) -> Iterator[Any]:
    """Make ``stream`` current inside the block; a no-op for None (CPU)."""
    if stream is None:
        yield None
        return
    torch = _torch()
    with torch.cuda.stream(stream):
        yield stream


def synchronize(stream: Any = None, device: Any = None) -> None:
    """Wait for ``stream`` (or, with no stream, for ``device`` when it is CUDA); CPU: no-op."""
    if stream is not None:
        stream.synchronize()
        return
    torch = _torch()
    dev = as_device(device)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _libc() -> Any:
    """The C library through ctypes (errno kept for each call), or None where there is none."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    if not name:
        return None
    try:
        return ctypes.CDLL(name, use_errno=True)
    except OSError:
        return None


#: glibc ``mallopt`` parameters (malloc.h).
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3


def tune_host_allocator(mmap_threshold: int = 32 << 20, trim_threshold: int = 4 << 30, top_pad: int = 64 << 20) -> bool:
    """Opt-in: make glibc keep and reuse freed host memory instead of returning it to the OS.

    Receivers copy each request's tensors out of pool buffers into fresh host memory; with
    glibc's defaults, large blocks are mmapped and unmapped per request, so every page of
    every request is faulted in again (measured here: a fresh 200 MB clone runs at about a
    third of the speed of a copy into touched memory). Raising the mmap and trim thresholds
    keeps the heap's pages mapped between requests. Process-wide, so an engine calls it
    deliberately (``kvferry demo``'s workers do; a zero-copy receive does not need it). Returns False where glibc's
    ``mallopt`` is unavailable.
    """
    import ctypes

    libc = _libc()
    mallopt = getattr(libc, "mallopt", None)
    if mallopt is None:
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    ok = True
    for param, value in (
        (_M_MMAP_THRESHOLD, mmap_threshold),
        (_M_TRIM_THRESHOLD, trim_threshold),
        (_M_TOP_PAD, top_pad),
    ):
        ok = bool(mallopt(param, min(int(value), 2**31 - 1))) and ok
    return ok


#: The transparent huge page size this module advises for (x86-64 and most arm64 kernels).
HUGE_PAGE = 2 << 20
#: Where Linux says whether transparent huge pages are used: ``always [madvise] never``.
THP_ENABLED = "/sys/kernel/mm/transparent_hugepage/enabled"
_MADV_HUGEPAGE, _MADV_COLLAPSE = 14, 25  # asm-generic/mman-common.h


def huge_page_span(address: int, nbytes: int, page: int = HUGE_PAGE) -> tuple[int, int] | None:
    """``(start, length)`` of the whole ``page``-aligned pages inside ``[address, address +
    nbytes)``: the part of a buffer that can sit on huge pages. None when not one fits."""
    if address < 0 or nbytes < 0 or page < 1:
        raise ValueError(f"need address >= 0, nbytes >= 0 and page >= 1, got {address}, {nbytes}, {page}")
    start = -(-address // page) * page
    end = (address + nbytes) // page * page
    return (start, end - start) if end > start else None


@attrs.frozen
class HugePages:
    """What :func:`advise_huge_pages` did. ``total``: bytes of the distinct host storages it was
    given; ``advised``: bytes of them (their whole 2 MiB pages) advised to huge pages;
    ``collapsed``: bytes of those the kernel moved onto huge pages at once (when asked to);
    ``reason``: why less than asked was done (empty when all of it was)."""

    total: int = 0
    advised: int = 0
    collapsed: int = 0
    reason: str = ""

    def describe(self) -> str:
        """One line for a log or a report."""
        mb = 1 << 20
        text = f"{self.collapsed // mb} MB on huge pages, {self.advised // mb} MB advised, of {self.total // mb} MB"
        return f"{text} ({self.reason})" if self.reason else text


def thp_mode(path: str = THP_ENABLED) -> str | None:
    """The bracketed word of ``path`` (``always``, ``madvise`` or ``never``); None if unreadable."""
    try:
        with open(path) as f:
            text = f.read()
    except OSError:
        return None
    start, end = text.find("["), text.find("]")
    return text[start + 1 : end] if 0 <= start < end else None


def advise_huge_pages(tensors: Iterable[Any], *, collapse: bool = False, thp_path: str = THP_ENABLED) -> HugePages:
    """Advise the host memory under ``tensors`` to transparent huge pages (``MADV_HUGEPAGE``
    over each distinct storage's whole 2 MiB pages) and, with ``collapse``, ask the kernel to
    move what is already there onto them now (``MADV_COLLAPSE``, Linux 6.1+; synchronous, about
    1-4 s per 2 GB measured here). Extraction reads a request's blocks scattered over the cache:
    on 4 KiB pages every block starts with page-table walks, and a gather from a 1.9 GB cache
    measured 0.62-0.99x memcpy from one process to the next against 0.99-1.10x on huge pages.

    Never raises for what the kernel refuses: the result says what was done and why not the
    rest (not Linux, huge pages off, an errno). Device tensors and non-tensors are skipped.
    The bytes are unchanged; the memory stays the caller's (nothing is allocated or freed)."""
    import ctypes
    import os
    import sys

    storages: dict[int, int] = {}
    for t in tensors:
        if getattr(t, "device", None) is None or t.device.type != "cpu":
            continue
        storage = t.untyped_storage()
        storages.setdefault(storage.data_ptr(), storage.nbytes())
    total = sum(storages.values())
    if not storages:
        return HugePages(reason="no host memory among the tensors")
    if not sys.platform.startswith("linux"):
        return HugePages(total, reason=f"transparent huge pages are a Linux feature ({sys.platform})")
    mode = thp_mode(thp_path)
    if mode is None or mode == "never":
        return HugePages(total, reason=f"transparent huge pages are off ({thp_path}: {mode or 'unreadable'})")
    madvise = getattr(_libc(), "madvise", None)
    if madvise is None:
        return HugePages(total, reason="the C library has no madvise")
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    advised = collapsed = 0
    reasons: list[str] = []
    for address, nbytes in sorted(storages.items()):
        span = huge_page_span(address, nbytes)
        if span is None:
            continue
        start, length = span
        if madvise(start, length, _MADV_HUGEPAGE) != 0:
            reasons.append(f"MADV_HUGEPAGE: {os.strerror(ctypes.get_errno())}")
            continue
        advised += length
        if collapse:
            if madvise(start, length, _MADV_COLLAPSE) == 0:
                collapsed += length
            else:
                errno = ctypes.get_errno()
                reasons.append(
                    "MADV_COLLAPSE needs Linux 6.1+; the kernel's khugepaged collapses advised memory in the background"
                    if errno == 22  # EINVAL: an older kernel
                    else f"MADV_COLLAPSE: {os.strerror(errno)}"
                )
    if advised < total and not reasons:
        reasons.append("the rest is not whole 2 MiB pages")
    return HugePages(total, advised, collapsed, "; ".join(dict.fromkeys(reasons)))


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port the OS just handed out on ``host`` (free now; the caller binds it later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


def free_base_port(
    from_tp: int = 1,
    from_stage: int = 0,
    *,
    host: str = "127.0.0.1",
    attempts: int = 200,
    low: int = 20000,
    high: int = 60000,
) -> int:
    """A base port in ``[low, high]`` whose sender ports (``kv_port(base, from_stage, rank)``
    for every rank below ``from_tp``) are all free on ``host`` now: the OS picks a port, its
    multiple of 16 is tried. For demos and tests on one machine (another process may still
    take a port before it is bound). BindError when ``attempts`` tries found none."""
    for _ in range(attempts):
        base = free_port(host) // 16 * 16
        if not low <= base <= high:
            continue
        probes: list[socket.socket] = []
        try:
            for rank in range(from_tp):
                probe = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                probes.append(probe)
                probe.bind((host, kv_port(base, from_stage, rank, tp_size=from_tp)))
            return base
        except OSError:
            continue
        finally:
            for probe in probes:
                probe.close()
    raise BindError(f"no base port in [{low}, {high}] with {from_tp} free sender ports on {host}")
