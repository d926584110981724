"""The KV payload wire codec (SPEC 3.1), over plain bytes and integers: no torch.

Layout: ``[u32 big-endian header_len][header: UTF-8 JSON object][tensor data]``. One table of
fields (:data:`HEADER_FIELDS`, :data:`DESCRIPTOR_FIELDS`) defines the JSON keys and their order,
which is the reference's order, so ``plan_layout(..., align=1, version=False)`` reproduces a
reference header byte for byte. This module holds the encoder and the layout planner and is the
public face of the codec: the values live in :mod:`kvferry.core.header.values`, the decoder and
its limits in :mod:`kvferry.core.header.decode`, and every public name is importable from here.

Invariants (property-tested):

- ``decode_header(layout.header_bytes + data)`` gives back the planned header and spans;
- every span lies inside the payload; with ``align > 1`` every absolute tensor offset is a
  multiple of ``align`` (the header is padded with JSON whitespace so the data starts aligned);
- the header text is exactly ``json.dumps(<the table's object>, separators=(",", ":"))``
  (rendered piecewise here, with the tensor descriptors' part kept in a :class:`LayoutTemplate`);
- every malformed input raises :class:`PayloadError` and nothing else, and nothing is allocated
  from an unchecked length (see :func:`decode_header`).

Everything of a layout that depends only on the tensors' dtypes and shapes is a
:class:`LayoutTemplate`; :func:`kv_layout_template` and :func:`plan_layout` reuse a template for
a repeated signature (a bounded memo of immutable values), so a stage that sends the same
shapes again pays only for the request id, block ids and metadata. All sizes are in bytes.
"""

from __future__ import annotations

import functools
import json
import struct
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs

from kvferry.core.errors import ConfigError
from kvferry.core.header.decode import (
    DESCRIPTOR_FIELDS,
    HEADER_FIELDS,
    DecodedHeader,
    DecodeLimits,
    _enc_descriptor,
    decode_header,
)
from kvferry.core.header.values import (
    _MAX_INT,
    _MEMO_NDIM,
    CHECKSUM_ALGORITHMS,
    DTYPE_ITEMSIZE,
    FORMAT_VERSION,
    PREFIX_NBYTES,
    AbsentTensor,
    Entry,
    PayloadHeader,
    TensorDescriptor,
    TensorSpec,
    _checked,
    _checked_as,
    _CheckedEntries,
    _element_info,
    _exact,
    _fail,
    _header_with_entries,
    _size_memo,
    _trusted_descriptor,
    _with_checksums,
    checksum_digits,
    checksum_slots,
    tensor_name,
)

__all__ = [
    "DTYPE_ITEMSIZE",
    "FORMAT_VERSION",
    "CHECKSUM_ALGORITHMS",
    "PREFIX_NBYTES",
    "HEADER_FIELDS",
    "DESCRIPTOR_FIELDS",
    "DecodeLimits",
    "TensorSpec",
    "TensorDescriptor",
    "AbsentTensor",
    "PayloadHeader",
    "PayloadLayout",
    "LayoutTemplate",
    "DecodedHeader",
    "tensor_name",
    "kv_tensor_specs",
    "plan_template",
    "kv_layout_template",
    "plan_layout",
    "encode_header",
    "decode_header",
    "compute_checksum",
    "verify_checksum",
]

_PREFIX = struct.Struct(">I")
_NAMED_LAYERS = 10**9  # cache names carry at most 9 digits
_ENCODE = json.JSONEncoder(separators=(",", ":")).encode  # what json.dumps(..., separators) runs
_STR = json.encoder.encode_basestring_ascii  # a JSON string literal, ASCII escapes (quotes included)
_INT = int.__repr__  # how json renders an int (and an int subclass)


# ----------------------------------------------------------------------------------- encoding
def _header_object(header: PayloadHeader) -> dict[str, Any]:
    """The header as the table defines it (the rendering below is property-tested against it)."""
    out: dict[str, Any] = {}
    for f in HEADER_FIELDS:
        value = getattr(header, f.attr)
        if f.required or value is not None:
            out[f.key] = f.encode(value)
    return out


def _descriptor_text(entry: Entry) -> str:
    """``json.dumps(_enc_descriptor(entry), separators=(",", ":"))``, built directly."""
    if (
        type(entry) is TensorDescriptor
        and type(entry.layer) is int
        and type(entry.offset) is int
        and type(entry.nbytes) is int
        and _exact(entry.shape)
    ):
        text = (
            '{"n":'
            + _STR(entry.name)
            + ',"i":'
            + _INT(entry.layer)
            + ',"d":'
            + _STR(entry.dtype)
            + ',"s":['
            + ",".join(map(_INT, entry.shape))
            + '],"o":'
            + _INT(entry.offset)
            + ',"b":'
            + _INT(entry.nbytes)
        )
        return text + ("}" if entry.checksum is None else ',"c":' + _STR(checksum_digits(entry.checksum)) + "}")
    if type(entry) is AbsentTensor and type(entry.name) is str:
        return '{"n":' + _STR(entry.name) + ',"x":true}'
    return _ENCODE(_enc_descriptor(entry))  # unusual value types: let json render them


