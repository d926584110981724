"""Gathering one planned tensor out of a paged cache into a destination (SPEC 4, phase 2).

A :class:`TensorGather` knows one layer's key or value block view, the blocks to read and the
output shape; :meth:`TensorGather.gather_into` moves the bytes, once, with no temporary (except
the ``"staged"`` method). Planning lives in :mod:`kvferry.adapters.paged_cache`.

Whole blocks move by one of four methods (:data:`GatherMethod`); the partial last block is one
more copy. The torch methods run on CPU and accelerators alike (on CUDA the copies are queued on
the current stream). ``"native"`` (CPU only) is the optional C extension
``kvferry.adapters._gather``: the same bytes, written with streaming (non-temporal) stores when a
tensor is at least :data:`STREAM_MIN_BYTES`; :data:`NATIVE_GATHER` says whether it is in use.
"""

from __future__ import annotations

import array
import functools
import math
import os
from collections.abc import Iterable, Sequence
from typing import Any, Literal

import attrs
import torch

from kvferry.core.errors import ConfigError

_native: Any = None
if os.environ.get("KVFERRY_NATIVE_GATHER", "1") != "0":
    try:  # the optional C extension (pyproject.toml ext-modules, optional = true)
        from kvferry.adapters import _gather as _native
    except ImportError:  # not built (no compiler) or not loadable here: torch's copies only
        _native = None

__all__ = [
    "GatherMethod",
    "CROSS_DEVICE_MAX_RUNS",
    "DEVICE_MAX_RUNS",
    "STRIDED_MAX_RUNS",
    "TensorGather",
    "BlockIds",
    "BlockSite",
    "HostSpan",
    "Destination",
    "NATIVE_GATHER",
    "NATIVE_MAX_THREADS",
    "NATIVE_MIN_PIECE",
    "STREAM_MIN_BYTES",
    "native_isa",
    "MAX_SPLIT",
    "split_stride",
    "gather_split",
    "split_calls",
    "NativeCall",
    "write_all",
]

#: ``"index"``: one ``index_select(out=...)`` over byte rows of whole blocks (element-wise when a
#: block is strided, e.g. narrowed on the heads); ``"runs"``: one ``copy_`` per run of
#: consecutive block ids; ``"staged"``: gather on the cache's device, then one copy (the only
#: method with a temporary; for cross-device destinations with scattered blocks);
#: ``"native"``: the C extension (CPU to CPU; :data:`NATIVE_GATHER`); ``"auto"``: chosen per
#: tensor by :meth:`TensorGather.choose_method`.
GatherMethod = Literal["auto", "index", "runs", "staged", "native"]
#: One prepared native copy: the extension's function and its arguments (run by :func:`write_all`).
NativeCall = tuple[Any, tuple[Any, ...]]
METHODS = ("auto", "index", "runs", "staged", "native")
#: True when the native gather is built and loaded. ``KVFERRY_NATIVE_GATHER=0`` in the environment
#: (read at import) leaves it unloaded, as if it were not built.
NATIVE_GATHER: bool = _native is not None
#: ``"auto"`` picks ``"native"`` (single-threaded) only while ``torch.get_num_threads()`` is at
#: most this; with more intra-op threads torch's parallel copies are used.
NATIVE_MAX_THREADS = 1
#: ``"auto"`` picks ``"native"`` only when a block reads contiguous pieces of at least this many
#: bytes (a head slice of one token, a whole block, ...); smaller pieces stay with torch.
NATIVE_MIN_PIECE = 64
#: The native gather uses streaming stores for tensors of at least this many bytes (a request's
#: payload is then dozens of them, far beyond a core's caches); smaller ones use cached stores, so
#: they are still in cache when the payload is sent.
STREAM_MIN_BYTES = 1 << 20
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
#: Most destinations one :func:`gather_split` writes (the C extension's limit).
MAX_SPLIT = 64
_WIDE = ((8, torch.int64), (4, torch.int32), (2, torch.int16))
_WIDTH_DTYPE = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


def _row_elements(t: torch.Tensor) -> int | None:
    """Elements per ``t[i]`` when each is one contiguous run; None if ``t[i]`` is strided."""
    row = 1
    for size, stride in zip(reversed(t.shape[1:]), reversed(t.stride()[1:])):
        if size != 1 and stride != row:
            return None
        row *= size
    return row


