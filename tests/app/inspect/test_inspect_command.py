"""``kvferry inspect``: reference and kvferry payload files, corrupted files, bad paths."""

from __future__ import annotations

import json
import pathlib

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvferry.adapters.torch_frames import encode_bytes
from kvferry.app.cli import main
from kvferry.app.inspect.command import inspect_buffer
from kvferry.core.header import decode_header

DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.int8]


def _kv(
    layers: int = 3,
    tokens: int = 5,
    heads: int = 2,
    dim: int = 4,
    absent: int | None = 1,
    dtype: torch.dtype = torch.bfloat16,
) -> tuple[list, list]:
    gen = torch.Generator().manual_seed(layers * 100 + tokens)
    make = lambda: torch.randint(-50, 50, (tokens, heads, dim), generator=gen).to(dtype)  # noqa: E731
    keys = [None if i == absent else make() for i in range(layers)]
    values = [None if i == absent else make() for i in range(layers)]
    return keys, values


def _write(path: pathlib.Path, data: bytes) -> str:
    path.write_bytes(data)
    return str(path)


def _run(capsys: pytest.CaptureFixture[str], argv: list[str]) -> tuple[int, str, str]:
    code = main(["inspect", *argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_reference_layout_file(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    keys, values = _kv()
    data = encode_bytes("req-ref", keys, values, [7, 3, 9], {"seq_len": 5}, align=1, version=False)
    path = _write(tmp_path / "ref.kv", data)
    code, out, err = _run(capsys, [path])
    assert (code, err) == (0, "")
    assert "reference payload" in out and "'req-ref'" in out and "[7, 3, 9]" in out
    rows = {line.split()[0]: line.split() for line in out.splitlines() if "_cache_" in line}
    assert rows["key_cache_0"][1:6] == ["0", "bfloat16", "5x2x4", "80", "0"]
    assert rows["key_cache_1"][3] == "absent"
    assert rows["value_cache_2"][1:6] == ["2", "bfloat16", "5x2x4", "80", str(3 * 80)]
    assert all(r[-1] in ("none", "-") for r in rows.values())


def test_kvferry_file_with_checksums_as_json(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    keys, values = _kv(absent=None)
    data = encode_bytes("req-k", keys, values, [1], {"a": [1, 2]}, checksums="crc32")
    path = _write(tmp_path / "k.kv", data)
    code, out, err = _run(capsys, [path, "--json"])
    assert (code, err) == (0, "")
    report = json.loads(out)
    decoded = decode_header(data)
    assert report["valid"] and report["error"] is None and report["format"] == "kvferry v1"
    assert report["header"]["checksum_algorithm"] == "crc32"
    assert report["header"]["header_bytes"] == decoded.data_start
    table = [(t["name"], t["offset"], t["bytes"], t["checksum_status"]) for t in report["tensors"]]
    assert table == [(d.name, d.offset, d.nbytes, "ok") for d in decoded.header.present]


def test_corrupted_data_fails_with_one_line(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    keys, values = _kv(absent=None)
    data = bytearray(encode_bytes("req-c", keys, values, [1], {}, checksums="crc32"))
    data[-3] ^= 0x5A  # inside value_cache_2, the last tensor
    path = _write(tmp_path / "bad.kv", bytes(data))
    code, out, err = _run(capsys, [path])
    assert code == 1
    assert err.count("\n") == 1 and "value_cache_2" in err and "crc32 mismatch" in err
    assert "MISMATCH" in out  # the table of what could be read is still printed
    code, out, err = _run(capsys, [path, "--no-verify"])
    assert code == 0 and "not verified" in out


@pytest.mark.parametrize("cut, reason", [(2, "missing 4-byte header length"), (40, "exceeds buffer size")])
def test_truncated_file(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str], cut: int, reason: str) -> None:
    keys, values = _kv()
    data = encode_bytes("req-t", keys, values, [1], {}, align=1, version=False)
    path = _write(tmp_path / "t.kv", data[:cut])
    code, out, err = _run(capsys, [path])
    assert code == 1 and out == "" and reason in err and err.count("\n") == 1
    code, out, err = _run(capsys, [path, "--json"])
    assert code == 1 and json.loads(out)["valid"] is False and reason in json.loads(out)["error"]


def test_span_outside_data_is_invalid(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    keys, values = _kv(absent=None)
    data = encode_bytes("req-s", keys, values, [1], {}, align=1, version=False)
    code, _, err = _run(capsys, [_write(tmp_path / "s.kv", data[:-1])])
    assert code == 1 and "tensor span" in err


def test_unreadable_path_is_a_usage_error(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _run(capsys, [str(tmp_path / "missing.kv")])
    assert code == 2 and out == "" and "cannot read" in err
    code, _, err = _run(capsys, [_write(tmp_path / "empty.kv", b"")])
    assert code == 1 and "header length" in err


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    layers=st.integers(1, 4),
    tokens=st.integers(0, 6),
    heads=st.integers(1, 3),
    dtype=st.sampled_from(DTYPES),
    absent=st.none() | st.integers(0, 3),
    align=st.sampled_from([1, 8, 64]),
    checksums=st.sampled_from([None, "crc32"]),
)
def test_inspect_agrees_with_the_header_codec(
    layers: int, tokens: int, heads: int, dtype: torch.dtype, absent: int | None, align: int, checksums: str | None
) -> None:
    keys, values = _kv(layers, tokens, heads, 4, absent, dtype)
    data = encode_bytes(
        "r", keys, values, list(range(layers)), {"n": layers}, align=align, checksums=checksums, version=align > 1
    )
    report = inspect_buffer(data)
    decoded = decode_header(data)
    assert report["valid"] and report["total_bytes"] == len(data)
    assert [t["name"] for t in report["tensors"]] == [t.name for t in decoded.header.tensors]
    present = [t for t in report["tensors"] if not t.get("absent")]
    assert [(t["shape"], t["bytes"], t["absolute_offset"]) for t in present] == [
        (list(d.shape), d.nbytes, s[0]) for d, s in zip(decoded.header.present, [s for s in decoded.spans if s])
    ]
    assert all(t["checksum_status"] == ("ok" if checksums else "none") for t in present)


@settings(max_examples=60, deadline=None)
@given(data=st.binary(max_size=200), flips=st.lists(st.integers(0, 10_000), max_size=4))
def test_any_bytes_give_a_verdict_not_an_exception(data: bytes, flips: list[int]) -> None:
    keys, values = _kv(2, 2, 1, 2, None)
    payload = bytearray(encode_bytes("m", keys, values, [0], {}, checksums="crc32") + data)
    for f in flips:
        payload[f % len(payload)] ^= 0xFF
    report = inspect_buffer(bytes(payload))
    assert isinstance(report["valid"], bool)
    assert report["valid"] or (isinstance(report["error"], str) and "\n" not in report["error"])
