"""KV payloads -> tensors (SPEC 3.1), and the torch side of the dtype table and byte views.

Decoding makes tensors that are VIEWS of the received memory. Exceptions, where one copy is
made: a tensor whose bytes straddle two frames, and a tensor of a device buffer whose offset is
not a multiple of its element size (reference payloads are packed without alignment).
Tensors decoded from read-only memory (``bytes``) share it: they must not be written to (torch
warns about such buffers; the warning is suppressed here on purpose). Clone to own the data.

Speed: the header's validated descriptors are grouped into *runs* (consecutive tensors of one
dtype and shape at evenly spaced offsets: a model's K and V layers are one run) and a run of a
contiguous host buffer becomes its tensors with one ``as_strided`` + ``unbind``, not one
``frombuffer`` per tensor. The grouping is remembered for a repeated layout. Public names are
re-exported by :mod:`kvferry.adapters.torch_frames`.
"""

from __future__ import annotations

import bisect
import warnings
from collections.abc import Mapping
from typing import Any

import attrs
import torch

from kvferry.adapters.checksums import compute_checksum, verify_checksum
from kvferry.core.errors import ConfigError, PayloadError
from kvferry.core.header import (
    DTYPE_ITEMSIZE,
    PREFIX_NBYTES,
    DecodedHeader,
    DecodeLimits,
    TensorDescriptor,
    decode_header,
)
from kvferry.core.phrases import phrase

__all__ = [
    "TORCH_DTYPES",
    "dtype_name",
    "torch_dtype",
    "host_byte_view",
    "given_bytes",
    "DecodedKV",
    "decode_payload",
    "verify_deferred",
    "verify_arrived",
    "checksum_mismatch",
]

#: Allow-listed dtype names -> torch dtypes (only those this torch build has).
TORCH_DTYPES: dict[str, torch.dtype] = {
    name: dt for name in DTYPE_ITEMSIZE if isinstance(dt := getattr(torch, name, None), torch.dtype)
}
_NAMES = {dt: name for name, dt in TORCH_DTYPES.items()}
#: dtypes numpy lacks (or whose buffers memoryview cannot cast) -> a same-layout dtype it has
_NUMPY_AS = {
    dt: (torch.int16 if dt.itemsize == 2 else torch.int64 if dt.itemsize == 8 else torch.uint8)
    for name, dt in TORCH_DTYPES.items()
    if name == "bfloat16" or name.startswith(("float8", "complex"))
}