def _byte_rows(t: torch.Tensor) -> torch.Tensor | None:
    """``t`` as a 2-D uint8 view ``[t.shape[0], bytes per row]``; None if ``t[i]`` is strided."""
    row = _row_elements(t)
    if row is None:
        return None
    return t.as_strided((t.shape[0], row), (t.stride(0), 1)).view(torch.uint8)


def native_isa() -> str | None:
    """The native gather's streaming stores (``avx512f``, ``avx2``, ``sse2``, or ``memcpy`` on
    other CPUs), or None when the extension is not built."""
    return None if _native is None else str(_native.isa())


def _pieces(sizes: tuple[int, ...], strides: tuple[int, ...], itemsize: int) -> tuple[int, ...] | None:
    """A block of ``sizes``/``strides`` (elements) as the native gather reads it:
    ``(d0, s0, d1, s1, d2, s2, piece)``, i.e. up to three strided dimensions (outermost first,
    bytes) of contiguous pieces of ``piece`` bytes, in row-major order; None if it needs more."""
    dims = [(size, stride * itemsize) for size, stride in zip(sizes, strides) if size != 1]
    piece = itemsize
    while dims and dims[-1][1] == piece:
        piece *= dims.pop()[0]
    outer: list[tuple[int, int]] = []  # innermost first, merged where they tile
    for size, stride in reversed(dims):
        if outer and stride == outer[-1][0] * outer[-1][1]:
            outer[-1] = (outer[-1][0] * size, outer[-1][1])
        else:
            outer.append((size, stride))
    if len(outer) > 3:
        return None
    outer += [(1, 0)] * (3 - len(outer))
    return (*(v for dim in reversed(outer) for v in dim), piece)


@attrs.frozen(eq=False)
class HostSpan:
    """A gather's destination that is not made into a tensor: ``shape`` elements of ``dtype``
    at byte ``offset`` of ``buffer``, a 1-D contiguous ``uint8`` host tensor (a reserved pool
    region). The native gather writes through the address alone, so a payload is gathered into
    its region without a typed view per tensor (about 4 us each); :meth:`tensor` makes the view
    for the torch methods. :func:`kvferry.adapters.torch_frames.dest_spans` makes them for a
    payload's layout. ConfigError at construction unless ``buffer`` is a 1-D contiguous
    ``uint8`` host tensor holding the whole span: nothing is ever written outside it."""

    buffer: torch.Tensor = attrs.field(repr=False)
    offset: int
    dtype: torch.dtype
    shape: tuple[int, ...]

    def __attrs_post_init__(self) -> None:
        b, end = self.buffer, self.offset + math.prod(self.shape) * self.dtype.itemsize
        if b.dtype != torch.uint8 or b.dim() != 1 or not b.is_cpu or (b.numel() > 1 and b.stride(0) != 1):
            raise ConfigError(f"a host span needs a 1-D contiguous uint8 host buffer, not {b.dtype}{list(b.shape)}")
        if self.offset < 0 or end > b.numel() or min(self.shape, default=0) < 0:
            raise ConfigError(f"span [{self.offset}, {end}) lies outside the buffer of {b.numel()} bytes")

    @classmethod
    def in_checked_buffer(
        cls, buffer: torch.Tensor, offset: int, dtype: torch.dtype, shape: tuple[int, ...]
    ) -> HostSpan:
        """The span, made without the constructor's checks, for a caller that made them once for
        every span of a buffer (:func:`kvferry.adapters.torch_frames.dest_spans`: the buffer is a
        1-D contiguous ``uint8`` host tensor holding the whole payload layout)."""
        span = object.__new__(cls)
        for name, value in zip(_SPAN_FIELDS, (buffer, offset, dtype, shape)):
            object.__setattr__(span, name, value)  # frozen: as attrs' own __init__ sets fields
        return span

    @property
    def device(self) -> torch.device:
        return self.buffer.device

    def data_ptr(self) -> int:
        return self.buffer.data_ptr() + self.offset

    def tensor(self) -> torch.Tensor:
        """The typed view of the span."""
        nbytes = math.prod(self.shape) * self.dtype.itemsize
        return self.buffer.narrow(0, self.offset, nbytes).view(self.dtype).view(self.shape)


