"""The KV payload wire codec (SPEC 3.1), over plain bytes and integers: no torch.

Layout: ``[u32 big-endian header_len][header: UTF-8 JSON object][tensor data]``. One table of
fields (:data:`HEADER_FIELDS`, :data:`DESCRIPTOR_FIELDS`) drives both encoding and decoding;
the JSON key order is the table order, which is the reference's order, so
``plan_layout(..., align=1, version=False)`` reproduces a reference header byte for byte.

Invariants (property-tested):

- ``decode_header(layout.header_bytes + data)`` gives back the planned header and spans;
- every span lies inside the payload; with ``align > 1`` every absolute tensor offset is a
  multiple of ``align`` (the header is padded with JSON whitespace so the data starts aligned);
- every malformed input raises :class:`PayloadError` and nothing else, and nothing is allocated
  from an unchecked length: the header length is checked against the input and a limit before
  it is read, spans are checked against the data before anyone makes a tensor.

All sizes and offsets are in bytes.
"""

from __future__ import annotations

import json
import math
import re
import struct
import zlib
from types import MappingProxyType
from typing import Any, Callable, Mapping, Sequence, Union

import attrs

from kvferry.core.errors import ConfigError, PayloadError

__all__ = [
    "DTYPE_ITEMSIZE", "FORMAT_VERSION", "CHECKSUM_ALGORITHMS", "PREFIX_NBYTES",
    "HEADER_FIELDS", "DESCRIPTOR_FIELDS", "DecodeLimits", "TensorSpec", "TensorDescriptor",
    "AbsentTensor", "PayloadHeader", "PayloadLayout", "DecodedHeader", "tensor_name",
    "kv_tensor_specs", "plan_layout", "encode_header", "decode_header", "compute_checksum",
    "verify_checksum",
]

#: Bytes per element of every dtype a payload may carry (names are torch's without ``torch.``).
DTYPE_ITEMSIZE: Mapping[str, int] = MappingProxyType({
    "bool": 1, "uint8": 1, "int8": 1, "int16": 2, "int32": 4, "int64": 8,
    "float16": 2, "float32": 4, "float64": 8, "bfloat16": 2, "complex64": 8, "complex128": 16,
    "float8_e4m3fn": 1, "float8_e5m2": 1, "float8_e4m3fnuz": 1, "float8_e5m2fnuz": 1,
    "float8_e8m0fnu": 1,
})
#: The kvferry format version written under ``"v"``; bumped only for incompatible changes.
FORMAT_VERSION = 1
#: Checksum algorithms by header name: ``fn(buffer, running) -> int`` (unsigned 32 bit).
CHECKSUM_ALGORITHMS: Mapping[str, Callable[[Any, int], int]] = MappingProxyType({"crc32": zlib.crc32})
PREFIX_NBYTES = 4
_PREFIX = struct.Struct(">I")
_MAX_INT = 2**63 - 1  # no offset, size or dimension may exceed a signed 64-bit integer
_KINDS = {"key": "key_cache_", "value": "value_cache_"}
_NAME_RE = re.compile(r"(key|value)_cache_([0-9]{1,9})")
_HEX8_RE = re.compile(r"[0-9a-f]{8}")


def _fail(reason: str, tensor: str | None = None) -> PayloadError:
    where = f" (tensor {tensor!r})" if tensor is not None else ""
    return PayloadError(f"invalid KV payload{where}: {reason}")


@attrs.frozen
class DecodeLimits:
    """Upper bounds a decoder enforces before it reads or allocates anything.

    ``max_header_bytes`` bounds the JSON header (bytes). Parsed JSON costs more memory than its
    text (an empty list is 2 bytes of text and ~60 bytes of objects), so this limit is what
    bounds a hostile header's memory: the 4 MiB default caps one parse near 100 MB, while the
    largest real headers (a 1M-token request's block ids, hundreds of layers) stay under 1 MiB.
    ``max_tensors`` bounds descriptors, ``max_layers`` the ``nl`` claim, ``max_ndim`` a shape.
    """

    max_header_bytes: int = 4 * 1024 * 1024
    max_tensors: int = 65536
    max_layers: int = 65536
    max_ndim: int = 64


def tensor_name(kind: str, layer: int) -> str:
    """``key_cache_{layer}`` or ``value_cache_{layer}``; ``kind`` is ``"key"`` or ``"value"``."""
    if kind not in _KINDS:
        raise ConfigError(f"tensor kind must be 'key' or 'value', got {kind!r}")
    return f"{_KINDS[kind]}{layer}"


