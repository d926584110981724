"""kvferry's vLLM connector without vLLM: the hand-off params, the scheduler's plans and the
workers' page moves over the in-process connector (fake caches in vLLM's CPU layout)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from page_kit import caches, load, names, page_worker, publish, wait_for

from kvferry.app.vllm.pages import PageGeometry, block_runs, layer_key, recv_slices, send_slices, write_pages
from kvferry.app.vllm.params import ConnectorSettings, parse_decode_params, parse_prefill_params, prefill_result
from kvferry.app.vllm.scheduler import PageScheduler
from kvferry.app.vllm.worker import LoadJob, PageWorker, SaveJob
from kvferry.core.errors import ConfigError, RoutingError

BS, HEADS, HEAD, LAYERS, BLOCKS = 32, 4, 32, 3, 16


def _params(**over):
    p = prefill_result(
        transfer_id="t1",
        host="127.0.0.1",
        port=50151,
        num_tokens=70,
        block_size=BS,
        num_layers=LAYERS,
        tp_size=1,
        decode_tp_size=1,
        connector_type="shm",
        engine_id="e",
    )
    p.update(over)
    return p


# ------------------------------------------------------------------------------------ params
def test_prefill_result_is_what_the_decode_side_reads() -> None:
    src = parse_decode_params(_params())
    assert (src.transfer_id, src.port, src.num_tokens, src.block_size) == ("t1", 50151, 70, BS)
    assert src.source_metadata(1) == {"source_host": "127.0.0.1", "source_port": 50167}


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("remote_port", "x"),
        ("remote_port", 70000),
        ("remote_num_tokens", 0),
        ("transfer_id", ""),
        ("remote_block_size", True),
        ("kvferry_version", 99),
        ("decode_tp_size", None),
    ],
)
def test_bad_decode_params_name_the_field(field: str, value: object) -> None:
    with pytest.raises(ConfigError, match=rf"^kv_transfer_params\.{field}: "):
        parse_decode_params(_params(**{field: value}))


def test_missing_decode_field_is_named_and_non_remote_params_are_none() -> None:
    p = _params()
    del p["remote_host"]
    with pytest.raises(ConfigError, match=r"^kv_transfer_params\.remote_host: missing"):
        parse_decode_params(p)
    assert parse_decode_params({"do_remote_prefill": False}) is None
    assert parse_decode_params(None) is None
    with pytest.raises(ConfigError, match="kv_transfer_params: expected a dict"):
        parse_decode_params([1])


def test_prefill_params() -> None:
    assert parse_prefill_params({"foo": 1}) is None
    assert parse_prefill_params({"do_remote_decode": True, "transfer_id": "a", "decode_tp_size": 2}).decode_tp_size == 2
    with pytest.raises(ConfigError, match=r"^kv_transfer_params\.decode_tp_size: "):
        parse_prefill_params({"do_remote_decode": True, "decode_tp_size": 0})
    with pytest.raises(ConfigError, match=r"^kv_transfer_params\.transfer_id: "):
        parse_prefill_params({"do_remote_decode": True, "transfer_id": 5})


def test_settings_from_extra_config() -> None:
    s = ConnectorSettings.from_extra_config(None)
    assert s.connector_type == "shm" and s.sender_port(0, 1) == 50151 and s.sender_port(1, 2) == 50167
    z = ConnectorSettings.from_extra_config({"connector": {"type": "zmq"}, "base_port": 40000})
    assert z.sender_config(0, 1) == {
        "type": "zmq",
        "pool_bytes": s.pool_bytes,
        "lease_s": 60.0,
        "role": "sender",
        "port": 40100,
        "host": "127.0.0.1",
    }
    assert z.receiver_config() == {"type": "zmq", "role": "receiver"}
    with pytest.raises(ConfigError, match=r"^kv_connector_extra_config\.bogus: unknown option"):
        ConnectorSettings.from_extra_config({"bogus": 1})
    with pytest.raises(ConfigError, match=r"^kv_connector_extra_config\.load_timeout_s: "):
        ConnectorSettings.from_extra_config({"load_timeout_s": 0})
    assert s.inline_load_s == 0.02 and ConnectorSettings.from_extra_config({"inline_load_s": 0}).inline_load_s == 0
    for bad in (-0.1, 2, True, "0.1"):
        with pytest.raises(ConfigError, match=r"^kv_connector_extra_config\.inline_load_s: "):
            ConnectorSettings.from_extra_config({"inline_load_s": bad})
    assert s.idle_wait_s == 0.002 and ConnectorSettings.from_extra_config({"idle_wait_s": 0}).idle_wait_s == 0
    for bad in (-0.001, 1.5, False, None):
        with pytest.raises(ConfigError, match=r"^kv_connector_extra_config\.idle_wait_s: "):
            ConnectorSettings.from_extra_config({"idle_wait_s": bad})


# ---------------------------------------------------------------------------------- routing
def test_head_routing_from_core() -> None:
    assert [(s.target_rank, s.head_start, s.head_stop) for s in send_slices(1, 2, 4, 0)] == [(0, 0, 2), (1, 2, 4)]
    assert [(s.source_rank, s.recv_head_start, s.recv_head_stop) for s in recv_slices(2, 1, 4, 0)] == [
        (0, 0, 2),
        (1, 2, 4),
    ]
    # replicated KV heads (TP above the head count): decode rank r holds head r*H//TP
    assert [(s.target_rank, s.head_start, s.head_stop) for s in send_slices(1, 4, 2, 0)] == [
        (0, 0, 1),
        (1, 0, 1),
        (2, 1, 2),
        (3, 1, 2),
    ]
    # replicated prefill ranks share the decode ranks; each decode rank reads each head once
    assert [[s.target_rank for s in send_slices(4, 8, 2, r)] for r in range(4)] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert [(s.source_rank, s.abs_head_start) for s in recv_slices(4, 1, 2, 0)] == [(0, 0), (2, 1)]
    with pytest.raises(RoutingError, match=r"num_heads 3 .*source_tp 2"):
        send_slices(2, 2, 3, 0)
    assert layer_key("r", 0, 0, 0, 1) == "r_0_1_0_1"  # chunk = layer + 1


def test_geometry_refuses_other_layouts() -> None:
    with pytest.raises(ConfigError, match=r"kv_caches\[0\].*\[num_blocks, heads, block_size, 2\*head_size\]"):
        PageGeometry.of([torch.zeros(2, 4, 8, 4, 16)])
    g = PageGeometry.of([torch.zeros(BLOCKS, HEADS, BS, 2 * HEAD, dtype=torch.bfloat16)])
    assert (g.heads, g.block_size, g.head_size, g.dtype) == (HEADS, BS, HEAD, "bfloat16")


def test_geometry_of_an_nhd_cache_reads_its_pages_through_strides() -> None:
    memory = torch.arange(BLOCKS * BS * HEADS * 2 * HEAD, dtype=torch.float32).view(BLOCKS, BS, HEADS, 2 * HEAD)
    nhd = memory.transpose(1, 2)  # vLLM's LBNHC: the logical [N, H, B, 2D] over [N, B, H, 2D]
    g = PageGeometry.of([nhd])
    assert g.nhd and (g.heads, g.block_size, g.head_size) == (HEADS, BS, HEAD)
    k, v = g.regions(nhd)
    assert k.data_ptr() == nhd.data_ptr()  # views, no copy
    # each region holds the bytes an HND cache's page would: the page's first / second half of rows
    hnd = nhd.contiguous()
    hk, hv = PageGeometry.of([hnd]).regions(hnd)
    assert torch.equal(k.reshape(hk.shape), hk) and torch.equal(v.reshape(hv.shape), hv)
    assert not torch.equal(memory.reshape(hk.shape[0], -1)[:, : hk[0].numel()], hk.reshape(hk.shape[0], -1))  # control
    with pytest.raises(ConfigError, match="as layer 0 is"):
        PageGeometry.of([hnd, nhd])
    with pytest.raises(ConfigError, match="expected a contiguous tensor"):
        PageGeometry.of([torch.zeros(BLOCKS, 2 * HEAD, BS, HEADS).permute(0, 3, 2, 1)])
    with pytest.raises(ConfigError, match="block size must be even"):
        PageGeometry.of([torch.zeros(BLOCKS, 3, HEADS, 2 * HEAD).transpose(1, 2)])


# ----------------------------------------------------------------------------------- workers
def _caches(heads: int, seed: int | None) -> dict[str, torch.Tensor]:
    return caches(LAYERS, BLOCKS, heads, BS, HEAD, seed)


def _worker(name: str, rank: int, tp: int, producer: bool, **extra) -> PageWorker:
    return page_worker(name, rank, tp, producer, HEADS, **extra)


def _prefill(name: str, job: SaveJob, seed: int = 1) -> tuple[PageWorker, dict[str, torch.Tensor]]:
    p = _worker(name, 0, 1, True)
    caches = _caches(HEADS, seed)
    publish(p, caches, job)
    return p, caches


def _source(tid: str, tokens: int, decode_tp: int = 1) -> object:
    return parse_decode_params(
        _params(transfer_id=tid, num_tokens=tokens, remote_num_tokens=tokens, decode_tp_size=decode_tp)
    )


def _decode_heads(decode_tp: int, rank: int) -> tuple[int, int]:
    """The heads vLLM gives decode rank ``rank`` (written out here, not taken from kvferry)."""
    if decode_tp <= HEADS:
        per = HEADS // decode_tp
        return rank * per, (rank + 1) * per
    head = rank * HEADS // decode_tp  # replicated: one head on decode_tp / HEADS ranks
    return head, head + 1


@pytest.mark.parametrize("decode_tp", [1, 2, 8])
def test_pages_move_as_stored_into_the_decode_blocks(decode_tp: int) -> None:
    name = f"vllm-pages-{next(names)}"
    p_blocks, d_blocks = (3, 7, 1), (10, 2, 5)
    p, src = _prefill(name, SaveJob("r", "t", p_blocks, 70, decode_tp))
    ranks = []
    for rank in range(decode_tp):
        d = _worker(name, rank, decode_tp, False)
        dst = _caches(max(1, HEADS // decode_tp), None)
        d.register(dst)
        assert load(d, LoadJob("r", _source("t", 70, decode_tp), d_blocks, 0)) == ({"r"}, set())
        ranks.append((d, dst))
    try:
        for rank, (_, dst) in enumerate(ranks):
            start, stop = _decode_heads(decode_tp, rank)
            for name_, layer in src.items():
                want = layer[list(p_blocks), start:stop]
                assert not torch.equal(want, layer[list(reversed(p_blocks)), start:stop])  # control: block order
                if stop - start < HEADS:  # control: the neighbouring heads' pages differ
                    assert not torch.equal(want, layer[list(p_blocks), stop % HEADS : stop % HEADS + stop - start])
                assert torch.equal(dst[name_][list(d_blocks)], want)  # bit for bit, page for page
                others = [b for b in range(BLOCKS) if b not in d_blocks]
                assert not dst[name_][others].any()  # nothing else written
    finally:
        for d, _ in ranks:
            d.close()
        p.close()


def test_partial_load_after_a_local_prefix_hit() -> None:
    name = f"vllm-pages-{next(names)}"
    p, src = _prefill(name, SaveJob("r", "t", (3, 7, 1), 70, 1))
    d = _worker(name, 0, 1, False)
    dst = _caches(HEADS, None)
    d.register(dst)
    try:  # the decode side had the first block already: pages 1.. go into its blocks 4, 9
        assert load(d, LoadJob("r", _source("t", 70), (4, 9), 1)) == ({"r"}, set())
        for layer_name, layer in src.items():
            assert torch.equal(dst[layer_name][[4, 9]], layer[[7, 1]])
    finally:
        d.close()
        p.close()


class _Corrupting:
    """A sending connector that flips one byte of every payload after the checksum was taken."""

    def __init__(self, config):
        from kvferry.app.registry import create_connector

        self.inner = create_connector(config)

    def reserve(self, from_stage, to_stage, put_key, nbytes):
        r = self.inner.reserve(from_stage, to_stage, put_key, nbytes)

        def commit():
            r.buffer[-1] ^= 0xFF
            return r.commit()

        return SimpleNamespace(buffer=r.buffer, commit=commit, abort=r.abort)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_corrupt_payload_is_a_load_error_of_every_block() -> None:
    name = f"vllm-pages-{next(names)}"
    settings = ConnectorSettings.from_extra_config({"connector": {"type": "memory", "shared_name": name}})
    p = PageWorker(
        settings,
        tp_rank=0,
        tp_size=1,
        total_kv_heads=HEADS,
        producer=True,
        consumer=False,
        connector_factory=_Corrupting,
    )
    p.register(_caches(HEADS, 1))
    job = SaveJob("r", "t", (1, 2, 3), 70, 1)
    p.begin_step([job])
    p.end_step()
    wait_for(lambda: p.pending_saves == 0 or p.finished({"r"})[0] == {"r"})
    d = _worker(name, 0, 1, False)
    d.register(_caches(HEADS, None))
    try:
        assert load(d, LoadJob("r", _source("t", 70), (4, 5, 6), 0)) == ({"r"}, {4, 5, 6})
        assert d.stats.peek()["failures_corrupt"] == 1
    finally:
        d.close()
        p.close()


def test_missing_prefill_times_out_and_bad_params_fail_at_once() -> None:
    name = f"vllm-pages-{next(names)}"
    d = _worker(name, 0, 1, False, load_timeout_s=0.2)
    d.register(_caches(HEADS, None))
    try:
        assert load(d, LoadJob("r", _source("nobody", 70), (4, 5, 6), 0)) == ({"r"}, {4, 5, 6})
        assert load(d, LoadJob("q", None, (7,), 0, error="kv_transfer_params.remote_port: missing")) == ({"q"}, {7})
        assert d.stats.peek() == {"failures_timeout": 1, "failures_params": 1}
    finally:
        d.close()


def test_decode_tp_mismatch_is_refused() -> None:
    name = f"vllm-pages-{next(names)}"
    d = _worker(name, 0, 2, False)
    d.register(_caches(HEADS // 2, None))
    try:
        assert load(d, LoadJob("r", _source("t", 70, decode_tp=1), (4,), 0)) == ({"r"}, {4})
        assert d.stats.peek() == {"failures_layout": 1}
    finally:
        d.close()


# --------------------------------------------------------------------------------- scheduler
def _request(rid: str, n: int, params: dict | None, computed: int = 0) -> SimpleNamespace:
    return SimpleNamespace(
        request_id=rid,
        kv_transfer_params=params,
        num_prompt_tokens=n,
        num_computed_tokens=computed,
        prompt_token_ids=list(range(n)),
    )


def _scheduler(producer: bool, **settings) -> PageScheduler:
    settings.setdefault("kv_recompute_threshold", 0)  # short prompts here are handed off
    return PageScheduler(
        ConnectorSettings(**settings),
        engine_id="e",
        block_size=BS,
        num_layers=LAYERS,
        tp_size=1,
        producer=producer,
        consumer=not producer,
        block_ids_of=lambda rid: [5, 6, 7, 8],
    )


def test_prefill_scheduler_saves_when_the_prefill_completes_and_keeps_blocks() -> None:
    s = _scheduler(True)
    req = _request("a", 70, {"do_remote_decode": True})
    s.track(req)
    s.track(_request("b", 10, None))
    assert s.build_plan({"a": 40}).saves == ()  # chunked: not complete yet
    req.num_computed_tokens = 40
    [job] = s.build_plan({"a": 30}).saves
    assert (job.req_id, job.transfer_id, job.block_ids, job.num_tokens) == ("a", "a", (5, 6, 7), 70)
    assert not job.ends_now  # it may run on after this step: its pages are not read in place
    assert s.build_plan({"a": 1}).saves == ()  # saved once
    # the prefill half of a P/D pair generates one token: it ends in the step its prefill completes
    one = _request("c", 70, {"do_remote_decode": True})
    one.max_tokens = 1
    s.track(one)
    [job] = s.build_plan({"c": 70}).saves
    assert job.ends_now
    keep, params = s.request_finished(req)
    assert keep and params["remote_num_tokens"] == 70 and params["remote_port"] == 50151
    assert s.pending_sends
    s.sent({"a"})
    assert not s.pending_sends
    assert s.request_finished(_request("b", 10, None)) == (False, None)


def test_prefill_bad_params_are_returned_to_the_client() -> None:
    s = _scheduler(True)
    req = _request("a", 70, {"do_remote_decode": True, "decode_tp_size": "two"})
    s.track(req)
    assert s.build_plan({"a": 70}).saves == ()
    keep, params = s.request_finished(req)
    assert not keep and params["kvferry_error"].startswith("kv_transfer_params.decode_tp_size")


def test_decode_scheduler_loads_asynchronously_once() -> None:
    s = _scheduler(False)
    req = _request("d", 70, _params(transfer_id="t", remote_num_tokens=70))
    assert s.matched_tokens(req, 0) == (70, True)
    s.after_alloc(req, [11, 12, 13], 70)
    [job] = s.build_plan({}).loads
    assert (job.req_id, job.block_ids, job.first_page, job.error) == ("d", (11, 12, 13), 0, None)
    assert s.matched_tokens(req, 0) == (0, False)  # a recompute after a failure loads nothing
    bad = _request("e", 70, _params(remote_port="x"))
    assert s.matched_tokens(bad, 32) == (38, True)
    s.after_alloc(bad, [1, 2, 3], 38)
    [job] = s.build_plan({}).loads
    assert job.block_ids == (2, 3) and job.first_page == 1 and job.error.startswith("kv_transfer_params.remote_port")


# ----------------------------------------------------------------------------- import rule
def test_importing_kvferry_never_imports_vllm() -> None:
    """Every kvferry module but the connector class's own imports without vLLM (a blocked
    import would fail), and the package the engine loads only imports it on first access."""
    code = r"""