#: :class:`HostSpan`'s fields in order (what :meth:`HostSpan.in_checked_buffer` sets).
_SPAN_FIELDS = tuple(a.name for a in attrs.fields(HostSpan))
#: Where a gather writes: a tensor, or a span of a host buffer.
Destination = torch.Tensor | HostSpan


@attrs.frozen
class _NativeLayout:
    """What the native gather needs: a block's stride and the bytes it gathers, and
    :func:`_pieces` of a whole block and of the partial last block."""

    block_stride: int
    block_bytes: int
    full: tuple[int, ...]
    tail: tuple[int, ...]


@functools.lru_cache(maxsize=256)  # every layer of a cache shares one geometry
def _layout_of(
    shape: tuple[int, ...], stride: tuple[int, ...], itemsize: int, tail_tokens: int
) -> _NativeLayout | None:
    full = _pieces(shape[1:], stride[1:], itemsize)
    tail = _pieces((tail_tokens or 1, *shape[2:]), stride[1:], itemsize)
    if full is None or tail is None:
        return None
    return _NativeLayout(stride[0] * itemsize, math.prod(shape[1:]) * itemsize, full, tail)


class BlockIds:
    """A gather's whole-block ids as the copies need them: an int64 array whose address the
    native gather reads (no torch call: making a tensor is the costliest step of planning a
    small request, tens of microseconds on a process that was idle), and the int64 tensor on
    the blocks' device that the torch methods read, made on first use and kept."""

    __slots__ = ("ids", "device", "_host", "_tensor")

    def __init__(self, ids: Sequence[int], device: torch.device | str = "cpu") -> None:
        self.ids = tuple(ids)
        self.device = torch.device(device) if isinstance(device, str) else device
        self._host = array.array("q", self.ids)
        self._tensor: torch.Tensor | None = None

    def __len__(self) -> int:
        return len(self.ids)

    @property
    def is_cpu(self) -> bool:
        return self.device.type == "cpu"

    def address(self) -> int:
        """Where the ids lie, one int64 each (valid while this object lives)."""
        return self._host.buffer_info()[0]

    def tensor(self) -> torch.Tensor:
        if self._tensor is None:
            self._tensor = torch.tensor(self.ids, dtype=torch.int64, device=self.device)
        return self._tensor

    def same_ids(self, other: BlockIds) -> bool:
        return self is other or (self.ids == other.ids and self.device == other.device)


def block_ids_of(index: torch.Tensor | BlockIds) -> BlockIds:
    """``index`` as :class:`BlockIds` (a 1-D integer tensor's values, on its device)."""
    if isinstance(index, BlockIds):
        return index
    made = BlockIds([int(i) for i in index.reshape(-1).tolist()], index.device)
    if index.dtype == torch.int64 and index.dim() == 1 and index.is_contiguous():
        made._tensor = index  # the caller's tensor serves the torch methods as it is
    return made


def _native_layout(blocks: torch.Tensor, index: BlockIds, full_blocks: int, tail_tokens: int) -> _NativeLayout | None:
    """The layout for the native gather; None unless the blocks and ids are on the CPU, there
    are ``full_blocks`` ids and a block needs at most three strided dimensions. About 3 us
    (cached per geometry): planning computes it for every tensor."""
    if not (blocks.is_cpu and index.is_cpu) or len(index) != full_blocks or blocks.dim() < 2:
        return None
    return _layout_of(tuple(blocks.shape), blocks.stride(), blocks.element_size(), tail_tokens)


def _row_width(rows: torch.Tensor) -> int:
    """The widest integer (8, 4, 2 or 1 bytes) a uint8 row view can be reinterpreted as."""
    for width, _ in _WIDE:
        if (
            rows.shape[1] % width == 0
            and rows.stride(0) % width == 0
            and rows.data_ptr() % width == 0
            and rows.storage_offset() % width == 0
        ):
            return width
    return 1


