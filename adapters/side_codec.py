"""A request's KV fields packed for collectives (SPEC 3.2, 6), data-only: msgpack, never pickle.

Wire form: ``[i32 side_len][side bytes][blob 0][blob 1]...`` (framing in
:mod:`kvferry.core.side_payload`). The side bytes are msgpack of
``{"v": 1, "blobs": [nbytes, ...], "fields": {...}}`` where every heavy value in the fields is
replaced by a placeholder (a msgpack ext type holding a blob index):

- a KV cache (an object with ``key_cache``/``value_cache`` lists, ext 1, or a dict with exactly
  those two keys, ext 2) becomes one SPEC 3.1 payload blob;
- any other tensor, at any depth (e.g. a CFG branch's extra tensors), becomes a one-layer SPEC
  3.1 blob (``key_cache_0``; ext 3);
- a ``torch.dtype`` is carried by name (ext 4).

The primary field (``past_key_values`` by default) is packed first, so blob 0, right after the
side bytes, is the primary KV: with no other heavy values the blob region is exactly one SPEC 3.1
payload. CFG branch KV (``cfg_text_past_key_values`` ...) become further blobs. Tuples come back
as lists; dict keys must be strings. Tensors come back as views of the received buffer.
"""

from __future__ import annotations

import itertools
import struct
from collections.abc import Callable, Mapping
from typing import Any

import attrs
import msgpack
import torch

from kvferry.adapters.torch_frames import decode_payload, dtype_name, encode_frames, torch_dtype
from kvferry.core.errors import ConfigError, PayloadError
from kvferry.core.side_payload import SENDER_FAILED, SenderFailed, pack_side_frames, split_side_payload

__all__ = ["KVCacheLists", "SIDE_FORMAT_VERSION", "pack_request_kv", "unpack_request_kv"]

SIDE_FORMAT_VERSION = 1
_KV_OBJECT, _KV_DICT, _TENSOR, _DTYPE = 1, 2, 3, 4
_INDEX = struct.Struct(">I")
_MAX_DEPTH = 32


@attrs.define(eq=False)
class KVCacheLists:
    """The default rebuilt KV object: per-layer ``key_cache`` / ``value_cache`` lists."""

    key_cache: list
    value_cache: list


def _kv_lists(value: Any) -> tuple[int, list, list] | None:
    """``(ext code, keys, values)`` when ``value`` is a KV cache, else None."""
    if isinstance(value, Mapping):
        if set(value) == {"key_cache", "value_cache"}:
            return _KV_DICT, list(value["key_cache"] or ()), list(value["value_cache"] or ())
        return None
    if isinstance(value, (str, bytes, list, tuple, torch.Tensor)) or value is None:
        return None
    keys, values = getattr(value, "key_cache", None), getattr(value, "value_cache", None)
    if isinstance(keys, (list, tuple)) and isinstance(values, (list, tuple)):
        return _KV_OBJECT, list(keys), list(values)
    return None


@attrs.define(eq=False)
class _Packer:
    request_id: str
    align: int
    sizes: list[int] = attrs.Factory(list)
    frames: list[Any] = attrs.Factory(list)

    def blob(self, keys: list, values: list) -> bytes:
        encoded = encode_frames(self.request_id, keys, values, [], {}, align=self.align)
        self.frames.extend(encoded.frames)
        self.sizes.append(encoded.nbytes)
        return _INDEX.pack(len(self.sizes) - 1)

    def walk(self, value: Any, path: str, depth: int = 0) -> Any:
        if depth > _MAX_DEPTH:
            raise ConfigError(f"KV field {path} nests deeper than {_MAX_DEPTH} levels")
        if value is None or isinstance(value, (bool, int, float, str, bytes)):
            return value
        if isinstance(value, torch.Tensor):
            return msgpack.ExtType(_TENSOR, self.blob([value], [None]))
        if isinstance(value, torch.dtype):
            return msgpack.ExtType(_DTYPE, dtype_name(value).encode())
        kv = _kv_lists(value)
        if kv is not None:
            code, keys, values = kv
            if not all(t is None or isinstance(t, torch.Tensor) for t in keys + values):
                raise ConfigError(f"KV field {path} holds a layer that is neither a tensor nor None")
            return msgpack.ExtType(code, self.blob(keys, values))
        if isinstance(value, (list, tuple)):
            return [self.walk(v, f"{path}[{i}]", depth + 1) for i, v in enumerate(value)]
        if isinstance(value, Mapping):
            if not all(isinstance(k, str) for k in value):
                raise ConfigError(f"KV field {path} has a non-string key")
            return {k: self.walk(v, f"{path}.{k}", depth + 1) for k, v in value.items()}
        raise ConfigError(
            f"KV field {path} has a value of type {type(value).__name__} that the side codec cannot carry"
        )