import importlib, pkgutil, sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name == "vllm" or name.startswith("vllm."):
            raise ImportError("vllm imported by " + repr(name))
sys.meta_path.insert(0, Block())
import kvferry.core, kvferry.adapters, kvferry.app
# loaded only by vLLM itself (kv_connector_module_path): the connector class, and the bench's
# shim that lets vLLM's MooncakeConnector run on CPU-only torch
VLLM_MODULES = ("kvferry.app.vllm.connector", "kvferry.app.bench.engine.accelerator")
names = []
for pkg in (kvferry.core, kvferry.adapters, kvferry.app):
    for m in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + "."):
        if m.name in VLLM_MODULES or m.name.endswith("__main__"):
            continue
        importlib.import_module(m.name)
        names.append(m.name)
import kvferry.app.vllm as v
assert "kvferry.app.vllm.worker" in names and "kvferry.app.vllm.scheduler" in names, names
assert not [m for m in sys.modules if m == "vllm" or m.startswith("vllm.")]
print(len(names))
"""
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert int(out.stdout.strip().splitlines()[-1]) > 20


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


def test_pages_read_after_their_lease_are_an_expiredload() -> None:
    name = f"vllm-pages-{next(names)}"
    clock = _Clock()
    settings = ConnectorSettings.from_extra_config(
        {"connector": {"type": "memory", "shared_name": name, "clock": clock}, "lease_s": 5.0, "load_timeout_s": 2.0}
    )
    p = PageWorker(settings, tp_rank=0, tp_size=1, total_kv_heads=HEADS, producer=True, consumer=False)
    p.register(_caches(HEADS, 1))
    p.begin_step([SaveJob("r", "t", (1, 2, 3), 70, 1)])
    p.end_step()
    wait_for(lambda: p.finished({"r"})[0] == {"r"})
    clock.now += 6.0  # past the lease: nobody read the pages
    d = PageWorker(settings, tp_rank=0, tp_size=1, total_kv_heads=HEADS, producer=False, consumer=True)
    d.register(_caches(HEADS, None))
    try:
        assert load(d, LoadJob("r", _source("t", 70), (4, 5, 6), 0)) == ({"r"}, {4, 5, 6})
        failures = d.stats.peek()
        assert failures == {"failures_expired": 1}, failures
    finally:
        d.close()
        p.close()


def test_fan_in_prefill_tp2_to_decode_tp1_merges_heads_in_rank_order() -> None:
    name = f"vllm-pages-{next(names)}"
    settings = ConnectorSettings.from_extra_config({"connector": {"type": "memory", "shared_name": name}})
    prefills, sources = [], []
    for rank in range(2):
        p = PageWorker(settings, tp_rank=rank, tp_size=2, total_kv_heads=HEADS, producer=True, consumer=False)
        caches = _caches(HEADS // 2, 10 + rank)
        p.register(caches)
        job = SaveJob("r", "t", (2 + rank, 9), 40, 1)  # each rank's own blocks
        p.begin_step([job])
        for layer_name, t in caches.items():
            p.save_layer(layer_name, t)
        p.end_step()
        wait_for(lambda p=p: p.finished({"r"})[0] == {"r"})
        prefills.append(p)
        sources.append((caches, job.block_ids))
    d = _worker(name, 0, 1, False)
    dst = _caches(HEADS, None)
    d.register(dst)
    try:
        src = parse_decode_params(_params(transfer_id="t", remote_num_tokens=40, remote_tp_size=2))
        assert load(d, LoadJob("r", src, (12, 4), 0)) == ({"r"}, set())
        for layer_name in dst:
            want = torch.cat([c[layer_name][list(b)] for c, b in sources], dim=1)  # heads of rank 0, then 1
            assert torch.equal(dst[layer_name][[12, 4]], want)
    finally:
        d.close()
        for p in prefills:
            p.close()


def test_replicated_prefill_ranks_feed_one_decode_rank_each_head_once() -> None:
    # prefill TP 8 over 4 KV heads: ranks 2h and 2h+1 both hold head h (same pages, as in vLLM)
    name = f"vllm-pages-{next(names)}"
    settings = ConnectorSettings.from_extra_config({"connector": {"type": "memory", "shared_name": name}})
    full = _caches(HEADS, 21)
    blocks = (5, 1, 8)
    prefills = []
    for rank in range(8):
        p = PageWorker(settings, tp_rank=rank, tp_size=8, total_kv_heads=HEADS, producer=True, consumer=False)
        head = rank * HEADS // 8
        caches = {k: v[:, head : head + 1].contiguous() for k, v in full.items()}
        p.register(caches)
        job = SaveJob("r", "t", blocks, 90, 1)
        p.begin_step([job])
        for layer_name, t in caches.items():
            p.save_layer(layer_name, t)
        p.end_step()
        wait_for(lambda p=p: p.finished({"r"})[0] == {"r"})  # a replica that feeds nobody finishes too
        prefills.append(p)
    d = _worker(name, 0, 1, False)
    dst = _caches(HEADS, None)
    d.register(dst)
    try:
        src = parse_decode_params(_params(transfer_id="t", remote_num_tokens=90, remote_tp_size=8))
        assert load(d, LoadJob("r", src, (2, 11, 7), 0)) == ({"r"}, set())
        for layer_name in dst:
            assert torch.equal(dst[layer_name][[2, 11, 7]], full[layer_name][list(blocks)])  # every head, in order
            assert not torch.equal(dst[layer_name][[2, 11, 7]], full[layer_name][[1, 5, 8]])  # control: block order
    finally:
        d.close()
        for p in prefills:
            p.close()


def test_each_load_is_recorded_with_its_bytes_and_times() -> None:
    name = f"vllm-pages-{next(names)}"
    p, _ = _prefill(name, SaveJob("r", "t", (3, 7, 1), 70, 1))
    d = _worker(name, 0, 1, False, load_timeout_s=0.3)
    d.register(_caches(HEADS, None))
    try:
        assert load(d, LoadJob("r", _source("t", 70), (4, 9, 2), 0)) == ({"r"}, set())
        assert load(d, LoadJob("r2", _source("missing", 70), (5,), 0))[1] == {5}  # nothing published
        ok, failed = d.recent_loads
        # 3 pages x 4 heads x (K + V) x 32 x 32 bf16 values, per layer
        assert (ok.req_id, ok.transfer_id, ok.ok, ok.nbytes) == ("r", "t", True, LAYERS * 3 * HEADS * 2 * BS * HEAD * 2)
        assert ok.ended >= ok.started and ok.seconds == ok.ended - ok.started
        assert (failed.req_id, failed.ok, failed.nbytes) == ("r2", False, 0)
        # each is stamped once, when finished() told vLLM (the bench's report_ms)
        assert ok.reported is not None and ok.reported >= ok.ended
        assert failed.reported is not None and failed.reported >= failed.ended
    finally:
        d.close()
        p.close()


def test_a_load_is_stamped_reported_only_when_finished_reports_it() -> None:
    name = f"vllm-pages-{next(names)}"
    p, _ = _prefill(name, SaveJob("r", "t", (3, 7, 1), 70, 1))
    now = [100.0]
    d = _worker(name, 0, 1, False)
    d.clock = lambda: now[0]
    d.register(_caches(HEADS, None))
    try:
        d.start_loads([LoadJob("r", _source("t", 70), (4, 9, 2), 0)])  # there already: ends inline
        [record] = d.recent_loads
        assert record.ok and record.reported is None  # ended, vLLM not told yet
        now[0] = 100.5
        assert d.finished(set())[1] == {"r"}
        [record] = d.recent_loads
        assert record.reported == 100.5
        assert d.finished(set())[1] == set() and d.recent_loads[0].reported == 100.5  # stamped once
    finally:
        d.close()
        p.close()


# ------------------------------------------------------------------------- inline loads
_LAYER_OF_KEY = {layer_key("t", 0, layer, 0, 0): layer for layer in range(LAYERS)}


class _Recording:
    """A receiving connector that notes which thread read which layer of transfer "t"."""

    def __init__(self, config, log: list[tuple[int, str]]):
        from kvferry.app.registry import create_connector

        self.inner = create_connector(config)
        self.log = log

    def get_blocking(self, from_stage, to_stage, key, metadata=None, *, timeout_s):
        got = self.inner.get_blocking(from_stage, to_stage, key, metadata, timeout_s=timeout_s)
        if got is not None:
            self.log.append((_LAYER_OF_KEY[key], threading.current_thread().name))
        return got

    def get(self, from_stage, to_stage, key, metadata=None):
        got = self.inner.get(from_stage, to_stage, key, metadata)
        if got is not None:
            self.log.append((_LAYER_OF_KEY[key], threading.current_thread().name))
        return got

    def __getattr__(self, name):
        if name == "get_many" and hasattr(self.inner, "get_many"):

            def get_many(from_stage, to_stage, keys, metadata=None):
                self.log.append((-len(keys), threading.current_thread().name))  # one exchange, so many keys
                return self.inner.get_many(from_stage, to_stage, keys, metadata)

            return get_many
        return getattr(self.inner, name)


def _decode(settings: ConnectorSettings, factory) -> PageWorker:
    """A TP 1 decode rank whose receiving connector ``factory`` makes."""
    return PageWorker(
        settings, tp_rank=0, tp_size=1, total_kv_heads=HEADS, producer=False, consumer=True, connector_factory=factory
    )


def _recording_decode(
    name: str, log: list[tuple[int, str]], connector: dict | None = None, **extra
) -> tuple[PageWorker, dict[str, torch.Tensor]]:
    settings = ConnectorSettings.from_extra_config(
        {"connector": connector or {"type": "memory", "shared_name": name}, "load_timeout_s": 5.0, **extra}
    )
    d = _decode(settings, lambda cfg: _Recording(cfg, log))
    dst = _caches(HEADS, None)
    d.register(dst)
    return d, dst


def _saved_and_recording(**extra) -> tuple[PageWorker, dict, PageWorker, dict, list[tuple[int, str]]]:
    """``(prefill, its caches, decode, its caches, the decode's read log)``: request "r"
    (transfer "t", blocks 3, 7, 1) saved whole, and a recording decode rank beside it."""
    name = f"vllm-pages-{next(names)}"
    p, src = _prefill(name, SaveJob("r", "t", (3, 7, 1), 70, 1))
    log: list[tuple[int, str]] = []
    d, dst = _recording_decode(name, log, **extra)
    return p, src, d, dst, log


def test_a_load_whose_pages_are_there_ends_in_the_engine_thread() -> None:
    p, src, d, dst, log = _saved_and_recording()
    try:
        d.start_loads([LoadJob("r", _source("t", 70), (4, 9, 2), 0)])
        # finished at once, no wait: the load ran inside start_loads, in this thread
        assert d.finished(set()) == (set(), {"r"}) and d.load_errors() == set()
        assert log == [(layer, threading.current_thread().name) for layer in range(LAYERS)]
        for layer_name, layer in src.items():
            assert torch.equal(dst[layer_name][[4, 9, 2]], layer[[3, 7, 1]])
        assert d.recent_loads[-1].ok and d.recent_loads[-1].nbytes == LAYERS * 3 * HEADS * 2 * BS * HEAD * 2
    finally:
        d.close()
        p.close()


def test_without_inline_time_every_load_runs_on_a_load_thread() -> None:
    p, src, d, dst, log = _saved_and_recording(inline_load_s=0)
    try:
        assert load(d, LoadJob("r", _source("t", 70), (4, 9, 2), 0)) == ({"r"}, set())
        assert [layer for layer, _ in log] == list(range(LAYERS))
        assert all(thread.startswith("kvferry-load") for _, thread in log)
        for layer_name, layer in src.items():
            assert torch.equal(dst[layer_name][[4, 9, 2]], layer[[3, 7, 1]])
    finally:
        d.close()
        p.close()


def _half_saved(name: str, **extra) -> tuple[PageWorker, dict[str, torch.Tensor]]:
    """A prefill in the middle of its forward: layer 0 of request "r" (transfer "t") is out, the
    others come at its ``end_step()``."""
    return _in_the_forward(_worker(name, 0, 1, True, **extra), seed=3)


def _in_the_forward(p: PageWorker, seed: int) -> tuple[PageWorker, dict[str, torch.Tensor]]:
    """``p`` (a TP 1 prefill rank) registered and half through the forward of request "r"."""
    src = _caches(HEADS, seed)
    p.register(src)
    p.begin_step([SaveJob("r", "t", (3, 7, 1), 70, 1)])
    first = next(iter(src))
    p.save_layer(first, src[first])
    wait_for(lambda: p._saves["r"].layers_left == LAYERS - 1)
    return p, src


def test_a_load_started_before_the_prefill_ended_goes_on_where_the_engine_thread_stopped() -> None:
    name = f"vllm-pages-{next(names)}"
    p, src = _half_saved(name)  # layer 0 is out; layers 1.. come after the load starts
    log: list[tuple[int, str]] = []
    d, dst = _recording_decode(name, log)
    try:
        d.start_loads([LoadJob("r", _source("t", 70), (4, 9, 2), 0)])
        assert d.finished(set()) == (set(), set())  # not all there: still loading
        assert log == [(0, threading.current_thread().name)]
        p.end_step()  # the forward ends: the other layers are published
        got: set[str] = set()
        wait_for(lambda: got.update(d.finished(set())[1]) or "r" in got)
        assert d.load_errors() == set()
        assert [layer for layer, _ in log] == list(range(LAYERS))  # each layer read once, in order
        assert all(thread.startswith("kvferry-load") for _, thread in log[1:])
        for layer_name, layer in src.items():
            assert torch.equal(dst[layer_name][[4, 9, 2]], layer[[3, 7, 1]])
            assert not torch.equal(layer[[3, 7, 1]], layer[[1, 7, 3]])  # control: block order matters
        assert d.recent_loads[-1].nbytes == LAYERS * 3 * HEADS * 2 * BS * HEAD * 2
    finally:
        d.close()
        p.close()


def test_over_shm_an_inline_load_asks_the_prefill_for_every_layer_in_one_exchange(tmp_path) -> None:
    shm = {"type": "shm", "namespace": f"vp{os.getpid()}n{next(names)}", "runtime_dir": str(tmp_path)}
    settings = ConnectorSettings.from_extra_config({"connector": shm, "base_port": 41000, "pool_bytes": 1 << 20})
    p = PageWorker(settings, tp_rank=0, tp_size=1, total_kv_heads=HEADS, producer=True, consumer=False)
    src = _caches(HEADS, 5)
    p.register(src)
    p.begin_step([SaveJob("r", "t", (3, 7, 1), 70, 1)])
    p.end_step()
    wait_for(lambda: p.pending_saves == 0 or p.finished({"r"})[0] == {"r"})
    log: list[tuple[int, str]] = []
    d, dst = _recording_decode("unused", log, connector=shm)
    params = _params(transfer_id="t", num_tokens=70, remote_port=settings.sender_port(0, 1))
    try:
        d.start_loads([LoadJob("r", parse_decode_params(params), (4, 9, 2), 0)])
        assert d.finished(set()) == (set(), {"r"}) and d.load_errors() == set()
        assert log == [(-LAYERS, threading.current_thread().name)]  # one get_many, no single gets
        for layer_name, layer in src.items():
            assert torch.equal(dst[layer_name][[4, 9, 2]], layer[[3, 7, 1]])
        assert d._receiver.flush_releases(5.0)
        wait_for(lambda: p.sender_health()["used_bytes"] == 0)  # every region given back
    finally:
        d.close()
        p.close()


class _NeverThere:
    """A receiving connector where nothing ever arrives: each get waits out its timeout (as a
    real one does) and notes the thread and the timeout it was given."""

    def __init__(self, config, calls: list[tuple[str, float]]):
        self.calls = calls
        self.stop = threading.Event()

    def get_blocking(self, from_stage, to_stage, key, metadata=None, *, timeout_s):
        self.calls.append((threading.current_thread().name, timeout_s))
        self.stop.wait(timeout_s)
        return None

    def get_many(self, from_stage, to_stage, keys, metadata=None):
        return [None] * len(keys)

    def close(self):
        self.stop.set()


def test_the_loads_of_one_step_share_one_inlinewait_for() -> None:
    calls: list[tuple[str, float]] = []
    settings = ConnectorSettings.from_extra_config(
        {"connector": {"type": "memory"}, "load_timeout_s": 0.3, "inline_load_s": 0.05}
    )
    d = _decode(settings, lambda cfg: _NeverThere(cfg, calls))
    d.register(_caches(HEADS, None))
    try:
        d.start_loads([LoadJob(r, _source(f"t-{r}", 70), (i + 1,), 0) for i, r in enumerate(("a", "b", "c"))])
        engine = [t for name, t in calls if name == threading.current_thread().name]
        assert len(engine) == 1 and 0 < engine[0] <= 0.05  # the first waited; the budget was spent then
        got: set[str] = set()
        wait_for(lambda: got.update(d.finished(set())[1]) or got == {"a", "b", "c"})
        assert d.load_errors() == {1, 2, 3} and d.stats.peek()["failures_timeout"] == 3
        assert all(name.startswith("kvferry-load") for name, _ in calls[1:])
    finally:
        d.close()


# ------------------------------------------------------------------------------ block runs
@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 40), max_size=30))
def test_block_runs_rebuild_the_ids_and_are_maximal(ids: list[int]) -> None:
    runs = block_runs(ids)
    rebuilt = [first + k for first, _, length in runs for k in range(length)]
    assert rebuilt == ids
    assert [at for _, at, _ in runs] == [sum(r[2] for r in runs[:i]) for i in range(len(runs))]
    for (first, _, length), (nxt, _, _) in zip(runs, runs[1:]):
        assert first + length != nxt  # maximal: a run never continues into the next


@pytest.mark.parametrize("ids", [(4, 5, 6, 7), (9, 3, 4, 5, 12, 13, 0, 1), (5, 2, 8, 1)])
def test_pages_written_by_runs_equal_an_indexed_copy(ids: tuple[int, ...]) -> None:
    g = torch.Generator().manual_seed(len(ids))
    geometry = PageGeometry.of([torch.zeros(BLOCKS, HEADS, BS, 2 * HEAD, dtype=torch.bfloat16)])
    key = torch.randn(len(ids) + 1, 2, BS * HEAD, generator=g).to(torch.bfloat16)
    value = torch.randn(len(ids) + 1, 2, BS * HEAD, generator=g).to(torch.bfloat16)
    decoded = SimpleNamespace(key_cache=[key], value_cache=[value])
    index = torch.tensor(ids, dtype=torch.long)
    by_runs = torch.zeros(BLOCKS, HEADS, BS, 2 * HEAD, dtype=torch.bfloat16)
    by_index = torch.zeros_like(by_runs)
    n1 = write_pages(by_runs, geometry, decoded, index, 1, 1, 3, block_runs(ids))
    n2 = write_pages(by_index, geometry, decoded, index, 1, 1, 3)
    assert n1 == n2 == 2 * len(ids) * 2 * BS * HEAD * 2
    assert torch.equal(by_runs, by_index) and by_runs.any()
    kc = by_index.view(BLOCKS, HEADS, 2 * BS, HEAD)[:, :, :BS].reshape(BLOCKS, HEADS, BS * HEAD)
    assert torch.equal(kc[list(ids), 1:3], key[1:])  # pages 1.. of the payload, heads 1..2
    assert not kc[:, 0].any() and not kc[:, 3].any()  # control: other heads untouched


# ----------------------------------------------------------------------------- sync loads
def test_load_mode_is_checked_where_it_is_given() -> None:
    assert ConnectorSettings.from_extra_config(None).load_mode == "async"
    assert ConnectorSettings.from_extra_config({"load_mode": "sync"}).load_mode == "sync"
    with pytest.raises(ConfigError, match=r"^kv_connector_extra_config\.load_mode: expected one of async, sync"):
        ConnectorSettings.from_extra_config({"load_mode": "later"})
    assert parse_decode_params(_params()).load_mode is None
    assert parse_decode_params(_params(load_mode="sync")).load_mode == "sync"
    with pytest.raises(ConfigError, match=r"^kv_transfer_params\.load_mode: "):
        parse_decode_params(_params(load_mode=1))


@pytest.mark.parametrize(
    ("instance", "request_mode", "sync"),
    [("sync", None, True), ("async", "sync", True), ("sync", "async", False), ("async", None, False)],
)
def test_a_sync_load_offers_all_but_the_last_token_for_this_step(instance: str, request_mode, sync: bool) -> None:
    s = _scheduler(False, load_mode=instance)
    extra = {} if request_mode is None else {"load_mode": request_mode}
    req = _request("d", 70, _params(transfer_id="t", remote_num_tokens=70, **extra))
    assert s.matched_tokens(req, 0) == ((69, False) if sync else (70, True))
    s.after_alloc(req, [11, 12, 13], 69 if sync else 70)
    [job] = s.build_plan({}).loads
    assert (job.block_ids, job.first_page, job.sync) == ((11, 12, 13), 0, sync)


def test_a_sync_load_ends_in_the_step_and_is_never_reported_received() -> None:
    p, src, d, dst, log = _saved_and_recording()
    try:
        d.start_loads([LoadJob("r", _source("t", 70), (4, 9, 2), 0, sync=True)])
        for layer_name, layer in src.items():  # written before start_loads returned
            assert torch.equal(dst[layer_name][[4, 9, 2]], layer[[3, 7, 1]])
        assert log == [(layer, threading.current_thread().name) for layer in range(LAYERS)]
        assert d.finished(set()) == (set(), set()) and d.load_errors() == set()  # vLLM runs it already
        assert d.recent_loads[-1].ok and d.stats.peek()["requests_loaded"] == 1
    finally:
        d.close()
        p.close()


def test_a_sync_load_whose_pages_are_missing_fails_its_blocks_at_once() -> None:
    name = f"vllm-pages-{next(names)}"
    p, _ = _half_saved(name)  # only layer 0 is out when the decode step runs
    log: list[tuple[int, str]] = []
    d, _ = _recording_decode(name, log, inline_load_s=0.05)
    try:
        d.start_loads([LoadJob("r", _source("t", 70), (4, 9, 2), 0, sync=True)])
        assert d.load_errors() == {4, 9, 2}  # at once: vLLM recomputes (or fails) the request
        assert d.finished(set()) == (set(), set())
        assert d.stats.peek()["failures_timeout"] == 1 and not d.recent_loads[-1].ok
        assert log == [(0, threading.current_thread().name)]  # layer 0 read; nothing on a load thread
    finally:
        p.end_step()
        d.close()
        p.close()


def test_over_zmq_a_load_that_outlasts_the_engine_threads_wait_goes_on_and_is_exact() -> None:
    """Over real zmq: the engine thread reads layer 0 and waits ``inline_load_s`` for layer 1,
    which is not out yet; the load thread goes on with a new get of it, and every layer lands
    (a reply that came after the short wait would answer that newer get)."""
    from kvferry.adapters.platform import free_base_port

    settings = ConnectorSettings.from_extra_config(
        {"connector": {"type": "zmq"}, "base_port": free_base_port(), "load_timeout_s": 10.0, "inline_load_s": 0.05}
    )
    p, src = _in_the_forward(
        PageWorker(settings, tp_rank=0, tp_size=1, total_kv_heads=HEADS, producer=True, consumer=False), seed=9
    )
    log: list[tuple[int, str]] = []
    d, dst = _recording_decode("unused", log, connector={"type": "zmq"}, inline_load_s=0.05)
    params = _params(transfer_id="t", num_tokens=70, remote_port=settings.sender_port(0, 1), connector_type="zmq")
    try:
        d.start_loads([LoadJob("r", parse_decode_params(params), (4, 9, 2), 0)])
        assert d.finished(set()) == (set(), set())  # layer 1 not out: still loading
        assert log == [(0, threading.current_thread().name)]
        p.end_step()
        got: set[str] = set()
        wait_for(lambda: got.update(d.finished(set())[1]) or "r" in got)
        assert d.load_errors() == set()
        assert [layer for layer, _ in log] == list(range(LAYERS))
        assert all(thread.startswith("kvferry-load") for _, thread in log[1:])
        for layer_name, layer in src.items():
            assert torch.equal(dst[layer_name][[4, 9, 2]], layer[[3, 7, 1]])
    finally:
        d.close()
        p.close()


# ------------------------------------------------------------------------------ idle steps
def test_a_plan_is_idle_when_the_step_runs_no_tokens() -> None:
    s = _scheduler(True)
    assert s.build_plan({}).idle and not s.build_plan({"a": 3}).idle


def _timed(call):
    t0 = time.monotonic()
    out = call()
    return out, time.monotonic() - t0


def test_an_idle_step_of_the_prefill_waits_for_a_save_and_ends_with_it() -> None:
    """With a save in flight, an idle step's ``finished`` waits on the save thread's signal: at
    most ``idle_wait_s`` while nothing ends, and no longer than the save once it runs."""
    name = f"vllm-pages-{next(names)}"
    p, _ = _half_saved(name, idle_wait_s=0.05)  # layers 1.. are not queued before end_step
    try:
        (sent, _), waited = _timed(lambda: p.finished({"r"}, idle=True))
        assert sent == set() and waited >= 0.045  # nothing could end: the whole wait
        (sent, _), waited = _timed(lambda: p.finished({"r"}))
        assert sent == set() and waited < 0.05  # a step that ran tokens never waits
    finally:
        p.close()
    p, _ = _half_saved(name, idle_wait_s=1.0)
    try:
        p.end_step()  # the forward ends: the save thread publishes layers 1..
        (sent, _), waited = _timed(lambda: p.finished({"r"}, idle=True))
        assert sent == {"r"} and waited < 0.8  # woken by the save's end, not by the timeout
        (sent, _), waited = _timed(lambda: p.finished(set(), idle=True))
        assert sent == set() and waited < 0.5  # nothing in flight: no wait
    finally:
        p.close()


def test_an_idle_step_of_the_decode_waits_for_a_load_and_ends_with_it() -> None:
    name = f"vllm-pages-{next(names)}"
    p, src = _half_saved(name)
    log: list[tuple[int, str]] = []
    d, dst = _recording_decode(name, log, inline_load_s=0, idle_wait_s=1.0)
    try:
        d.start_loads([LoadJob("r", _source("t", 70), (4, 9, 2), 0)])
        assert d.finished(set()) == (set(), set())  # a load thread waits for layer 1
        p.end_step()
        (_, loaded), waited = _timed(lambda: d.finished(set(), idle=True))
        assert loaded == {"r"} and waited < 0.8 and d.load_errors() == set()
        for layer_name, layer in src.items():
            assert torch.equal(dst[layer_name][[4, 9, 2]], layer[[3, 7, 1]])
    finally:
        d.close()
        p.close()


def test_a_save_into_a_pool_it_never_fits_fails_without_retrying() -> None:
    """The one put rule (app/put.py) in the saver: a page payload larger than the whole pool is
    too_large, so it fails the request's transfer at the first attempt (no backoff), counted as a
    put failure; a payload that fits the same pool goes through (the control)."""
    name = f"pages-full-{next(names)}"
    settings = ConnectorSettings.from_extra_config(
        {"connector": {"type": "memory", "shared_name": name}, "pool_bytes": 1 << 16, "load_timeout_s": 2.0}
    )
    slept: list[float] = []
    p = PageWorker(
        settings, tp_rank=0, tp_size=1, total_kv_heads=HEADS, producer=True, consumer=False, sleep=slept.append
    )
    p.register(_caches(HEADS, 1))
    big = SaveJob("big", "t-big", tuple(range(8)), 8 * BS, 1)  # 8 blocks of 16 KiB per layer: over 64 KiB
    small = SaveJob("small", "t-small", (0,), BS, 1)  # one block per layer: fits
    for job in (big, small):
        p.begin_step([job])
        p.end_step()
    sent: set[str] = set()
    wait_for(lambda: sent.update(p.finished({"big", "small"})[0]) or sent == {"big", "small"})
    stats = p.stats.peek()
    assert slept == []  # too_large is never retried
    assert stats.get("failures_put") == 1, stats
    assert stats.get("requests_sent") == 1, stats


def test_a_save_into_a_full_pool_waits_for_a_read_to_free_room_and_counts_it() -> None:
    """Back-pressure: the pool (64 KiB) holds request a's three one-block pages (16 KiB each
    and a header); b's first page does not fit until a decode reads a's pages, which the put's
    wait lets happen here (the injected sleep reads them). b then goes out, counted once in
    ``put_waits``. The control: c, with nobody reading, uses up its attempts and fails as a put."""
    name = f"pages-wait-{next(names)}"
    settings = ConnectorSettings.from_extra_config(
        {"connector": {"type": "memory", "shared_name": name}, "pool_bytes": 1 << 16, "load_timeout_s": 2.0}
    )
    slept: list[float] = []
    loaded: list[tuple[set[str], set[int]]] = []

    def sleep(s: float) -> None:
        slept.append(s)
        if not loaded:  # the first wait: a decode reads a's pages
            loaded.append(load(d, LoadJob("a", _source("t-a", BS), (5,), 0)))

    p = PageWorker(settings, tp_rank=0, tp_size=1, total_kv_heads=HEADS, producer=True, consumer=False, sleep=sleep)
    p.register(_caches(HEADS, 1))
    d = _worker(name, 0, 1, False)  # after the prefill: the pool is the prefill's, of pool_bytes
    d.register(_caches(HEADS, None))
    try:
        sent: set[str] = set()
        for job in (SaveJob("a", "t-a", (0,), BS, 1), SaveJob("b", "t-b", (1,), BS, 1)):
            p.begin_step([job])
            p.end_step()
        wait_for(lambda: sent.update(p.finished({"a", "b"})[0]) or sent == {"a", "b"})
        stats = p.stats.peek()
        assert loaded == [({"a"}, set())] and len(slept) == 1, (slept, stats)
        assert stats.get("put_waits") == 1 and not stats.get("failures_put"), stats
        assert stats.get("requests_sent") == 2, stats
        # the control: b's pages fill the pool again and nobody reads them
        p.begin_step([SaveJob("c", "t-c", (2,), BS, 1)])
        p.end_step()
        wait_for(lambda: sent.update(p.finished({"c"})[0]) or "c" in sent)
        stats = p.stats.peek()
        assert stats.get("failures_put") == 1 and stats.get("put_waits") == 1, stats
        assert len(slept) == 1 + p.retry.attempts - 1, slept  # every attempt of c's first page waited
    finally:
        p.close()
        d.close()
