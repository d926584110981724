"""Tensors -> KV payloads (SPEC 3.1) without needless copies, and head slicing on tensors.

Encoding builds *frames*: the header bytes, then for every tensor a memoryview of its own bytes
(and zero padding where the layout aligns): the concatenation of the frames IS the payload, and
no tensor byte is copied for contiguous CPU tensors. Device tensors are copied to the host by
:func:`encode_frames` (frames are host memory); :func:`encode_device_tensor` and
:func:`write_payload_into` write on the device instead. The layout of a repeated (dtype, shape)
signature is planned once (:class:`~kvferry.core.header.LayoutTemplate`), so encoding a
56-tensor payload costs one byte view per tensor and the header's request-specific part.

Decoding (:func:`decode_payload`, :class:`DecodedKV`) and the dtype table live in
:mod:`kvferry.adapters.torch_decode`; they are re-exported here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import attrs
import torch

from kvferry.adapters.checksums import compute_checksum
from kvferry.adapters.paged_gather import Destination, HostSpan
from kvferry.adapters.torch_decode import (
    _NAMES,
    _NUMPY_AS,
    TORCH_DTYPES,
    DecodedKV,
    _typed_view,
    decode_payload,
    dtype_name,
    given_bytes,
    host_byte_view,
    torch_dtype,
)
from kvferry.core.errors import ConfigError, RoutingError
from kvferry.core.head_slices import slice_bounds
from kvferry.core.header import AbsentTensor, LayoutTemplate, PayloadLayout, kv_layout_template

__all__ = [
    "TORCH_DTYPES",
    "dtype_name",
    "torch_dtype",
    "host_byte_view",
    "EncodedPayload",
    "DecodedKV",
    "plan_tensors",
    "encode_frames",
    "encode_bytes",
    "encode_device_tensor",
    "write_payload_into",
    "dest_problem",
    "finish_payload_in",
    "dest_views",
    "dest_spans",
    "decode_payload",
    "slice_heads",
    "merge_heads",
    "slice_layers",
    "merge_layers",
]

_ZEROS = bytes(4096)


def _flat_u8(tensor: torch.Tensor) -> torch.Tensor:
    t = tensor.detach()
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    return t.reshape(-1).view(torch.uint8)


@attrs.frozen(eq=False)
class EncodedPayload:
    """Frames (buffers) whose concatenation is one payload of ``nbytes`` bytes."""

    frames: tuple[Any, ...]
    nbytes: int
    layout: PayloadLayout


# ------------------------------------------------------------------------------------ encode
_TEMPLATES: dict[tuple, LayoutTemplate] = {}  # (torch signature, options) -> template
_TEMPLATES_MAX = 64


def _signature(layers: Sequence[Any]) -> tuple[tuple[torch.dtype, torch.Size] | None, ...]:
    out: list[tuple[torch.dtype, torch.Size] | None] = []
    for t in layers:
        if t is None:
            out.append(None)
        elif isinstance(t, torch.Tensor):
            out.append((t.dtype, t.shape))
        else:
            raise ConfigError(f"KV layers must be tensors or None, got {type(t).__name__}")
    return tuple(out)


def _template(
    key_cache: Sequence[Any], value_cache: Sequence[Any], align: Any, version: Any, checksums: Any
) -> LayoutTemplate:
    """The layout template of these tensors' dtypes and shapes, reused for a repeated signature
    (torch dtypes and sizes are exact, so equal signatures are equal layouts)."""
    return _template_of(_signature(key_cache), _signature(value_cache), align, version, checksums)


def _template_of(keys: tuple, values: tuple, align: Any, version: Any, checksums: Any) -> LayoutTemplate:
    key = (keys, values, align, bool(version), checksums)
    cacheable = type(align) is int and (checksums is None or type(checksums) is str)
    template = _TEMPLATES.get(key) if cacheable else None
    if template is None:
        spec = lambda sig: None if sig is None else (dtype_name(sig[0]), tuple(sig[1]))  # noqa: E731
        template = kv_layout_template(
            [spec(s) for s in key[0]], [spec(s) for s in key[1]], align=align, version=version, checksums=checksums
        )
        if cacheable:
            if len(_TEMPLATES) >= _TEMPLATES_MAX:
                _TEMPLATES.clear()
            _TEMPLATES[key] = template
    return template


def plan_tensors(
    request_id: str,
    key_cache: Sequence[torch.Tensor | None],
    value_cache: Sequence[torch.Tensor | None],
    block_ids: Sequence[int],
    metadata: dict,
    *,
    align: int = 64,
    version: bool = True,
    checksums: str | None = None,
) -> tuple[PayloadLayout, list[torch.Tensor | None]]:
    """The layout for these tensors and the tensors in layout order (keys, then values)."""
    layout = _template(key_cache, value_cache, align, version, checksums).layout(request_id, block_ids, metadata)
    return layout, [*key_cache, *value_cache]


def _views_of(layers: Sequence[Any], views: list[Any]) -> tuple:
    """Append each layer's byte view to ``views``; return the layers' signature (one pass: the
    per-tensor Python work is most of an encode)."""
    signature: list[Any] = []
    for t in layers:
        if t is None:
            signature.append(None)
            views.append(None)
            continue
        if not isinstance(t, torch.Tensor):
            raise ConfigError(f"KV layers must be tensors or None, got {type(t).__name__}")
        dtype = t.dtype
        if dtype not in _NAMES:
            dtype_name(dtype)  # raises ConfigError naming the allow-list
        signature.append((dtype, t.shape))
        as_dtype = _NUMPY_AS.get(dtype)
        try:  # host_byte_view's fast path, inlined
            views.append((t if as_dtype is None else t.view(as_dtype)).numpy().data.cast("B"))
        except (RuntimeError, TypeError, ValueError):
            views.append(host_byte_view(t))
    return tuple(signature)


def encode_frames(
    request_id: str,
    key_cache: Sequence[torch.Tensor | None],
    value_cache: Sequence[torch.Tensor | None],
    block_ids: Sequence[int],
    metadata: dict,
    *,
    align: int = 64,
    checksums: str | None = None,
    version: bool = True,
) -> EncodedPayload:
    """Header bytes + memoryviews of the tensors (+ zero padding): never one joined object."""
    views: list[Any] = []
    signatures = _views_of(key_cache, views), _views_of(value_cache, views)
    template = _template_of(*signatures, align, version, checksums)
    layout = template.layout(request_id, block_ids, metadata)
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
    request_id: str,
    key_cache: Sequence[torch.Tensor | None],
    value_cache: Sequence[torch.Tensor | None],
    block_ids: Sequence[int],
    metadata: dict,
    *,
    align: int = 64,
    checksums: str | None = None,
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


def dest_problem(dest: Any, layout: PayloadLayout) -> str | None:
    """Why ``dest`` cannot hold the payload ``layout`` describes (it must be a contiguous 1-D
    ``uint8`` tensor of at least ``layout.total_nbytes``), or None when it can."""
    if not isinstance(dest, torch.Tensor) or dest.dtype != torch.uint8 or dest.dim() != 1:
        return "destination must be a 1-D uint8 tensor"
    if dest.numel() < layout.total_nbytes or (dest.numel() and dest.stride(0) != 1):
        return f"destination must be contiguous and hold {layout.total_nbytes} bytes, has {dest.numel()}"
    return None


def _check_dest(dest: Any, layout: PayloadLayout) -> None:
    problem = dest_problem(dest, layout)
    if problem is not None:
        raise ConfigError(problem)


def dest_views(dest: torch.Tensor, layout: PayloadLayout) -> list[torch.Tensor | None]:
    """Typed views into ``dest`` where each tensor of ``layout`` goes (None = absent layer).

    Writing into these views (e.g. gathering paged blocks) and then calling
    :func:`finish_payload_in` produces the payload in place with no extra copy.
    """
    return cast("list[torch.Tensor | None]", _dest_places(dest, layout, spans=False))


def dest_spans(dest: torch.Tensor, layout: PayloadLayout) -> list[Destination | None]:
    """Where each tensor of ``layout`` goes in ``dest``, as :func:`dest_views` but without
    making the views when ``dest`` is on the host: a :class:`HostSpan` per tensor (the native
    gather needs only its address; the torch methods make the view when they run). A device
    buffer gets :func:`dest_views`. ConfigError as :func:`dest_views` for a buffer too small
    or a span misaligned for its dtype."""
    return _dest_places(dest, layout, spans=dest.device.type == "cpu")


def _dest_places(dest: torch.Tensor, layout: PayloadLayout, *, spans: bool) -> list[Destination | None]:
    """:func:`dest_views` (``spans`` False) or :func:`dest_spans` of a host ``dest``: a span
    where the tensor's bytes are aligned for its dtype, a view where a view is what works (an
    empty tensor, a misaligned offset: as :func:`dest_views` makes them)."""
    _check_dest(dest, layout)
    base = dest.storage_offset()
    out: list[Destination | None] = []
    for entry, span in zip(layout.header.tensors, layout.spans):
        if span is None or isinstance(entry, AbsentTensor):  # the span of an absent layer is None
            out.append(None)
            continue
        if spans:
            dtype = torch_dtype(entry.dtype)
            if entry.nbytes and (base + span[0]) % dtype.itemsize == 0:
                # _check_dest passed and the layout holds the span: the buffer is checked once
                out.append(HostSpan.in_checked_buffer(dest, span[0], dtype, entry.shape))
                continue
        view = _typed_view(dest, span[0], entry, copy_if_misaligned=False)
        if view is None:
            raise ConfigError(f"tensor {entry.name!r} would be misaligned in the destination buffer")
        out.append(view)
    return out


def finish_payload_in(dest: torch.Tensor, layout: PayloadLayout, host_bytes: memoryview | None = None) -> PayloadLayout:
    """Write the header and zero the padding into ``dest`` once the tensor bytes are in place.

    Pending checksums are computed from ``dest`` itself (a host copy for device buffers).
    Returns the layout as written (with its checksums). A host buffer is read and written
    through one byte view of it (never a copy): on a small request a torch op per span cost
    more than its bytes. ``host_bytes``: that view when the caller has it (a pool
    reservation's, the same bytes as ``dest``), so ``dest`` is not asked for one.
    """
    _check_dest(dest, layout)
    host = given_bytes(host_bytes, dest)
    if host is None and dest.device.type == "cpu":
        host = dest.numpy().data
    if layout.checksums_pending:
        algorithm = layout.header.checksum_algorithm
        assert algorithm is not None  # pending checksums were planned with an algorithm
        layout = layout.with_checksums(
            [
                compute_checksum(algorithm, host[a : a + n] if host is not None else host_byte_view(dest[a : a + n]))
                for a, n in (s for s in layout.spans if s is not None)
            ]
        )
    if host is not None:
        host[: layout.data_start] = layout.header_bytes
        for start, stop in layout.gaps():
            host[start:stop] = bytes(stop - start)
        return layout
    dest[: layout.data_start].copy_(torch.frombuffer(bytearray(layout.header_bytes), dtype=torch.uint8))
    for start, stop in layout.gaps():
        dest[start:stop].zero_()
    return layout


def write_payload_into(
    dest: torch.Tensor, layout: PayloadLayout, tensors: Sequence[torch.Tensor | None]
) -> PayloadLayout:
    """Copy ``tensors`` (layout order: keys then values) and the header into a reserved buffer."""
    _check_dest(dest, layout)
    if len(tensors) != len(layout.header.tensors):
        raise ConfigError(f"expected {len(layout.header.tensors)} tensors, got {len(tensors)}")
    for entry, span, tensor in zip(layout.header.tensors, layout.spans, tensors):
        if span is None or not span[1] or isinstance(entry, AbsentTensor):  # absent layers have no span
            continue
        if tensor is None or dtype_name(tensor.dtype) != entry.dtype or tuple(tensor.shape) != entry.shape:
            raise ConfigError(f"tensor {entry.name!r} does not match the planned dtype and shape")
        dest[span[0] : span[0] + span[1]].copy_(_flat_u8(tensor))
    return finish_payload_in(dest, layout)


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