def pack_request_kv(
    fields: Mapping[str, Any], *, primary: str = "past_key_values", request_id: str = "", align: int = 64
) -> list[Any]:
    """Frames whose concatenation is the side payload for ``fields`` (join them for one buffer).

    Raises ConfigError (local misuse) for a value the codec cannot carry, naming the field; the
    caller then falls back or sends the sender-failed message.
    """
    if not isinstance(fields, Mapping) or not all(isinstance(k, str) for k in fields):
        raise ConfigError("KV fields must be a mapping with string keys")
    packer = _Packer(request_id, align)
    order = sorted(fields, key=lambda k: k != primary)  # the primary KV becomes blob 0
    packed = {k: packer.walk(fields[k], k) for k in order}
    try:
        side = msgpack.packb({"v": SIDE_FORMAT_VERSION, "blobs": packer.sizes, "fields": packed}, use_bin_type=True)
    except (OverflowError, TypeError, ValueError) as exc:  # e.g. an integer outside 64 bits
        raise ConfigError(f"KV fields cannot be packed as msgpack: {exc}") from None
    return pack_side_frames(side, packer.frames)


def _as_bytes_view(buf: Any) -> Any:
    if isinstance(buf, (list, tuple)):
        return bytearray().join(f.cpu().numpy().data if isinstance(f, torch.Tensor) else f for f in buf)
    if isinstance(buf, torch.Tensor):
        if buf.dtype != torch.uint8 or buf.dim() != 1:
            raise PayloadError("invalid side payload: a packed tensor must be 1-D uint8")
        return buf if buf.device.type != "cpu" else buf.contiguous().numpy().data
    return buf


def _split_device(data: torch.Tensor) -> tuple[bytes, torch.Tensor] | tuple[memoryview, memoryview] | SenderFailed:
    """Split a device buffer, copying only the prefix and the side bytes to the host."""
    head = bytes(data[:4].cpu().numpy())
    if len(head) < 4:
        return split_side_payload(head)  # empty -> miss, 1-3 bytes -> PayloadError
    side_len = int.from_bytes(head, "big", signed=True)
    if side_len <= 0:
        return SENDER_FAILED
    if 4 + side_len > data.numel():
        raise PayloadError(f"invalid side payload: side_len={side_len} exceeds buffer size={data.numel()}")
    return bytes(data[4 : 4 + side_len].cpu().numpy()), data[4 + side_len :]


def unpack_request_kv(
    buf: Any, *, kv_factory: Callable[[list, list], Any] = KVCacheLists, verify: bool = True
) -> dict[str, Any] | None:
    """The fields packed by :func:`pack_request_kv`, or None when the sender failed.

    ``buf``: bytes-like, a 1-D uint8 tensor (CPU or device; device tensors stay on the device)
    or a sequence of frames (joined: one copy). Malformed input raises PayloadError only.
    """
    data = _as_bytes_view(buf)
    split = _split_device(data) if isinstance(data, torch.Tensor) else split_side_payload(data)
    if isinstance(split, SenderFailed):
        return None
    side, blob_base = split
    blob_len = blob_base.numel() if isinstance(blob_base, torch.Tensor) else len(blob_base)
    try:
        doc = msgpack.unpackb(side, raw=False, ext_hook=lambda code, raw: ("\0ext", code, raw))
    except (ValueError, TypeError, RecursionError, OverflowError) as exc:
        raise PayloadError(f"invalid side payload: side bytes are not msgpack ({exc})") from None
    if not isinstance(doc, dict) or doc.get("v") != SIDE_FORMAT_VERSION:
        raise PayloadError("invalid side payload: unknown side format")
    sizes, fields = doc.get("blobs"), doc.get("fields")
    if not isinstance(sizes, list) or not all(type(s) is int and s >= 0 for s in sizes) or not isinstance(fields, dict):
        raise PayloadError("invalid side payload: malformed blob table or fields")
    if sum(sizes) != blob_len:
        raise PayloadError(f"invalid side payload: blobs total {sum(sizes)} bytes, {blob_len} present")
    starts = list(itertools.accumulate(sizes, initial=0))  # linear: the table may be long
    decoded: dict[int, Any] = {}

    def blob(raw: bytes) -> Any:
        if len(raw) != 4 or (index := _INDEX.unpack(raw)[0]) >= len(sizes):
            raise PayloadError("invalid side payload: placeholder names no blob")
        if index not in decoded:
            decoded[index] = decode_payload(blob_base[starts[index] : starts[index] + sizes[index]], verify=verify)
        return decoded[index]

    def restore(value: Any) -> Any:
        if isinstance(value, list):
            return [restore(v) for v in value]
        if isinstance(value, dict):
            return {k: restore(v) for k, v in value.items()}
        if not (isinstance(value, tuple) and len(value) == 3 and value[0] == "\0ext"):
            return value
        _, code, raw = value
        if code == _DTYPE:
            try:
                return torch_dtype(raw.decode())
            except UnicodeDecodeError:
                raise PayloadError("invalid side payload: bad dtype name") from None
        if code == _TENSOR:
            kv = blob(raw)
            if kv.num_layers != 1 or kv.key_cache[0] is None:
                raise PayloadError("invalid side payload: tensor blob is not one tensor")
            return kv.key_cache[0]
        if code in (_KV_OBJECT, _KV_DICT):
            kv = blob(raw)
            keys, values = list(kv.key_cache), list(kv.value_cache)
            return kv_factory(keys, values) if code == _KV_OBJECT else {"key_cache": keys, "value_cache": values}
        raise PayloadError(f"invalid side payload: unknown placeholder type {code}")

    return {k: restore(v) for k, v in fields.items()}
