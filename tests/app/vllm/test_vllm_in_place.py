"""Pages read in place (ConnectorSettings.in_place): a payload's header plus the address ranges
of the cache that :meth:`PageWriter.pieces` lists hold, byte for byte, what
:meth:`PageWriter.gather` copies into a pool (an index_select per page tensor), for dense and
MLA caches, head slices, FP8 bytes, with and without checksums; and the saver holds a request's
blocks until every payload read in place is freed. The NIXL reads of these ranges are in
tests/adapters/connectors/test_nixl.py; real vLLM in tests/engines/vllm/test_pd_connectors.py."""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Sequence
from typing import Any

import attrs
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from page_kit import wait_for

from kvferry.adapters.torch_decode import decode_payload
from kvferry.app.vllm.pages import PageGeometry, PageWriter, layer_key, page_spans, payload_pieces
from kvferry.app.vllm.params import ConnectorSettings
from kvferry.app.vllm.worker import PageWorker, SaveJob
from kvferry.core.errors import ConfigError, PayloadError

ZEROS = torch.zeros(4096, dtype=torch.uint8)


def _read(pieces: Sequence[tuple[int, int]]) -> bytes:
    return b"".join(ctypes.string_at(addr, n) for addr, n in pieces)


def _gathered(writer: PageWriter, layer: torch.Tensor, blocks: list[int], h0: int, h1: int, layout: Any) -> bytes:
    dest = torch.empty(layout.total_nbytes, dtype=torch.uint8)
    writer.gather(layer, torch.tensor(blocks, dtype=torch.long), h0, h1, dest, layout)
    return bytes(dest.numpy())


@settings(max_examples=60, deadline=None)
@given(
    latent=st.booleans(),
    heads=st.integers(1, 4),
    block_size=st.sampled_from([1, 2, 16]),
    head_size=st.sampled_from([4, 8, 12, 64]),
    dtype=st.sampled_from([torch.bfloat16, torch.float32, torch.float8_e4m3fn]),
    checksums=st.sampled_from([None, "crc32c", "crc32"]),
    data=st.data(),
)
def test_the_header_and_the_pieces_are_the_gathered_payload_byte_for_byte(
    latent: bool, heads: int, block_size: int, head_size: int, dtype: torch.dtype, checksums: str | None, data: Any
) -> None:
    num_blocks = 12
    if latent:
        heads = 1
        layer = torch.randn(num_blocks, 1, block_size, 2 * head_size).to(dtype)
    else:
        layer = torch.randn(num_blocks, heads, block_size, 2 * head_size).to(dtype)
    geometry = PageGeometry.of([layer], latent=latent)
    writer = PageWriter(geometry, checksums=checksums)
    blocks = data.draw(st.lists(st.integers(0, num_blocks - 1), min_size=1, max_size=8))
    h0 = data.draw(st.integers(0, heads - 1))
    h1 = data.draw(st.integers(h0 + 1, heads))
    layout = writer.layout("req", blocks, h1 - h0, {"layer": 0})
    got = writer.pieces(layer, blocks, h0, h1, layout, (ZEROS.data_ptr(), 16))
    assert got is not None
    head, pieces = got
    want = _gathered(writer, layer, blocks, h0, h1, layout)
    assert len(head) + sum(n for _, n in pieces) == layout.total_nbytes
    assert head + _read(pieces) == want
    # every piece lies in the layer or in the zeros, never elsewhere
    lo, hi = layer.data_ptr(), layer.data_ptr() + layer.numel() * layer.element_size()
    assert all(lo <= a and a + n <= hi or a == ZEROS.data_ptr() and n <= 16 for a, n in pieces)
    # control: the pieces are the layer's own bytes (a byte changed there is read changed)
    flat = layer.view(torch.uint8).reshape(-1)
    off = pieces[-1][0] - lo if pieces[-1][0] != ZEROS.data_ptr() else pieces[0][0] - lo
    if 0 <= off < flat.numel():
        flat[off] ^= 0xFF
        assert head + _read(pieces) != want