def dtype_name(dtype: torch.dtype) -> str:
    """The wire name of an allow-listed torch dtype; ConfigError for any other dtype."""
    try:
        return _NAMES[dtype]
    except (KeyError, TypeError):
        raise ConfigError(f"dtype {dtype} is not in the payload allow-list {sorted(TORCH_DTYPES)}") from None


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a wire name; PayloadError when this torch build lacks it."""
    try:
        return TORCH_DTYPES[name]
    except KeyError:
        raise PayloadError(f"invalid KV payload: dtype {name!r} is not available in this torch") from None


def given_bytes(known: Any, tensor: torch.Tensor) -> memoryview | None:
    """``known`` when it can stand for a host ``uint8`` tensor's bytes without asking torch
    (a pool's memoryview of the same memory, handed over by the buffer's owner): a memoryview
    of exactly the tensor's length, the tensor on the CPU. None otherwise: the caller then asks
    the tensor for its own view."""
    if isinstance(known, memoryview) and tensor.device.type == "cpu" and len(known) == tensor.numel():
        return known
    return None


def host_byte_view(tensor: torch.Tensor) -> memoryview:
    """A flat ``uint8`` memoryview of a tensor's bytes (zero-copy for contiguous CPU tensors).

    The common case (a contiguous CPU tensor without autograd, conjugate or negative bits) is
    three cheap calls; numpy and memoryview refuse every other case, which then takes the careful
    path (detach, host copy, resolved bits, contiguous copy).
    """
    try:
        as_dtype = _NUMPY_AS.get(tensor.dtype)
        return (tensor if as_dtype is None else tensor.view(as_dtype)).numpy().data.cast("B")
    except (RuntimeError, TypeError, ValueError):
        pass
    t = tensor.detach()
    if t.numel() == 0:
        return memoryview(b"")
    if t.device.type != "cpu":
        t = t.cpu()
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().data


@attrs.frozen(eq=False)
class DecodedKV:
    """A decoded payload; tensors are views of the received memory (None = absent layer)."""

    request_id: str
    block_ids: tuple[int, ...]
    metadata: dict
    num_layers: int
    key_cache: tuple[torch.Tensor | None, ...]
    value_cache: tuple[torch.Tensor | None, ...]
    nbytes: int
    #: The header's checksum algorithm (``"ck"``), None when the payload has no checksums.
    checksum_algorithm: str | None = None
    #: Checksums decoding left to the caller (``defer_verify=True``): ``{(is_key, layer):
    #: (tensor name, expected checksum)}``; empty when every checksum was verified (or none was
    #: asked for). A caller that defers owns the check: :func:`verify_deferred`, or a copy that
    #: checks as it goes (``kvferry.adapters.checksums.copy_crc32c``).
    unverified: dict[tuple[bool, int], tuple[str, int]] = attrs.field(factory=dict)

    def to_reference_dict(self) -> dict[str, Any]:
        """The reference decoder's dict: request_id, layer_blocks{key_cache, value_cache}, ..."""
        return {
            "request_id": self.request_id,
            "layer_blocks": {"key_cache": list(self.key_cache), "value_cache": list(self.value_cache)},
            "block_ids": list(self.block_ids),
            "metadata": dict(self.metadata),
        }


# ------------------------------------------------------------------------------- typed views
def _typed_view(
    buf: torch.Tensor, start: int, desc: TensorDescriptor, *, copy_if_misaligned: bool
) -> torch.Tensor | None:
    dtype = torch_dtype(desc.dtype)
    if not desc.nbytes:
        return torch.empty(desc.shape, dtype=dtype, device=buf.device)
    piece = buf[start : start + desc.nbytes]
    if piece.storage_offset() % dtype.itemsize == 0:
        return piece.view(dtype).view(desc.shape)
    if buf.device.type == "cpu":  # a fresh storage at the exact address has no offset to align
        return _from_host(buf.numpy().data, start, desc)
    if not copy_if_misaligned:
        return None
    return piece.clone().view(dtype).view(desc.shape)


