"""Reading a KV payload header (SPEC 3.1): the field table, decode limits, validation.

One table of fields (:data:`HEADER_FIELDS`, :data:`DESCRIPTOR_FIELDS`) drives both encoding and
decoding; the JSON key order is the table order, which is the reference's order. Import the
public names from :mod:`kvferry.core.header`.

Every malformed input raises :class:`PayloadError` and nothing else, and nothing is allocated
from an unchecked length: the header length is checked against the input and a limit before
it is read, spans are checked against the data before anyone makes a tensor.

Speed (a 56-tensor header decodes in tens of microseconds): a ``td`` text validated before is
reused (:mod:`kvferry.core.header.json_reader`), and a new one made of plain present descriptors is
checked column by column with C-level passes (:func:`_bulk_descriptors`) instead of one Python
loop per descriptor; anything else takes the per-descriptor path, which names the fault.
All sizes are in bytes.
"""

from __future__ import annotations

import operator
import struct
from collections.abc import Callable
from itertools import chain, repeat
from typing import Any, TypeGuard, cast

import attrs

from kvferry.core.errors import ConfigError
from kvferry.core.header.json_reader import _parse, _remember, _Reused
from kvferry.core.header.values import (
    _HEX8_RE,
    _MAX_INT,
    _MEMO_NDIM,
    _NAME_MAX,
    CHECKSUM_ALGORITHMS,
    DTYPE_ITEMSIZE,
    FORMAT_VERSION,
    PREFIX_NBYTES,
    AbsentTensor,
    Entry,
    PayloadHeader,
    TensorDescriptor,
    _checked,
    _checked_as,
    _CheckedEntries,
    _fail,
    _name_memo,
    _parse_name,
    _short,
    _size_memo,
    _trusted_descriptor,
    checksum_digits,
)
from kvferry.core.phrases import phrase

__all__ = ["HEADER_FIELDS", "DESCRIPTOR_FIELDS", "DecodeLimits", "DecodedHeader", "decode_header"]

_PREFIX = struct.Struct(">I")


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