def test_a_checksummed_payload_read_in_place_decodes_and_verifies() -> None:
    layer = torch.randn(8, 2, 16, 2 * 32).to(torch.bfloat16)
    writer = PageWriter(PageGeometry.of([layer]), checksums="crc32c")
    layout = writer.layout("req", [5, 1, 2], 1, {"layer": 0})
    head, pieces = writer.pieces(layer, [5, 1, 2], 1, 2, layout, (ZEROS.data_ptr(), 4096))
    decoded = decode_payload(bytearray(head + _read(pieces)))
    pages = layer[[5, 1, 2], 1:2].reshape(3, 1, -1)  # a (block, head) page: its K region, then its V region
    assert torch.equal(decoded.key_cache[0].view(3, 1, -1), pages[..., : 16 * 32])
    assert torch.equal(decoded.value_cache[0].view(3, 1, -1), pages[..., 16 * 32 :])
    # a page changed after the header was written fails the check, loudly
    layer[1, 1, 0, 0] += 1
    with pytest.raises(PayloadError, match="crc32c mismatch"):
        decode_payload(bytearray(head + _read(pieces)))


@given(st.lists(st.integers(0, 30), min_size=1, max_size=12), st.integers(1, 3), st.integers(0, 2))
def test_page_spans_are_the_pages_in_gather_order_adjacent_ones_merged(blocks: list[int], heads: int, h0: int) -> None:
    h0 = min(h0, heads - 1)
    places = ((0, heads * 2 * 10, 2 * 10), (10, heads * 2 * 10, 2 * 10))  # K and V of regions of 10 bytes
    spans = page_spans(places, 10, blocks, h0, heads)
    for (base, bstride, hstride), part in zip(places, spans):
        flat = [(base + b * bstride + h * hstride + i) for b in blocks for h in range(h0, heads) for i in range(10)]
        assert [a + i for a, n in part for i in range(n)] == flat
        assert all(a + n != b for (a, n), (b, _) in zip(part, part[1:]))  # maximal


def test_padding_is_listed_as_zeros_and_a_wrong_size_is_refused() -> None:
    got = payload_pieces(64, 150, [(64, 20), (96, 40)], [[(1000, 20)], [(2000, 15), (3000, 25)]], 8)
    # 12 bytes of padding between the tensors, 14 after them, in pieces of at most 8 zeros
    assert got == [(1000, 20), (-1, 8), (-1, 4), (2000, 15), (3000, 25), (-1, 8), (-1, 6)]
    assert sum(n for _, n in got) == 150 - 64
    assert payload_pieces(64, 300, [(64, 20)], [[(1000, 19)]], 8) is None
    with pytest.raises(ConfigError):
        payload_pieces(64, 300, [(64, 20)], [[(1000, 20)]], 0)


def test_a_device_or_nhd_cache_is_gathered() -> None:
    nhd = torch.randn(4, 16, 2, 2 * 8).transpose(1, 2)  # vLLM's LBNHC view: not contiguous
    writer = PageWriter(PageGeometry.of([nhd]))
    layout = writer.layout("req", [1], 2, {"layer": 0})
    assert writer.pieces(nhd, [1], 0, 2, layout, (ZEROS.data_ptr(), 16)) is None