def _from_host(view: memoryview, start: int, desc: TensorDescriptor) -> torch.Tensor:
    """A tensor at ``view[start:]``; read-only views warn: callers hold one catch_warnings."""
    dtype = torch_dtype(desc.dtype)
    if not desc.nbytes:
        return torch.empty(desc.shape, dtype=dtype)
    return torch.frombuffer(view, dtype=dtype, offset=start, count=desc.nbytes // dtype.itemsize).view(desc.shape)


@attrs.frozen(eq=False)
class _Run:
    """Present tensors of one dtype and shape, ``step`` bytes apart from ``start`` (relative to
    the tensor data); ``slots`` are ``(is_key, layer, descriptor)`` in order."""

    start: int
    step: int
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    slots: tuple[tuple[bool, int, TensorDescriptor], ...]


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, acc = [], 1
    for d in reversed(shape):
        strides.append(acc)
        acc *= max(d, 1)
    return tuple(reversed(strides))


def _group(entries: tuple) -> tuple[_Run, ...]:
    runs: list[list] = []  # [start, step, nbytes, dtype, shape, slots]
    for e in entries:
        if not isinstance(e, TensorDescriptor):
            continue
        dtype, slot = torch_dtype(e.dtype), (e.name.startswith("key"), e.layer, e)
        run = runs[-1] if runs else None
        if run is not None and run[2] and run[2] == e.nbytes and run[3] is dtype and run[4] == e.shape:
            gap = e.offset - (run[0] + run[1] * (len(run[5]) - 1))
            if len(run[5]) == 1 and gap >= e.nbytes and gap % dtype.itemsize == 0:
                run[1] = gap
            if gap == run[1]:
                run[5].append(slot)
                continue
        runs.append([e.offset, 0, e.nbytes, dtype, e.shape, [slot]])
    return tuple(_Run(r[0], r[1], r[2], r[3], r[4], _contiguous_strides(r[4]), tuple(r[5])) for r in runs)


_PLANS: dict[int, tuple[tuple, tuple[_Run, ...]]] = {}  # id(entries) -> (entries, runs); holds entries
_PLANS_MAX = 64


def _runs(entries: tuple) -> tuple[_Run, ...]:
    """The runs of a header's entries; remembered by identity (the header codec hands back the
    same validated entries object for a repeated layout)."""
    known = _PLANS.get(id(entries))
    if known is not None and known[0] is entries:
        return known[1]
    runs = _group(entries)
    if len(_PLANS) >= _PLANS_MAX:
        _PLANS.clear()
    _PLANS[id(entries)] = (entries, runs)
    return runs


def _host_run(base: torch.Tensor, view: memoryview, data_start: int, run: _Run) -> Any:
    """The run's tensors as views of ``base`` (= ``view``, 1-D uint8): the buffer viewed as the
    run's dtype, one as_strided and an unbind (three torch calls for a run of any length: a
    small request pays per call); a buffer whose size or start the dtype does not divide is
    narrowed to the run first."""
    count, itemsize = len(run.slots), run.dtype.itemsize
    first = data_start + run.start
    if not run.nbytes:
        return [torch.empty(run.shape, dtype=run.dtype) for _ in run.slots]
    if (base.storage_offset() + first) % itemsize:  # misaligned (packed reference payloads)
        return [_from_host(view, data_start + s[2].offset, s[2]) for s in run.slots]
    offset = base.storage_offset()
    if offset % itemsize == 0 and base.numel() % itemsize == 0:  # the whole buffer as the dtype
        at = (offset + first) // itemsize  # as_strided's offset counts from the storage's start
        typed = base.view(run.dtype)
        if count == 1:
            return (typed.as_strided(run.shape, run.strides, at),)
        return typed.as_strided((count, *run.shape), (run.step // itemsize, *run.strides), at).unbind(0)
    typed = base.narrow(0, first, run.step * (count - 1) + run.nbytes).view(run.dtype)
    if count == 1:
        return (typed.view(run.shape),)
    return typed.as_strided((count, *run.shape), (run.step // itemsize, *run.strides)).unbind(0)


# ------------------------------------------------------------------------------------ decode
def _as_view(buf: Any) -> memoryview:
    if isinstance(buf, torch.Tensor):
        if (
            buf.device.type != "cpu"
            or buf.dtype != torch.uint8
            or buf.dim() != 1
            or (buf.numel() and buf.stride(0) != 1)
        ):
            raise PayloadError("invalid KV payload: frames must be contiguous 1-D uint8 CPU tensors or bytes-like")
        return buf.numpy().data
    try:
        view = buf if isinstance(buf, memoryview) else memoryview(buf)
        return view if view.format == "B" and view.ndim == 1 else view.cast("B")
    except (TypeError, ValueError) as exc:
        raise PayloadError(f"invalid KV payload: not a contiguous bytes-like object ({exc})") from None


class _Frames:
    """Several host buffers read as one payload; spans inside one frame stay views."""

    def __init__(self, views: list[memoryview]) -> None:
        self.views = views
        self.starts = [0]
        for v in views:
            self.starts.append(self.starts[-1] + len(v))
        self.total = self.starts[-1]

    def head(self, start: int, nbytes: int) -> Any:
        """Bytes ``[start, start+nbytes)``: a view when the first frame holds them, else a copy."""
        if self.views and start + nbytes <= len(self.views[0]):
            return self.views[0][start : start + nbytes]
        return self.read(start, nbytes)

    def read(self, start: int, nbytes: int) -> bytearray:
        out = bytearray(nbytes)
        pos = start
        while pos < start + nbytes:
            i = bisect.bisect_right(self.starts, pos) - 1
            local = pos - self.starts[i]
            take = min(len(self.views[i]) - local, start + nbytes - pos)
            out[pos - start : pos - start + take] = self.views[i][local : local + take]
            pos += take
        return out

    def tensor(self, start: int, desc: TensorDescriptor) -> torch.Tensor:
        i = bisect.bisect_right(self.starts, start) - 1
        if desc.nbytes and i < len(self.views) and start + desc.nbytes <= self.starts[i + 1]:
            return _from_host(self.views[i], start - self.starts[i], desc)
        return _from_host(memoryview(self.read(start, desc.nbytes)), 0, desc)  # straddles: one copy


def _decode_head(read: Any, total: int, limits: DecodeLimits) -> DecodedHeader:
    """Read only the prefix, then at most the (limited) claimed header, and validate it."""
    prefix = bytes(read(0, min(PREFIX_NBYTES, total)))
    claimed = int.from_bytes(prefix, "big") if len(prefix) == PREFIX_NBYTES else 0
    head = read(0, min(total, PREFIX_NBYTES + min(claimed, limits.max_header_bytes)))
    return decode_header(head, total_len=total, limits=limits)


def _tensors(
    data: Any, limits: DecodeLimits, host_bytes: memoryview | None = None
) -> tuple[DecodedHeader, list, memoryview | None]:
    """The validated header, ``[(slot, tensor)]`` of every present tensor and, for one host
    buffer, its bytes (a tensor's are ``[data_start + offset, + nbytes)`` of them: what its
    checksum is computed over, without asking torch for a view of each tensor).
    ``host_bytes``: those bytes when the caller has them already (a pool buffer's), so a
    host tensor is not asked for its numpy view."""
    if isinstance(data, torch.Tensor) and data.device.type != "cpu":
        if data.dtype != torch.uint8 or data.dim() != 1:
            raise PayloadError(f"invalid KV payload: {phrase('device_tensor')}")
        decoded = _decode_head(lambda a, n: bytes(data[a : a + n].cpu().numpy()), data.numel(), limits)
        return (
            decoded,
            [
                (slot, _typed_view(data, decoded.data_start + slot[2].offset, slot[2], copy_if_misaligned=True))
                for run in _runs(decoded.header.tensors)
                for slot in run.slots
            ],
            None,
        )
    if isinstance(data, (list, tuple)):
        frames = _Frames([_as_view(f) for f in data])
        decoded = _decode_head(frames.head, frames.total, limits)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # read-only input: documented, see module doc
            return (
                decoded,
                [
                    (slot, frames.tensor(decoded.data_start + slot[2].offset, slot[2]))
                    for run in _runs(decoded.header.tensors)
                    for slot in run.slots
                ],
                None,
            )
    known = given_bytes(host_bytes, data) if isinstance(data, torch.Tensor) else None
    view = known if known is not None else _as_view(data)
    decoded = decode_header(view, limits=limits)
    out: list = []
    if isinstance(data, torch.Tensor):  # writable memory: nothing to warn about
        for run in _runs(decoded.header.tensors):
            out.extend(zip(run.slots, _host_run(data, view, decoded.data_start, run)))
        return decoded, out, view
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # read-only input: documented, see module doc
        base = torch.frombuffer(view, dtype=torch.uint8)
        for run in _runs(decoded.header.tensors):
            out.extend(zip(run.slots, _host_run(base, view, decoded.data_start, run)))
    return decoded, out, view


def _is_pool_buffer(data: Any) -> bool:
    """``isinstance(data, PoolBuffer)`` (its members are there), without the runtime Protocol
    check's cost (tens of microseconds, paid on every layer of every load)."""
    return hasattr(data, "tensor") and hasattr(data, "release")


def decode_payload(
    data: Any, *, verify: bool = True, defer_verify: bool = False, limits: DecodeLimits = DecodeLimits()
) -> DecodedKV:
    """Decode bytes-like data, a 1-D uint8 tensor (any device), a pool buffer (``.tensor``; not
    released here) or a sequence of frames. Checksums, when the header has them, are verified
    unless ``verify=False``; with ``defer_verify=True`` they are not verified here but listed in
    ``DecodedKV.unverified`` for the caller to check (:func:`verify_deferred`) before it trusts
    the bytes. Every malformed input raises PayloadError."""
    host_bytes = None
    if not isinstance(data, (bytes, bytearray, memoryview, torch.Tensor, list, tuple)) and _is_pool_buffer(data):
        host_bytes = getattr(data, "host_bytes", None)
        data = data.tensor
    decoded, tensors, view = _tensors(data, limits, host_bytes)
    h = decoded.header
    check = verify and h.checksum_algorithm is not None
    keys: list[torch.Tensor | None] = [None] * h.num_layers
    values: list[torch.Tensor | None] = [None] * h.num_layers
    unverified: dict[tuple[bool, int], tuple[str, int]] = {}
    for (is_key, layer, desc), tensor in tensors:
        if check and defer_verify and desc.checksum is not None:
            unverified[(is_key, layer)] = (desc.name, desc.checksum)
        elif check and view is not None:
            start = decoded.data_start + desc.offset
            verify_checksum(h, desc, view[start : start + desc.nbytes])
        elif check:
            verify_checksum(h, desc, host_byte_view(tensor))
        (keys if is_key else values)[layer] = tensor
    return DecodedKV(
        h.request_id,
        h.block_ids,
        h.metadata,
        h.num_layers,
        tuple(keys),
        tuple(values),
        decoded.total_len,
        h.checksum_algorithm,
        unverified,
    )


def checksum_mismatch(algorithm: str, name: str, expected: int, actual: int) -> PayloadError:
    """The PayloadError of a tensor whose bytes do not match its checksum (the same words as
    the decoder's own check)."""
    return PayloadError(
        f"invalid KV payload (tensor {name!r}): {algorithm} mismatch: header says {expected:08x}, data has {actual:08x}"
    )


def verify_deferred(decoded: DecodedKV, which: tuple[bool, int] | None = None) -> None:
    """Check the checksums :func:`decode_payload` left unverified (all, or the one tensor
    ``which`` = ``(is_key, layer)``), and strike them off; PayloadError naming the tensor on a
    mismatch."""
    keys = [which] if which is not None else list(decoded.unverified)
    for key in keys:
        entry = decoded.unverified.get(key)
        if entry is None:
            continue
        is_key, layer = key
        tensor = (decoded.key_cache if is_key else decoded.value_cache)[layer]
        assert tensor is not None and decoded.checksum_algorithm is not None  # listed only with both
        actual = compute_checksum(decoded.checksum_algorithm, host_byte_view(tensor))
        if actual != entry[1]:
            raise checksum_mismatch(decoded.checksum_algorithm, entry[0], entry[1], actual)
        del decoded.unverified[key]


def verify_arrived(decoded: DecodedKV, arrived: Mapping[str, int]) -> None:
    """:func:`verify_deferred` of every tensor, taking the checksum the transport computed as
    the bytes arrived (:class:`~kvferry.adapters.checksums.ArrivingChecksums`, by tensor name)
    where it equals the header's: those tensors are not read again. Any other is checked by
    reading it, so a difference raises the usual PayloadError naming the tensor."""
    for key, (name, expected) in list(decoded.unverified.items()):
        if arrived.get(name) == expected:
            del decoded.unverified[key]
    verify_deferred(decoded)