@attrs.frozen(eq=False)
class BlockSite:
    """One layer's key or value block view (``[num_blocks, block_tokens, *token_shape]``) and
    what every request's :class:`TensorGather` over it derives from the view alone: made once
    per cache (:class:`~kvferry.adapters.paged_cache.CacheGeometry`), not once per request."""

    blocks: torch.Tensor = attrs.field(repr=False)
    token_shape: tuple[int, ...] = attrs.field(init=False)
    token_bytes: int = attrs.field(init=False)
    whole_rows: bool = attrs.field(init=False)
    _layouts: dict[int, _NativeLayout | None] = attrs.field(init=False, factory=dict, repr=False)

    @token_shape.default
    def _token_shape_default(self) -> tuple[int, ...]:
        return tuple(self.blocks.shape[2:])

    @token_bytes.default
    def _token_bytes_default(self) -> int:
        return math.prod(self.token_shape) * self.blocks.element_size()

    @whole_rows.default
    def _whole_rows_default(self) -> bool:
        return _row_elements(self.blocks) is not None

    def layout(self, tail_tokens: int) -> _NativeLayout | None:
        """The native layout of a gather with ``tail_tokens`` in its partial block and a
        planned index (what :func:`_native_layout` gives it); None: torch only."""
        if tail_tokens not in self._layouts:
            b = self.blocks
            self._layouts[tail_tokens] = (
                _layout_of(tuple(b.shape), b.stride(), b.element_size(), tail_tokens)
                if b.is_cpu and b.dim() >= 2
                else None
            )
        return self._layouts[tail_tokens]