# ------------------------------------------------------------------------------- the saver
class _InPlaceSender:
    """A connector with the PiecesPut ability that keeps what it was given: the pieces are read
    (by address) when a test says a decode read them, and on_free is called then."""

    max_pieces = 64

    def __init__(self) -> None:
        self.registered: list[tuple[int, int]] = []
        self.puts: dict[str, tuple[bytes, list[tuple[int, int]], Any]] = {}
        self.gathered: list[str] = []
        self.lock = threading.Lock()

    def register_memory(self, tensor: torch.Tensor) -> None:
        self.registered.append((tensor.data_ptr(), tensor.numel() * tensor.element_size()))

    def put_pieces(self, from_stage, to_stage, put_key, head, spans, on_free):  # noqa: ANN001, ANN201
        assert all(any(a <= s and s + n <= a + m for a, m in self.registered) for s, n in spans)
        with self.lock:
            self.puts[put_key] = (bytes(head), list(spans), on_free)
        return True, len(head) + sum(n for _, n in spans), {"size": len(head) + sum(n for _, n in spans)}

    def put(self, from_stage, to_stage, put_key, data):  # noqa: ANN001, ANN201
        self.gathered.append(put_key)  # a save that may not be read in place
        return True, data.numel(), {"size": data.numel()}

    def read(self, key: str) -> bytes:
        head, spans, on_free = self.puts.pop(key)
        out = head + _read(spans)
        on_free()
        return out

    def health(self) -> dict[str, Any]:
        return {"ok": True}

    def close(self) -> None:
        pass


def test_the_saver_holds_a_requests_blocks_until_every_payload_read_in_place_is_freed() -> None:
    sender = _InPlaceSender()
    settings_ = ConnectorSettings.from_extra_config({"connector": {"type": "memory"}})
    worker = PageWorker(
        settings_,
        tp_rank=0,
        tp_size=1,
        total_kv_heads=2,
        producer=True,
        consumer=False,
        connector_factory=lambda cfg: sender,
    )
    caches = {f"layer.{i}": torch.randn(6, 2, 4, 16).to(torch.bfloat16) for i in range(3)}
    try:
        worker.register(caches)
        assert len(sender.registered) == 4  # the zeros and the 3 layers
        worker.begin_step([SaveJob("r", "t", (4, 1), 7, 1, ends_now=True), SaveJob("s", "u", (2,), 3, 1)])
        for name, t in caches.items():
            worker.save_layer(name, t)
        worker.end_step()
        wait_for(lambda: len(sender.puts) == 3)  # "r" in place, one payload per layer
        wait_for(lambda: worker.finished({"s"})[0] == {"s"}, what="the gathered save")
        assert sorted(sender.gathered) == sorted(layer_key("u", 0, i, 0, 0) for i in range(3))
        assert worker.finished({"r"})[0] == set()  # every layer out, none read: held
        read = {key: sender.read(key) for key in sorted(sender.puts)[:2]}
        assert worker.finished(set())[0] == set()  # one still read in place
        last = sorted(sender.puts)[0]
        read[last] = sender.read(last)
        wait_for(lambda: "r" in worker.finished(set())[0], what="the blocks of r freed")
        stats = worker.take_stats()
        assert stats["requests_sent"] == 2 and stats["bytes_in_place"] > 0
        # what a decode read in place: each layer's pages of blocks 4 and 1, K then V regions
        for i, (name, t) in enumerate(caches.items()):
            decoded = decode_payload(bytearray(read[layer_key("t", 0, i, 0, 0)]))
            pages = t[[4, 1]].reshape(2, 2, -1)
            assert decoded.metadata["layer"] == i, name
            assert torch.equal(decoded.key_cache[0].view(2, 2, -1), pages[..., : 4 * 8])
            assert torch.equal(decoded.value_cache[0].view(2, 2, -1), pages[..., 4 * 8 :])
    finally:
        worker.close()


