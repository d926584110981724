"""FP8 KV cache scales as payload metadata: built, cut with the heads, merged on fan-in.

An FP8 cache (``float8_e4m3fn``, ``float8_e5m2``) is only readable with its dequantisation
scales. kvferry carries them in the payload's metadata under ``kv_scales`` (so the reference's
decoder, which ignores metadata it does not know, still reads the payload)::

    {"granularity": "layer" | "head" | "block",
     "k_scale": [per layer: one number | one number per head of the payload | one per block],
     "v_scale": [same shape as k_scale]}

- ``layer``: one scale per layer (vLLM's ``k_scale``/``v_scale``);
- ``head``: one scale per KV head the payload carries, per layer; cut with the heads
  (:func:`slice_scales`) and concatenated on fan-in (:func:`merge_scales`);
- ``block``: one scale per block the payload carries (the request's valid block ids, in order),
  per layer; identical on every rank of a TP group for one request, so never cut.

Numbers are JSON numbers: a float32 scale becomes a Python float exactly, and the codec's
``repr`` round trip is exact, so scales arrive bit for bit. Non-finite scales are refused.
On fan-in, ``layer`` scales that differ between the merged shards become ``head`` scales (each
head keeps its sender's scale), so nothing is lost.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from kvferry.core.errors import ConfigError, KVFerryError, PayloadError
from kvferry.core.validate import check_number

__all__ = [
    "KV_SCALES_KEY",
    "GRANULARITIES",
    "FP8_FORMATS",
    "scales_record",
    "slice_scales",
    "merge_scales",
    "read_scales",
    "fp8_format",
    "scales_mismatch",
]

#: Metadata key of the scales record.
KV_SCALES_KEY = "kv_scales"
GRANULARITIES = ("layer", "head", "block")
#: vLLM's per-tensor FP8 ``kv_cache_dtype`` names -> the format of the cache's bytes.
FP8_FORMATS = {"fp8": "fp8_e4m3", "fp8_e4m3": "fp8_e4m3", "fp8_e5m2": "fp8_e5m2"}


def _number(where: str, value: Any, error: type[KVFerryError]) -> float:
    return check_number(where, value, error, expected="a finite number")


def _layer_entries(where: str, granularity: str, values: Any, error: type[KVFerryError]) -> list[Any]:
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
        raise error(f"{where} must be a list with one entry per layer, got {type(values).__name__}")
    out: list[Any] = []
    for i, entry in enumerate(values):
        if entry is None:  # an absent layer
            out.append(None)
        elif granularity == "layer":
            out.append(_number(f"{where}[{i}]", entry, error))
        else:
            if isinstance(entry, (str, bytes)) or not isinstance(entry, Sequence):
                raise error(f"{where}[{i}] must be a list of numbers ({granularity} scales), got {entry!r}")
            out.append([_number(f"{where}[{i}][{j}]", x, error) for j, x in enumerate(entry)])
    return out


def scales_record(granularity: str, k_scale: Sequence[Any], v_scale: Sequence[Any] | None) -> dict[str, Any]:
    """The ``kv_scales`` record (JSON-able). ``v_scale`` None for a cache without values (MLA).

    ConfigError naming the field for an unknown granularity, a non-finite scale or K and V
    lists of different lengths."""
    if granularity not in GRANULARITIES:
        raise ConfigError(f"kv_scales.granularity must be one of {GRANULARITIES}, got {granularity!r}")
    k = _layer_entries("kv_scales.k_scale", granularity, k_scale, ConfigError)
    record: dict[str, Any] = {"granularity": granularity, "k_scale": k}
    if v_scale is not None:
        v = _layer_entries("kv_scales.v_scale", granularity, v_scale, ConfigError)
        if len(v) != len(k):
            raise ConfigError(f"kv_scales: k_scale has {len(k)} layers, v_scale {len(v)}")
        record["v_scale"] = v
    return record


def read_scales(metadata: Any) -> dict[str, Any] | None:
    """The validated scales record of received metadata (None when absent); PayloadError
    (remote data) when it is malformed."""
    if not isinstance(metadata, Mapping) or KV_SCALES_KEY not in metadata:
        return None
    rec = metadata[KV_SCALES_KEY]
    if not isinstance(rec, Mapping) or rec.get("granularity") not in GRANULARITIES or "k_scale" not in rec:
        raise PayloadError(f"malformed {KV_SCALES_KEY} metadata: {rec!r}")
    gran = rec["granularity"]
    out: dict[str, Any] = {
        "granularity": gran,
        "k_scale": _layer_entries("kv_scales.k_scale", gran, rec["k_scale"], PayloadError),
    }
    if rec.get("v_scale") is not None:
        out["v_scale"] = _layer_entries("kv_scales.v_scale", gran, rec["v_scale"], PayloadError)
    return out


def slice_scales(record: Mapping[str, Any], head_start: int, head_stop: int) -> dict[str, Any]:
    """The record for the heads ``head_start:head_stop`` of the payload's shard: per-head scales
    are cut, per-layer and per-block scales are kept."""
    out = dict(record)
    if record["granularity"] != "head":
        return out
    for name in ("k_scale", "v_scale"):
        if name in record:
            out[name] = [None if e is None else list(e[head_start:head_stop]) for e in record[name]]
    return out


def merge_scales(records: Sequence[Mapping[str, Any] | None], heads: Sequence[int]) -> dict[str, Any] | None:
    """One record for shards concatenated on the head dim, in merge order; ``heads[i]`` is the
    number of heads shard ``i`` carries. None when no shard has scales; PayloadError when only
    some do or granularities cannot be combined."""
    if all(r is None for r in records):
        return None
    if any(r is None for r in records):
        raise PayloadError("some merged shards carry kv_scales and others do not")
    recs = [r for r in records if r is not None]
    if len(recs) == 1:
        return dict(recs[0])
    grans = {r["granularity"] for r in recs}
    if grans == {"block"} or (grans == {"layer"} and all(_same(r, recs[0]) for r in recs)):
        return dict(recs[0])
    if "block" in grans:
        raise PayloadError(f"cannot merge per-block kv_scales with {sorted(grans - {'block'})} scales")
    names = [n for n in ("k_scale", "v_scale") if n in recs[0]]
    out: dict[str, Any] = {"granularity": "head"}
    for name in names:
        layers = len(recs[0][name])
        merged: list[Any] = []
        for layer in range(layers):
            row: list[float] = []
            present = False
            for rec, count in zip(recs, heads):
                entry = rec[name][layer] if layer < len(rec[name]) else None
                if entry is None:
                    continue
                present = True
                row.extend(list(entry) if rec["granularity"] == "head" else [entry] * count)
            merged.append(row if present else None)
        out[name] = merged
    return out


def _same(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    return all(a.get(n) == b.get(n) for n in ("k_scale", "v_scale"))


def fp8_format(cache_dtype: Any) -> str | None:
    """The format of an FP8 cache's bytes (``fp8_e4m3``, ``fp8_e5m2``) for vLLM's
    ``kv_cache_dtype`` (``fp8`` is ``fp8_e4m3``, as vLLM maps it); None for any other."""
    if not isinstance(cache_dtype, str):
        return None
    return FP8_FORMATS.get(cache_dtype.strip().lower())


def scales_mismatch(
    received: Mapping[str, Any] | None,
    k_scale: Sequence[float],
    v_scale: Sequence[float | None] | None,
    names: Sequence[str] | None = None,
) -> str | None:
    """Why an FP8 cache's per-layer scales (``k_scale[i]``/``v_scale[i]`` of layer ``i``; the
    receiver's own) cannot read pages quantised with the ``received`` record (the sender's,
    :func:`read_scales` of its payload), or None when they can: the record is per layer, has
    one entry per layer and every layer's scales are equal, bit for bit (JSON numbers round-trip
    exactly). The first layer that differs is named (``names[i]`` when given) with both sides'
    numbers. Pure; both sides' numbers come from here."""
    if received is None:
        return "the sender's pages carry no kv_scales, this cache is FP8 (its scales are needed to read them)"
    if received.get("granularity") != "layer":
        return f"the sender's kv_scales are per {received.get('granularity')!r}, this cache's are per layer"
    theirs_k = list(received.get("k_scale") or ())
    theirs_v = list(received.get("v_scale") or ()) if received.get("v_scale") is not None else None
    if len(theirs_k) != len(k_scale):
        return f"the sender's kv_scales cover {len(theirs_k)} layers, this cache has {len(k_scale)}"
    if (theirs_v is None) != (v_scale is None) or (theirs_v is not None and len(theirs_v) != len(theirs_k)):
        return "the sender's kv_scales and this cache's differ in having v_scale"
    for i, mine_k in enumerate(k_scale):
        mine_v = v_scale[i] if v_scale is not None else None
        their_v = theirs_v[i] if theirs_v is not None else None
        if theirs_k[i] != mine_k or their_v != mine_v:
            name = f" ({names[i]})" if names is not None and i < len(names) else ""
            return (
                f"layer {i}{name}: the sender's k_scale {theirs_k[i]!r} v_scale {their_v!r}, "
                f"this cache's k_scale {mine_k!r} v_scale {mine_v!r}"
            )
    return None
