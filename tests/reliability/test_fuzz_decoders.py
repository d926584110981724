"""Decoder fuzzing (SPEC 3.1, 3.2): hostile bytes get PayloadError, never anything else.

- the seed corpus (reference and kvferry layouts, side payloads) decodes bit-exact, so the
  mutations start from meaningful inputs;
- 100,000 mutated inputs through ``decode_payload`` (bytes, split frames, uint8 tensors) and
  ``unpack_request_kv``: only PayloadError escapes; accepted payloads hand out only bytes of the
  input; the run is bounded by a pytest timeout (a hang fails it);
- allocation: a tracemalloc sample of the mutated inputs stays within a small multiple of the
  input's size (the header is copied to text once for the JSON parser);
  length claims (header length, shapes, offsets, side lengths, blob tables) far
  beyond the input allocate nothing; the JSON parse of a header is bounded by the header limit;
- hypothesis builds structurally odd headers (any JSON values in any field).
"""

from __future__ import annotations

import json
import pathlib
import random
import struct
import time
import tracemalloc
from typing import Any

import msgpack
import pytest
import torch
from fuzz_corpus import build_seeds, build_side_seeds, mutate
from fuzz_target import Verdict, decode_kv, decode_side, fuzz_one, run_loop
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvferry.adapters.side_codec import unpack_request_kv
from kvferry.adapters.torch_frames import decode_payload
from kvferry.core.errors import PayloadError
from kvferry.core.header import DecodeLimits

FUZZ_INPUTS = 100_000
FUZZ_SEED = 20240601
HERE = pathlib.Path(__file__).resolve().parent
#: Allowance for Python bookkeeping of one decode (attrs objects, small lists), bytes.
OVERHEAD = 64 * 1024


@pytest.fixture(scope="module")
def seeds() -> list[bytes]:
    return [s.raw for s in build_seeds()]


@pytest.fixture(scope="module")
def side_seeds() -> list[bytes]:
    return [s.raw for s in build_side_seeds()]


def test_seed_corpus_is_valid_in_both_layouts(seeds: list[bytes], side_seeds: list[bytes]) -> None:
    labels = {s.label for s in build_seeds()}
    assert labels == {"reference", "kvferry", "kvferry+crc32"}
    for raw in seeds:
        kv = decode_payload(raw)
        assert kv.nbytes == len(raw) and kv.request_id.startswith("req-")
        again = decode_payload([raw[:5], raw[5:]])  # frames: same tensors
        for a, b in zip((*kv.key_cache, *kv.value_cache), (*again.key_cache, *again.value_cache)):
            assert (a is None and b is None) or torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    for raw in side_seeds:
        fields = unpack_request_kv(raw)
        assert fields is not None and "past_key_values" in fields


@pytest.mark.timeout(120)
def test_100k_mutated_inputs_raise_only_payload_error(tmp_path: pathlib.Path) -> None:
    # two shards at once, one per core: half of the inputs in a child process (its own seed)
    import warm_spawn

    half = FUZZ_INPUTS // 2
    out_path = tmp_path / "shard.json"
    with open(out_path, "w") as out, open(tmp_path / "shard.log", "w") as log:
        child = warm_spawn.popen(
            ["fuzz_target.py", "--shard", str(FUZZ_INPUTS - half), str(FUZZ_SEED + 1)],
            stdout=out,
            stderr=log,
            cwd=str(HERE),
        )
    try:
        verdict, seconds = run_loop(half, seed=FUZZ_SEED)
        code = child.wait(timeout=100)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(timeout=10)
    assert code == 0, (tmp_path / "shard.log").read_text()[-3000:]
    shard = json.loads(out_path.read_text())
    for name in ("inputs", "accepted", "rejected", "misses"):
        setattr(verdict, name, getattr(verdict, name) + shard[name])
    seconds = max(seconds, shard["seconds"])
    print(f"\ndecoder fuzz: {verdict.as_dict()} in {seconds:.1f} s ({verdict.inputs / seconds:,.0f} inputs/s)")
    assert verdict.inputs >= FUZZ_INPUTS
    assert verdict.rejected > verdict.inputs // 2  # the mutations do hit the validation
    assert verdict.accepted > verdict.inputs // 50  # and some mutated payloads stay valid


def _peak_alloc(fn: Any) -> int:
    """Peak Python allocation (bytes) while ``fn`` runs, above what was live before."""
    tracemalloc.reset_peak()
    before = tracemalloc.get_traced_memory()[0]
    fn()
    return tracemalloc.get_traced_memory()[1] - before


