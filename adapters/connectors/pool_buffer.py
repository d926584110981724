"""Received data that lives in a pool, and tying its release to the life of its views.

:class:`PooledBuffer` is what pool-backed connectors return from ``get``: ``tensor`` is a 1-D
``uint8`` view of the payload bytes, ``release()`` gives the region back (idempotent; when it
returns the pool may reuse the region), ``release_soon()`` does the same without waiting
(fire-and-forget: the pool may reuse the region once the release reached it).

A *tied* buffer (:meth:`PooledBuffer.tied`) hands out a tensor whose storage owns the release:
its bytes are exported through a small owner object (``__array_interface__`` ->
``numpy.asarray`` -> ``torch.from_numpy``), so every tensor viewing them (slices, ``view``,
``narrow``, decoded KV tensors) keeps the owner alive. When the buffer object and every such
view are gone, a ``weakref.finalize`` on the owner releases the region (``release_soon``). A
dropped reader therefore never pins a pool, and bytes are never given back while any tensor
still reads them, unless the caller releases explicitly (promising it is done with them).

Releases the garbage collector triggers never run inside the collector (it may fire while the
dropping thread holds a connector's lock): the finalizer only queues the release, and one
daemon thread per process (``kvferry-gc-release``) runs it. Explicit releases run inline.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import weakref
from collections.abc import Callable
from typing import Any

import attrs
import numpy as np
import torch

__all__ = ["PooledBuffer", "tie_release", "tie_region", "can_tie", "release_soon", "wait_for_gc_releases"]

logger = logging.getLogger(__name__)

_QUEUE: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
_WORKER: dict[str, Any] = {"pid": None, "lock": threading.Lock()}


def _run_releases() -> None:
    while True:
        release = _QUEUE.get()
        try:
            release()
        except Exception:  # one failing release must not stop the others
            logger.exception("a pool buffer release triggered by garbage collection failed")


def _ensure_worker() -> None:
    """Start this process's release thread (again after a fork). Called where buffers are
    tied (an ordinary context), never from a finalizer."""
    pid = os.getpid()
    if _WORKER["pid"] == pid:
        return
    with _WORKER["lock"]:
        if _WORKER["pid"] != pid:
            threading.Thread(target=_run_releases, name="kvferry-gc-release", daemon=True).start()
            _WORKER["pid"] = pid


def _defer(release: Callable[[], None]) -> None:
    """The finalizer's callback: queue the release (SimpleQueue.put is safe in a finalizer)."""
    _QUEUE.put(release)


def wait_for_gc_releases(timeout_s: float) -> bool:
    """Wait until every release the garbage collector queued so far has run (the queue is
    FIFO: a marker queued now runs after them). True when done within ``timeout_s``."""
    _ensure_worker()
    done = threading.Event()
    _QUEUE.put(done.set)
    return done.wait(timeout_s)


class _Exported:
    """Owner of exported pool bytes: alive while any tensor over them is (see tie_release)."""

    __slots__ = ("__array_interface__", "keep", "__weakref__")
    __array_interface__: dict[str, Any]
    keep: Any


def can_tie(view: Any) -> bool:
    """True when ``view`` is a CPU, contiguous, 1-D ``uint8`` tensor (what :func:`tie_release`
    accepts)."""
    return (
        isinstance(view, torch.Tensor)
        and view.device.type == "cpu"
        and view.dim() == 1
        and view.dtype == torch.uint8
        and view.is_contiguous()
    )


def tie_release(view: torch.Tensor, release: Callable[[], None]) -> tuple[torch.Tensor, weakref.finalize]:
    """A tensor over the bytes of ``view``; once it, every view of it and the owner are gone,
    ``release`` runs on the release thread (see the module doc).

    ``view`` must pass :func:`can_tie` (else ValueError). ``view`` itself is kept alive by the
    owner, so the memory stays mapped while any tied tensor lives. The finalizer does not run
    at interpreter exit; ``detach()``-ing it settles the release early (exactly one of the
    detacher and the collector gets to release).
    """
    if not can_tie(view):
        raise ValueError("only a CPU, contiguous, 1-D uint8 tensor can be tied to a release")
    return tie_region(view, view.data_ptr(), int(view.numel()), release)


def tie_region(
    keep: Any, address: int, nbytes: int, release: Callable[[], None]
) -> tuple[torch.Tensor, weakref.finalize]:
    """:func:`tie_release` of the ``nbytes`` host bytes at ``address``, which ``keep`` (held by
    the owner) keeps mapped: a pool hands out a region of a mapping it holds without making a
    view of it first (a torch op, several microseconds on a small request's path)."""
    tensor, finalizer, _ = _tie(keep, address, nbytes, release)
    return tensor, finalizer


