"""The page copy that checks its checksum in the same read (adapters/checked_scatter.py, the
native copy_crc32c in adapters/_crc32c.c), and the vLLM page write that uses it.

copy_crc32c is compared with a copy made by Python slicing and with core's pure CRC-32C, for
chunk sizes that take the folding path (multiples of 64: a 256-byte step that crosses chunks
for 64, 192 and 320), the three-stream path (multiples of 8) and the window path (others), with
each routine this CPU has; scatter_spans with the addresses torch's own views give; the
fused page write with the plain one, byte for byte, and a flipped byte caught in either."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvferry.adapters.checked_scatter import scatter_checked, scatter_spans, writable_bytes
from kvferry.adapters.torch_frames import decode_payload
from kvferry.app.vllm.pages import PageGeometry, PageWriter, block_runs, write_pages
from kvferry.core.errors import PayloadError
from kvferry.core.header.checksums import crc32c as pure_crc32c

native = pytest.importorskip("kvferry.adapters._crc32c", reason="the native CRC-32C is not built")


def _expected_copy(dst: bytearray, src: bytes, chunk: int, spans: list[tuple[int, int, int]]) -> bytearray:
    out, at = bytearray(dst), 0
    for offset, stride, count in spans:
        for k in range(count):
            place = offset + k * stride
            out[place : place + chunk] = src[at : at + chunk]
            at += chunk
    return out


@st.composite
def _scatters(draw: st.DrawFn) -> tuple[int, list[tuple[int, int, int]], int]:
    chunk = draw(st.sampled_from([8, 16, 24, 40, 64, 192, 320, 2048, 4096, 1, 3, 12, 100]))
    slots = draw(st.integers(1, 48))
    order = draw(st.permutations(range(slots)))
    used = order[: draw(st.integers(0, slots))]
    spans = [(slot * chunk, 0, 1) for slot in used]
    if draw(st.booleans()) and used:  # one strided span in front
        spans = [(0, chunk * 2, slots // 2)] + [s for s in spans if (s[0] // chunk) % 2 == 1]
    return chunk, spans, slots * chunk


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=_scatters(), seed=st.integers(0, 2**16), value=st.integers(0, 2**32 - 1))
def test_copy_crc32c_copies_like_slicing_and_checks_like_crc32c(
    engine: str, case: tuple[int, list[tuple[int, int, int]], int], seed: int, value: int
) -> None:
    chunk, spans, size = case
    rng = random.Random(seed)
    total = sum(count for _o, _s, count in spans) * chunk
    src = rng.randbytes(total)
    dst = bytearray(rng.randbytes(size))
    want = _expected_copy(dst, src, chunk, spans)
    got = native.copy_crc32c(dst, src, chunk, spans, value)
    assert got == pure_crc32c(src, value), engine
    assert dst == want


def test_copy_crc32c_crosses_the_long_rounds_with_chunks_not_dividing_them(engine: str) -> None:
    chunk = 2056  # 8192 is no multiple of it: the three streams reach chunk ends at different steps
    count = 3 * 8192 * 2 // chunk + 7
    src = random.Random(1).randbytes(count * chunk)
    dst = bytearray(count * chunk * 2)
    spans = [(chunk, 2 * chunk, count)]  # every other slot, the first one left free
    assert native.copy_crc32c(dst, src, chunk, spans) == pure_crc32c(src)
    assert dst == _expected_copy(bytearray(len(dst)), src, chunk, spans)


@pytest.mark.parametrize(
    ("chunk", "spans", "src_len", "words"),
    [
        (8, [(96, 0, 1)], 8, "past the destination"),
        (8, [(0, 93, 2)], 16, "past the destination"),
        (8, [(0, 8, 2)], 24, "the spans hold 16 bytes"),
        (8, [(-8, 8, 1)], 8, ">= 0"),
        (0, [], 0, "chunk must be"),
        (8, [(0, 8)], 8, "3 arguments"),
        (8, [[0, 8, 1]], 8, "tuple"),
    ],
)
def test_copy_crc32c_refuses_bad_spans_before_writing(
    chunk: int, spans: list[tuple[int, ...]], src_len: int, words: str
) -> None:
    dst = bytearray(100)
    with pytest.raises((ValueError, TypeError), match=words):
        native.copy_crc32c(dst, bytes(range(1, src_len + 1)), chunk, spans)
    assert dst == bytearray(100)


@settings(max_examples=60, deadline=None)
@given(
    heads=st.integers(1, 4),
    blocks=st.integers(2, 12),
    data=st.data(),
    latent=st.booleans(),
)
def test_page_places_and_spans_land_where_torch_views_point(
    heads: int, blocks: int, data: st.DataObject, latent: bool
) -> None:
    heads = 1 if latent else heads
    shape = (blocks, heads, 4, 6)
    layer = torch.zeros(shape, dtype=torch.bfloat16)
    geometry = PageGeometry.of([layer], latent=latent)
    start = data.draw(st.integers(0, heads - 1))
    stop = data.draw(st.integers(start + 1, heads))
    ids = data.draw(st.lists(st.integers(0, blocks - 1), min_size=1, max_size=blocks, unique=True))
    runs = block_runs(ids)
    es = layer.element_size()
    for view, (base, block, head) in zip(geometry.page_tensors(layer), geometry.page_places(es)):
        spans = scatter_spans(runs, block, head, stop - start, base + start * head)
        got = [offset + k * stride for offset, stride, count in spans for k in range(count)]
        want = [view[b, h].data_ptr() - layer.data_ptr() for b in ids for h in range(start, stop)]
        assert got == want


def _payload(
    checksums: str, heads: int = 2, blocks: int = 6
) -> tuple[torch.Tensor, PageGeometry, list[int], torch.Tensor]:
    torch.manual_seed(3)
    layer = torch.randn(blocks * 2, heads, 16, 2 * 32).to(torch.bfloat16)
    geometry = PageGeometry.of([layer])
    ids = [1, 2, 3, 7, 9, 4][:blocks]
    writer = PageWriter(geometry, checksums=checksums)
    layout = writer.layout("t", ids, heads, {"layout": geometry.payload_layout, "layer": 0})
    buf = torch.empty(layout.total_nbytes, dtype=torch.uint8)
    writer.gather(layer, torch.tensor(ids), 0, heads, buf, layout)
    return layer, geometry, ids, buf


@pytest.mark.parametrize("first_page", [0, 2])
def test_the_fused_page_write_equals_the_plain_one(first_page: int) -> None:
    source, geometry, ids, buf = _payload("crc32c")
    into = torch.tensor([10, 11, 2, 5, 0, 1][first_page:])
    plain = torch.zeros_like(source)
    fused = torch.zeros_like(source)
    decoded = decode_payload(buf)
    write_pages(plain, geometry, decoded, into, first_page, 0, 2, block_runs(into.tolist()))
    deferred = decode_payload(buf, defer_verify=True)
    assert len(deferred.unverified) == 2  # K and V left to the write
    nbytes = write_pages(
        fused, geometry, deferred, into, first_page, 0, 2, block_runs(into.tolist()), writable_bytes(fused)
    )
    assert not deferred.unverified and nbytes == into.numel() * 2 * 2 * 16 * 32 * 2
    assert torch.equal(fused.view(torch.int16), plain.view(torch.int16))
    # control: the pages really moved (the written blocks hold the source's, the rest is zero)
    assert torch.equal(fused[into], source[torch.tensor(ids[first_page:])])
    assert not fused[torch.tensor([3, 4, 6])].any()


def test_a_head_slice_is_written_into_its_heads_only() -> None:
    source, geometry, ids, buf = _payload("crc32c", heads=1)
    decode = torch.zeros(12, 3, 16, 64, dtype=torch.bfloat16)  # a rank with 3 heads takes it as head 1
    into = torch.tensor([0, 1, 2, 3, 4, 5])
    deferred = decode_payload(buf, defer_verify=True)
    write_pages(
        decode, PageGeometry.of([decode]), deferred, into, 0, 1, 2, block_runs(into.tolist()), writable_bytes(decode)
    )
    assert not deferred.unverified
    assert torch.equal(decode[:6, 1:2], source[torch.tensor(ids)])
    assert not decode[:, 0].any() and not decode[:, 2].any() and not decode[6:].any()


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("where", ["key", "value", "before the written pages"])
def test_a_flipped_byte_fails_the_write_naming_the_tensor(fused: bool, where: str) -> None:
    _source, geometry, _ids, buf = _payload("crc32c")
    decoded = decode_payload(buf, verify=False)
    tensor = decoded.value_cache[0] if where == "value" else decoded.key_cache[0]
    page = 2 * 16 * 32 * 2  # bytes of one page: 2 heads of 16 x 32 bfloat16
    offset = tensor.data_ptr() - buf.data_ptr() + (3 * page + 5 if where != "before the written pages" else 7)
    buf[offset] ^= 0x10
    into = torch.tensor([0, 1, 2, 3])  # pages 2-5: a flip in page 0 is outside what is written
    target = torch.zeros(12, 2, 16, 64, dtype=torch.bfloat16)
    deferred = decode_payload(buf, defer_verify=True)
    with pytest.raises(PayloadError, match="value_cache_0" if where == "value" else "key_cache_0"):
        write_pages(
            target,
            geometry,
            deferred,
            into,
            2,
            0,
            2,
            block_runs(into.tolist()),
            writable_bytes(target) if fused else None,
        )
    # control: without the check the same bytes are written without a word
    write_pages(target, geometry, decode_payload(buf, verify=False), into, 2, 0, 2, block_runs(into.tolist()))


def test_crc32_payloads_are_checked_before_their_copy() -> None:
    _source, geometry, _ids, buf = _payload("crc32")
    buf[-3] ^= 0x01
    target = torch.zeros(12, 2, 16, 64, dtype=torch.bfloat16)
    deferred = decode_payload(buf, defer_verify=True)
    into = torch.arange(6)
    with pytest.raises(PayloadError, match="crc32 mismatch"):
        write_pages(target, geometry, deferred, into, 0, 0, 2, block_runs(into.tolist()), writable_bytes(target))
    k, v = geometry.regions(target)
    assert k.any() and not v.any()  # K checked and written, V's check failed before its copy


def test_writable_bytes_is_the_tensor_itself_or_none() -> None:
    t = torch.zeros(4, 8, dtype=torch.bfloat16)
    view = writable_bytes(t)
    assert view is not None and len(view) == 64
    view[0:2] = b"\x80\x3f"  # bfloat16 1.0
    assert t[0, 0].item() == 1.0
    assert writable_bytes(t.t()) is None  # not contiguous: a copy would lose the writes
    assert writable_bytes(torch.zeros(3, requires_grad=True)) is None


def test_scatter_checked_declines_what_it_cannot_do_exactly() -> None:
    t = torch.zeros(4, 2, 8, dtype=torch.float32)
    out = writable_bytes(torch.zeros(64, dtype=torch.float32))
    assert out is not None
    runs = block_runs([0, 1])
    place = (0, 64, 32)
    assert scatter_checked(out, t, 0, runs, place, ("crc32", "k", 0)) is False
    assert scatter_checked(out, t.transpose(0, 1), 0, runs, place, ("crc32c", "k", 0)) is False
    assert scatter_checked(out, t, 3, runs, place, ("crc32c", "k", 0)) is False  # pages past the tensor
    assert bytes(out) == bytes(256)


def test_latent_pages_are_written_and_checked_in_one_read() -> None:
    torch.manual_seed(5)
    cache = torch.randn(10, 1, 16, 72).to(torch.bfloat16)
    geometry = PageGeometry.of([cache], latent=True)
    writer = PageWriter(geometry, checksums="crc32c")
    ids = [7, 2, 9]
    layout = writer.layout("t", ids, 1, {"layout": geometry.payload_layout, "layer": 0})
    buf = torch.empty(layout.total_nbytes, dtype=torch.uint8)
    writer.gather(cache, torch.tensor(ids), 0, 1, buf, layout)
    dest = torch.zeros_like(cache)
    into = torch.tensor([0, 1, 5])
    deferred = decode_payload(buf, defer_verify=True)
    assert list(deferred.unverified) == [(True, 0)]  # the latent: no value tensor
    n = write_pages(dest, geometry, deferred, into, 0, 0, 1, block_runs(into.tolist()), writable_bytes(dest))
    assert n == 3 * 16 * 72 * 2 and not deferred.unverified
    assert torch.equal(dest[into], cache[torch.tensor(ids)]) and not dest[torch.tensor([2, 3, 4, 6, 7, 8, 9])].any()
    buf[-1] ^= 0x01  # the last latent byte
    with pytest.raises(PayloadError, match="key_cache_0"):
        write_pages(dest, geometry, decode_payload(buf, defer_verify=True), into, 0, 0, 1, None, writable_bytes(dest))
