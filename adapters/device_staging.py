"""Pinned host staging for page copies between a device cache and host payload memory.

A device-to-host copy into pageable memory (a connector's pool, a shared-memory segment) is
staged by the driver in small pieces and runs at a fraction of the bus's speed; into pinned
(page-locked) memory it is one DMA. :class:`PinnedStaging` keeps one reusable pinned buffer
(grown on demand, never shrunk) and copies through it: device -> pinned (one DMA) -> host
payload (a memcpy), and the reverse for loads. One copy at a time per instance (a lock);
each copy waits for its stream, so the bytes are in place when a call returns.
"""

from __future__ import annotations

import threading

import torch

__all__ = ["PinnedStaging"]


class PinnedStaging:
    """One pinned host buffer for device <-> host page copies (see the module)."""

    def __init__(self) -> None:
        self._buf: torch.Tensor | None = None
        self._lock = threading.Lock()

    @property
    def nbytes(self) -> int:
        """The pinned bytes held now (0 before the first copy)."""
        return 0 if self._buf is None else self._buf.numel()

    def _host(self, src: torch.Tensor) -> torch.Tensor:
        n = src.numel() * src.element_size()
        if self._buf is None or self._buf.numel() < n:
            self._buf = torch.empty(max(n, 2 * self.nbytes), dtype=torch.uint8, pin_memory=True)
        return self._buf[:n].view(src.dtype).view(src.shape)

    def to_host(self, src: torch.Tensor, out: torch.Tensor) -> None:
        """Copy the contiguous device tensor ``src`` into the host tensor ``out`` (same shape
        and dtype, any strides) through the pinned buffer."""
        with self._lock:
            host = self._host(src)
            host.copy_(src, non_blocking=True)
            torch.cuda.current_stream(src.device).synchronize()
            out.copy_(host)

    def to_device(self, src: torch.Tensor, device: torch.device) -> torch.Tensor:
        """The host tensor ``src`` as a contiguous tensor on ``device``, copied through the
        pinned buffer (the copy is complete on return)."""
        with self._lock:
            host = self._host(src)
            host.copy_(src)
            out = host.to(device, non_blocking=True)
            torch.cuda.current_stream(device).synchronize()
            return out
