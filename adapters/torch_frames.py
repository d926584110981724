"""Tensors <-> KV payloads (SPEC 3.1) without needless copies, and head slicing on tensors.

Encoding builds *frames*: the header bytes, then for every tensor a memoryview of its own bytes
(and zero padding where the layout aligns): the concatenation of the frames IS the payload, and
no tensor byte is copied for contiguous CPU tensors. Device tensors are copied to the host by
:func:`encode_frames` (frames are host memory); :func:`encode_device_tensor` and
:func:`write_payload_into` write on the device instead.

Decoding makes tensors that are VIEWS of the received memory. Exceptions, where one copy is
made: a tensor whose bytes straddle two frames, and a tensor of a device buffer whose offset is
not a multiple of its element size (reference payloads are packed without alignment).
Tensors decoded from read-only memory (``bytes``) share it: they must not be written to (torch
warns about such buffers; the warning is suppressed here on purpose). Clone to own the data.
"""

from __future__ import annotations

import bisect
import warnings
from typing import Any, Sequence

import attrs
import torch

from kvferry.core.errors import ConfigError, PayloadError, RoutingError
from kvferry.core.head_slices import slice_bounds
from kvferry.core.header import (
    DTYPE_ITEMSIZE, PREFIX_NBYTES, DecodedHeader, DecodeLimits, PayloadLayout, TensorDescriptor,
    compute_checksum, decode_header, kv_tensor_specs, plan_layout, verify_checksum,
)
from kvferry.core.ports import PoolBuffer

__all__ = [
    "TORCH_DTYPES", "dtype_name", "torch_dtype", "host_byte_view", "EncodedPayload", "DecodedKV",
    "plan_tensors", "encode_frames", "encode_bytes", "encode_device_tensor", "write_payload_into",
    "finish_payload_in", "dest_views", "decode_payload", "slice_heads", "merge_heads",
    "slice_layers", "merge_layers",
]

#: Allow-listed dtype names -> torch dtypes (only those this torch build has).
TORCH_DTYPES: dict[str, torch.dtype] = {
    name: dt for name in DTYPE_ITEMSIZE if isinstance(dt := getattr(torch, name, None), torch.dtype)
}
_NAMES = {dt: name for name, dt in TORCH_DTYPES.items()}
_ZEROS = bytes(4096)


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


