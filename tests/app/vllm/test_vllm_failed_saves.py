"""A prefill's failed save is told to the decode at once (failure records, core.tombstones):
the decode's load fails as ``sender_failed`` far within its ``load_timeout_s`` and vLLM's
policy applies in its next step; the control, a save that succeeds, loads the pages."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import torch
from page_kit import caches, memory_params, names, wait_for

from kvferry.app.registry import create_connector
from kvferry.app.vllm.params import ConnectorSettings, parse_decode_params
from kvferry.app.vllm.worker import LoadJob, PageWorker, SaveJob
from kvferry.core.errors import UnreadableGrant
from kvferry.core.policy import RetryPolicy

BS, HEADS, HEAD, LAYERS, BLOCKS = 32, 4, 32, 3, 16
TOKENS = 64  # two pages a layer: 2 x 16 KiB
P_BLOCKS, D_BLOCKS = (3, 7), (10, 2)
LOAD_TIMEOUT_S = 30.0
FAST_S = 2.0  # a told failure ends the load in well under this (measured: milliseconds)
SMALL_POOL = 1 << 16  # the smallest pool the settings take
FILLER = 40 << 10  # what an unread payload leaves of it: less than one layer's pages


def _worker(name: str, producer: bool, factory: Any = create_connector, **extra: Any) -> PageWorker:
    settings = ConnectorSettings.from_extra_config({"connector": {"type": "memory", "shared_name": name}, **extra})
    return PageWorker(
        settings,
        tp_rank=0,
        tp_size=1,
        total_kv_heads=HEADS,
        producer=producer,
        consumer=not producer,
        connector_factory=factory,
    )


def _job(name: str) -> LoadJob:
    params = memory_params(tokens=TOKENS, block_size=BS, layers=LAYERS, prefill_tp=1, decode_tp=1, engine_id=name)
    return LoadJob("r", parse_decode_params(params), D_BLOCKS, 0)


def _decode(name: str) -> tuple[PageWorker, dict[str, torch.Tensor]]:
    d = _worker(name, False, load_timeout_s=LOAD_TIMEOUT_S)
    dst = caches(LAYERS, BLOCKS, HEADS, BS, HEAD)
    d.register(dst)
    return d, dst


def _wait_loaded(d: PageWorker) -> tuple[float, set[int]]:
    """Seconds until the decode reports its load finished, and the blocks reported failed."""
    start = time.monotonic()
    got: set[str] = set()
    wait_for(lambda: got.update(d.finished(set())[1]) or "r" in got, timeout_s=LOAD_TIMEOUT_S + 5)
    return time.monotonic() - start, d.load_errors()


def _check_pages(dst: dict[str, torch.Tensor], src: dict[str, torch.Tensor], loaded: bool) -> None:
    for layer_name, layer in src.items():
        want = layer[list(P_BLOCKS)]
        assert want.any()
        assert torch.equal(dst[layer_name][list(D_BLOCKS)], want) is loaded


@pytest.mark.parametrize("full", [True, False])
def test_a_save_that_meets_a_full_pool_fails_the_decodes_load_at_once(full: bool) -> None:
    """The decode waits for the pages (its load started first); the prefill's pool holds an
    unread payload that leaves less than a layer's pages free, so the first layer's put fails
    after its retries (``failures_put``) and the decode's load ends ``sender_failed`` within
    ``FAST_S`` of a 30 s timeout, its blocks reported failed. The control: a pool with room,
    the same load gets the prefill's pages bit for bit."""
    name = f"vllm-failed-{next(names)}"
    made: list[Any] = []

    def factory(cfg: Any) -> Any:
        made.append(create_connector(cfg))
        return made[-1]

    p = _worker(name, True, factory, pool_bytes=SMALL_POOL if full else 1 << 20)
    p.retry = RetryPolicy(attempts=2, first_backoff_s=0.05)
    src = caches(LAYERS, BLOCKS, HEADS, BS, HEAD, seed=5)
    p.register(src)
    d, dst = _decode(name)
    try:
        if full:
            assert made[0].put("0", "1", "someone-else", torch.zeros(FILLER, dtype=torch.uint8))[0]
        started = time.monotonic()
        d.start_loads([_job(name)])
        p.begin_step([SaveJob("r", "t", P_BLOCKS, TOKENS, 1)])
        p.end_step()
        seconds, failed = _wait_loaded(d)
        seconds = time.monotonic() - started
        wait_for(lambda: p.finished({"r"})[0] == {"r"})
        print(f"full pool {full}: the decode's load ended {seconds:.3f} s after it started")
        if full:
            assert seconds < FAST_S, seconds
            assert failed == set(D_BLOCKS)
            assert p.stats.peek().get("failures_put") == 1 and p.stats.peek().get("saves_failed_told") == 1
            assert d.stats.peek() == {"failures_sender_failed": 1}
            assert made[0].health()["entries"] == 1  # only the filler: nothing of the failed save left
        else:
            assert failed == set()
            assert d.stats.peek().get("requests_loaded") == 1 and "failures_sender_failed" not in d.stats.peek()
            assert not any(k.startswith("failures") for k in p.stats.peek())
        _check_pages(dst, src, loaded=not full)
    finally:
        d.close()
        p.close()


