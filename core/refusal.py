"""A sender's refusal of one request, as the receiving stage reads it (docs/wire-format.md).

When the send path cannot send a request's KV (the cache layout is ambiguous, extraction failed,
every put failed) it puts a *refusal marker* under each of the request's keys instead: a payload
in the ordinary format (SPEC 3.1) with no tensor data, every layer absent, and
``meta["kvferry_refused"] = {"v": 1, "reason": ..., "detail": ..., "fix": ...}``. A kvferry
receiver that takes one ends the receive at once with a ``refused`` outcome; vllm-omni's decoder
reads it as a payload whose layers are all absent (``None``), which its pipelines treat as no KV,
at once instead of after ``recv_timeout``.

Pure: builds and reads the metadata record; the bytes are the header codec's.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

__all__ = ["REFUSAL_KEY", "REFUSAL_VERSION", "MARKER_MAX_BYTES", "MAX_TEXT_CHARS", "Refusal"]

#: The metadata key of a refusal marker.
REFUSAL_KEY = "kvferry_refused"
REFUSAL_VERSION = 1
#: A marker is one header; receivers look for a refusal only in payloads up to this size.
MARKER_MAX_BYTES = 64 * 1024
#: ``detail`` and ``fix`` are cut to this many characters (the marker stays small).
MAX_TEXT_CHARS = 2000


def _text(value: Any) -> str:
    text = value if isinstance(value, str) else str(value)
    return text if len(text) <= MAX_TEXT_CHARS else text[: MAX_TEXT_CHARS - 3] + "..."


@attrs.frozen
class Refusal:
    """Why a sender refused a request: ``reason`` (a send reason word, e.g. ``error``,
    ``no_blocks``, ``pool_full``), ``detail`` (what happened, naming the request and the cache
    shape) and ``fix`` (what the operator changes)."""

    reason: str = attrs.field(converter=_text)
    detail: str = attrs.field(default="", converter=_text)
    fix: str = attrs.field(default="", converter=_text)

    def metadata(self) -> dict[str, Any]:
        """The marker's metadata dict (JSON-able)."""
        return {REFUSAL_KEY: {"v": REFUSAL_VERSION, "reason": self.reason, "detail": self.detail, "fix": self.fix}}

    @classmethod
    def from_metadata(cls, metadata: Any) -> Refusal | None:
        """The refusal a payload's metadata carries, or None when it carries none. A record of
        another shape (not a mapping, a version other than 1, non-string fields) is no refusal:
        the payload then goes through the ordinary checks."""
        if not isinstance(metadata, Mapping):
            return None
        record = metadata.get(REFUSAL_KEY)
        if not isinstance(record, Mapping) or record.get("v") != REFUSAL_VERSION:
            return None
        fields = [record.get(k, "") for k in ("reason", "detail", "fix")]
        if not all(isinstance(f, str) for f in fields) or not fields[0]:
            return None
        return cls(*fields)

    def describe(self) -> str:
        """One line for logs and outcome details."""
        out = f"{self.reason}: {self.detail}" if self.detail else self.reason
        return f"{out}; fix: {self.fix}" if self.fix else out