def host_byte_view(tensor: torch.Tensor) -> memoryview:
    """A flat ``uint8`` memoryview of a tensor's bytes (zero-copy for contiguous CPU tensors)."""
    t = tensor.detach()
    if t.numel() == 0:
        return memoryview(b"")
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.resolve_conj().resolve_neg().contiguous()
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def _flat_u8(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().resolve_conj().resolve_neg().reshape(-1).view(torch.uint8)


@attrs.frozen(eq=False)
class EncodedPayload:
    """Frames (buffers) whose concatenation is one payload of ``nbytes`` bytes."""

    frames: tuple[Any, ...]
    nbytes: int
    layout: PayloadLayout


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

    def to_reference_dict(self) -> dict[str, Any]:
        """The reference decoder's dict: request_id, layer_blocks{key_cache, value_cache}, ..."""
        return {
            "request_id": self.request_id,
            "layer_blocks": {"key_cache": list(self.key_cache), "value_cache": list(self.value_cache)},
            "block_ids": list(self.block_ids),
            "metadata": dict(self.metadata),
        }


# ------------------------------------------------------------------------------------ encode
def plan_tensors(
    request_id: str, key_cache: Sequence[torch.Tensor | None], value_cache: Sequence[torch.Tensor | None],
    block_ids: Sequence[int], metadata: dict, *, align: int = 64, version: bool = True,
    checksums: str | None = None,
) -> tuple[PayloadLayout, list[torch.Tensor | None]]:
    """The layout for these tensors and the tensors in layout order (keys, then values)."""
    def spec(t: Any) -> tuple[str, tuple[int, ...]] | None:
        if t is None:
            return None
        if not isinstance(t, torch.Tensor):
            raise ConfigError(f"KV layers must be tensors or None, got {type(t).__name__}")
        return dtype_name(t.dtype), tuple(t.shape)

    num_layers, specs = kv_tensor_specs([spec(t) for t in key_cache], [spec(t) for t in value_cache])
    layout = plan_layout(
        request_id, block_ids, metadata, num_layers, specs, align=align, version=version, checksums=checksums
    )
    return layout, [*key_cache, *value_cache]


def encode_frames(
    request_id: str, key_cache: Sequence[torch.Tensor | None], value_cache: Sequence[torch.Tensor | None],
    block_ids: Sequence[int], metadata: dict, *, align: int = 64, checksums: str | None = None,
    version: bool = True,
) -> EncodedPayload:
    """Header bytes + memoryviews of the tensors (+ zero padding): never one joined object."""
    layout, tensors = plan_tensors(
        request_id, key_cache, value_cache, block_ids, metadata, align=align, version=version, checksums=checksums
    )
    views = [None if t is None else host_byte_view(t) for t in tensors]
    if checksums is not None:
        layout = layout.with_checksums([compute_checksum(checksums, v) for v in views if v is not None])
    frames: list[Any] = [layout.header_bytes]
    pos = layout.data_start
    for view, span in zip(views, layout.spans):
        if span is None or not span[1]:
            continue
        if span[0] > pos:
            gap = span[0] - pos
            frames.append(memoryview(_ZEROS)[:gap] if gap <= len(_ZEROS) else bytes(gap))
        frames.append(view)
        pos = span[0] + span[1]
    return EncodedPayload(tuple(frames), layout.total_nbytes, layout)


def encode_bytes(*args: Any, **kwargs: Any) -> bytes:
    """One bytes object (same arguments as :func:`encode_frames`); ``align=1, version=False``
    without checksums is the reference's ``to_bytes`` output byte for byte."""
    return b"".join(encode_frames(*args, **kwargs).frames)


def encode_device_tensor(
    request_id: str, key_cache: Sequence[torch.Tensor | None], value_cache: Sequence[torch.Tensor | None],
    block_ids: Sequence[int], metadata: dict, *, align: int = 64, checksums: str | None = None,
    version: bool = True,
) -> torch.Tensor:
    """The payload as one 1-D uint8 tensor on the tensors' device (first non-CPU tensor).

    RuntimeError when no tensor is on a device (as the reference's ``to_gpu_tensor``).
    """
    device = next((t.device for t in [*key_cache, *value_cache] if t is not None and t.device.type != "cpu"), None)
    if device is None:
        raise RuntimeError("no KV tensor is on a device; use encode_frames() or encode_bytes()")
    layout, tensors = plan_tensors(
        request_id, key_cache, value_cache, block_ids, metadata, align=align, version=version, checksums=checksums
    )
    out = torch.empty(layout.total_nbytes, dtype=torch.uint8, device=device)
    write_payload_into(out, layout, tensors)
    return out


def _check_dest(dest: Any, layout: PayloadLayout) -> None:
    if not isinstance(dest, torch.Tensor) or dest.dtype != torch.uint8 or dest.dim() != 1:
        raise ConfigError("destination must be a 1-D uint8 tensor")
    if dest.numel() < layout.total_nbytes or (dest.numel() and dest.stride(0) != 1):
        raise ConfigError(f"destination must be contiguous and hold {layout.total_nbytes} bytes, has {dest.numel()}")


def dest_views(dest: torch.Tensor, layout: PayloadLayout) -> list[torch.Tensor | None]:
    """Typed views into ``dest`` where each tensor of ``layout`` goes (None = absent layer).

    Writing into these views (e.g. gathering paged blocks) and then calling
    :func:`finish_payload_in` produces the payload in place with no extra copy.
    """
    _check_dest(dest, layout)
    out: list[torch.Tensor | None] = []
    for entry, span in zip(layout.header.tensors, layout.spans):
        if span is None:
            out.append(None)
            continue
        view = _typed_view(dest, span[0], entry, copy_if_misaligned=False)
        if view is None:
            raise ConfigError(f"tensor {entry.name!r} would be misaligned in the destination buffer")
        out.append(view)
    return out


def finish_payload_in(dest: torch.Tensor, layout: PayloadLayout) -> PayloadLayout:
    """Write the header and zero the padding into ``dest`` once the tensor bytes are in place.

    Pending checksums are computed from ``dest`` itself (a host copy for device buffers).
    Returns the layout as written (with its checksums).
    """
    _check_dest(dest, layout)
    if layout.checksums_pending:
        algorithm = layout.header.checksum_algorithm
        layout = layout.with_checksums([
            compute_checksum(algorithm, host_byte_view(dest[s[0]:s[0] + s[1]])) for s in layout.spans if s is not None
        ])
    header = torch.frombuffer(bytearray(layout.header_bytes), dtype=torch.uint8)
    dest[: layout.data_start].copy_(header)
    for start, stop in layout.gaps():
        dest[start:stop].zero_()
    return layout


def write_payload_into(dest: torch.Tensor, layout: PayloadLayout, tensors: Sequence[torch.Tensor | None]) -> PayloadLayout:
    """Copy ``tensors`` (layout order: keys then values) and the header into a reserved buffer."""
    _check_dest(dest, layout)
    if len(tensors) != len(layout.header.tensors):
        raise ConfigError(f"expected {len(layout.header.tensors)} tensors, got {len(tensors)}")
    for entry, span, tensor in zip(layout.header.tensors, layout.spans, tensors):
        if span is None or not span[1]:
            continue
        if tensor is None or dtype_name(tensor.dtype) != entry.dtype or tuple(tensor.shape) != entry.shape:
            raise ConfigError(f"tensor {entry.name!r} does not match the planned dtype and shape")
        dest[span[0]:span[0] + span[1]].copy_(_flat_u8(tensor))
    return finish_payload_in(dest, layout)


# ------------------------------------------------------------------------------------ decode
def _typed_view(buf: torch.Tensor, start: int, desc: TensorDescriptor, *, copy_if_misaligned: bool) -> torch.Tensor | None:
    dtype = torch_dtype(desc.dtype)
    if not desc.nbytes:
        return torch.empty(desc.shape, dtype=dtype, device=buf.device)
    piece = buf[start:start + desc.nbytes]
    if piece.storage_offset() % dtype.itemsize == 0:
        return piece.view(dtype).view(desc.shape)
    if buf.device.type == "cpu":  # a fresh storage at the exact address has no offset to align
        return _from_host(memoryview(buf.numpy()), start, desc)
    if not copy_if_misaligned:
        return None
    return piece.clone().view(dtype).view(desc.shape)


def _from_host(view: memoryview, start: int, desc: TensorDescriptor) -> torch.Tensor:
    dtype = torch_dtype(desc.dtype)
    if not desc.nbytes:
        return torch.empty(desc.shape, dtype=dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # read-only input: documented, see module doc
        flat = torch.frombuffer(view, dtype=dtype, offset=start, count=desc.nbytes // dtype.itemsize)
    return flat.view(desc.shape)


def _as_view(buf: Any) -> memoryview:
    if isinstance(buf, torch.Tensor):
        if buf.device.type != "cpu" or buf.dtype != torch.uint8 or buf.dim() != 1 or (buf.numel() and buf.stride(0) != 1):
            raise PayloadError("invalid KV payload: frames must be contiguous 1-D uint8 CPU tensors or bytes-like")
        return memoryview(buf.numpy())
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
            return self.views[0][start:start + nbytes]
        return self.read(start, nbytes)

    def read(self, start: int, nbytes: int) -> bytearray:
        out = bytearray(nbytes)
        pos = start
        while pos < start + nbytes:
            i = bisect.bisect_right(self.starts, pos) - 1
            local = pos - self.starts[i]
            take = min(len(self.views[i]) - local, start + nbytes - pos)
            out[pos - start:pos - start + take] = self.views[i][local:local + take]
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


def decode_payload(data: Any, *, verify: bool = True, limits: DecodeLimits = DecodeLimits()) -> DecodedKV:
    """Decode bytes-like data, a 1-D uint8 tensor (any device), a pool buffer (``.tensor``; not
    released here) or a sequence of frames. Checksums, when the header has them, are verified
    unless ``verify=False``. Every malformed input raises PayloadError."""
    if not isinstance(data, (bytes, bytearray, memoryview, torch.Tensor, list, tuple)) and isinstance(data, PoolBuffer):
        data = data.tensor
    if isinstance(data, torch.Tensor) and data.device.type != "cpu":
        if data.dtype != torch.uint8 or data.dim() != 1:
            raise PayloadError("invalid KV payload: a packed payload tensor must be 1-D uint8")
        decoded = _decode_head(lambda a, n: bytes(data[a:a + n].cpu().numpy()), data.numel(), limits)
        make = lambda start, desc: _typed_view(data, start, desc, copy_if_misaligned=True)  # noqa: E731
    else:
        frames = _Frames([_as_view(f) for f in data] if isinstance(data, (list, tuple)) else [_as_view(data)])
        decoded = _decode_head(frames.head, frames.total, limits)
        make = frames.tensor
    h = decoded.header
    keys: list[torch.Tensor | None] = [None] * h.num_layers
    values: list[torch.Tensor | None] = [None] * h.num_layers
    for entry, span in zip(h.tensors, decoded.spans):
        if span is None:
            continue
        tensor = make(span[0], entry)
        if verify and h.checksum_algorithm is not None:
            verify_checksum(h, entry, host_byte_view(tensor))
        (keys if entry.kind == "key" else values)[entry.layer] = tensor
    return DecodedKV(h.request_id, h.block_ids, h.metadata, h.num_layers, tuple(keys), tuple(values), decoded.total_len)


# ------------------------------------------------------------------------------- head slices
def slice_heads(tensor: Any, offset_in_shard: int, num_slices: int) -> Any:
    """Slice ``offset_in_shard`` of ``num_slices`` equal parts of dim 1 (heads), as a view.

    None -> None; a non-tensor is returned unchanged; fewer than 2 dims, ``num_slices <= 0``,
    an offset outside ``[0, num_slices)`` or heads not divisible -> RoutingError (a ValueError).
    """
    if tensor is None or not isinstance(tensor, torch.Tensor):
        return tensor
    if tensor.dim() < 2:
        raise RoutingError(f"cannot slice heads of a {tensor.dim()}-D tensor: heads are dim 1")
    start, stop = slice_bounds(tensor.shape[1], offset_in_shard, num_slices)
    return tensor[:, start:stop]


def merge_heads(tensors: Sequence[Any]) -> Any:
    """Concatenate along dim 1 in the given (source-rank) order, skipping None.

    All None (or empty) -> None; one -> it; non-tensors -> the first; mismatched shapes ->
    RoutingError.
    """
    present = [t for t in tensors if t is not None]
    if not present:
        return None
    if len(present) == 1 or not all(isinstance(t, torch.Tensor) for t in present):
        return present[0]
    try:
        return torch.cat(present, dim=1)
    except RuntimeError as exc:
        raise RoutingError(f"cannot merge KV shards along the head dimension: {exc}") from None


def slice_layers(layers: Sequence[Any] | None, offset_in_shard: int, num_slices: int) -> list[Any]:
    """:func:`slice_heads` applied to every layer (None/missing list -> empty list)."""
    return [slice_heads(t, offset_in_shard, num_slices) for t in (layers or ())]


def merge_layers(per_source: Sequence[Sequence[Any] | None]) -> list[Any]:
    """Per layer, :func:`merge_heads` across sources (lists in source-rank order)."""
    lists = [list(p or ()) for p in per_source]
    depth = max((len(p) for p in lists), default=0)
    return [merge_heads([p[i] if i < len(p) else None for p in lists]) for i in range(depth)]
