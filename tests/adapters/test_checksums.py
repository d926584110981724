"""The checksums with the machine's fastest routine (adapters/checksums.py, adapters/_crc32c.c).

The native CRC-32C gives core's pure value for every length and alignment, with each routine
this CPU has (the carry-less folding of 256-byte steps and its lane join and tail, the crc32
instruction's three-stream rounds of 24 KiB and 768 bytes, their tails, and the table); the
folding's constants are derived here from the polynomial, and a model of the folding in Python
gives the bitwise CRC; without the extension the default is zlib's crc32 and a crc32c payload still
verifies (in a subprocess with KVFERRY_NATIVE_CHECKSUM=0)."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvferry.adapters import checksums
from kvferry.adapters.torch_frames import decode_payload, encode_bytes
from kvferry.core.header import decode_header
from kvferry.core.header.checksums import crc32c as pure_crc32c

native = pytest.importorskip("kvferry.adapters._crc32c", reason="the native CRC-32C is not built")


# lengths around every boundary of the routines: 8-byte words, short rounds (3 x 256), long
# rounds (3 x 8192), folding (from 512 bytes, 256 a step, a tail under 256), and their sums
SIZES = [0, 1, 7, 8, 9, 255, 511, 512, 513, 767, 768, 769, 1023, 1024, 1279, 1280, 1543]
SIZES += [24575, 24576, 24577, 24576 + 768 + 13, 3 * 24576 + 5, 65536 + 255]


@pytest.mark.parametrize("size", SIZES)
def test_native_crc32c_equals_the_pure_one_at_every_boundary(engine: str, size: int) -> None:
    data = random.Random(size).randbytes(size + 8)
    for start in (0, 1, 5):  # unaligned starts take the byte head first
        view = memoryview(data)[start : start + size]
        assert native.crc32c(view) == pure_crc32c(view), (engine, size, start)


@settings(max_examples=150, deadline=None)
@given(data=st.binary(max_size=2000), cut=st.integers(0, 2000), value=st.integers(0, 2**32 - 1))
def test_native_crc32c_continues_and_starts_like_the_pure_one(data: bytes, cut: int, value: int) -> None:
    cut = min(cut, len(data))
    assert native.crc32c(data, value) == pure_crc32c(data, value)
    assert native.crc32c(data[cut:], native.crc32c(data[:cut])) == pure_crc32c(data)


def test_the_engine_is_found_at_run_time() -> None:
    cpu_flags = open("/proc/cpuinfo").read() if os.path.exists("/proc/cpuinfo") else ""
    flags = set(cpu_flags.split())
    expected = "table"
    if "sse4_2" in flags:
        expected = "sse4.2"
        if {"pclmulqdq", "avx512f", "vpclmulqdq"} <= flags:
            expected = "vpclmulqdq"
    assert native.engine() == expected == checksums.checksum_engine("crc32c")
    assert native.set_engine("no-such-routine") is False and native.engine() == expected
    assert checksums.NATIVE_CRC32C and checksums.DEFAULT_CHECKSUM == "crc32c"
    assert checksums.CHECKSUMS["crc32c"] is native.crc32c
    assert checksums.sending_checksum("crc32c") == "crc32c" and checksums.sending_checksum(None) is None


def test_a_tensor_buffer_is_checksummed_in_place() -> None:
    tensor = torch.arange(4096, dtype=torch.int32)
    view = tensor.numpy().data.cast("B")
    assert checksums.compute_checksum("crc32c", view) == pure_crc32c(view.tobytes())


@st.composite
def _payloads(draw):
    """An encoded payload with checksums (either algorithm), layers of random sizes, some
    absent, and random alignment; with its header's checksums by tensor name."""
    algorithm = draw(st.sampled_from(["crc32c", "crc32"]))
    layers = draw(st.integers(1, 5))
    rng = random.Random(draw(st.integers(0, 2**32)))

    def tensor():
        if draw(st.booleans()) and layers > 1 and draw(st.integers(0, 3)) == 0:
            return None
        return torch.tensor([rng.randrange(256) for _ in range(draw(st.integers(0, 3000)))], dtype=torch.uint8)

    keys = [tensor() for _ in range(layers)]
    values = [tensor() if k is not None else None for k in keys]
    if all(k is None for k in keys):
        keys[0] = torch.ones(7, dtype=torch.uint8)
    raw = encode_bytes("r", keys, values, [0], {}, checksums=algorithm, align=draw(st.sampled_from([1, 64])))
    decoded = decode_header(raw)
    return raw, {d.name: d.checksum for d in decoded.header.tensors if getattr(d, "nbytes", 0)}