@attrs.frozen(eq=False)
class TensorGather:
    """How to gather one layer's key or value tensor.

    ``blocks``: the normalised ``[num_blocks, block_tokens, *token_shape]`` view into the cache
    (any strides, e.g. narrowed on the heads); ``block_ids``: the blocks read (``full_blocks``
    whole ones, then one partial block of ``tail_tokens`` tokens when that is > 0); ``index``:
    the whole blocks' ids (:class:`BlockIds` on the cache's device; a 1-D integer tensor given
    to the constructor is converted); ``runs``: their runs of consecutive ids as
    ``(dst_block, src_block, count)`` (``paged_cache.block_runs``).
    """

    layer: int
    which: str
    blocks: torch.Tensor = attrs.field(repr=False)
    block_ids: tuple[int, ...] = attrs.field(repr=False)
    tokens: int
    full_blocks: int
    tail_tokens: int
    index: BlockIds = attrs.field(repr=False, converter=block_ids_of)
    runs: tuple[tuple[int, int, int], ...] = attrs.field(repr=False)
    #: Output shape ``(tokens, *token_shape)`` and bytes.
    shape: tuple[int, ...] = attrs.field(init=False)
    nbytes: int = attrs.field(init=False)
    _whole_rows: bool = attrs.field(init=False, repr=False)  # a block is one contiguous run
    _layout: _NativeLayout | None = attrs.field(init=False, repr=False)  # None: torch only

    @shape.default
    def _shape_default(self) -> tuple[int, ...]:
        return (self.tokens, *self.blocks.shape[2:])

    @nbytes.default
    def _nbytes_default(self) -> int:
        return math.prod(self.shape) * self.blocks.element_size()

    @_whole_rows.default
    def _whole_rows_default(self) -> bool:
        return _row_elements(self.blocks) is not None

    @_layout.default
    def _layout_default(self) -> _NativeLayout | None:
        return _native_layout(self.blocks, self.index, self.full_blocks, self.tail_tokens)

    @classmethod
    def on_site(
        cls,
        site: BlockSite,
        layer: int,
        which: str,
        block_ids: tuple[int, ...],
        tokens: int,
        full_blocks: int,
        tail_tokens: int,
        index: BlockIds,
        runs: tuple[tuple[int, int, int], ...],
    ) -> TensorGather:
        """The gather the constructor builds over ``site.blocks``, with the fields derived from
        the view taken from ``site`` instead of computed again. ``index`` must be what planning
        makes: the first ``full_blocks`` ids, :class:`BlockIds` on the blocks' device.
        About 1.5 us against the constructor's 4 (a plan makes one per tensor per request)."""
        gather = object.__new__(cls)
        put = object.__setattr__  # frozen: how attrs' own __init__ sets fields (_GATHER_SLOTS)
        put(gather, "layer", layer)
        put(gather, "which", which)
        put(gather, "blocks", site.blocks)
        put(gather, "block_ids", block_ids)
        put(gather, "tokens", tokens)
        put(gather, "full_blocks", full_blocks)
        put(gather, "tail_tokens", tail_tokens)
        put(gather, "index", index)
        put(gather, "runs", runs)
        put(gather, "shape", (tokens, *site.token_shape))
        put(gather, "nbytes", tokens * site.token_bytes)
        put(gather, "_whole_rows", site.whole_rows)
        put(gather, "_layout", site.layout(tail_tokens))
        return gather

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
        return not self._whole_rows

    def choose_method(self, out_device: torch.device, method: GatherMethod = "auto") -> str:
        """The concrete method for a destination on ``out_device``.

        ``"auto"``: cross-device, ``"runs"`` up to :data:`CROSS_DEVICE_MAX_RUNS` runs, else
        ``"staged"``; on an accelerator, ``"runs"`` up to :data:`DEVICE_MAX_RUNS` runs, else
        ``"index"``; on CPU, ``"native"`` when :data:`NATIVE_GATHER`, torch runs at most
        :data:`NATIVE_MAX_THREADS` threads and a block reads pieces of at least
        :data:`NATIVE_MIN_PIECE` bytes, else ``"runs"`` for strided blocks with up to
        :data:`STRIDED_MAX_RUNS` runs, else ``"index"``. ConfigError for ``"native"`` when the
        extension is unavailable, either side is not on the CPU, or the blocks are strided in
        more than three dimensions.
        """
        if method not in METHODS:
            raise ConfigError(f"gather method must be one of {METHODS}, got {method!r}")
        cross = out_device != self.device
        if method == "index" and cross:
            raise ConfigError(f"'index' needs the destination on {self.device}, not {out_device}")
        if method == "native":
            if _native is None:
                raise ConfigError(
                    "the native gather (kvferry.adapters._gather) is not built "
                    "or is switched off (KVFERRY_NATIVE_GATHER=0)"
                )
            if cross or out_device.type != "cpu" or self._layout is None:
                raise ConfigError(
                    f"{self.name}: 'native' needs a CPU cache with blocks strided in "
                    f"at most 3 dimensions and a CPU destination (cache on "
                    f"{self.device}, destination on {out_device})"
                )
        if method != "auto":
            return method
        if cross:
            return "runs" if len(self.runs) <= CROSS_DEVICE_MAX_RUNS else "staged"
        if self.device.type != "cpu":
            return "runs" if len(self.runs) <= DEVICE_MAX_RUNS else "index"
        layout = self._layout
        if (
            NATIVE_GATHER
            and layout is not None
            and layout.full[-1] >= NATIVE_MIN_PIECE
            and torch.get_num_threads() <= NATIVE_MAX_THREADS
        ):
            return "native"
        return "runs" if self.strided and len(self.runs) <= STRIDED_MAX_RUNS else "index"

    def check_out(self, out: Any) -> None:
        """ConfigError unless ``out`` is a contiguous tensor, or a :class:`HostSpan`, of this
        shape and dtype."""
        if type(out) is HostSpan:
            if out.shape != self.shape or out.dtype != self.dtype:
                have, need = f"{out.dtype}{list(out.shape)}", f"{self.dtype}{list(self.shape)}"
                raise ConfigError(f"{self.name}: destination span is {have}, need {need}")
            return
        if not isinstance(out, torch.Tensor):
            raise ConfigError(f"{self.name}: destination must be a tensor, not {type(out).__name__}")
        if tuple(out.shape) != self.shape or out.dtype != self.dtype or not out.is_contiguous():
            raise ConfigError(
                f"{self.name}: destination is {out.dtype}{list(out.shape)} "
                f"(contiguous={out.is_contiguous()}), need contiguous {self.dtype}{list(self.shape)}"
            )

    @torch.no_grad()
    def gather_into(self, out: torch.Tensor, *, method: GatherMethod = "auto") -> torch.Tensor:
        """Write this tensor's tokens into ``out`` in place; return ``out``.

        Whole blocks: one ``index_select(out=...)`` over byte rows (``"index"``), one ``copy_``
        per run (``"runs"``) or one temporary (``"staged"``); then the partial last block's first
        ``tail_tokens`` tokens in one more ``copy_``; or ``"native"``: both in C.
        """
        self.check_out(out)
        self.write_unchecked(out, self.choose_method(out.device, method))
        return out

    def write_unchecked(self, out: Destination, chosen: str) -> None:
        """Copy into ``out`` already passed by :meth:`check_out`, with a method :meth:`choose_method`
        returned (not ``"auto"``); autograd must be off. :meth:`gather_into` does all three."""
        if self.nbytes == 0:
            return
        if chosen == "native":
            self._write_native(out)
            return
        if isinstance(out, HostSpan):  # the torch methods write through a view
            out = out.tensor()
        block_shape = tuple(self.blocks.shape[1:])
        if self.full_blocks:
            dst = out.narrow(0, 0, self.full_blocks * block_shape[0]).view(self.full_blocks, *block_shape)
            if chosen == "runs":
                for at, src, count in self.runs:
                    dst.narrow(0, at, count).copy_(self.blocks.narrow(0, src, count))
            elif chosen == "staged":
                dst.copy_(torch.index_select(self.blocks, 0, self.index.tensor()))
            else:
                rows, dst_rows = _byte_rows(self.blocks), _byte_rows(dst)
                if rows is not None and dst_rows is not None:
                    width = min(_row_width(rows), _row_width(dst_rows))
                    wide = _WIDTH_DTYPE[width]
                    torch.index_select(rows.view(wide), 0, self.index.tensor(), out=dst_rows.view(wide))
                else:  # strided blocks: element-wise gather, still no temporary
                    torch.index_select(self.blocks, 0, self.index.tensor(), out=dst)
        if self.tail_tokens:
            last = self.blocks.select(0, self.block_ids[self.full_blocks])
            out.narrow(0, self.full_blocks * block_shape[0], self.tail_tokens).copy_(
                last.narrow(0, 0, self.tail_tokens)
            )

    def _write_native(self, out: Destination) -> None:
        """The ``"native"`` copy: whole blocks in one call, the partial last block in another.
        IndexError, before any byte moves, if a block id is outside ``blocks``."""
        _run_native(self.native_calls(out))

    def native_calls(self, out: Destination) -> list[NativeCall]:
        """The native copies that write this tensor into ``out`` (already passed by
        :meth:`check_out`): the whole blocks, then the partial last block; nothing moves until
        :func:`write_all` runs them. IndexError now if a block id is outside ``blocks``."""
        layout, native = self._layout, _native
        if layout is None or native is None:
            raise ConfigError(f"{self.name}: the native gather cannot read these blocks")
        self._check_tail_id()
        calls: list[NativeCall] = []
        if self.full_blocks:
            where = (out.data_ptr(), self.blocks.data_ptr(), self.index.address(), self.full_blocks)
            walk = (self.blocks.shape[0], layout.block_stride, *layout.full, self._stream)
            calls.append((native.gather, (*where, *walk)))
        if self.tail_tokens:
            calls.append(self._tail_call(out))
        return calls

    @property
    def _stream(self) -> bool:
        return self.nbytes >= STREAM_MIN_BYTES

    def _check_tail_id(self) -> None:
        last = self.block_ids[self.full_blocks] if self.tail_tokens else 0
        if not 0 <= last < self.blocks.shape[0]:
            raise IndexError(f"{self.name}: block {last} outside [0, {self.blocks.shape[0]})")

    def _tail_call(self, out: Destination) -> NativeCall:
        """The native copy of the partial last block's tokens (after :meth:`_check_tail_id`)."""
        layout, last = self._layout, self.block_ids[self.full_blocks]
        assert layout is not None  # the native path runs only on blocks with a native layout
        return (
            _native.gather,
            (
                out.data_ptr() + self.full_blocks * layout.block_bytes,
                self.blocks.data_ptr() + last * layout.block_stride,
                0,
                1,
                1,
                layout.block_stride,
                *layout.tail,
                self._stream,
            ),
        )


