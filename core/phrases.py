"""The reference decoder's error phrases, in one table, so that callers matching its messages
keep working.

The reference raises ``ValueError`` with these texts for malformed payloads, and its callers
(and its own tests) match on them. kvferry raises :class:`~kvferry.core.errors.PayloadError` (a
``ValueError``) whose message contains the same phrase, after kvferry's own prefix
(``invalid KV payload (tensor 'key_cache_0'): ...``). Each entry is a ``str.format`` template;
:func:`phrase` fills it. Every entry has a test that provokes it in kvferry's decoder (and,
where the reference venv is there, in the reference's).
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

__all__ = ["REFERENCE_PHRASES", "phrase"]

#: name -> template. The names are kvferry's; the texts are the reference's.
REFERENCE_PHRASES: Mapping[str, str] = MappingProxyType(
    {
        # the 4-byte big-endian header length is not there
        "short_prefix": "missing 4-byte header length",
        # the header length claims more bytes than the payload has
        "header_len": "header_len={header_len} exceeds buffer size={size}",
        # a descriptor's dtype is outside the allow-list
        "dtype": "Unsupported dtype in KV payload: {dtype}",
        # a tensor's (offset, bytes) does not lie inside the tensor data
        "span": (
            "Corrupted KV payload tensor span for {name}: offset={offset}, bytes={nbytes}, tensor_data_bytes={data}"
        ),
        # a descriptor without ``i`` whose name does not give the layer, or with a name that is
        # neither key_cache_* nor value_cache_*
        "name": "Invalid KV tensor name in payload: {name}",
        # ``i`` is not a non-negative integer below ``nl``
        "layer": "Invalid layer index in KV payload: {layer}",
        "layer_range": "Invalid layer index in KV payload: {layer} (num_layers={num_layers})",
        # from_bytes_device was given something other than a 1-D uint8 tensor
        "device_tensor": "Packed device KV payload must be a 1-D uint8 tensor",
    }
)


def phrase(key: str, /, **values: Any) -> str:
    """The reference's text ``key`` of :data:`REFERENCE_PHRASES`, filled with ``values``."""
    return REFERENCE_PHRASES[key].format(**values)