@settings(max_examples=150, deadline=None)
@given(_payloads(), st.lists(st.integers(1, 2000), max_size=40))
def test_checksums_fed_stretch_by_stretch_are_the_headers(payload, steps) -> None:
    """Fed in stretches of any sizes, in order, the arriving checksums are the header's for every
    tensor with bytes, whichever stretches the tensors straddle."""
    raw, expected = payload
    head = decode_header(raw).data_start
    check = checksums.ArrivingChecksums.start(raw[: head + (steps[0] if steps else 0)], len(raw))
    assert check is not None
    view, at = memoryview(raw), head
    for step in [*steps, len(raw)]:
        at = min(len(raw), at + step)
        check.feed(view, at)
        assert check.complete == (at == len(raw) or not any(stop > at for _, stop, _ in check.spans))
    assert check.complete and check.values == expected


def test_arriving_checksums_start_only_from_a_whole_header_that_names_an_algorithm() -> None:
    keys = [torch.arange(100, dtype=torch.uint8)]
    raw = encode_bytes("r", keys, keys, [0], {}, checksums="crc32c")
    head = decode_header(raw).data_start
    assert checksums.ArrivingChecksums.start(raw[: head - 1], len(raw)) is None  # the header is cut
    assert checksums.ArrivingChecksums.start(raw[:head], len(raw)) is not None
    plain = encode_bytes("r", keys, keys, [0], {})
    assert checksums.ArrivingChecksums.start(plain, len(plain)) is None  # no checksums to compute
    frames = checksums.ArrivedFrames((memoryview(raw),), {"key_cache_0": 1})
    assert isinstance(frames, tuple) and len(frames) == 1 and checksums.arrived_checksums(frames) == {"key_cache_0": 1}
    assert checksums.arrived_checksums((memoryview(raw),)) is None


_FALLBACK = r"""
import json, logging, sys, torch
logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
from kvferry.adapters import checksums
from kvferry.adapters.torch_frames import decode_payload, encode_bytes
raw = bytes.fromhex(sys.argv[1])
got = decode_payload(raw)  # a crc32c payload from a native sender: verified with the pure routine
tampered = bytearray(raw); tampered[-1] ^= 1
try:
    decode_payload(bytes(tampered)); rejected = False
except Exception as exc:
    rejected = "crc32c mismatch" in str(exc)
keys = [torch.ones(2, 2)]
own = encode_bytes("r", keys, keys, [0], {}, checksums=checksums.sending_checksum("crc32c"))
print(json.dumps({"native": checksums.NATIVE_CRC32C, "default": checksums.DEFAULT_CHECKSUM,
    "engine": checksums.checksum_engine("crc32c"), "value0": got.value_cache[0].tolist(),
    "rejected": rejected, "own": b'"ck":"crc32"' in own}))
"""


