"""A data-only object codec for collectives (SPEC 3.2, 6): msgpack, never pickle.

Supported: None, bool, int, float, str, bytes, lists, tuples (kept as tuples), dicts, and
tensors (sent as dtype / shape / bytes; decoded on CPU). Anything else is refused on the
sending side (ConfigError, a local misuse); malformed bytes from a peer raise PayloadError only.
"""

from __future__ import annotations

import math
from typing import Any

import msgpack

from kvferry.core.errors import ConfigError, PayloadError
from kvferry.core.header import DTYPE_ITEMSIZE

__all__ = ["MAX_OBJECT_BYTES", "encode_object", "decode_object"]

#: Largest encoded object (bytes) a group sends or accepts: bounds what a peer can make us allocate.
MAX_OBJECT_BYTES = 8 << 30
_EXT_TENSOR, _EXT_TUPLE = 1, 2


def _torch() -> Any:
    import torch

    return torch


def _default(obj: Any) -> Any:
    torch = _torch()
    if isinstance(obj, tuple):
        return msgpack.ExtType(_EXT_TUPLE, _pack(list(obj)))
    if isinstance(obj, torch.Tensor):
        name = str(obj.dtype).removeprefix("torch.")
        if name not in DTYPE_ITEMSIZE:
            raise ConfigError(f"tensor dtype {obj.dtype} cannot be sent (allow-list: {sorted(DTYPE_ITEMSIZE)})")
        t = obj.detach().cpu().resolve_conj().resolve_neg().contiguous()
        data = t.reshape(-1).view(torch.uint8).numpy().tobytes()
        return msgpack.ExtType(_EXT_TENSOR, _pack([name, list(t.shape), data]))
    base: type[Any]
    for base in (bool, int, float, str, bytes, list, dict):  # subclasses (IntEnum, OrderedDict...)
        if isinstance(obj, base):
            return base(obj)
    raise ConfigError(f"object of type {type(obj).__name__} cannot be sent by the data-only codec")


def _pack(obj: Any) -> bytes:
    return msgpack.packb(obj, default=_default, use_bin_type=True, strict_types=True)


def encode_object(obj: Any) -> bytes:
    """Encode ``obj`` as msgpack; ConfigError for anything but plain data and tensors."""
    try:
        return _pack(obj)
    except (TypeError, ValueError, OverflowError) as exc:
        if isinstance(exc, ConfigError):
            raise
        raise ConfigError(f"object cannot be sent by the data-only codec: {exc}") from exc


def _tensor_from(fields: Any) -> Any:
    torch = _torch()
    if not (isinstance(fields, list) and len(fields) == 3):
        raise PayloadError("invalid object: tensor entry is not [dtype, shape, bytes]")
    name, shape, data = fields
    if name not in DTYPE_ITEMSIZE or not isinstance(getattr(torch, name, None), torch.dtype):
        raise PayloadError(f"invalid object: tensor dtype {name!r} is not allowed")
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
        raise PayloadError(f"invalid object: tensor shape {shape!r}")
    if not isinstance(data, bytes) or len(data) != math.prod(shape) * DTYPE_ITEMSIZE[name]:
        raise PayloadError(f"invalid object: tensor of {name}{shape} does not match its byte count")
    if not data:
        return torch.empty(shape, dtype=getattr(torch, name))
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(getattr(torch, name)).reshape(shape)


def _ext_hook(code: int, data: bytes) -> Any:
    if code == _EXT_TUPLE:
        return tuple(_unpack(data))
    if code == _EXT_TENSOR:
        return _tensor_from(_unpack(data))
    raise PayloadError(f"invalid object: unknown extension type {code}")


def _unpack(data: Any) -> Any:
    return msgpack.unpackb(data, ext_hook=_ext_hook, raw=False, strict_map_key=False, use_list=True)


def decode_object(data: Any) -> Any:
    """Decode bytes from :func:`encode_object`; PayloadError for anything malformed."""
    try:
        return _unpack(bytes(data))
    except PayloadError:
        raise
    except (ValueError, TypeError, msgpack.UnpackException, RecursionError) as exc:
        raise PayloadError(f"invalid object: {exc}") from exc
