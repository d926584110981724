"""Gathering one planned tensor out of a paged cache into a destination (SPEC 4, phase 2).

A :class:`TensorGather` knows one layer's key or value block view, the blocks to read and the
output shape; :meth:`TensorGather.gather_into` moves the bytes, once, with no temporary (except
the ``"staged"`` method). Planning lives in :mod:`kvferry.adapters.paged_cache`.

Whole blocks move by one of three methods (:data:`GatherMethod`); the partial last block is one
more ``copy_``. Every copy is a torch op, so the same code runs on CPU and accelerators (on CUDA
the copies are queued on the current stream).
"""

from __future__ import annotations

import math
from typing import Any, Literal

import attrs
import torch

from kvferry.core.errors import ConfigError

__all__ = [
    "GatherMethod", "CROSS_DEVICE_MAX_RUNS", "DEVICE_MAX_RUNS", "STRIDED_MAX_RUNS", "TensorGather",
]

#: ``"index"``: one ``index_select(out=...)`` over byte rows of whole blocks (element-wise when a
#: block is strided, e.g. narrowed on the heads); ``"runs"``: one ``copy_`` per run of
#: consecutive block ids; ``"staged"``: gather on the cache's device, then one copy (the only
#: method with a temporary; for cross-device destinations with scattered blocks); ``"auto"``:
#: chosen per tensor by :meth:`TensorGather.choose_method`.
GatherMethod = Literal["auto", "index", "runs", "staged"]
METHODS = ("auto", "index", "runs", "staged")
#: Cross-device ``"auto"``: up to this many runs are copied run by run into the destination;
#: more are staged, so the link sees one large transfer instead of many small ones.
CROSS_DEVICE_MAX_RUNS = 16
#: Same-device ``"auto"`` on an accelerator: up to this many runs use one device memcpy per
#: run, more use one index kernel.
DEVICE_MAX_RUNS = 4
#: Same-device ``"auto"`` on CPU for strided blocks (head slices, the packed layout): up to this
#: many runs use one strided ``copy_`` per run (measured 15-25 % faster than the element-wise
#: index for one run, equal at 4 runs of 64 blocks, slower below); more use the index. Whole
#: contiguous blocks always use the index on CPU (byte rows: as fast as runs for one run, far
#: faster for scattered blocks).
STRIDED_MAX_RUNS = 4
_WIDE = ((8, torch.int64), (4, torch.int32), (2, torch.int16))
_WIDTH_DTYPE = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


def _byte_rows(t: torch.Tensor) -> torch.Tensor | None:
    """``t`` as a 2-D uint8 view ``[t.shape[0], bytes per row]``; None if ``t[i]`` is strided."""
    row = 1
    for size, stride in zip(reversed(t.shape[1:]), reversed(t.stride()[1:])):
        if size != 1 and stride != row:
            return None
        row *= size
    return t.as_strided((t.shape[0], row), (t.stride(0), 1)).view(torch.uint8)


def _row_width(rows: torch.Tensor) -> int:
    """The widest integer (8, 4, 2 or 1 bytes) a uint8 row view can be reinterpreted as."""
    for width, _ in _WIDE:
        if rows.shape[1] % width == 0 and rows.stride(0) % width == 0 \
                and rows.data_ptr() % width == 0 and rows.storage_offset() % width == 0:
            return width
    return 1


