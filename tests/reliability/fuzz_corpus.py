"""Seed corpus and mutators for the decoder fuzz tests (built in memory, never committed).

Seeds are valid payloads: the reference layout (``align=1``, no version, no checksums, so the
bytes the reference's ``to_bytes`` writes) and kvferry's (aligned, versioned, some with crc32),
absent layers, empty tensors, every allow-listed dtype, and side payloads (SPEC 3.2) carrying a
request's KV fields. Mutators are deterministic functions of a ``random.Random``: byte flips,
splices, truncations, length-prefix lies and JSON-aware edits of the header (huge numbers,
negative offsets, wrong types, deep nesting).
"""

from __future__ import annotations

import functools
import json
import random
import struct
from collections.abc import Callable
from typing import Any

import torch

from kvferry.adapters.side_codec import pack_request_kv
from kvferry.adapters.torch_frames import TORCH_DTYPES, encode_bytes

__all__ = ["Seed", "build_seeds", "build_side_seeds", "mutate", "header_end", "MUTATORS"]

_DTYPES = sorted(TORCH_DTYPES)


class Seed:
    """One valid input: ``raw`` bytes and a label saying how it was built."""

    __slots__ = ("raw", "label")

    def __init__(self, raw: bytes, label: str) -> None:
        self.raw = raw
        self.label = label


def _tensor(rng: random.Random, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    n = 1
    for d in shape:
        n *= d
    raw = bytes(rng.getrandbits(8) for _ in range(n * dtype.itemsize))
    return (
        torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype).reshape(shape)
        if n
        else torch.empty(shape, dtype=dtype)
    )


def _kv(rng: random.Random, layers: int, dtype: torch.dtype, absent: float) -> tuple[list, list]:
    tokens, heads, dim = rng.randrange(0, 4), rng.randrange(1, 3), rng.choice((1, 2, 4))
    keys = [None if rng.random() < absent else _tensor(rng, dtype, (tokens, heads, dim)) for _ in range(layers)]
    values = [None if rng.random() < absent else _tensor(rng, dtype, (tokens, heads, dim)) for _ in range(layers)]
    return keys, values


def build_seeds(count: int = 48, seed: int = 7) -> list[Seed]:
    """Valid KV payloads of both layouts; all dtypes appear, a third carry crc32 checksums."""
    rng = random.Random(seed)
    out: list[Seed] = []
    for i in range(count):
        dtype = TORCH_DTYPES[_DTYPES[i % len(_DTYPES)]]
        keys, values = _kv(rng, rng.randrange(0, 4), dtype, 0.2)
        bids = [rng.randrange(0, 1000) for _ in range(rng.randrange(0, 5))]
        meta = {"seq_len": rng.randrange(100), "block_size": 16, "dtype": str(dtype), "note": "é"}
        if i % 2 == 0:  # the reference layout: packed, no extensions
            raw = encode_bytes(f"req-{i}", keys, values, bids, meta, align=1, version=False)
            out.append(Seed(raw, "reference"))
        else:
            checksums = "crc32" if i % 3 == 1 else None
            raw = encode_bytes(f"req-{i}", keys, values, bids, meta, align=rng.choice((8, 64)), checksums=checksums)
            out.append(Seed(raw, "kvferry+crc32" if checksums else "kvferry"))
    return out


def build_side_seeds(count: int = 12, seed: int = 11) -> list[Seed]:
    """Valid side payloads (SPEC 3.2): primary KV, CFG branch KV, extra tensors, dtypes."""
    rng = random.Random(seed)
    out: list[Seed] = []
    for i in range(count):
        keys, values = _kv(rng, rng.randrange(1, 3), torch.float16, 0.1)
        fields: dict[str, Any] = {
            "past_key_values": {"key_cache": keys, "value_cache": values},
            "kv_metadata": {"seq_len": i, "tags": ["a", i]},
        }
        if i % 2:
            bk, bv = _kv(rng, 1, torch.bfloat16, 0.0)
            fields["cfg_text_past_key_values"] = {"key_cache": bk, "value_cache": bv}
            fields["cfg_text_kv_metadata"] = {"dtype": torch.bfloat16, "extra": _tensor(rng, torch.int32, (2,))}
        out.append(Seed(bytes(bytearray().join(pack_request_kv(fields, request_id=f"r{i}"))), "side"))
    return out


def header_end(raw: bytes) -> int:
    """End of the JSON header of a KV payload (clamped to the input)."""
    if len(raw) < 4:
        return len(raw)
    return min(len(raw), 4 + struct.unpack(">I", raw[:4])[0])


# ----------------------------------------------------------------------------------- mutators
_INTERESTING = (
    0,
    1,
    -1,
    2**31 - 1,
    2**31,
    2**32 - 1,
    2**32,
    2**63 - 1,
    2**63,
    2**64,
    -(2**63),
    10**30,
    1.5,
    float("1e308"),
)
_JUNK_VALUES = (None, True, "x", [], {}, [[[]]], {"n": 1}, "key_cache_0", "float128", 1e400)