def test_without_the_extension_the_default_is_crc32_and_crc32c_still_verifies() -> None:
    keys, values = [torch.arange(6.0).reshape(2, 3)], [torch.arange(6.0, 12.0).reshape(2, 3)]
    raw = encode_bytes("r", keys, values, [0], {}, checksums="crc32c")
    assert decode_header(raw).header.checksum_algorithm == "crc32c"
    env = {**os.environ, "KVFERRY_NATIVE_CHECKSUM": "0"}
    done = subprocess.run(
        [sys.executable, "-c", _FALLBACK, raw.hex()], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report == {
        "native": False,
        "default": "crc32",
        "engine": "python",
        "value0": values[0].tolist(),
        "rejected": True,
        "own": True,
    }
    assert "pure-Python CRC-32C" in done.stderr and "sending crc32 instead of crc32c" in done.stderr
    assert decode_payload(raw).value_cache[0].tolist() == values[0].tolist()  # and natively here


def test_the_vllm_connector_checks_with_crc32c_by_default() -> None:
    from kvferry.app.vllm.params import ConnectorSettings

    settings = ConnectorSettings()
    assert settings.checksums == "crc32c"
    assert checksums.sending_checksum(settings.checksums) == checksums.DEFAULT_CHECKSUM == "crc32c"


# ----------------------------------------------------- the folding's constants and its model
def _x_pow_mod(e: int) -> int:
    """x^e mod P (CRC-32C's polynomial, normal bit order), by shifting."""
    poly = (1 << 32) | int(f"{0x82F63B78:032b}"[::-1], 2)
    r = 1
    for _ in range(e):
        r <<= 1
        if r >> 32:
            r ^= poly
    return r


def _fold_constant(e: int) -> int:
    return int(f"{_x_pow_mod(e):032b}"[::-1], 2)  # bit-reflected, as the data


def _clmul(a: int, b: int) -> int:
    r = 0
    while b:
        if b & 1:
            r ^= a
        a, b = a << 1, b >> 1
    return r


def _raw(reg: int, data: bytes) -> int:
    """The CRC register after ``data`` (no initial value or final xor), bit by bit."""
    for byte in data:
        reg ^= byte
        for _ in range(8):
            reg = (reg >> 1) ^ 0x82F63B78 if reg & 1 else reg >> 1
    return reg


def _folded(data: bytes, reg: int, lanes: int) -> int:
    """``lanes`` 16-byte lanes carried over ``16 * lanes`` bytes a step by two carry-less
    multiplies each (constants x^(D+31), x^(D-33) mod P, D the step in bits), joined lane by
    lane (D = 128), then the register after the joined lane and the tail: what the native
    routine does with lanes = 16."""
    step = 16 * lanes
    d = 8 * step
    k_low, k_high = _fold_constant(d + 31), _fold_constant(d - 33)
    whole = len(data) // step * step
    acc = [int.from_bytes(data[16 * i : 16 * i + 16], "little") for i in range(lanes)]
    acc[0] ^= reg
    for at in range(step, whole, step):
        for i, x in enumerate(acc):
            nxt = int.from_bytes(data[at + 16 * i : at + 16 * i + 16], "little")
            acc[i] = _clmul(x & (2**64 - 1), k_low) ^ _clmul(x >> 64, k_high) ^ nxt
    x = acc[0]
    for lane in acc[1:]:
        x = _clmul(x & (2**64 - 1), _fold_constant(159)) ^ _clmul(x >> 64, _fold_constant(95)) ^ lane
    return _raw(_raw(0, x.to_bytes(16, "little")), data[whole:])


@settings(max_examples=40, deadline=None)
@given(data=st.binary(min_size=64, max_size=1200), value=st.integers(0, 2**32 - 1), lanes=st.sampled_from([1, 4, 16]))
def test_folding_model_gives_the_bitwise_crc(data: bytes, value: int, lanes: int) -> None:
    if len(data) < 16 * lanes:
        data = data * (16 * lanes // len(data) + 1)
    assert _folded(data, value ^ 0xFFFFFFFF, lanes) ^ 0xFFFFFFFF == pure_crc32c(data, value)


def test_the_native_folding_constants_are_the_derived_ones() -> None:
    import re
    from pathlib import Path

    source = Path(__file__).resolve().parents[2] / "adapters" / "_crc32c.c"
    defined = dict(re.findall(r"#define (K\d+_(?:LOW|HIGH)) (0x[0-9a-f]+)u", source.read_text()))
    expected = {
        "K128_LOW": _fold_constant(128 + 31),
        "K128_HIGH": _fold_constant(128 - 33),
        "K2048_LOW": _fold_constant(2048 + 31),
        "K2048_HIGH": _fold_constant(2048 - 33),
    }
    assert {k: int(v, 16) for k, v in defined.items()} == expected