def _td_text(entries: Sequence[Entry]) -> str:
    try:
        return "[" + ",".join(map(_descriptor_text, entries)) + "]"
    except (TypeError, ValueError, RecursionError) as exc:
        raise ConfigError(f"payload tensor descriptors are not JSON-serialisable: {exc}") from None


def _header_text(header: PayloadHeader, td_text: str) -> str:
    """``json.dumps(_header_object(header), separators=(",", ":"))`` with ``td`` given as text."""
    try:
        meta = _ENCODE(header.metadata)
    except (TypeError, ValueError, RecursionError) as exc:
        raise ConfigError(f"payload metadata is not JSON-serialisable: {exc}") from None
    nl, version, algorithm = header.num_layers, header.format_version, header.checksum_algorithm
    text = (  # block ids and nl are ints, not bools (PayloadHeader checked): json writes int.__repr__
        '{"rid":'
        + _STR(header.request_id)
        + ',"bids":['
        + ",".join(map(_INT, header.block_ids))
        + '],"meta":'
        + meta
        + ',"td":'
        + td_text
        + ',"nl":'
        + _INT(nl)
    )
    if version is not None:
        text += ',"v":' + (_INT(version) if type(version) is int else _ENCODE(version))
    if algorithm is not None:
        text += ',"ck":' + _STR(algorithm)
    return text + "}"


def _frame(text: str, pad_to: int) -> bytes:
    body = text.encode("utf-8")
    body += b" " * ((-(PREFIX_NBYTES + len(body))) % pad_to)
    if len(body) > 0xFFFFFFFF:
        raise ConfigError(f"payload header of {len(body)} bytes does not fit a u32 length")
    return _PREFIX.pack(len(body)) + body


def encode_header(header: PayloadHeader, *, pad_to: int = 1) -> bytes:
    """``u32 length + compact JSON``, padded with spaces so its length is a multiple of ``pad_to``.

    The JSON is ``json.dumps(obj, separators=(",", ":"))`` with the standard library's other
    defaults (ASCII escapes, NaN allowed), exactly what the reference writes. Raises ConfigError
    when the metadata is not JSON-serialisable.
    """
    return _frame(_header_text(header, _td_text(header.tensors)), pad_to)


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