def _flip(rng: random.Random, raw: bytes, peers: list[bytes]) -> bytes:
    out = bytearray(raw)
    if out:
        limit = header_end(raw) if rng.random() < 0.8 else len(out)
        for _ in range(rng.randrange(1, 4)):
            pos = rng.randrange(max(1, limit))
            if pos < len(out):
                out[pos] ^= 1 << rng.randrange(8)
    return bytes(out)


def _set_byte(rng: random.Random, raw: bytes, peers: list[bytes]) -> bytes:
    out = bytearray(raw)
    if out:
        pos = rng.randrange(max(1, header_end(raw)))
        if pos < len(out):
            out[pos] = rng.choice(b'0123456789-"{}[],:eE.\\ \x00\x80\xff')
    return bytes(out)


def _truncate(rng: random.Random, raw: bytes, peers: list[bytes]) -> bytes:
    return raw[: rng.randrange(len(raw) + 1)]


def _insert_delete(rng: random.Random, raw: bytes, peers: list[bytes]) -> bytes:
    pos = rng.randrange(len(raw) + 1)
    if rng.random() < 0.5:
        return raw[:pos] + bytes(rng.getrandbits(8) for _ in range(rng.randrange(1, 9))) + raw[pos:]
    return raw[:pos] + raw[pos + rng.randrange(1, 9) :]


def _prefix_lie(rng: random.Random, raw: bytes, peers: list[bytes]) -> bytes:
    claim = rng.choice((0, 1, 3, header_end(raw) - 5, header_end(raw), len(raw), 2**31, 2**32 - 1, rng.getrandbits(32)))
    return struct.pack(">I", claim % 2**32) + raw[4:]


def _splice(rng: random.Random, raw: bytes, peers: list[bytes]) -> bytes:
    other = rng.choice(peers)
    return (
        raw[: header_end(raw)] + other[header_end(other) :]
        if rng.random() < 0.5
        else other[: header_end(other)] + raw[header_end(raw) :]
    )


@functools.lru_cache(maxsize=512)
def _slot_paths(header: bytes) -> tuple[tuple[Any, ...], ...] | None:
    """Paths (keys / indices from the root) of every value in a JSON header; None if not JSON."""
    try:
        obj = json.loads(header.decode("utf-8"))
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None
    paths: list[tuple[Any, ...]] = []
    stack: list[tuple[Any, tuple[Any, ...]]] = [(obj, ())]
    while stack:
        node, path = stack.pop()
        items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
        for k, v in items:
            paths.append(path + (k,))
            stack.append((v, path + (k,)))
    return tuple(paths)


def _json_edit(rng: random.Random, raw: bytes, peers: list[bytes]) -> bytes:
    """Replace one value of the JSON header (any depth) by an interesting number or junk."""
    end = header_end(raw)
    paths = _slot_paths(bytes(raw[4:end]))
    if not paths:
        return _flip(rng, raw, peers)
    obj = json.loads(raw[4:end].decode("utf-8"))
    *parents, key = rng.choice(paths)
    parent = obj
    for step in parents:
        parent = parent[step]
    choice = rng.random()
    if choice < 0.5:
        parent[key] = rng.choice(_INTERESTING)
    elif choice < 0.8:
        parent[key] = rng.choice(_JUNK_VALUES)
    elif isinstance(parent, dict):
        del parent[key]
    else:
        parent.append(parent[key])
    body = json.dumps(obj, separators=(",", ":")).encode()
    return struct.pack(">I", len(body)) + body + raw[end:]


def _deep(rng: random.Random, raw: bytes, peers: list[bytes]) -> bytes:
    """A header nesting far deeper than the JSON parser's recursion limit."""
    depth = rng.choice((100, 2000, 2000, 100_000)) if rng.random() < 0.3 else 50
    body = b'{"rid":"r","bids":[],"meta":' + b"[" * depth + b"]" * depth + b',"td":[],"nl":0}'
    return struct.pack(">I", len(body)) + body


MUTATORS: tuple[Callable[[random.Random, bytes, list[bytes]], bytes], ...] = (
    _flip,
    _flip,
    _set_byte,
    _set_byte,
    _truncate,
    _insert_delete,
    _prefix_lie,
    _splice,
    _json_edit,
    _json_edit,
    _json_edit,
    _deep,
)


def mutate(rng: random.Random, raw: bytes, peers: list[bytes]) -> bytes:
    """One to three stacked mutations of ``raw`` (``peers``: other seeds for splicing)."""
    for _ in range(1 if rng.random() < 0.7 else rng.randrange(2, 4)):
        raw = rng.choice(MUTATORS)(rng, raw, peers)
    return raw
