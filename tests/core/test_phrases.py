"""Each of the reference's error phrases (core.phrases) comes out of kvferry's decoder for the
fault the reference names with it, as a PayloadError (a ValueError). The same faults through
the reference's own decoder: tests/app/compat/test_reference_codec.py."""

from __future__ import annotations

import json
import re
import struct

import pytest
import torch

from kvferry.app.compat.codec import KVCacheTransferData
from kvferry.core.errors import PayloadError
from kvferry.core.header import decode_header
from kvferry.core.phrases import REFERENCE_PHRASES, phrase

DESC = {"n": "key_cache_0", "i": 0, "d": "float32", "s": [3], "o": 0, "b": 12}


def payload(desc: dict | None = None, *, nl: int = 1, data: bytes = b"\x00" * 12) -> bytes:
    header = json.dumps({"rid": "r", "bids": [0], "meta": {}, "td": [desc or DESC], "nl": nl}).encode()
    return struct.pack(">I", len(header)) + header + data


#: phrase name -> malformed input that provokes it
FAULTS = {
    "short_prefix": b"\x00\x00",
    "header_len": struct.pack(">I", 999) + b"{}",
    "dtype": payload({**DESC, "d": "cuda"}),
    "span": payload({**DESC, "o": 4096}),
    "name": payload({k: v for k, v in DESC.items() if k != "i"} | {"n": "keys_0"}),
    "layer": payload({**DESC, "i": -1}),
    "layer_range": payload({**DESC, "i": 3}),
}


def as_pattern(template: str) -> str:
    """The template's fixed text, with every ``{field}`` matching anything."""
    return ".*".join(re.escape(part) for part in re.split(r"\{[a-z_]+\}", template))


def test_every_phrase_has_a_fault() -> None:
    assert set(FAULTS) | {"device_tensor"} == set(REFERENCE_PHRASES)


@pytest.mark.parametrize("name", sorted(FAULTS))
def test_phrase_in_decoder_message(name: str) -> None:
    with pytest.raises(PayloadError) as info:
        decode_header(FAULTS[name])
    assert isinstance(info.value, ValueError)
    assert re.search(as_pattern(REFERENCE_PHRASES[name]), str(info.value)), str(info.value)


@pytest.mark.parametrize("name", sorted(FAULTS))
def test_phrase_through_compat_from_bytes(name: str) -> None:
    with pytest.raises(ValueError, match=as_pattern(REFERENCE_PHRASES[name])):
        KVCacheTransferData.from_bytes(FAULTS[name])


def test_device_tensor_phrase() -> None:
    for bad in (torch.zeros(4, dtype=torch.int32), torch.zeros(2, 2, dtype=torch.uint8), b"\x00" * 8):
        with pytest.raises(PayloadError, match=re.escape(phrase("device_tensor"))):
            KVCacheTransferData.from_bytes_device(bad)


def test_filled_values_appear() -> None:
    with pytest.raises(PayloadError) as info:
        decode_header(FAULTS["span"])
    assert "offset=4096, bytes=12, tensor_data_bytes=12" in str(info.value)
    assert phrase("dtype", dtype="x") == "Unsupported dtype in KV payload: x"