def test_in_place_is_on_by_default_and_off_gathers_every_payload() -> None:
    assert ConnectorSettings().in_place
    with pytest.raises(ConfigError, match="in_place"):
        ConnectorSettings.from_extra_config({"in_place": "yes"})
    sender = _InPlaceSender()
    off = ConnectorSettings.from_extra_config({"in_place": False})
    worker = PageWorker(off, tp_rank=0, tp_size=1, total_kv_heads=2, producer=True, consumer=False,
                        connector_factory=lambda cfg: sender)  # fmt: skip
    caches = {"layer.0": torch.randn(6, 2, 4, 16).to(torch.bfloat16)}
    try:
        worker.register(caches)
        assert sender.registered == []
        worker.begin_step([SaveJob("r", "t", (4, 1), 7, 1, ends_now=True)])
        worker.save_layer("layer.0", caches["layer.0"])
        worker.end_step()
        wait_for(lambda: worker.finished({"r"})[0] == {"r"})
        assert sender.gathered == [layer_key("t", 0, 0, 0, 0)] and not sender.puts
    finally:
        worker.close()


def test_a_failed_put_in_place_fails_the_save_and_holds_nothing() -> None:
    class _Refusing(_InPlaceSender):
        def put_pieces(self, from_stage, to_stage, put_key, head, spans, on_free):  # noqa: ANN001, ANN201
            return False, 0, {"reason": "error", "detail": "refused by the test"}

    sender = _Refusing()
    fast = {"connector": {"type": "memory"}, "load_timeout_s": 1.0}
    worker = PageWorker(ConnectorSettings.from_extra_config(fast), tp_rank=0, tp_size=1, total_kv_heads=2,
                        producer=True, consumer=False, connector_factory=lambda cfg: sender)  # fmt: skip
    worker._saver.retry = attrs.evolve(worker._saver.retry, attempts=1)
    caches = {"layer.0": torch.randn(6, 2, 4, 16).to(torch.bfloat16)}
    try:
        worker.register(caches)
        worker.begin_step([SaveJob("r", "t", (4, 1), 7, 1, ends_now=True)])
        worker.save_layer("layer.0", caches["layer.0"])
        worker.end_step()
        # the save ends (failed): vLLM gets the blocks back, nothing is left pinned
        wait_for(lambda: worker.finished({"r"})[0] == {"r"})
        stats = worker.take_stats()
        assert stats.get("failures_put") == 1 and "bytes_in_place" not in stats and not sender.gathered
    finally:
        worker.close()


def _registered(extra: dict[str, Any], blocks: int) -> PageWorker:
    worker = PageWorker(
        ConnectorSettings.from_extra_config({"connector": {"type": "memory"}, **extra}),
        tp_rank=0,
        tp_size=1,
        total_kv_heads=2,
        producer=True,
        consumer=False,
        connector_factory=lambda cfg: _InPlaceSender(),
    )
    worker.register({f"layer.{i}": torch.zeros(blocks, 2, 4, 16, dtype=torch.bfloat16) for i in range(2)})
    return worker


def test_a_host_cache_is_moved_onto_huge_pages_at_registration() -> None:
    """By default a host cache of whole 2 MiB pages is collapsed onto huge pages when vLLM
    registers it; ``advise`` leaves the moving to the kernel, ``off`` does nothing; a bad value
    fails at start naming the key."""
    from kvferry.adapters.platform import thp_mode

    if thp_mode() in (None, "never"):
        pytest.skip(f"transparent huge pages are off or unknown here ({thp_mode()})")
    blocks = 16384  # 4 MiB a layer
    worker = _registered({}, blocks)
    try:
        done = worker.huge_pages
        assert done is not None and done.total == 2 * blocks * 256 and done.advised > 0
        if "Linux 6.1" not in done.reason:
            assert done.collapsed == done.advised
    finally:
        worker.close()
    worker = _registered({"huge_pages": "advise"}, blocks)
    try:
        assert worker.huge_pages is not None and worker.huge_pages.advised > 0 and worker.huge_pages.collapsed == 0
    finally:
        worker.close()
    worker = _registered({"huge_pages": "off"}, blocks)
    try:
        assert worker.huge_pages is None
    finally:
        worker.close()
    with pytest.raises(ConfigError, match="huge_pages"):
        ConnectorSettings.from_extra_config({"huge_pages": "always"})
