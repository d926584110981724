"""Hybrid KV cache groups on the worker side, without vLLM: layers of a full-attention group and
of a sliding-window group (vLLM's hybrid manager: one page shape, each group its own blocks) are
saved and loaded between PageWorkers over the memory connector. Each layer moves its group's
pages only (the window's for the sliding-window group), lands in the decode's blocks of that
group, and a load that cannot be written (a page the prefill did not send, another group's
payload) fails the request, reported per request (vLLM's ``failed_recving``), never as blocks."""

from __future__ import annotations

import itertools
import threading

import pytest
import torch
from page_kit import wait_for

from kvferry.adapters.checked_scatter import writable_bytes
from kvferry.adapters.torch_decode import decode_payload
from kvferry.app.vllm.group_pages import write_group_pages
from kvferry.app.vllm.groups import NULL_BLOCK, GroupPages
from kvferry.app.vllm.pages import PageGeometry, PageWriter
from kvferry.app.vllm.params import ConnectorSettings, parse_decode_params, prefill_result
from kvferry.app.vllm.worker import LoadJob, PageWorker, SaveJob
from kvferry.core.errors import ConfigError, PayloadError

BLOCKS, BS, HEADS, HD = 24, 16, 2, 32
LAYER_GROUPS = (0, 1, 0, 1)  # full, sliding window, full, sliding window
PAGE_BYTES = HEADS * BS * 2 * HD * 2  # one block of one layer, bf16
TOKENS = 100  # 7 pages; a window of 48 keeps pages 3..6 (skipped: 100 - 48 + 1 = 53 tokens)
P_FULL = [3, 7, 1, 9, 11, 2, 5]
P_SWA = [14, 4, 20, 8]  # pages 3..6
D_FULL = (10, 12, 13, 15, 16, 17, 18)
D_SWA = (NULL_BLOCK, NULL_BLOCK, NULL_BLOCK, 21, 6, 19, 22)
_names = itertools.count()


def _worker(name: str, rank: int, tp: int, producer: bool, groups: tuple[int, ...] = LAYER_GROUPS) -> PageWorker:
    settings = ConnectorSettings.from_extra_config(
        {"connector": {"type": "memory", "shared_name": name}, "load_timeout_s": 2.0}
    )
    w = PageWorker(settings, tp_rank=rank, tp_size=tp, total_kv_heads=HEADS, producer=producer, consumer=not producer)
    w.layer_groups = groups
    return w


def _caches(heads: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        f"model.layers.{i}.self_attn.attn": torch.randn(BLOCKS, heads, BS, 2 * HD, generator=g).to(torch.bfloat16)
        for i in range(len(LAYER_GROUPS))
    }