def test_allocation_of_a_mutated_sample_is_bounded_by_the_input(seeds: list[bytes], side_seeds: list[bytes]) -> None:
    rng = random.Random(99)
    worst = 0.0
    tracemalloc.start()
    try:
        for i in range(400):
            pool = side_seeds if i % 4 == 3 else seeds
            data = mutate(rng, rng.choice(pool), pool)
            verdict = Verdict()
            run = (
                (lambda: decode_side(data, verdict, i % 3))
                if pool is side_seeds
                else (lambda: decode_kv(data, verdict, i % 3))
            )
            peak = _peak_alloc(run)
            # a header is copied up to three times (joined from frames, bytes, str for the JSON
            # parser); a tensor input is copied once into a bytearray by the harness itself
            allowed = len(data) * 5 + OVERHEAD
            if peak > allowed:
                # tracemalloc counts every thread's allocations, so another thread running in the
                # window can push the peak over (seen once in a whole run, 83,637 B against 68,561,
                # and not in four reruns). A second decode of the same bytes allocates the same.
                peak = min(peak, _peak_alloc(run))
            assert peak <= allowed, (peak, len(data), data[:200])
            if len(data) >= 4096:
                worst = max(worst, peak / len(data))
    finally:
        tracemalloc.stop()
    print(f"\nworst allocation / input size over the sample (inputs >= 4 KiB): {worst:.2f}")


def _header(obj: dict[str, Any]) -> bytes:
    body = json.dumps(obj, separators=(",", ":")).encode()
    return struct.pack(">I", len(body)) + body


def _desc(**fields: Any) -> dict[str, Any]:
    return {"n": "key_cache_0", "i": 0, "d": "float32", "s": [1], "o": 0, "b": 4, **fields}


def _kv_header(td: list, nl: int = 1) -> bytes:
    return _header({"rid": "r", "bids": [], "meta": {}, "td": td, "nl": nl})


def _side(doc: Any, tail: bytes = b"") -> bytes:
    side = msgpack.packb(doc, use_bin_type=True)
    return struct.pack(">i", len(side)) + side + tail


HOSTILE_CLAIMS = {
    "header_len 4 GiB": struct.pack(">I", 2**32 - 1) + b"{}",
    "header_len past the input": struct.pack(">I", 10_000) + b'{"rid":"r"}',
    "shape of 2**40 floats over 4 bytes": _kv_header([_desc(s=[2**40], b=2**42)]) + b"\0" * 4,
    "nbytes 2**62": _kv_header([_desc(s=[2**60], b=2**62)]) + b"\0" * 4,
    "offset 2**62": _kv_header([_desc(o=2**62)]) + b"\0" * 4,
    "empty tensor, huge other dims": _kv_header([_desc(s=[0, 2**40, 2**40], b=0)]),
    "empty tensor, 2**62 wide": _kv_header([_desc(s=[0, 2**62, 4], b=0)]),
    "64 dims": _kv_header([_desc(s=[1] * 64, b=4)]) + b"\0" * 4,
    "65 dims": _kv_header([_desc(s=[1] * 65, b=4)]) + b"\0" * 4,
    "nl 2**40": _kv_header([], nl=2**40),
    "layer index 2**40": _kv_header([_desc(i=2**40)], nl=1) + b"\0" * 4,
    "side_len 2**31-1": struct.pack(">i", 2**31 - 1) + b"\x80",
    "blob table of 2**62": _side({"v": 1, "blobs": [2**62], "fields": {}}),
    "msgpack array claiming 2**32-1 items": struct.pack(">i", 5) + b"\xdd\xff\xff\xff\xff",
    "msgpack bin claiming 4 GiB": struct.pack(">i", 5) + b"\xc6\xff\xff\xff\xff",
    "deep msgpack": struct.pack(">i", 100_000) + b"\x91" * 100_000,
}


@pytest.mark.parametrize("name", sorted(HOSTILE_CLAIMS))
def test_length_claims_beyond_the_input_allocate_nothing(name: str) -> None:
    data = HOSTILE_CLAIMS[name]
    verdict = Verdict()
    tracemalloc.start()
    try:
        peak = _peak_alloc(lambda: (decode_kv(data, verdict), decode_side(data, verdict), decode_kv(data, verdict, 1)))
    finally:
        tracemalloc.stop()
    assert verdict.accepted <= 2  # "64 dims" is a valid one-float payload; everything else fails
    assert peak <= 4 * len(data) + 4 * OVERHEAD, (name, peak, len(data))
    if name != "64 dims":
        assert verdict.accepted == 0, name