@attrs.frozen(eq=False)
class TensorGather:
    """How to gather one layer's key or value tensor.

    ``blocks``: the normalised ``[num_blocks, block_tokens, *token_shape]`` view into the cache
    (any strides, e.g. narrowed on the heads); ``block_ids``: the blocks read (``full_blocks``
    whole ones, then one partial block of ``tail_tokens`` tokens when that is > 0); ``index``:
    the whole blocks' ids, int64 on the cache's device; ``runs``: their runs of consecutive ids
    as ``(dst_block, src_block, count)`` (``paged_cache.block_runs``).
    """

    layer: int
    which: str
    blocks: torch.Tensor = attrs.field(repr=False)
    block_ids: tuple[int, ...] = attrs.field(repr=False)
    tokens: int
    full_blocks: int
    tail_tokens: int
    index: torch.Tensor = attrs.field(repr=False)
    runs: tuple[tuple[int, int, int], ...] = attrs.field(repr=False)
    #: Output shape ``(tokens, *token_shape)`` and bytes.
    shape: tuple[int, ...] = attrs.field(init=False)
    nbytes: int = attrs.field(init=False)
    _rows: torch.Tensor | None = attrs.field(init=False, repr=False)  # uint8 view of ``blocks``

    @shape.default
    def _shape_default(self) -> tuple[int, ...]:
        return (self.tokens, *self.blocks.shape[2:])

    @nbytes.default
    def _nbytes_default(self) -> int:
        return math.prod(self.shape) * self.blocks.element_size()

    @_rows.default
    def _rows_default(self) -> torch.Tensor | None:
        return _byte_rows(self.blocks)

    @property
    def name(self) -> str:
        """Wire name: ``key_cache_{layer}`` or ``value_cache_{layer}``."""
        return f"{self.which}_cache_{self.layer}"

    @property
    def dtype(self) -> torch.dtype:
        return self.blocks.dtype

    @property
    def device(self) -> torch.device:
        return self.blocks.device

    @property
    def dtype_name(self) -> str:
        """The wire dtype name (torch's, without ``torch.``)."""
        return str(self.blocks.dtype).removeprefix("torch.")

    @property
    def strided(self) -> bool:
        """True when a block is not one contiguous run of bytes (head slices, packed layout)."""
        return self._rows is None

    def choose_method(self, out_device: torch.device, method: GatherMethod = "auto") -> str:
        """The concrete method for a destination on ``out_device``.

        ``"auto"``: cross-device, ``"runs"`` up to :data:`CROSS_DEVICE_MAX_RUNS` runs, else
        ``"staged"``; on an accelerator, ``"runs"`` up to :data:`DEVICE_MAX_RUNS` runs, else
        ``"index"``; on CPU, ``"runs"`` for strided blocks with up to :data:`STRIDED_MAX_RUNS`
        runs, else ``"index"``.
        """
        if method not in METHODS:
            raise ConfigError(f"gather method must be one of {METHODS}, got {method!r}")
        cross = out_device != self.device
        if method == "index" and cross:
            raise ConfigError(f"'index' needs the destination on {self.device}, not {out_device}")
        if method != "auto":
            return method
        if cross:
            return "runs" if len(self.runs) <= CROSS_DEVICE_MAX_RUNS else "staged"
        if self.device.type != "cpu":
            return "runs" if len(self.runs) <= DEVICE_MAX_RUNS else "index"
        return "runs" if self.strided and len(self.runs) <= STRIDED_MAX_RUNS else "index"

    def check_out(self, out: Any) -> None:
        """ConfigError unless ``out`` is a contiguous tensor of this shape and dtype."""
        if not isinstance(out, torch.Tensor):
            raise ConfigError(f"{self.name}: destination must be a tensor, not {type(out).__name__}")
        if tuple(out.shape) != self.shape or out.dtype != self.dtype or not out.is_contiguous():
            raise ConfigError(
                f"{self.name}: destination is {out.dtype}{list(out.shape)} "
                f"(contiguous={out.is_contiguous()}), need contiguous {self.dtype}{list(self.shape)}")

    @torch.no_grad()
    def gather_into(self, out: torch.Tensor, *, method: GatherMethod = "auto") -> torch.Tensor:
        """Write this tensor's tokens into ``out`` in place; return ``out``.

        Whole blocks: one ``index_select(out=...)`` over byte rows (``"index"``), one ``copy_``
        per run (``"runs"``) or one temporary (``"staged"``); then the partial last block's first
        ``tail_tokens`` tokens in one more ``copy_``.
        """
        self.check_out(out)
        return self.write_unchecked(out, self.choose_method(out.device, method))

    def write_unchecked(self, out: torch.Tensor, chosen: str) -> torch.Tensor:
        """Copy into ``out`` already passed by :meth:`check_out`, with a method :meth:`choose_method`
        returned (not ``"auto"``); autograd must be off. :meth:`gather_into` does all three."""
        if self.nbytes == 0:
            return out
        block_shape = tuple(self.blocks.shape[1:])
        if self.full_blocks:
            dst = out.narrow(0, 0, self.full_blocks * block_shape[0]).view(
                self.full_blocks, *block_shape)
            if chosen == "runs":
                for at, src, count in self.runs:
                    dst.narrow(0, at, count).copy_(self.blocks.narrow(0, src, count))
            elif chosen == "staged":
                dst.copy_(torch.index_select(self.blocks, 0, self.index))
            else:
                dst_rows = _byte_rows(dst)
                if self._rows is not None and dst_rows is not None:
                    width = min(_row_width(self._rows), _row_width(dst_rows))
                    wide = _WIDTH_DTYPE[width]
                    torch.index_select(self._rows.view(wide), 0, self.index, out=dst_rows.view(wide))
                else:  # strided blocks: element-wise gather, still no temporary
                    torch.index_select(self.blocks, 0, self.index, out=dst)
        if self.tail_tokens:
            last = self.blocks.select(0, self.block_ids[self.full_blocks])
            out.narrow(0, self.full_blocks * block_shape[0], self.tail_tokens).copy_(
                last.narrow(0, 0, self.tail_tokens))
        return out
