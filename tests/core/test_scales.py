"""FP8 scales as payload metadata: validated, cut with heads, merged on fan-in, exact through JSON."""

from __future__ import annotations

import json
import struct

import pytest

from kvferry.core.errors import ConfigError, PayloadError
from kvferry.core.scales import merge_scales, read_scales, scales_record, slice_scales


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