def _tie(
    keep: Any, address: int, nbytes: int, release: Callable[[], None]
) -> tuple[torch.Tensor, weakref.finalize, memoryview]:
    """:func:`tie_region`, and a byte view of the same bytes (the numpy array the tensor is
    made from already is one: reading a header through it costs no torch call)."""
    owner = _Exported()
    owner.keep = keep
    owner.__array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (address, False), "version": 3}
    array = np.asarray(owner)
    tensor = torch.from_numpy(array)
    _ensure_worker()
    finalizer = weakref.finalize(owner, _defer, release)
    finalizer.atexit = False
    return tensor, finalizer, array.data


def release_soon(item: Any) -> None:
    """Release received ``item`` without waiting when it offers ``release_soon``, else with
    ``release``; nothing for data that is not a pool buffer."""
    soon = getattr(item, "release_soon", None)
    if callable(soon):
        soon()
        return
    release = getattr(item, "release", None)
    if callable(release):
        release()


@attrs.define(eq=False)
class PooledBuffer:
    """Received data living in a pool: ``tensor`` is a 1-D uint8 view; ``release()`` is
    idempotent and lets the pool reuse the region. Also a context manager (releases on exit).
    ``host_bytes``: the same bytes as a memoryview, when the buffer was made with one (a tied
    buffer: the decoder and the marker check read the header through it, not through torch).

    ``on_release`` waits until the pool took the region back; ``on_release_soon`` (optional)
    only sends the release on its way. Exactly one of them runs, once, whoever asks first
    (an explicit call, or the garbage collector for a tied buffer).
    """

    tensor: Any
    _on_release: Callable[[], None] | None = attrs.field(alias="on_release")
    _on_release_soon: Callable[[], None] | None = attrs.field(default=None, alias="on_release_soon")
    _finalizer: weakref.finalize | None = attrs.field(default=None, alias="finalizer")
    host_bytes: memoryview | None = attrs.field(default=None, repr=False)
    _done: bool = attrs.field(init=False, default=False)

    @classmethod
    def tied(
        cls, view: torch.Tensor, on_release: Callable[[], None], on_release_soon: Callable[[], None] | None = None
    ) -> PooledBuffer:
        """A buffer whose ``tensor`` is tied to the release (module doc); falls back to an
        untied buffer over ``view`` when it cannot be tied (not a CPU contiguous uint8 view)."""
        if not can_tie(view):
            return cls(view, on_release=on_release, on_release_soon=on_release_soon)
        tensor, finalizer, host = _tie(view, view.data_ptr(), int(view.numel()), on_release_soon or on_release)
        return cls(tensor, on_release=on_release, on_release_soon=on_release_soon, finalizer=finalizer, host_bytes=host)

    @classmethod
    def tied_region(
        cls,
        keep: Any,
        address: int,
        nbytes: int,
        on_release: Callable[[], None],
        on_release_soon: Callable[[], None] | None = None,
    ) -> PooledBuffer:
        """:meth:`tied` of the ``nbytes`` host bytes at ``address`` of a mapping ``keep`` holds
        (:func:`tie_region`)."""
        tensor, finalizer, host = _tie(keep, address, nbytes, on_release_soon or on_release)
        return cls(tensor, on_release=on_release, on_release_soon=on_release_soon, finalizer=finalizer, host_bytes=host)

    @property
    def nbytes(self) -> int:
        return int(self.tensor.numel())

    @property
    def tied_to_views(self) -> bool:
        """True when dropping the buffer and every view of ``tensor`` releases it."""
        return self._finalizer is not None

    @property
    def released(self) -> bool:
        if self._finalizer is not None:
            return not self._finalizer.alive
        return self._done or self._on_release is None

    def _claim(self) -> bool:
        """True for exactly one caller (detaching a finalizer is atomic)."""
        if self._finalizer is not None:
            return self._finalizer.detach() is not None
        if self._done or self._on_release is None:
            return False
        self._done = True
        return True

    def release(self) -> None:
        """Give the region back; when this returns the pool may reuse it. Idempotent."""
        if self._claim() and self._on_release is not None:
            self._on_release()

    def release_soon(self) -> None:
        """Give the region back without waiting for the pool to confirm. Idempotent."""
        if self._claim():
            callback = self._on_release_soon or self._on_release
            if callback is not None:
                callback()

    def __enter__(self) -> PooledBuffer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