def test_json_header_expansion_is_bounded_by_the_header_limit() -> None:
    """JSON objects cost more than their text (``[]`` is 2 bytes, an empty list ~60): the
    limit on the header's length is what bounds the parse. Headers over it are not read."""
    limit = 256 * 1024

    def lists(n: int) -> bytes:
        body = b'{"rid":"r","bids":[],"meta":{"x":[' + b"[]," * n + b'[]]},"td":[],"nl":0}'
        return struct.pack(">I", len(body)) + body

    under, over = lists(limit // 3 - 40), lists(limit)
    assert len(under) - 4 <= limit < len(over) - 4
    limits = DecodeLimits(max_header_bytes=limit)

    def refuse() -> None:
        with pytest.raises(PayloadError, match="exceeds the limit"):
            decode_payload(over, limits=limits)

    tracemalloc.start()
    try:
        accepted = _peak_alloc(lambda: decode_payload(under, limits=limits))
        refused = _peak_alloc(refuse)
    finally:
        tracemalloc.stop()
    assert accepted <= 32 * limit
    assert refused <= OVERHEAD
    assert DecodeLimits().max_header_bytes <= 4 * 1024 * 1024  # the default bounds a parse to ~100 MB


LONG_CONTENT = {
    "70k descriptors (over max_tensors)": _kv_header([{"n": "key_cache_0", "x": True}] * 70_000),
    "a million blob sizes": _side({"v": 1, "blobs": [0] * 1_000_000, "fields": {}}),
    "a million block ids": _header({"rid": "r", "bids": [7] * 1_000_000, "meta": {}, "td": [], "nl": 0}),
}


@pytest.mark.parametrize("name", sorted(LONG_CONTENT))
def test_long_real_content_costs_linear_time_and_bounded_memory(name: str) -> None:
    """Not a claim but real content: parsing it costs objects (bounded by the header limit)
    and must stay linear (a quadratic blob-offset table once made this hang)."""
    data = LONG_CONTENT[name]
    assert len(data) < DecodeLimits().max_header_bytes
    verdict = Verdict()
    started = time.monotonic()
    tracemalloc.start()
    try:
        peak = _peak_alloc(lambda: (decode_kv(data, verdict), decode_side(data, verdict)))
    finally:
        tracemalloc.stop()
    assert time.monotonic() - started < 60.0  # seconds: 20.5 s seen on a 2-core machine at load 10; quadratic was hours
    assert peak <= 32 * len(data), (peak, len(data))


def test_tensor_count_limit_is_enforced() -> None:
    with pytest.raises(PayloadError, match="exceed the limit 8"):
        decode_payload(_kv_header([_desc()] * 9), limits=DecodeLimits(max_tensors=8))
    with pytest.raises(PayloadError, match="exceed the limit 65536"):
        decode_payload(LONG_CONTENT["70k descriptors (over max_tensors)"])


# --------------------------------------------------------------------------- hypothesis
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner, max_size=4),
    max_leaves=12,
)
descriptor = st.fixed_dictionaries(
    {},
    optional={
        "n": st.sampled_from(["key_cache_0", "value_cache_1", "key_cache_x", ""]) | json_values,
        "i": st.integers(-2, 3) | json_values,
        "d": st.sampled_from(["float16", "int8", "bool"]) | json_values,
        "s": st.lists(st.integers(-1, 5), max_size=4) | json_values,
        "o": st.integers(-1, 64) | json_values,
        "b": st.integers(-1, 64) | json_values,
        "x": st.booleans() | json_values,
        "c": st.text(max_size=9) | json_values,
    },
)
header = st.fixed_dictionaries(
    {},
    optional={
        "rid": st.text(max_size=5) | json_values,
        "bids": st.lists(st.integers(), max_size=3) | json_values,
        "meta": st.dictionaries(st.text(max_size=3), json_values, max_size=3) | json_values,
        "td": st.lists(descriptor, max_size=4) | json_values,
        "nl": st.integers(-1, 4) | json_values,
        "v": st.integers(0, 2) | json_values,
        "ck": st.sampled_from(["crc32", "md5"]) | json_values,
    },
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(header, st.binary(max_size=96))
def test_structurally_odd_headers_raise_only_payload_error(obj: dict[str, Any], data: bytes) -> None:
    try:
        body = json.dumps(obj, separators=(",", ":"), allow_nan=True).encode()
    except (ValueError, OverflowError):
        return
    fuzz_one(struct.pack(">I", len(body)) + body + data)


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=200), st.integers(0, 2))
def test_random_bytes_raise_only_payload_error(data: bytes, how: int) -> None:
    verdict = Verdict()
    decode_kv(data, verdict, how)
    decode_side(data, verdict, how)
    assert verdict.accepted + verdict.rejected + verdict.misses == 2
