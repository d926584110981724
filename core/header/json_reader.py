"""The KV payload header's JSON object, read as ``json.loads`` reads it, remembering ``td``.

The object is read with the standard library's own scanner one top-level value at a time, so
the raw text of ``td`` is known. A ``td`` text validated before (identical characters, hence an
identical parse and an identical verdict) is handed back as :class:`_Reused` with its validated
descriptors instead of being parsed again; so is a text that differs from one only in its
checksums' hex digits (each request's own), with those checksums read into the descriptors;
any other is parsed and, once the decoder has validated it, remembered (:func:`_remember`).
Anything this reader does not accept is handed to ``json.loads`` as a whole, which decides.
The memo is a few immutable values, replaced whole.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import attrs

from kvferry.core.header.values import (
    _HEX8_RE,
    TensorDescriptor,
    _CheckedEntries,
    _fail,
    _short,
    _with_checksums,
    checksum_slots,
)

if TYPE_CHECKING:
    from kvferry.core.header.decode import DecodeLimits

__all__: list[str] = []


@attrs.frozen
class _Reused:
    """A ``td`` value whose exact text was validated before (under limits at least as wide)."""

    entries: _CheckedEntries


_MEMO_SIZE = 8  # distinct layouts remembered
_MEMO_MAX_TEXT = 256 * 1024  # longer td texts are validated every time (bounds the memo's memory)


@attrs.frozen
class _Known:
    """A validated ``td`` text: its entries, widest shape and, for checksummed entries written
    as the encoder writes them, where the checksums' digits are (:func:`checksum_slots`)."""

    raw: str
    entries: _CheckedEntries
    ndim: int
    slots: tuple[int, ...] | None


#: Validated ``td`` texts, newest first; replaced whole, never mutated.
_memo: tuple[_Known, ...] = ()


def _recall(text: str, at: int, limits: DecodeLimits) -> tuple[_Reused, int] | None:
    for known in _memo:
        raw, entries = known.raw, known.entries
        if len(entries) > limits.max_tensors or known.ndim > limits.max_ndim:
            continue
        if text.startswith(raw, at):
            return _Reused(entries), at + len(raw)  # a JSON array is self-delimiting
        if known.slots is not None and _same_but_checksums(text, at, known):
            values = [int(text[at + slot : at + slot + 8], 16) for slot in known.slots]
            return _Reused(_with_checksums(entries, values)), at + len(raw)
    return None


def _same_but_checksums(text: str, at: int, known: _Known) -> bool:
    """Whether ``text`` from ``at`` is ``known.raw`` but for 8 lowercase hex digits in each of
    its checksum slots: the same tensors, other checksums (each read as the decoder reads it)."""
    raw, done = known.raw, 0
    for slot in known.slots or ():
        if not text.startswith(raw[done:slot], at + done) or not _HEX8_RE.fullmatch(text, at + slot, at + slot + 8):
            return False
        done = slot + 8
    return text.startswith(raw[done:], at + done)


def _remember(raw: str, entries: Any) -> None:
    global _memo
    if type(entries) is _CheckedEntries and len(raw) <= _MEMO_MAX_TEXT:
        ndim = max((len(e.shape) for e in entries if type(e) is TensorDescriptor), default=0)
        known = _Known(raw, entries, ndim, checksum_slots(raw, entries))
        _memo = (known,) + tuple(m for m in _memo if m.raw != raw)[: _MEMO_SIZE - 1]


# --------------------------------------------------------------------------- the JSON object
_Scanner = Callable[[str, int], tuple[Any, int]]  # (text, index) -> (value, index after it)
_StringReader = Callable[[str, int, bool], tuple[str, int]]  # (text, index after the quote, strict)
# json.loads' own value scanner and string reader
_SCAN: _Scanner = json.decoder.JSONDecoder().scan_once  # type: ignore[attr-defined]  # stubs omit scan_once
_SCAN_STRING: _StringReader = json.decoder.scanstring  # type: ignore[attr-defined]  # stubs omit scanstring
_WS = re.compile(r"[ \t\n\r]*")
_SPACE = " \t\n\r"


def _skip(text: str, at: int) -> int:
    if at < len(text) and text[at] in _SPACE:
        found = _WS.match(text, at)
        assert found is not None  # the pattern matches the empty string too
        return found.end()
    return at


def _read_object(text: str, limits: DecodeLimits) -> tuple[dict[str, Any], str | None] | None:
    """``(object, raw td text or None)`` exactly as ``json.loads`` would parse ``text``, with a
    previously validated ``td`` text replaced by :class:`_Reused`. None when the text is not a
    well-formed JSON object (``json.loads`` then decides what it is)."""
    n = len(text)
    at = _skip(text, 0)
    if at >= n or text[at] != "{":
        return None
    obj: dict[str, Any] = {}
    td_raw: str | None = None
    at = _skip(text, at + 1)
    if at < n and text[at] == "}":
        at += 1
    else:
        while True:
            if at >= n or text[at] != '"':
                return None
            key, at = _SCAN_STRING(text, at + 1, True)
            at = _skip(text, at)
            if at >= n or text[at] != ":":
                return None
            at = _skip(text, at + 1)
            recalled = _recall(text, at, limits) if key == "td" else None
            if recalled is not None:
                obj[key], at = recalled
                td_raw = None
            else:
                start = at
                obj[key], at = _SCAN(text, at)
                if key == "td":
                    td_raw = text[start:at]
            at = _skip(text, at)
            if at < n and text[at] == "}":
                at += 1
                break
            if at >= n or text[at] != ",":
                return None
            at = _skip(text, at + 1)
    return (obj, td_raw) if _skip(text, at) == n else None


def _parse(text: str, limits: DecodeLimits) -> tuple[Any, str | None]:
    if not text.startswith("\ufeff"):  # json.loads refuses a BOM; let it say so
        try:
            found = _read_object(text, limits)
        except (StopIteration, ValueError, RecursionError):
            found = None
        if found is not None:
            return found
    try:
        return json.loads(text), None
    except (ValueError, RecursionError) as exc:
        raise _fail(f"header is not UTF-8 JSON ({_short(str(exc))})") from None