# ------------------------------------------------------------------------------------ layouts
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
    #: Where each present tensor's checksum digits are in the rendered header (None: unknown,
    #: :meth:`with_checksums` renders the header again).
    _ck_at: tuple[int, ...] | None = attrs.field(default=None, repr=False, eq=False)

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
        entries = self.header.tensors
        if self._ck_at is not None and type(entries) is _CheckedEntries and len(self._ck_at) == len(present):
            # the checksums' digits written where the rendered header has them: the same bytes
            # as rendering it again with these checksums, for a fraction of the work
            masked = [int(v) & 0xFFFFFFFF for v in values]
            written = bytearray(self._rendered)
            for at, value in zip(self._ck_at, masked):
                written[at : at + 8] = checksum_digits(value).encode("ascii")
            header = _header_with_entries(self.header, _with_checksums(entries, masked))
            return attrs.evolve(self, header=header, checksums_pending=False, rendered=bytes(written))
        it = iter(values)
        tensors = _checked(
            [
                t if isinstance(t, AbsentTensor) else attrs.evolve(t, checksum=int(next(it)) & 0xFFFFFFFF)
                for t in self.header.tensors
            ]
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


@attrs.frozen
class LayoutTemplate:
    """The part of a payload's layout fixed by its tensors' dtypes and shapes (and options).

    ``entries`` are the validated descriptors (offsets relative to the tensor data, checksums 0
    while pending); ``rel_spans[k]`` is ``(offset, nbytes)`` relative to the tensor data (None =
    absent); ``data_nbytes`` is the tensor data's size including padding; ``td_text`` is the
    descriptors' JSON. :meth:`layout` adds a request id, block ids and metadata.
    """

    num_layers: int
    entries: tuple[Entry, ...]
    rel_spans: tuple[tuple[int, int] | None, ...]
    data_nbytes: int
    align: int
    version: bool
    checksums: str | None
    td_text: str = attrs.field(repr=False)
    #: Where each present descriptor's checksum digits are in ``td_text`` (checksum_slots).
    ck_slots: tuple[int, ...] | None = attrs.field(init=False, repr=False, eq=False)

    @ck_slots.default
    def _ck_slots(self) -> tuple[int, ...] | None:
        return checksum_slots(self.td_text, self.entries)

    def layout(self, request_id: str, block_ids: Sequence[int], metadata: Mapping[str, Any]) -> PayloadLayout:
        """The full layout of one payload; ConfigError for a bad request id, ids or metadata."""
        if not isinstance(metadata, Mapping):
            raise ConfigError(f"metadata must be a mapping, got {type(metadata).__name__}")
        header = PayloadHeader(
            request_id,
            block_ids,
            metadata,
            self.num_layers,
            self.entries,
            FORMAT_VERSION if self.version else None,
            self.checksums,
        )
        text = _header_text(header, self.td_text)
        rendered = _frame(text, self.align)
        start = len(rendered)
        spans = tuple(None if s is None else (start + s[0], s[1]) for s in self.rel_spans)
        ck_at = None
        if self.ck_slots is not None and text.isascii():  # ASCII (as json writes it): bytes = chars
            td_at = PREFIX_NBYTES + text.rindex(',"td":') + len(',"td":')  # td follows the metadata
            ck_at = tuple(td_at + slot for slot in self.ck_slots)
        return PayloadLayout(
            header, start, spans, start + self.data_nbytes, self.align, self.checksums is not None, rendered, ck_at
        )


def _check_options(align: Any, checksums: Any) -> None:
    if isinstance(align, bool) or not isinstance(align, int) or align < 1 or align & (align - 1):
        raise ConfigError(f"align must be a power of two >= 1, got {align!r}")
    if checksums is not None and checksums not in CHECKSUM_ALGORITHMS:
        raise ConfigError(f"unknown checksum algorithm {checksums!r}; known: {sorted(CHECKSUM_ALGORITHMS)}")


def _place(pos: int, nbytes: int, align: int) -> int:
    """Where a tensor of ``nbytes`` goes after ``pos`` (bytes from the data start): the next
    multiple of ``align``; empty tensors have no bytes to align and stay at ``pos``."""
    return -(-pos // align) * align if nbytes else pos


def _build_template(
    num_layers: int,
    tensor_specs: Sequence[TensorSpec | AbsentTensor],
    align: int,
    version: bool,
    checksums: str | None,
) -> LayoutTemplate:
    entries: list[Entry] = []
    pos = 0
    checksum = 0 if checksums is not None else None
    for spec in tensor_specs:
        if isinstance(spec, AbsentTensor):
            entries.append(spec)
            continue
        if not isinstance(spec, TensorSpec):
            raise ConfigError(f"tensor_specs must hold TensorSpec or AbsentTensor, got {spec!r}")
        nbytes = spec.nbytes
        pos = _place(pos, nbytes, align)
        name, layer, dtype, shape = spec.name, spec.layer, spec.dtype, spec.shape
        if type(name) is str and type(layer) is int and type(dtype) is str and _exact(shape) and pos <= _MAX_INT:
            entries.append(_trusted_descriptor(name, layer, dtype, shape, pos, nbytes, checksum))  # spec: checked
        else:
            entries.append(TensorDescriptor(name, layer, dtype, shape, pos, nbytes, checksum))
        pos += nbytes
    checked = _checked(entries)
    # a probe header runs every header-level check (layer range, duplicates) once, here
    PayloadHeader("", (), {}, num_layers, checked, FORMAT_VERSION if version else None, checksums)
    spans = tuple(None if isinstance(e, AbsentTensor) else (e.offset, e.nbytes) for e in checked)
    return LayoutTemplate(num_layers, checked, spans, pos, align, bool(version), checksums, _td_text(checked))


_build_memo = functools.lru_cache(maxsize=64)(_build_template)


def _memo_safe(num_layers: Any, tensor_specs: Any) -> bool:
    """Whether equal keys render equal JSON: exact ints and strings only (``True == 1``)."""
    if type(num_layers) is not int or type(tensor_specs) is not tuple:
        return False
    for spec in tensor_specs:
        if type(spec) is not TensorSpec and not (type(spec) is AbsentTensor and type(spec.name) is str):
            return False
    return True


def plan_template(
    num_layers: int,
    tensor_specs: Sequence[TensorSpec | AbsentTensor],
    *,
    align: int = 64,
    version: bool = True,
    checksums: str | None = None,
) -> LayoutTemplate:
    """Offsets and descriptors for these tensors (pure; see :func:`plan_layout` for the rules).

    Memoised (64 signatures) when ``tensor_specs`` is a tuple of specs with exact types.
    """
    _check_options(align, checksums)
    if _memo_safe(num_layers, tensor_specs):
        return _build_memo(num_layers, tensor_specs, align, bool(version), checksums)
    return _build_template(num_layers, tensor_specs, align, bool(version), checksums)


def kv_layout_template(
    keys: Sequence[tuple[str, Sequence[int]] | None],
    values: Sequence[tuple[str, Sequence[int]] | None],
    *,
    align: int = 64,
    version: bool = True,
    checksums: str | None = None,
) -> LayoutTemplate:
    """``plan_template(*kv_tensor_specs(keys, values), ...)``, the same value, built directly.

    Per-layer ``(dtype, shape)`` pairs (None = absent layer), keys first. Not memoised: callers
    that repeat a signature keep the template (e.g. keyed by their own exact dtype/shape types).
    """
    _check_options(align, checksums)
    if len(values) > len(keys):
        raise ConfigError(f"{len(values)} value layers but only {len(keys)} key layers")
    entries: list[Entry] = []
    spans: list[tuple[int, int] | None] = []
    texts: list[str] = []
    middles: dict[tuple[str, tuple[int, ...]], str] = {}  # (dtype, shape) -> the descriptor's JSON between "i" and "o"
    tail = ',"c":"00000000"}' if checksums is not None else "}"
    checksum = 0 if checksums is not None else None
    pos = min_layers = 0
    for prefix, items in (("key_cache_", keys), ("value_cache_", values)):
        for layer, item in enumerate(items):
            name = f"{prefix}{layer}"
            if item is None:
                entries.append(AbsentTensor(name))
                spans.append(None)
                texts.append('{"n":"' + name + '","x":true}')
                continue
            dtype, shape = item[0], tuple(item[1])
            exact = type(dtype) is str and layer < _NAMED_LAYERS and len(shape) <= _MEMO_NDIM and _exact(shape)
            # the name is made here and matches the layer: only the dtype and shape need checking
            problem, nbytes = (
                _size_memo(dtype, shape)
                if exact and dtype in DTYPE_ITEMSIZE
                else _element_info(name, layer, dtype, shape)
            )
            if problem:
                raise ConfigError(f"tensor {name!r}: {problem}")
            pos = _place(pos, nbytes, align)
            if not exact or pos > _MAX_INT:
                entries.append(TensorDescriptor(name, layer, dtype, shape, pos, nbytes, checksum))
                texts.append(_descriptor_text(entries[-1]))
            else:
                entries.append(_trusted_descriptor(name, layer, dtype, shape, pos, nbytes, checksum))
                middle = middles.get((dtype, shape))
                if middle is None:
                    middle = middles[(dtype, shape)] = (
                        ',"d":' + _STR(dtype) + ',"s":[' + ",".join(map(_INT, shape)) + '],"o":'
                    )
                texts.append(
                    '{"n":"' + name + '","i":' + _INT(layer) + middle + _INT(pos) + ',"b":' + _INT(nbytes) + tail
                )
            spans.append((pos, nbytes))
            min_layers = max(min_layers, layer + 1)
            pos += nbytes
    present = [s for s in spans if s is not None]
    checked = _checked_as(
        entries,
        min_layers,
        None if not present else checksums is not None,
        tuple(spans),
        max((o + n for o, n in present), default=0),
    )
    return LayoutTemplate(
        len(keys), checked, checked.rel_spans, pos, align, bool(version), checksums, "[" + ",".join(texts) + "]"
    )


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
    template = plan_template(num_layers, tensor_specs, align=align, version=version, checksums=checksums)
    return template.layout(request_id, block_ids, metadata)


# ---------------------------------------------------------------------------------- checksums
def compute_checksum(
    algorithm: str, data: Any, functions: Mapping[str, Callable[[Any, int], int]] = CHECKSUM_ALGORITHMS
) -> int:
    """Checksum of a bytes-like object or of a sequence of them (concatenated meaning).

    ``functions`` maps algorithm names to their routines (default: the pure ones of
    :data:`CHECKSUM_ALGORITHMS`; ``kvferry.adapters.checksums`` passes native ones)."""
    fn = functions.get(algorithm)
    if fn is None:
        raise ConfigError(f"unknown checksum algorithm {algorithm!r}")
    parts = data if isinstance(data, (list, tuple)) else (data,)
    value = 0
    for part in parts:
        value = fn(part, value)
    return value & 0xFFFFFFFF


def verify_checksum(
    header: PayloadHeader,
    descriptor: TensorDescriptor,
    data: Any,
    functions: Mapping[str, Callable[[Any, int], int]] = CHECKSUM_ALGORITHMS,
) -> None:
    """Raise PayloadError naming the tensor when ``data`` does not match its checksum."""
    if header.checksum_algorithm is None or descriptor.checksum is None:
        return
    actual = compute_checksum(header.checksum_algorithm, data, functions)
    if actual != descriptor.checksum:
        raise _fail(
            f"{header.checksum_algorithm} mismatch: header says {descriptor.checksum:08x}, data has {actual:08x}",
            descriptor.name,
        )
