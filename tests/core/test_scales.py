"""FP8 scales as payload metadata: validated, cut with heads, merged on fan-in, exact through JSON."""

from __future__ import annotations

import json
import struct

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvferry.core.errors import ConfigError, PayloadError
from kvferry.core.scales import (
    fp8_format,
    merge_scales,
    read_scales,
    scales_mismatch,
    scales_record,
    slice_scales,
)


def _f32(x: float) -> float:
    return struct.unpack("<f", struct.pack("<f", x))[0]


def test_float32_scales_survive_the_json_header_bit_for_bit() -> None:
    k = [_f32(0.0123456789 * (i + 1)) for i in range(4)]
    rec = scales_record("layer", k, [_f32(x * 3.3) for x in k])
    back = read_scales({"kv_scales": json.loads(json.dumps(rec, separators=(",", ":")))})
    assert back is not None
    assert [struct.pack("<f", x) for x in back["k_scale"]] == [struct.pack("<f", x) for x in k]


def test_per_head_scales_are_cut_and_merged_back() -> None:
    full = scales_record("head", [[1.0, 2.0, 3.0, 4.0], None], [[5.0, 6.0, 7.0, 8.0], None])
    left, right = slice_scales(full, 0, 2), slice_scales(full, 2, 4)
    assert left["k_scale"] == [[1.0, 2.0], None] and right["v_scale"] == [[7.0, 8.0], None]
    assert merge_scales([left, right], [2, 2]) == full


def test_layer_scales_that_differ_merge_into_head_scales() -> None:
    a, b = scales_record("layer", [1.0], [2.0]), scales_record("layer", [3.0], [4.0])
    assert merge_scales([a, b], [2, 1]) == {
        "granularity": "head",
        "k_scale": [[1.0, 1.0, 3.0]],
        "v_scale": [[2.0, 2.0, 4.0]],
    }
    assert merge_scales([a, a], [2, 2]) == a
    blocks = scales_record("block", [[1.0, 2.0]], [[3.0, 4.0]])
    assert slice_scales(blocks, 0, 1) == blocks and merge_scales([blocks, blocks], [1, 1]) == blocks


def test_bad_scales() -> None:
    with pytest.raises(ConfigError, match="granularity"):
        scales_record("token", [1.0], [1.0])
    with pytest.raises(ConfigError, match=r"kv_scales.k_scale\[0\] must be a finite number"):
        scales_record("layer", [float("nan")], [1.0])
    with pytest.raises(ConfigError, match="k_scale has 2 layers, v_scale 1"):
        scales_record("layer", [1.0, 1.0], [1.0])
    with pytest.raises(PayloadError, match="malformed kv_scales"):
        read_scales({"kv_scales": {"granularity": "x"}})
    with pytest.raises(PayloadError, match="some merged shards"):
        merge_scales([scales_record("layer", [1.0], [1.0]), None], [1, 1])
    assert read_scales({}) is None and merge_scales([None, None], [1, 1]) is None


_scale = st.integers(1, 2**24).map(lambda i: _f32(i / 4096))  # float32 scales (no float strategy: FTZ here)


@given(k=st.lists(_scale, min_size=1, max_size=8), data=st.data())
def test_equal_scales_through_the_header_match_and_any_changed_layer_is_named(k: list[float], data) -> None:
    v = data.draw(st.lists(_scale, min_size=len(k), max_size=len(k)))
    names = [f"model.layers.{i}.self_attn.attn" for i in range(len(k))]
    sent = read_scales({"kv_scales": json.loads(json.dumps(scales_record("layer", k, v)))})
    assert scales_mismatch(sent, k, v, names) is None
    i = data.draw(st.integers(0, len(k) - 1))
    which = data.draw(st.sampled_from(["k", "v"]))
    other = data.draw(_scale.filter(lambda x: x != (k if which == "k" else v)[i]))
    mine_k = [other if (j == i and which == "k") else x for j, x in enumerate(k)]
    mine_v = [other if (j == i and which == "v") else x for j, x in enumerate(v)]
    why = scales_mismatch(sent, mine_k, mine_v, names)
    assert why is not None and f"layer {i} ({names[i]})" in why and repr(other) in why


def test_scales_that_cannot_be_compared_say_why() -> None:
    rec = scales_record("layer", [0.5, 0.25], [1.0, 2.0])
    assert "no kv_scales" in (scales_mismatch(None, [0.5], [1.0]) or "")
    assert "cover 2 layers, this cache has 3" in (scales_mismatch(rec, [0.5, 0.25, 1.0], [1.0, 2.0, 1.0]) or "")
    assert "per 'head'" in (scales_mismatch(scales_record("head", [[0.5]], [[1.0]]), [0.5], [1.0]) or "")
    assert "v_scale" in (scales_mismatch(scales_record("layer", [0.5, 0.25], None), [0.5, 0.25], [1.0, 2.0]) or "")
    assert scales_mismatch(rec, [0.5, 0.25], [1.0, 2.0]) is None


def test_fp8_formats_are_vllms_cache_dtypes() -> None:
    assert [fp8_format(x) for x in ("fp8", "FP8_e4m3", "fp8_e5m2")] == ["fp8_e4m3", "fp8_e4m3", "fp8_e5m2"]
    assert [fp8_format(x) for x in ("auto", "bfloat16", "fp8_ds_mla", "int8_per_token_head", None)] == [None] * 5
