"""The values of a KV payload header (SPEC 3.1): dtypes, tensor names, descriptors, the header.

Pure data and validation, shared by the encoder (:mod:`kvferry.core.header`) and the decoder
(:mod:`kvferry.core.header.decode`); import the public names from :mod:`kvferry.core.header`.

Validation is memoised where it only depends on small hashable inputs (a tensor name and its
layer; a dtype and a shape): a 56-tensor payload repeats one ``(dtype, shape)`` 56 times, and a
stage repeats the same names on every request. Memo keys are built only from exact ``int`` and
``str`` values, so ``True``/``1.0`` never hit an entry made for ``1``. All sizes are in bytes.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Iterable, Mapping
from types import MappingProxyType
from typing import Any

import attrs

from kvferry.core.errors import ConfigError, PayloadError
from kvferry.core.header.checksums import CHECKSUM_ALGORITHMS
from kvferry.core.phrases import phrase
from kvferry.core.validate import check_int

__all__ = [
    "DTYPE_ITEMSIZE",
    "FORMAT_VERSION",
    "CHECKSUM_ALGORITHMS",
    "PREFIX_NBYTES",
    "TensorSpec",
    "TensorDescriptor",
    "AbsentTensor",
    "PayloadHeader",
    "tensor_name",
]

#: Bytes per element of every dtype a payload may carry (names are torch's without ``torch.``).
DTYPE_ITEMSIZE: Mapping[str, int] = MappingProxyType(
    {
        "bool": 1,
        "uint8": 1,
        "int8": 1,
        "int16": 2,
        "int32": 4,
        "int64": 8,
        "float16": 2,
        "float32": 4,
        "float64": 8,
        "bfloat16": 2,
        "complex64": 8,
        "complex128": 16,
        "float8_e4m3fn": 1,
        "float8_e5m2": 1,
        "float8_e4m3fnuz": 1,
        "float8_e5m2fnuz": 1,
        "float8_e8m0fnu": 1,
    }
)
#: The kvferry format version written under ``"v"``; bumped only for incompatible changes.
FORMAT_VERSION = 1
PREFIX_NBYTES = 4
_MAX_INT = 2**63 - 1  # no offset, size or dimension may exceed a signed 64-bit integer
_KINDS = {"key": "key_cache_", "value": "value_cache_"}
_NAME_RE = re.compile(r"(key|value)_cache_([0-9]{1,9})")


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _fail(reason: str, tensor: str | None = None) -> PayloadError:
    where = f" (tensor {tensor!r})" if tensor is not None else ""
    return PayloadError(f"invalid KV payload{where}: {reason}")


def tensor_name(kind: str, layer: int) -> str:
    """``key_cache_{layer}`` or ``value_cache_{layer}``; ``kind`` is ``"key"`` or ``"value"``."""
    if kind not in _KINDS:
        raise ConfigError(f"tensor kind must be 'key' or 'value', got {kind!r}")
    return f"{_KINDS[kind]}{layer}"


_NAME_MAX = len("value_cache_") + 9  # longer strings are never cache names (and are not memoised)


def _match_name(name: str) -> tuple[str, int] | None:
    match = _NAME_RE.fullmatch(name)
    return (match.group(1), int(match.group(2))) if match else None


_name_memo = functools.lru_cache(maxsize=4096)(_match_name)


def _parse_name(name: str) -> tuple[str, int] | None:
    """``(kind, layer)`` of a cache tensor name, None for any other string."""
    if type(name) is str:
        return _name_memo(name) if len(name) <= _NAME_MAX else None
    return _match_name(name)


_ROLE_PREFIXES = tuple(_KINDS.values())


def _name_problem(name: str, layer: int) -> str | None:
    """The name gives only the role (its prefix), as in the reference: the layer is ``i``.

    ``key_cache_extra_suffix`` with ``i: 0`` is layer 0's key; a suffix that disagrees with
    ``i`` is not a fault. A name that is neither ``key_cache_*`` nor ``value_cache_*`` is
    refused (the reference would drop that tensor without a word)."""
    if type(name) is not str or not name.startswith(_ROLE_PREFIXES):
        return phrase("name", name=name)
    return None


def _size_problem(dtype: str, shape: tuple[int, ...]) -> tuple[str | None, int]:
    """``(problem, nbytes)`` of ``dtype`` x ``shape``; nbytes is 0 when there is a problem."""
    if dtype not in DTYPE_ITEMSIZE:
        return phrase("dtype", dtype=dtype), 0
    if any(isinstance(d, bool) or not isinstance(d, int) or d < 0 or d > _MAX_INT for d in shape):
        return f"shape {list(shape)} has a dimension that is not a non-negative integer", 0
    if math.prod(max(d, 1) for d in shape) * DTYPE_ITEMSIZE[dtype] > _MAX_INT:
        return f"shape {list(shape)} spans more than 2**63 bytes (strides would overflow)", 0
    return None, math.prod(shape) * DTYPE_ITEMSIZE[dtype]


_size_memo = functools.lru_cache(maxsize=1024)(_size_problem)
_MEMO_NDIM = 64  # longer shapes are checked but not memoised


def _exact(values: tuple[Any, ...]) -> bool:
    """True when every item is exactly an ``int`` (memo keys must not mix bools and floats in)."""
    for v in values:
        if type(v) is not int:
            return False
    return True


def _element_info(name: Any, layer: Any, dtype: Any, shape: tuple[Any, ...]) -> tuple[str | None, int]:
    """``(problem, nbytes)`` of one tensor; the checks run in the order of the error messages."""
    if type(layer) is not int and (isinstance(layer, bool) or not isinstance(layer, int)):
        return phrase("layer", layer=repr(layer)), 0
    problem = _name_problem(name, layer)
    if problem:
        return problem, 0
    if type(dtype) is str and dtype in DTYPE_ITEMSIZE and len(shape) <= _MEMO_NDIM and _exact(shape):
        return _size_memo(dtype, shape)  # bounded keys: an allow-listed name and <= 64 exact ints
    return _size_problem(dtype, shape)


def _int_tuple(values: Iterable[int]) -> tuple[int, ...]:
    """A shape or block-id list as a tuple (the attrs converter of those fields)."""
    return tuple(values)


@attrs.frozen(cache_hash=True)
class TensorSpec:
    """A tensor to be laid out: name, layer index, dtype name and shape (elements)."""

    name: str
    layer: int
    dtype: str
    shape: tuple[int, ...] = attrs.field(converter=_int_tuple)

    def __attrs_post_init__(self) -> None:
        problem, _ = _element_info(self.name, self.layer, self.dtype, self.shape)
        if problem:
            raise ConfigError(f"tensor {self.name!r}: {problem}")

    @property
    def nbytes(self) -> int:
        return _element_info(self.name, self.layer, self.dtype, self.shape)[1]


@attrs.frozen
class TensorDescriptor:
    """A present tensor: ``offset`` is relative to the start of the tensor data (bytes).

    Invariant: ``nbytes == prod(shape) * itemsize(dtype)``; ``checksum`` is set exactly when
    the header names a checksum algorithm.
    """

    name: str
    layer: int
    dtype: str
    shape: tuple[int, ...] = attrs.field(converter=_int_tuple)
    offset: int
    nbytes: int
    checksum: int | None = None

    def __attrs_post_init__(self) -> None:
        problem, expected = _element_info(self.name, self.layer, self.dtype, self.shape)
        if problem:
            raise ConfigError(f"tensor {self.name!r}: {problem}")
        if not (0 <= self.offset <= _MAX_INT and 0 <= self.nbytes <= _MAX_INT):
            raise ConfigError(f"tensor {self.name!r}: offset/nbytes out of range")
        if expected != self.nbytes:
            raise ConfigError(
                f"tensor {self.name!r}: shape {list(self.shape)} of {self.dtype} is {expected} "
                f"bytes but the descriptor says {self.nbytes}"
            )

    @property
    def kind(self) -> str:
        """``"key"`` or ``"value"``."""
        return "key" if self.name.startswith("key_cache_") else "value"


@attrs.frozen
class AbsentTensor:
    """A layer that carries no tensor (``{"n": name, "x": true}``)."""

    name: str


Entry = TensorDescriptor | AbsentTensor


class _CheckedEntries(tuple[Entry, ...]):
    """Entries whose header-independent invariants hold (made only by :func:`_checked`).

    ``min_layers`` is the smallest ``num_layers`` they fit; ``checksummed`` is whether the
    present tensors carry checksums (None: no present tensor); ``rel_spans`` are the
    ``(offset, nbytes)`` relative to the tensor data (None = absent); ``data_end`` is the
    largest ``offset + nbytes`` (bytes). :class:`PayloadHeader` skips its per-entry loop for
    them, which is what makes a validated, cached layout cheap to reuse.
    """

    min_layers: int
    checksummed: bool | None
    rel_spans: tuple[tuple[int, int] | None, ...]
    data_end: int


def _checked(entries: Any) -> tuple[Entry, ...]:
    """The entries as a :class:`_CheckedEntries` when they are consistent on their own, else a
    plain tuple (then :class:`PayloadHeader` finds and reports the first fault itself)."""
    if type(entries) is _CheckedEntries:
        return entries
    items: tuple[Any, ...] = tuple(entries)
    seen: set[tuple[bool, int]] = set()
    spans: list[tuple[int, int] | None] = []
    min_layers, data_end, checksummed = 0, 0, None
    for entry in items:
        if type(entry) is AbsentTensor:
            spans.append(None)
            continue
        if type(entry) is not TensorDescriptor:
            return items
        slot = (entry.name.startswith("key_cache_"), entry.layer)
        has_checksum = entry.checksum is not None
        if slot in seen or (checksummed is not None and checksummed != has_checksum):
            return items
        seen.add(slot)
        checksummed = has_checksum
        min_layers = max(min_layers, entry.layer + 1)
        data_end = max(data_end, entry.offset + entry.nbytes)
        spans.append((entry.offset, entry.nbytes))
    return _checked_as(items, min_layers, checksummed, tuple(spans), data_end)


_new, _set = object.__new__, object.__setattr__


def _trusted_descriptor(
    name: str, layer: int, dtype: str, shape: tuple[int, ...], offset: int, nbytes: int, checksum: int | None = None
) -> TensorDescriptor:
    """A descriptor of values the caller validated exactly as ``TensorDescriptor.__init__``
    would (exact ``str``/``int`` types, a cache name matching ``layer``, an allow-listed dtype,
    ``nbytes`` the shape's size, offset and nbytes in ``[0, 2**63)``, ``shape`` a tuple): the
    same value, without checking it twice."""
    d = _new(TensorDescriptor)
    _set(d, "name", name)
    _set(d, "layer", layer)
    _set(d, "dtype", dtype)
    _set(d, "shape", shape)
    _set(d, "offset", offset)
    _set(d, "nbytes", nbytes)
    _set(d, "checksum", checksum)
    return d


#: A descriptor's checksum as written: exactly 8 lowercase hex digits (:func:`checksum_digits`).
_HEX8_RE = re.compile(r"[0-9a-f]{8}")
#: A present descriptor's checksum as the encoder writes it: the last field of its object.
_CHECKSUM_FIELD = re.compile(r',"c":"(' + _HEX8_RE.pattern + r')"\}')


def checksum_digits(value: int) -> str:
    """How a checksum is written in a header: 8 lowercase hex digits (what :data:`_HEX8_RE`
    accepts back)."""
    return f"{value:08x}"


def checksum_slots(td_text: str, entries: Any) -> tuple[int, ...] | None:
    """Where the 8 hex digits of each present descriptor's checksum are in ``td_text`` (the
    ``td`` array's JSON text ``entries`` were read from or rendered to), in entry order; None
    unless ``entries`` are checksummed :class:`_CheckedEntries` and the text names ``"c"``
    exactly once per present descriptor, each last in its object in the encoder's form and
    equal to its checksum. A text equal to ``td_text`` but for other hex digits in these
    slots describes the same tensors with those checksums (:func:`_with_checksums`)."""
    if type(entries) is not _CheckedEntries or entries.checksummed is not True:
        return None
    present = [e for e in entries if type(e) is TensorDescriptor]
    if td_text.count('"c":') != len(present):  # a "c" anywhere else (strings escape their quotes)
        return None
    found = list(_CHECKSUM_FIELD.finditer(td_text))
    if len(found) != len(present) or any(int(m.group(1), 16) != e.checksum for m, e in zip(found, present)):
        return None
    return tuple(m.start(1) for m in found)


def _with_checksums(entries: _CheckedEntries, values: Iterable[int]) -> _CheckedEntries:
    """Checksummed ``entries`` with the present descriptors' checksums replaced by ``values``
    (u32s the caller checked), in order: every other invariant is unchanged, so kept."""
    it = iter(values)
    out: list[Entry] = [
        _trusted_descriptor(e.name, e.layer, e.dtype, e.shape, e.offset, e.nbytes, next(it))
        if type(e) is TensorDescriptor
        else e
        for e in entries
    ]
    return _checked_as(out, entries.min_layers, entries.checksummed, entries.rel_spans, entries.data_end)


def _checked_as(
    entries: Iterable[Entry],
    min_layers: int,
    checksummed: bool | None,
    rel_spans: tuple[tuple[int, int] | None, ...],
    data_end: int,
) -> _CheckedEntries:
    """:class:`_CheckedEntries` whose invariants the caller established (see :func:`_checked`)."""
    out = _CheckedEntries(entries)
    out.min_layers, out.checksummed, out.rel_spans, out.data_end = min_layers, checksummed, rel_spans, data_end
    return out


def _as_entries(value: Any) -> tuple[Entry, ...]:
    return value if type(value) is _CheckedEntries else tuple(value)


def _all_ints(values: tuple[Any, ...]) -> bool:
    kinds = set(map(type, values))
    if kinds <= {int}:
        return True
    return not any(isinstance(b, bool) or not isinstance(b, int) for b in values)


@attrs.frozen
class PayloadHeader:
    """The decoded (or planned) header. ``metadata`` is a JSON-able dict (do not mutate).

    Invariants: every present tensor's layer is in ``[0, num_layers)``; no (kind, layer) pair
    is present twice; ``checksum_algorithm`` is set exactly when descriptors carry checksums.
    """

    request_id: str
    block_ids: tuple[int, ...] = attrs.field(converter=_int_tuple)
    metadata: dict[str, Any] = attrs.field(converter=dict, hash=False)
    num_layers: int
    tensors: tuple[Entry, ...] = attrs.field(converter=_as_entries)
    format_version: int | None = None
    checksum_algorithm: str | None = None

    def __attrs_post_init__(self) -> None:
        if not isinstance(self.request_id, str):
            raise ConfigError(f"request_id must be a string, got {self.request_id!r}")
        if not _all_ints(self.block_ids):
            raise ConfigError("block_ids must be integers")
        check_int("num_layers", self.num_layers, 0, expected="a non-negative integer")
        if self.checksum_algorithm is not None and self.checksum_algorithm not in CHECKSUM_ALGORITHMS:
            raise ConfigError(f"unknown checksum algorithm {self.checksum_algorithm!r}")
        tensors = self.tensors
        if (
            type(tensors) is _CheckedEntries
            and tensors.min_layers <= self.num_layers
            and tensors.checksummed in (None, self.checksum_algorithm is not None)
        ):
            return  # the per-entry invariants were checked when the entries were made
        seen: set[tuple[str, int]] = set()
        for entry in tensors:
            if isinstance(entry, AbsentTensor):
                continue
            if not isinstance(entry, TensorDescriptor):
                raise ConfigError(f"tensors must be descriptors, got {entry!r}")
            if entry.layer >= self.num_layers:
                raise ConfigError(
                    f"tensor {entry.name!r}: {phrase('layer_range', layer=entry.layer, num_layers=self.num_layers)}"
                )
            if (entry.kind, entry.layer) in seen:
                raise ConfigError(f"tensor {entry.name!r} appears twice")
            seen.add((entry.kind, entry.layer))
            if (entry.checksum is None) != (self.checksum_algorithm is None):
                raise ConfigError(f"tensor {entry.name!r}: checksum present iff an algorithm is named")

    @property
    def present(self) -> tuple[TensorDescriptor, ...]:
        return tuple(t for t in self.tensors if isinstance(t, TensorDescriptor))


_HEADER_FIELDS = tuple(a.name for a in attrs.fields(PayloadHeader))


def _header_with_entries(header: PayloadHeader, tensors: _CheckedEntries) -> PayloadHeader:
    """``header`` with ``tensors`` that :func:`_with_checksums` made from its own: its
    invariants hold as they did, so the copy is not checked again (the metadata dict is shared;
    a header's metadata is not mutated)."""
    copy = _new(PayloadHeader)
    for name in _HEADER_FIELDS:
        _set(copy, name, getattr(header, name))
    _set(copy, "tensors", tensors)
    return copy