# ---------------------------------------------------------------------------- the field table
def _want_int(value: Any, what: str, tensor: str | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= _MAX_INT:
        raise _fail(f"{what} must be an integer in [0, 2**63), got {_short(value)}", tensor)
    return value


def _want_str(value: Any, what: str, tensor: str | None = None) -> str:
    if not isinstance(value, str):
        raise _fail(f"{what} must be a string, got {_short(value)}", tensor)
    return value


def _dec_bids(value: Any, ctx: Any) -> tuple[int, ...]:
    if not isinstance(value, list):
        raise _fail("bids must be a list of integers")
    if not set(map(type, value)) <= {int} and any(isinstance(b, bool) or not isinstance(b, int) for b in value):
        raise _fail("bids must be a list of integers")
    return tuple(value)


def _dec_meta(value: Any, ctx: Any) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise _fail(f"meta must be an object, got {_short(value)}")
    return value


def _dec_td(value: Any, limits: DecodeLimits) -> tuple[Entry, ...]:
    if type(value) is _Reused:
        return value.entries
    if not isinstance(value, list):
        raise _fail("td must be a list of tensor descriptors")
    if len(value) > limits.max_tensors:
        raise _fail(f"{len(value)} tensor descriptors exceed the limit {limits.max_tensors}")
    bulk = _bulk_descriptors(value, limits)
    return bulk if bulk is not None else _checked([_dec_descriptor(item, limits) for item in value])


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


def _enc_descriptor(entry: Entry) -> dict[str, Any]:
    if isinstance(entry, AbsentTensor):
        return {"n": entry.name, "x": True}
    out = {}
    for f in DESCRIPTOR_FIELDS:
        value = getattr(entry, f.attr)
        if value is not None:
            out[f.key] = f.encode(value)
    return out


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


def _want_layer(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= _MAX_INT:
        raise _fail(phrase("layer", layer=_short(value)), name)
    return value


def _want_span_int(value: Any, what: str, item: dict[str, Any], name: str) -> int:
    """An offset or byte count: a negative integer is the reference's span fault."""
    if isinstance(value, int) and not isinstance(value, bool) and value < 0:
        raise _fail(
            phrase("span", name=name, offset=_short(item.get("o")), nbytes=_short(item.get("b")), data="?"), name
        )
    return _want_int(value, what, name)


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
    _Field("i", "layer", lambda v, c: _want_layer(v, c[1]), required=False),
    _Field("d", "dtype", lambda v, c: _want_str(v, "dtype d", c[1])),
    _Field("s", "shape", lambda v, c: _dec_shape(v, c[0], c[1]), list),
    _Field("o", "offset", lambda v, c: _want_span_int(v, "offset o", c[2], c[1])),
    _Field("b", "nbytes", lambda v, c: _want_span_int(v, "byte count b", c[2], c[1])),
    _Field("c", "checksum", lambda v, c: _dec_checksum(v, c[1]), checksum_digits, required=False),
)


#: A descriptor's constructor arguments: name, layer, dtype, shape, offset, nbytes, checksum.
_Fields = tuple[str, int, str, tuple[int, ...], int, int, int | None]


def _small_int(value: Any) -> TypeGuard[int]:
    return type(value) is int and 0 <= value <= _MAX_INT


def _fast_fields(item: dict[str, Any], limits: DecodeLimits) -> _Fields | None:
    """The descriptor's fields when every one has its plain form, else None (then the table
    decodes it and reports the first fault). Decides exactly as the table would."""
    name, layer, dtype, shape = item.get("n"), item.get("i"), item.get("d"), item.get("s")
    offset, nbytes, checksum = item.get("o"), item.get("b"), item.get("c")
    if (
        type(name) is not str
        or item.get("x", False) is not False
        or not _small_int(layer)
        or type(dtype) is not str
        or type(shape) is not list
        or len(shape) > limits.max_ndim
        or not _small_int(offset)
        or not _small_int(nbytes)
    ):
        return None
    for d in shape:
        if not _small_int(d):
            return None
    if checksum is not None:
        if type(checksum) is not str or not _HEX8_RE.fullmatch(checksum):
            return None
        checksum = int(checksum, 16)
    elif "c" in item:
        return None
    return name, layer, dtype, tuple(shape), offset, nbytes, checksum


_COLUMNS = operator.itemgetter("n", "i", "d", "s", "o", "b")
_COLUMNS_C = operator.itemgetter("n", "i", "d", "s", "o", "b", "c")
_FIRST, _SECOND = operator.itemgetter(0), operator.itemgetter(1)
_DICT, _STR, _INT, _LIST, _NONE = {dict}, {str}, {int}, {list}, {None}
_DTYPES = frozenset(DTYPE_ITEMSIZE)


def _ints_ok(values: Any) -> bool:
    return not values or (set(map(type, values)) == _INT and min(values) >= 0 and max(values) <= _MAX_INT)


def _bulk_descriptors(items: list[Any], limits: DecodeLimits) -> _CheckedEntries | None:
    """A ``td`` list of plain present descriptors (exactly ``n i d s o b`` [``c``]), validated
    column by column in C-level passes; None unless every descriptor passes every check
    :func:`_dec_descriptor` and :func:`_checked` make (then they decide, and name the fault)."""
    if not items or set(map(type, items)) != _DICT:
        return None
    widths = set(map(len, items))
    getter = _COLUMNS if widths == {6} else _COLUMNS_C if widths == {7} else None
    if getter is None:
        return None
    try:
        columns = tuple(zip(*map(getter, items)))
    except KeyError:
        return None
    names, layers, dtypes, shapes, offsets, nbytes = columns[:6]
    if set(map(type, names)) != _STR or max(map(len, names)) > _NAME_MAX or set(map(type, dtypes)) != _STR:
        return None
    if not (_ints_ok(layers) and _ints_ok(offsets) and _ints_ok(nbytes) and set(dtypes) <= _DTYPES):
        return None
    if set(map(type, shapes)) != _LIST or max(map(len, shapes)) > min(limits.max_ndim, _MEMO_NDIM):
        return None
    if not _ints_ok(list(chain.from_iterable(shapes))):
        return None
    parsed = list(map(_name_memo, names))  # (kind, layer); short exact strings: bounded memo keys
    if None in parsed:
        return None
    pairs = cast("list[tuple[str, int]]", parsed)  # no None left
    if tuple(map(_SECOND, pairs)) != layers or len(set(pairs)) != len(pairs):
        return None
    shapes = tuple(map(tuple, shapes))
    sizes = list(map(_size_memo, dtypes, shapes))  # (problem, nbytes) per exact (dtype, shape)
    if set(map(_FIRST, sizes)) != _NONE or tuple(map(_SECOND, sizes)) != nbytes:
        return None
    checksums: Any = repeat(None)
    if getter is _COLUMNS_C:
        if set(map(type, columns[6])) != _STR or not all(map(_HEX8_RE.fullmatch, columns[6])):
            return None
        checksums = map(int, columns[6], repeat(16))
    entries = list(map(_trusted_descriptor, names, layers, dtypes, shapes, offsets, nbytes, checksums))
    return _checked_as(
        entries,
        max(layers) + 1,
        getter is _COLUMNS_C,
        tuple(zip(offsets, nbytes)),
        max(map(operator.add, offsets, nbytes)),
    )


def _dec_descriptor(item: Any, limits: DecodeLimits) -> Entry:
    if not isinstance(item, dict):
        raise _fail(f"tensor descriptor must be an object, got {_short(item)}")
    fields = _fast_fields(item, limits)
    if fields is None:
        name = _want_str(item.get("n"), "descriptor name n")
        absent = item.get("x", False)
        if not isinstance(absent, bool):
            raise _fail("absent flag x must be a boolean", name)
        if absent:
            return AbsentTensor(name)
        values: dict[str, Any] = {}
        for f in DESCRIPTOR_FIELDS:
            if f.key in item:
                values[f.attr] = f.decode(item[f.key], (limits, name, item))
            elif f.required:
                raise _fail(f"descriptor lacks {f.key!r}", name)
        if "layer" not in values:  # older senders: the layer is the name's suffix
            parsed = _parse_name(name)
            if parsed is None:
                raise _fail(phrase("name", name=_short(name)), name)
            values["layer"] = parsed[1]
        fields = (
            name,
            values["layer"],
            values["dtype"],
            values["shape"],
            values["offset"],
            values["nbytes"],
            values.get("checksum"),
        )
    try:
        return TensorDescriptor(*fields)
    except ConfigError as exc:
        raise _fail(str(exc).partition(": ")[2] or str(exc), fields[0]) from None


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
        raise _fail(phrase("short_prefix"))
    (header_len,) = _PREFIX.unpack(view[:PREFIX_NBYTES])
    if header_len > limits.max_header_bytes:
        raise _fail(f"header_len={header_len} exceeds the limit {limits.max_header_bytes}")
    data_start = PREFIX_NBYTES + header_len
    if data_start > len(view):
        raise _fail(phrase("header_len", header_len=header_len, size=len(view)))
    try:
        text = str(view[PREFIX_NBYTES:data_start], "utf-8")
    except UnicodeDecodeError as exc:
        raise _fail(f"header is not UTF-8 JSON ({_short(str(exc))})") from None
    obj, td_raw = _parse(text, limits)
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
    if td_raw is not None:
        _remember(td_raw, values["tensors"])
    try:
        header = PayloadHeader(**values)
    except ConfigError as exc:
        raise _fail(str(exc)) from None
    data_len = total - data_start
    tensors = header.tensors
    if type(tensors) is _CheckedEntries and tensors.data_end <= data_len:
        spans = tuple(None if s is None else (data_start + s[0], s[1]) for s in tensors.rel_spans)
        return DecodedHeader(header, data_start, total, spans)
    out: list[tuple[int, int] | None] = []
    for entry in tensors:
        if isinstance(entry, AbsentTensor):
            out.append(None)
            continue
        if entry.offset + entry.nbytes > data_len:
            raise _fail(
                phrase("span", name=entry.name, offset=entry.offset, nbytes=entry.nbytes, data=data_len), entry.name
            )
        out.append((data_start + entry.offset, entry.nbytes))
    return DecodedHeader(header, data_start, total, tuple(out))