def _parse_name(name: str) -> tuple[str, int] | None:
    match = _NAME_RE.fullmatch(name)
    return (match.group(1), int(match.group(2))) if match else None


def _element_problem(name: str, layer: int, dtype: str, shape: tuple[int, ...]) -> str | None:
    parsed = _parse_name(name)
    if parsed is None:
        return "name is not key_cache_<layer> or value_cache_<layer>"
    if parsed[1] != layer:
        return f"layer index {layer} disagrees with the name"
    if dtype not in DTYPE_ITEMSIZE:
        return f"unsupported dtype {dtype!r}"
    if any(isinstance(d, bool) or not isinstance(d, int) or d < 0 or d > _MAX_INT for d in shape):
        return f"shape {list(shape)} has a dimension that is not a non-negative integer"
    if math.prod(max(d, 1) for d in shape) * DTYPE_ITEMSIZE[dtype] > _MAX_INT:
        return f"shape {list(shape)} spans more than 2**63 bytes (strides would overflow)"
    return None


def _check_element(self: Any) -> None:
    problem = _element_problem(self.name, self.layer, self.dtype, self.shape)
    if problem:
        raise ConfigError(f"tensor {self.name!r}: {problem}")


@attrs.frozen
class TensorSpec:
    """A tensor to be laid out: name, layer index, dtype name and shape (elements)."""

    name: str
    layer: int
    dtype: str
    shape: tuple[int, ...] = attrs.field(converter=tuple)

    def __attrs_post_init__(self) -> None:
        _check_element(self)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPE_ITEMSIZE[self.dtype]


@attrs.frozen
class TensorDescriptor:
    """A present tensor: ``offset`` is relative to the start of the tensor data (bytes).

    Invariant: ``nbytes == prod(shape) * itemsize(dtype)``; ``checksum`` is set exactly when
    the header names a checksum algorithm.
    """

    name: str
    layer: int
    dtype: str
    shape: tuple[int, ...] = attrs.field(converter=tuple)
    offset: int
    nbytes: int
    checksum: int | None = None

    def __attrs_post_init__(self) -> None:
        _check_element(self)
        if not (0 <= self.offset <= _MAX_INT and 0 <= self.nbytes <= _MAX_INT):
            raise ConfigError(f"tensor {self.name!r}: offset/nbytes out of range")
        expected = math.prod(self.shape) * DTYPE_ITEMSIZE[self.dtype]
        if expected != self.nbytes:
            raise ConfigError(
                f"tensor {self.name!r}: shape {list(self.shape)} of {self.dtype} is {expected} "
                f"bytes but the descriptor says {self.nbytes}"
            )

    @property
    def kind(self) -> str:
        """``"key"`` or ``"value"``."""
        return "key" if self.name.startswith("key") else "value"


@attrs.frozen
class AbsentTensor:
    """A layer that carries no tensor (``{"n": name, "x": true}``)."""

    name: str


Entry = Union[TensorDescriptor, AbsentTensor]


@attrs.frozen
class PayloadHeader:
    """The decoded (or planned) header. ``metadata`` is a JSON-able dict (do not mutate).

    Invariants: every present tensor's layer is in ``[0, num_layers)``; no (kind, layer) pair
    is present twice; ``checksum_algorithm`` is set exactly when descriptors carry checksums.
    """

    request_id: str
    block_ids: tuple[int, ...] = attrs.field(converter=tuple)
    metadata: dict = attrs.field(converter=dict, hash=False)
    num_layers: int
    tensors: tuple[Entry, ...] = attrs.field(converter=tuple)
    format_version: int | None = None
    checksum_algorithm: str | None = None

    def __attrs_post_init__(self) -> None:
        if not isinstance(self.request_id, str):
            raise ConfigError(f"request_id must be a string, got {self.request_id!r}")
        if any(isinstance(b, bool) or not isinstance(b, int) for b in self.block_ids):
            raise ConfigError("block_ids must be integers")
        if isinstance(self.num_layers, bool) or not isinstance(self.num_layers, int) or self.num_layers < 0:
            raise ConfigError(f"num_layers must be a non-negative integer, got {self.num_layers!r}")
        if self.checksum_algorithm is not None and self.checksum_algorithm not in CHECKSUM_ALGORITHMS:
            raise ConfigError(f"unknown checksum algorithm {self.checksum_algorithm!r}")
        seen: set[tuple[str, int]] = set()
        for entry in self.tensors:
            if isinstance(entry, AbsentTensor):
                continue
            if not isinstance(entry, TensorDescriptor):
                raise ConfigError(f"tensors must be descriptors, got {entry!r}")
            if entry.layer >= self.num_layers:
                raise ConfigError(f"tensor {entry.name!r}: layer outside [0, {self.num_layers})")
            if (entry.kind, entry.layer) in seen:
                raise ConfigError(f"tensor {entry.name!r} appears twice")
            seen.add((entry.kind, entry.layer))
            if (entry.checksum is None) != (self.checksum_algorithm is None):
                raise ConfigError(f"tensor {entry.name!r}: checksum present iff an algorithm is named")

    @property
    def present(self) -> tuple[TensorDescriptor, ...]:
        return tuple(t for t in self.tensors if isinstance(t, TensorDescriptor))