#: Every field of :class:`TensorGather` in order (what :meth:`TensorGather.on_site` sets).
_GATHER_SLOTS = tuple(a.name for a in attrs.fields(TensorGather))
assert _GATHER_SLOTS == (
    "layer", "which", "blocks", "block_ids", "tokens", "full_blocks", "tail_tokens", "index", "runs",
    "shape", "nbytes", "_whole_rows", "_layout",
)  # fmt: skip


def split_stride(gathers: Sequence[TensorGather]) -> int | None:
    """The byte distance between consecutive gathers when they are equal slices of one tensor
    (same blocks, block ids and layout, each view ``stride`` bytes after the previous one, e.g.
    the head slices of several receivers), so :func:`gather_split` can read the source once;
    None otherwise (or when the native gather is not in use)."""
    if _native is None or not 2 <= len(gathers) <= MAX_SPLIT:
        return None
    first = gathers[0]
    base, layout = first.blocks, first._layout
    if layout is None:
        return None
    stride = gathers[1].blocks.data_ptr() - base.data_ptr()
    if stride <= 0:
        return None
    start, shape, strides, dtype = base.data_ptr(), base.shape, base.stride(), base.dtype
    for j, g in enumerate(gathers[1:], 1):
        b = g.blocks
        if (
            (g._layout is not layout and g._layout != layout)  # slices of one geometry share it
            or b.data_ptr() != start + j * stride
            or b.shape != shape
            or b.stride() != strides
            or b.dtype != dtype
            or g.full_blocks != first.full_blocks
            or g.tail_tokens != first.tail_tokens
            or (g.block_ids is not first.block_ids and g.block_ids != first.block_ids)
            or not g.index.same_ids(first.index)
        ):
            return None
    return stride