def _save(name: str, prefill_tp: int, decode_tp: int) -> tuple[list[PageWorker], list[dict[str, torch.Tensor]]]:
    job = SaveJob(
        "r",
        "t",
        tuple(P_FULL),
        TOKENS,
        decode_tp,
        (GroupPages(0, 0, tuple(P_FULL)), GroupPages(1, 3, tuple(P_SWA))),
    )
    workers, caches = [], []
    for rank in range(prefill_tp):
        p = _worker(name, rank, prefill_tp, True)
        c = _caches(HEADS // prefill_tp, seed=10 * (rank + 1))
        p.register(c)
        p.begin_step([job])
        for layer_name, t in c.items():
            p.save_layer(layer_name, t)
        p.end_step()
        wait_for(lambda p=p: p.finished({"r"})[0] == {"r"})
        workers.append(p)
        caches.append(c)
    return workers, caches


def _params(prefill_tp: int, decode_tp: int) -> dict:
    return prefill_result(
        transfer_id="t",
        host="127.0.0.1",
        port=50151,
        num_tokens=TOKENS,
        block_size=BS,
        num_layers=len(LAYER_GROUPS),
        tp_size=prefill_tp,
        decode_tp_size=decode_tp,
        connector_type="memory",
        engine_id="e",
    )


def _load(d: PageWorker, job: LoadJob) -> tuple[set[str], set[int]]:
    got: set[str] = set()
    wait_for(lambda: got.update(d.finished(set())[1]) or "r" in got)
    return d.failed_loads(), d.load_errors()


@pytest.mark.parametrize(("prefill_tp", "decode_tp"), [(1, 1), (1, 2), (2, 1)])
def test_each_group_moves_its_pages_into_its_own_blocks(prefill_tp: int, decode_tp: int) -> None:
    name = f"vllm-hybrid-{next(_names)}"
    prefills, sources = _save(name, prefill_tp, decode_tp)
    decodes = []
    try:
        source = parse_decode_params(_params(prefill_tp, decode_tp))
        job = LoadJob("r", source, D_FULL, 0, groups=(GroupPages(0, 0, D_FULL), GroupPages(1, 0, D_SWA)))
        for rank in range(decode_tp):
            d = _worker(name, rank, decode_tp, False)
            heads = HEADS // decode_tp
            dst = {n: torch.zeros(BLOCKS, heads, BS, 2 * HD, dtype=torch.bfloat16) for n in sources[0]}
            d.register(dst)
            decodes.append(d)
            d.start_loads([job])
            assert _load(d, job) == (set(), set())
            [record] = d.recent_loads
            # bytes: every page of the full layers, the window's 4 of 7 pages of the others
            assert record.ok and record.nbytes == (2 * 7 + 2 * 4) * PAGE_BYTES // decode_tp
            h0 = rank * heads  # this decode rank's heads, in the model's numbering
            for i, (layer_name, layer) in enumerate(dst.items()):
                per = HEADS // prefill_tp  # each head from the prefill rank that holds it
                src = torch.cat(
                    [sources[h // per][layer_name][:, h % per : h % per + 1] for h in range(h0, h0 + heads)], 1
                )
                if LAYER_GROUPS[i] == 0:
                    assert torch.equal(layer[list(D_FULL)], src[P_FULL])
                    written = set(D_FULL)
                else:
                    assert torch.equal(layer[list(D_SWA[3:])], src[P_SWA])
                    # control: the full group's blocks of those pages hold other bytes
                    assert not torch.equal(layer[list(D_SWA[3:])], src[P_FULL[3:]])
                    written = set(D_SWA[3:])
                assert not layer[[b for b in range(BLOCKS) if b not in written]].any(), layer_name
    finally:
        for w in decodes + prefills:
            w.close()


def test_a_page_the_prefill_did_not_send_fails_the_request_not_blocks() -> None:
    name = f"vllm-hybrid-{next(_names)}"
    prefills, _ = _save(name, 1, 1)
    d = _worker(name, 0, 1, False)
    try:
        d.register({n: torch.zeros(BLOCKS, HEADS, BS, 2 * HD, dtype=torch.bfloat16) for n in _caches(HEADS, 0)})
        source = parse_decode_params(_params(1, 1))
        # this decode keeps page 2 of the window too: the prefill sent pages 3..6 only
        wide = (NULL_BLOCK, NULL_BLOCK, 23, 21, 6, 19, 22)
        job = LoadJob("r", source, D_FULL, 0, groups=(GroupPages(0, 0, D_FULL), GroupPages(1, 0, wide)))
        d.start_loads([job])
        assert _load(d, job) == ({"r"}, set())  # failed_recving, no invalid blocks
        assert d.stats.peek().get("failures_layout") == 1
        assert not d.recent_loads[-1].ok
    finally:
        d.close()
        for p in prefills:
            p.close()


def test_a_payload_of_another_group_fails_the_load() -> None:
    name = f"vllm-hybrid-{next(_names)}"
    prefills, _ = _save(name, 1, 1)
    d = _worker(name, 0, 1, False, groups=(1, 0, 1, 0))  # this decode's layers in the other groups
    try:
        d.register({n: torch.zeros(BLOCKS, HEADS, BS, 2 * HD, dtype=torch.bfloat16) for n in _caches(HEADS, 0)})
        source = parse_decode_params(_params(1, 1))
        job = LoadJob("r", source, D_FULL, 0, groups=(GroupPages(0, 0, D_FULL), GroupPages(1, 0, D_SWA)))
        d.start_loads([job])
        assert _load(d, job) == ({"r"}, set())
        assert d.stats.peek().get("failures_layout") == 1
    finally:
        d.close()
        for p in prefills:
            p.close()


def test_layers_without_a_group_each_are_refused_at_register() -> None:
    w = _worker(f"vllm-hybrid-{next(_names)}", 0, 1, False, groups=(0, 1))
    with pytest.raises(ConfigError, match="4 layers, 2 in KV cache groups"):
        w.register(_caches(HEADS, 0))
    w.close()


# ------------------------------------------------------------------- a save that holds its step
class _Gated:
    """The memory connector's sender whose puts wait for ``gate`` (no reservations: every
    layer goes through ``put``)."""

    def __init__(self, inner: object, gate: threading.Event) -> None:
        self.inner, self.gate = inner, gate

    def put(self, **kw: object) -> object:
        assert self.gate.wait(10)
        return self.inner.put(**kw)  # type: ignore[attr-defined]

    def close(self) -> None:
        self.inner.close()  # type: ignore[attr-defined]


def _gated_worker(name: str, gate: threading.Event, timeout_s: float) -> PageWorker:
    from kvferry.app.registry import create_connector

    settings = ConnectorSettings.from_extra_config(
        {"connector": {"type": "memory", "shared_name": name}, "load_timeout_s": timeout_s}
    )
    w = PageWorker(
        settings,
        tp_rank=0,
        tp_size=1,
        total_kv_heads=HEADS,
        producer=True,
        consumer=False,
        connector_factory=lambda cfg: _Gated(create_connector(cfg), gate),
    )
    w.layer_groups = LAYER_GROUPS
    w.register(_caches(HEADS, 3))
    return w


def _one_step(w: PageWorker, hold: bool) -> None:
    groups = (GroupPages(0, 0, tuple(P_FULL)), GroupPages(1, 3, tuple(P_SWA)))
    w.begin_step([SaveJob("r", "t", tuple(P_FULL), TOKENS, 1, groups, hold_step=hold)])
    w.end_step()  # vLLM's wait_for_save: the forward handed no layer over, end_step queues them all


@pytest.mark.parametrize("hold", [False, True])
def test_a_save_that_holds_its_step_is_out_when_the_step_ends(hold: bool) -> None:
    """vLLM frees the window's first sent page right after the step (groups.freed_at_finish):
    such a save is out by then; another one goes on in the background (the control)."""
    gate = threading.Event()
    w = _gated_worker(f"vllm-hybrid-{next(_names)}", gate, 10.0)
    try:
        if hold:  # the puts go through once the gate opens, from another thread, while end_step waits
            threading.Thread(target=gate.set).start()
        _one_step(w, hold)
        assert (w.finished({"r"})[0] == {"r"}) is hold
        gate.set()
        wait_for(lambda: w.finished({"r"})[0] == {"r"} or not w.pending_saves)
        assert w.stats.peek().get("requests_sent") == 1
    finally:
        gate.set()
        w.close()


def test_a_held_save_not_out_by_its_deadline_is_failed_not_sent() -> None:
    gate = threading.Event()
    w = _gated_worker(f"vllm-hybrid-{next(_names)}", gate, 0.2)
    try:
        _one_step(w, True)  # the gate stays shut: end_step gives up after load_timeout_s
        assert w.stats.peek().get("failures_timeout") == 1
        gate.set()
        wait_for(lambda: w.finished({"r"})[0] == {"r"})
        assert not w.stats.peek().get("requests_sent")  # its remaining layers were not sent
    finally:
        gate.set()
        w.close()


def test_a_decode_of_one_group_refuses_a_hybrid_prefills_pages() -> None:
    """A decode with vLLM's hybrid manager off (one group) must not write a window's pages as
    if they started at page 0: the load fails (its blocks reported, the one-group way)."""
    name = f"vllm-hybrid-{next(_names)}"
    prefills, _ = _save(name, 1, 1)
    d = _worker(name, 0, 1, False, groups=())
    try:
        dst = {n: torch.zeros(BLOCKS, HEADS, BS, 2 * HD, dtype=torch.bfloat16) for n in _caches(HEADS, 0)}
        d.register(dst)
        d.start_loads([LoadJob("r", parse_decode_params(_params(1, 1)), D_FULL, 0)])
        assert _load(d, LoadJob("r", None, (), 0)) == (set(), set(D_FULL))
        assert d.stats.peek().get("failures_layout") == 1
        assert not any(t.any() for t in dst.values())  # nothing written
    finally:
        d.close()
        for p in prefills:
            p.close()


@pytest.mark.parametrize("fused", [True, False])
def test_a_flipped_byte_of_a_group_payload_fails_its_write(fused: bool) -> None:
    """A group's pages are checked as write_pages checks them (in the copy when the cache's
    bytes are given, else before it): a flipped byte raises PayloadError naming the tensor,
    and the same payload unflipped writes its pages (the control)."""
    source = _caches(HEADS, seed=3)["model.layers.0.self_attn.attn"]
    geometry = PageGeometry.of([source])
    writer = PageWriter(geometry, checksums="crc32c")
    sent = [4, 7, 9]
    meta = {"layout": geometry.payload_layout, "layer": 0, "block_size": BS, "group": 1, "first_page": 2}
    layout = writer.layout("t", sent, HEADS, meta)
    buf = torch.empty(layout.total_nbytes, dtype=torch.uint8)
    writer.gather(source, torch.tensor(sent), 0, HEADS, buf, layout)
    target = GroupPages(1, 2, (11, 12, 13))

    def write(data: torch.Tensor) -> tuple[int, torch.Tensor]:
        dest = torch.zeros_like(source)
        decoded = decode_payload(data, defer_verify=True)
        n = write_group_pages(
            dest,
            geometry,
            decoded,
            0,
            1,
            target,
            5,
            (HEADS, 0, HEADS),
            layer_bytes=writable_bytes(dest) if fused else None,
        )
        assert not decoded.unverified
        return n, dest

    n, dest = write(buf)
    assert n > 0 and torch.equal(dest[[11, 12, 13]], source[sent])
    bad = buf.clone()
    bad[-5] ^= 0x04  # in the last page's V region
    with pytest.raises(PayloadError, match="value_cache_0"):
        write(bad)