# ---------------------------------------------------------------------------- the field table
def _want_int(value: Any, what: str, tensor: str | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= _MAX_INT:
        raise _fail(f"{what} must be an integer in [0, 2**63), got {_short(value)}", tensor)
    return value


def _want_str(value: Any, what: str, tensor: str | None = None) -> str:
    if not isinstance(value, str):
        raise _fail(f"{what} must be a string, got {_short(value)}", tensor)
    return value


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _dec_bids(value: Any, ctx: Any) -> tuple[int, ...]:
    if not isinstance(value, list) or any(isinstance(b, bool) or not isinstance(b, int) for b in value):
        raise _fail("bids must be a list of integers")
    return tuple(value)


def _dec_meta(value: Any, ctx: Any) -> dict:
    if not isinstance(value, dict):
        raise _fail(f"meta must be an object, got {_short(value)}")
    return value


def _dec_td(value: Any, limits: DecodeLimits) -> tuple[Entry, ...]:
    if not isinstance(value, list):
        raise _fail("td must be a list of tensor descriptors")
    if len(value) > limits.max_tensors:
        raise _fail(f"{len(value)} tensor descriptors exceed the limit {limits.max_tensors}")
    return tuple(_dec_descriptor(item, limits) for item in value)


def _dec_version(value: Any, ctx: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value != FORMAT_VERSION:
        raise _fail(f"unsupported format version {_short(value)} (this decoder reads {FORMAT_VERSION})")
    return value


def _dec_algorithm(value: Any, ctx: Any) -> str:
    if not isinstance(value, str) or value not in CHECKSUM_ALGORITHMS:
        raise _fail(f"unknown checksum algorithm {_short(value)}")
    return value


@attrs.frozen
class _Field:
    key: str  # JSON key
    attr: str  # attribute of the value class
    decode: Callable[[Any, Any], Any]  # JSON value, context -> attribute value (raises PayloadError)
    encode: Callable[[Any], Any] = lambda v: v
    required: bool = True  # optional fields are omitted when None


#: Top-level header keys in wire order (the reference writes rid, bids, meta, td, nl).
HEADER_FIELDS: tuple[_Field, ...] = (
    _Field("rid", "request_id", lambda v, c: _want_str(v, "rid")),
    _Field("bids", "block_ids", _dec_bids, list),
    _Field("meta", "metadata", _dec_meta),
    _Field("td", "tensors", _dec_td, lambda ts: [_enc_descriptor(t) for t in ts]),
    _Field("nl", "num_layers", lambda v, c: _want_int(v, "nl")),
    _Field("v", "format_version", _dec_version, required=False),
    _Field("ck", "checksum_algorithm", _dec_algorithm, required=False),
)


def _dec_shape(value: Any, limits: DecodeLimits, name: str) -> tuple[int, ...]:
    if not isinstance(value, list) or len(value) > limits.max_ndim:
        raise _fail(f"shape must be a list of at most {limits.max_ndim} integers", name)
    return tuple(_want_int(d, "shape dimension", name) for d in value)


def _dec_checksum(value: Any, name: str) -> int:
    if not isinstance(value, str) or not _HEX8_RE.fullmatch(value):
        raise _fail("checksum must be 8 lowercase hex digits", name)
    return int(value, 16)


#: Present-descriptor keys in wire order; ``i`` and ``c`` are optional on decode.
DESCRIPTOR_FIELDS: tuple[_Field, ...] = (
    _Field("n", "name", lambda v, c: v),
    _Field("i", "layer", lambda v, c: _want_int(v, "layer index i", c[1]), required=False),
    _Field("d", "dtype", lambda v, c: _want_str(v, "dtype d", c[1])),
    _Field("s", "shape", lambda v, c: _dec_shape(v, c[0], c[1]), list),
    _Field("o", "offset", lambda v, c: _want_int(v, "offset o", c[1])),
    _Field("b", "nbytes", lambda v, c: _want_int(v, "byte count b", c[1])),
    _Field("c", "checksum", lambda v, c: _dec_checksum(v, c[1]), lambda v: f"{v:08x}", required=False),
)


def _enc_descriptor(entry: Entry) -> dict[str, Any]:
    if isinstance(entry, AbsentTensor):
        return {"n": entry.name, "x": True}
    out = {}
    for f in DESCRIPTOR_FIELDS:
        value = getattr(entry, f.attr)
        if value is not None:
            out[f.key] = f.encode(value)
    return out


def _dec_descriptor(item: Any, limits: DecodeLimits) -> Entry:
    if not isinstance(item, dict):
        raise _fail(f"tensor descriptor must be an object, got {_short(item)}")
    name = _want_str(item.get("n"), "descriptor name n")
    absent = item.get("x", False)
    if not isinstance(absent, bool):
        raise _fail("absent flag x must be a boolean", name)
    if absent:
        return AbsentTensor(name)
    values: dict[str, Any] = {}
    for f in DESCRIPTOR_FIELDS:
        if f.key in item:
            values[f.attr] = f.decode(item[f.key], (limits, name))
        elif f.required:
            raise _fail(f"descriptor lacks {f.key!r}", name)
    if "layer" not in values:  # older senders: the layer is the name's suffix
        parsed = _parse_name(name)
        if parsed is None:
            raise _fail("no layer index and the name has no layer suffix", name)
        values["layer"] = parsed[1]
    try:
        return TensorDescriptor(**values)
    except ConfigError as exc:
        raise _fail(str(exc).partition(": ")[2] or str(exc), name) from None


def _header_object(header: PayloadHeader) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for f in HEADER_FIELDS:
        value = getattr(header, f.attr)
        if f.required or value is not None:
            out[f.key] = f.encode(value)
    return out


def encode_header(header: PayloadHeader, *, pad_to: int = 1) -> bytes:
    """``u32 length + compact JSON``, padded with spaces so its length is a multiple of ``pad_to``.

    The JSON is ``json.dumps(obj, separators=(",", ":"))`` with the standard library's other
    defaults (ASCII escapes, NaN allowed), exactly what the reference writes. Raises ConfigError
    when the metadata is not JSON-serialisable.
    """
    try:
        text = json.dumps(_header_object(header), separators=(",", ":"))
    except (TypeError, ValueError, RecursionError) as exc:
        raise ConfigError(f"payload metadata is not JSON-serialisable: {exc}") from None
    body = text.encode("utf-8")
    body += b" " * ((-(PREFIX_NBYTES + len(body))) % pad_to)
    if len(body) > 0xFFFFFFFF:
        raise ConfigError(f"payload header of {len(body)} bytes does not fit a u32 length")
    return _PREFIX.pack(len(body)) + body


def kv_tensor_specs(
    keys: Sequence[tuple[str, Sequence[int]] | None], values: Sequence[tuple[str, Sequence[int]] | None]
) -> tuple[int, tuple[TensorSpec | AbsentTensor, ...]]:
    """``(num_layers, specs)`` for per-layer ``(dtype, shape)`` pairs (None = absent layer).

    Keys first in layer order, then values, as the reference lays them out; ``num_layers`` is
    ``len(keys)``. ``values`` may be shorter than ``keys`` but not longer.
    """
    if len(values) > len(keys):
        raise ConfigError(f"{len(values)} value layers but only {len(keys)} key layers")
    specs: list[TensorSpec | AbsentTensor] = []
    for kind, items in (("key", keys), ("value", values)):
        for layer, item in enumerate(items):
            name = tensor_name(kind, layer)
            specs.append(AbsentTensor(name) if item is None else TensorSpec(name, layer, item[0], item[1]))
    return len(keys), tuple(specs)


def _round_up(value: int, align: int) -> int:
    return -(-value // align) * align


@attrs.frozen
class PayloadLayout:
    """Where every byte of one payload goes, computed before any tensor byte is written.

    ``spans[k]`` is the absolute ``(offset, nbytes)`` in the payload of ``header.tensors[k]``
    (None for an absent layer); ``data_start == len(header_bytes)``; ``total_nbytes`` is the
    payload size. When checksums were planned, :meth:`with_checksums` must supply them before
    :attr:`header_bytes` can be read (the header has the same length either way).
    """

    header: PayloadHeader
    data_start: int
    spans: tuple[tuple[int, int] | None, ...]
    total_nbytes: int
    align: int
    checksums_pending: bool
    _rendered: bytes = attrs.field(repr=False)

    @property
    def header_bytes(self) -> bytes:
        """The u32 prefix and the header, padded to ``data_start`` bytes."""
        if self.checksums_pending:
            raise ConfigError("checksums were planned: call with_checksums() before header_bytes")
        return self._rendered

    def with_checksums(self, values: Sequence[int]) -> PayloadLayout:
        """The same layout with one checksum per present tensor, in ``header.tensors`` order."""
        present = self.header.present
        if self.header.checksum_algorithm is None or len(values) != len(present):
            raise ConfigError(f"expected {len(present)} checksums for a checksummed layout")
        it = iter(values)
        tensors = tuple(
            t if isinstance(t, AbsentTensor) else attrs.evolve(t, checksum=int(next(it)) & 0xFFFFFFFF)
            for t in self.header.tensors
        )
        header = attrs.evolve(self.header, tensors=tensors)
        rendered = encode_header(header, pad_to=self.align)
        if len(rendered) != self.data_start:  # fixed-width checksums keep the length
            raise ConfigError("checksummed header changed length")
        return attrs.evolve(self, header=header, checksums_pending=False, rendered=rendered)

    def gaps(self) -> tuple[tuple[int, int], ...]:
        """Absolute ``(start, stop)`` of the padding between tensors (to be zero-filled)."""
        out, pos = [], self.data_start
        for start, nbytes in sorted(s for s in self.spans if s is not None and s[1]):
            if start > pos:
                out.append((pos, start))
            pos = max(pos, start + nbytes)
        return tuple(out)


def plan_layout(
    request_id: str,
    block_ids: Sequence[int],
    metadata: Mapping[str, Any],
    num_layers: int,
    tensor_specs: Sequence[TensorSpec | AbsentTensor],
    *,
    align: int = 64,
    version: bool = True,
    checksums: str | None = None,
) -> PayloadLayout:
    """Assign offsets and render the header for one payload (pure; no tensor bytes needed).

    Tensors are packed in ``tensor_specs`` order; with ``align > 1`` (a power of two) each
    non-empty tensor starts at a multiple of ``align`` bytes from the payload start, so a payload
    written into an ``align``-aligned buffer has aligned tensors. ``align=1, version=False,
    checksums=None`` is the reference layout, byte for byte. ``checksums`` names an algorithm
    of :data:`CHECKSUM_ALGORITHMS`. Local misuse raises ConfigError.
    """
    if isinstance(align, bool) or not isinstance(align, int) or align < 1 or align & (align - 1):
        raise ConfigError(f"align must be a power of two >= 1, got {align!r}")
    if not isinstance(metadata, Mapping):
        raise ConfigError(f"metadata must be a mapping, got {type(metadata).__name__}")
    if checksums is not None and checksums not in CHECKSUM_ALGORITHMS:
        raise ConfigError(f"unknown checksum algorithm {checksums!r}; known: {sorted(CHECKSUM_ALGORITHMS)}")
    entries: list[Entry] = []
    pos = 0
    for spec in tensor_specs:
        if isinstance(spec, AbsentTensor):
            entries.append(spec)
            continue
        if not isinstance(spec, TensorSpec):
            raise ConfigError(f"tensor_specs must hold TensorSpec or AbsentTensor, got {spec!r}")
        nbytes = spec.nbytes
        if nbytes:  # empty tensors have no bytes to align
            pos = _round_up(pos, align)
        checksum = 0 if checksums is not None else None
        entries.append(TensorDescriptor(spec.name, spec.layer, spec.dtype, spec.shape, pos, nbytes, checksum))
        pos += nbytes
    header = PayloadHeader(
        request_id, block_ids, metadata, num_layers, entries,
        FORMAT_VERSION if version else None, checksums,
    )
    rendered = encode_header(header, pad_to=align)
    start = len(rendered)
    spans = tuple(None if isinstance(t, AbsentTensor) else (start + t.offset, t.nbytes) for t in entries)
    return PayloadLayout(header, start, spans, start + pos, align, checksums is not None, rendered)


# ----------------------------------------------------------------------------------- decoding
@attrs.frozen
class DecodedHeader:
    """A validated header: every span lies inside ``[data_start, total_len)``.

    ``spans`` is aligned with ``header.tensors`` (absolute ``(offset, nbytes)``, None = absent).
    """

    header: PayloadHeader
    data_start: int
    total_len: int
    spans: tuple[tuple[int, int] | None, ...]


def _byte_view(buf: Any) -> memoryview:
    try:
        view = buf if isinstance(buf, memoryview) else memoryview(buf)
        return view if view.format == "B" and view.ndim == 1 else view.cast("B")
    except (TypeError, ValueError) as exc:
        raise _fail(f"not a contiguous bytes-like object ({exc})") from None


def decode_header(buf: Any, total_len: int | None = None, *, limits: DecodeLimits = DecodeLimits()) -> DecodedHeader:
    """Validate the header at the start of ``buf`` (bytes-like) before anything is allocated.

    ``total_len`` is the whole payload's length when ``buf`` holds only its beginning (e.g. the
    first frame); by default ``len(buf)``. Raises PayloadError, and nothing else, on any fault.
    """
    view = _byte_view(buf)
    total = len(view) if total_len is None else total_len
    if isinstance(total, bool) or not isinstance(total, int) or total < len(view):
        raise _fail(f"total_len {total_len!r} is smaller than the buffer")
    if len(view) < PREFIX_NBYTES:
        raise _fail("missing 4-byte header length")
    (header_len,) = _PREFIX.unpack(view[:PREFIX_NBYTES])
    if header_len > limits.max_header_bytes:
        raise _fail(f"header_len={header_len} exceeds the limit {limits.max_header_bytes}")
    data_start = PREFIX_NBYTES + header_len
    if data_start > len(view):
        raise _fail(f"header_len={header_len} exceeds buffer size={len(view)}")
    try:
        obj = json.loads(bytes(view[PREFIX_NBYTES:data_start]).decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise _fail(f"header is not UTF-8 JSON ({_short(str(exc))})") from None
    if not isinstance(obj, dict):
        raise _fail("header is not a JSON object")
    values: dict[str, Any] = {}
    for f in HEADER_FIELDS:
        if f.key in obj:
            values[f.attr] = f.decode(obj[f.key], limits)
        elif f.required:
            raise _fail(f"header lacks {f.key!r}")
    if values["num_layers"] > limits.max_layers:
        raise _fail(f"nl={values['num_layers']} exceeds the limit {limits.max_layers}")
    try:
        header = PayloadHeader(**values)
    except ConfigError as exc:
        raise _fail(str(exc)) from None
    data_len = total - data_start
    spans: list[tuple[int, int] | None] = []
    for entry in header.tensors:
        if isinstance(entry, AbsentTensor):
            spans.append(None)
            continue
        if entry.offset + entry.nbytes > data_len:
            raise _fail(
                f"span offset={entry.offset}, bytes={entry.nbytes} lies outside the "
                f"{data_len} bytes of tensor data", entry.name,
            )
        spans.append((data_start + entry.offset, entry.nbytes))
    return DecodedHeader(header, data_start, total, tuple(spans))


def compute_checksum(algorithm: str, data: Any) -> int:
    """Checksum of a bytes-like object or of a sequence of them (concatenated meaning)."""
    fn = CHECKSUM_ALGORITHMS.get(algorithm)
    if fn is None:
        raise ConfigError(f"unknown checksum algorithm {algorithm!r}")
    parts = data if isinstance(data, (list, tuple)) else (data,)
    value = 0
    for part in parts:
        value = fn(part, value)
    return value & 0xFFFFFFFF


def verify_checksum(header: PayloadHeader, descriptor: TensorDescriptor, data: Any) -> None:
    """Raise PayloadError naming the tensor when ``data`` does not match its checksum."""
    if header.checksum_algorithm is None or descriptor.checksum is None:
        return
    actual = compute_checksum(header.checksum_algorithm, data)
    if actual != descriptor.checksum:
        raise _fail(
            f"{header.checksum_algorithm} mismatch: header says {descriptor.checksum:08x}, "
            f"data has {actual:08x}", descriptor.name,
        )