def gather_split(gathers: Sequence[TensorGather], outs: Sequence[Destination], stride: int, replicas: int = 1) -> None:
    """Write ``gathers[j]`` into ``outs[j * replicas + r]`` for every ``r < replicas`` (each
    checked by :meth:`TensorGather.check_out`) in one pass over the source: the native split
    gather for the whole blocks (every copy of a slice written from one read), then each
    partial last block. ``stride``: :func:`split_stride` of ``gathers`` (not None; any value
    for one gather)."""
    _run_native(split_calls(gathers, outs, stride, replicas))


def split_calls(
    gathers: Sequence[TensorGather], outs: Sequence[Destination], stride: int, replicas: int = 1
) -> list[NativeCall]:
    """:func:`gather_split`'s native copies, to run with :func:`write_all`; nothing moves
    before then (a bad destination count raises ConfigError, a block id out of range
    IndexError, here)."""
    first = gathers[0]
    layout = first._layout
    if replicas < 1 or len(outs) != len(gathers) * replicas or len(outs) > MAX_SPLIT:
        raise ConfigError(f"{len(outs)} destinations for {len(gathers)} slices of {replicas} copies each")
    if first.tail_tokens:  # split_stride: every slice has the same ids
        for g in gathers:
            g._check_tail_id()
    calls: list[NativeCall] = []
    if first.full_blocks:
        assert layout is not None  # split_stride gave a stride: the gathers have a native layout
        calls.append(
            (
                _native.gather_split,
                (
                    tuple([o.data_ptr() for o in outs]),
                    stride,
                    first.blocks.data_ptr(),
                    first.index.address(),
                    first.full_blocks,
                    first.blocks.shape[0],
                    layout.block_stride,
                    *layout.full,
                    first._stream,
                    replicas,
                ),
            )
        )
    if first.tail_tokens:
        calls.extend(gathers[j // replicas]._tail_call(out) for j, out in enumerate(outs))
    return calls


def write_all(items: Iterable[tuple[TensorGather, Destination, str]], calls: Sequence[NativeCall] = ()) -> None:
    """Write each ``(gather, destination, method)`` (the destination passed by
    :meth:`TensorGather.check_out`, the method by :meth:`TensorGather.choose_method`): every
    native copy, with ``calls`` prepared by the caller, is prepared first (every id checked
    before a byte moves) and run back to back (:func:`_run_native`); the torch methods after,
    with autograd off (the native copies do not need it: a small request gathered natively
    does not pay for entering it, tens of microseconds on a process that was idle)."""
    prepared = list(calls)
    others: list[tuple[TensorGather, Destination, str]] = []
    for gather, out, method in items:
        if method == "native":
            prepared.extend(gather.native_calls(out))
        else:
            others.append((gather, out, method))
    _run_native(prepared)
    if others:
        with torch.no_grad():
            for gather, out, method in others:
                gather.write_unchecked(out, method)


def _run_native(calls: Sequence[NativeCall]) -> None:
    """Run prepared native copies in order. A request's copies are prepared first and run
    back to back: the Python between two copies runs on caches the last copy just swept
    (measured ~25 us a tensor when interleaved, against ~8 us prepared apart)."""
    for fn, args in calls:
        fn(*args)