class _Gated:
    """The memory connector's sender whose puts wait for ``gate`` (no reservations: every
    layer goes through ``put``); its failure records go straight through."""

    def __init__(self, inner: Any, gate: threading.Event) -> None:
        self.inner, self.gate = inner, gate

    def put(self, **kw: Any) -> Any:
        assert self.gate.wait(10)
        return self.inner.put(**kw)

    def publish_failure(self, *args: Any) -> bool:
        return self.inner.publish_failure(*args)

    def close(self) -> None:
        self.inner.close()


@pytest.mark.parametrize("out_in_time", [False, True])
def test_a_save_dropped_at_the_end_of_its_step_fails_the_decodes_load_at_once(out_in_time: bool) -> None:
    """A save that holds its step (``hold_step``: vLLM frees a page it sends right after the
    step) and is not out when the prefill's wait ends is failed (``failures_timeout``) and told:
    the decode's load, waiting with 30 s to go, ends ``sender_failed`` at once. The control: the
    puts go through while the step waits, and the decode loads the pages."""
    name = f"vllm-failed-{next(names)}"
    gate = threading.Event()
    p = _worker(name, True, lambda cfg: _Gated(create_connector(cfg), gate), load_timeout_s=0.3)
    src = caches(LAYERS, BLOCKS, HEADS, BS, HEAD, seed=6)
    p.register(src)
    d, dst = _decode(name)
    try:
        started = time.monotonic()
        d.start_loads([_job(name)])
        if out_in_time:
            threading.Thread(target=gate.set).start()
        p.begin_step([SaveJob("r", "t", P_BLOCKS, TOKENS, 1, hold_step=True)])
        p.end_step()  # shut gate: gives up after the prefill's 0.3 s
        seconds, failed = _wait_loaded(d)
        seconds = time.monotonic() - started
        gate.set()
        wait_for(lambda: p.finished({"r"})[0] == {"r"})
        print(f"out in time {out_in_time}: the decode's load ended {seconds:.3f} s after it started")
        if out_in_time:
            assert failed == set() and d.stats.peek().get("requests_loaded") == 1
            assert not any(k.startswith("failures") for k in p.stats.peek())
        else:
            assert seconds < FAST_S, seconds
            assert failed == set(D_BLOCKS)
            assert p.stats.peek().get("failures_timeout") == 1 and p.stats.peek().get("saves_failed_told") == 1
            assert d.stats.peek() == {"failures_sender_failed": 1}
        _check_pages(dst, src, loaded=out_in_time)
    finally:
        gate.set()
        d.close()
        p.close()


class _Mute:
    """A gated sender that cannot carry failure records (as mooncake): no ``publish_failure``."""

    def __init__(self, inner: Any, gate: threading.Event) -> None:
        self.inner, self.gate = inner, gate

    def put(self, **kw: Any) -> Any:
        assert self.gate.wait(10)
        return self.inner.put(**kw)

    def close(self) -> None:
        self.inner.close()


def test_over_a_connector_without_records_the_decode_still_waits_out_its_timeout() -> None:
    """The fallback: the same dropped save over a connector that cannot say it fails the
    decode's load at its ``load_timeout_s`` (here 1 s), as before, counted ``timeout``."""
    name = f"vllm-failed-{next(names)}"
    gate = threading.Event()
    p = _worker(name, True, lambda cfg: _Mute(create_connector(cfg), gate), load_timeout_s=0.3)
    p.register(caches(LAYERS, BLOCKS, HEADS, BS, HEAD, seed=7))
    d = _worker(name, False, load_timeout_s=1.0)
    d.register(caches(LAYERS, BLOCKS, HEADS, BS, HEAD))
    try:
        started = time.monotonic()
        d.start_loads([_job(name)])
        p.begin_step([SaveJob("r", "t", P_BLOCKS, TOKENS, 1, hold_step=True)])
        p.end_step()
        _, failed = _wait_loaded(d)
        seconds = time.monotonic() - started
        print(f"no records: the decode's load ended {seconds:.3f} s after it started")
        assert seconds >= 1.0 and failed == set(D_BLOCKS)
        assert p.stats.peek().get("failures_timeout") == 1 and "saves_failed_told" not in p.stats.peek()
        assert d.stats.peek() == {"failures_timeout": 1}
    finally:
        gate.set()
        d.close()
        p.close()


class _Unreadable:
    """The decode's connector whose blocking gets meet a grant they cannot read, as the shm
    connector raises it when the prefill's segment cannot be mapped here (another shm_dir)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def get_blocking(self, *args: Any, **kw: Any) -> Any:
        raise UnreadableGrant("the sender at ipc://p granted 'k' in shared memory this receiver cannot read")

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def test_a_grant_the_decode_cannot_read_fails_its_load_at_once() -> None:
    """A layer whose grant the decode cannot read (UnreadableGrant from the connector's
    blocking get) fails the load as ``unavailable`` within ``FAST_S`` of its 30 s timeout, its
    blocks reported failed, instead of waiting for a key the grant drained."""
    name = f"vllm-failed-{next(names)}"
    d = _worker(name, False, lambda cfg: _Unreadable(create_connector(cfg)), load_timeout_s=LOAD_TIMEOUT_S)
    d.register(caches(LAYERS, BLOCKS, HEADS, BS, HEAD))
    try:
        started = time.monotonic()
        d.start_loads([_job(name)])
        _, failed = _wait_loaded(d)
        seconds = time.monotonic() - started
        assert seconds < FAST_S, seconds
        assert failed == set(D_BLOCKS)
        assert d.stats.peek() == {"failures_unavailable": 1}
    finally:
        d.close()
