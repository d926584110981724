"""Shared set-up of the vLLM page tests (no vLLM): workers over the in-process connector, a
prefill rank's forward that publishes a request, a decode rank's load, the params a prefill
returns, and a bounded wait. Imported by name (``from page_kit import ...``) by the test modules
beside it."""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch

from kvferry.app.vllm.params import ConnectorSettings, prefill_result
from kvferry.app.vllm.worker import LoadJob, PageWorker, SaveJob

#: Unique in-process connector names (``shared_name``), one per test that needs its own.
names = itertools.count()


def wait_for(pred: Callable[[], Any], timeout_s: float = 10.0, what: str = "timed out") -> None:
    """Poll ``pred`` every 10 ms until it is true; fail the test after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    tick = threading.Event()
    while not pred():
        assert time.monotonic() < deadline, what
        tick.wait(0.01)


def page_worker(name: str, rank: int, tp: int, producer: bool, total_kv_heads: int, **extra: Any) -> PageWorker:
    """A prefill (``producer``) or decode worker rank over the memory connector ``name``
    (``load_timeout_s`` 2 s unless ``extra`` says otherwise; ``extra`` is its extra config)."""
    settings = ConnectorSettings.from_extra_config(
        {"connector": {"type": "memory", "shared_name": name}, "load_timeout_s": 2.0, **extra}
    )
    return PageWorker(
        settings, tp_rank=rank, tp_size=tp, total_kv_heads=total_kv_heads, producer=producer, consumer=not producer
    )


def publish(worker: PageWorker, caches: Mapping[str, torch.Tensor], job: SaveJob, what: str = "timed out") -> None:
    """Register ``caches`` on a prefill ``worker`` and run one step that saves ``job`` (what
    vLLM's attention layers do during the forward), until the worker reports it sent."""
    worker.register(dict(caches))
    worker.begin_step([job])
    for layer_name, t in caches.items():
        worker.save_layer(layer_name, t)
    worker.end_step()
    wait_for(lambda: worker.finished({job.req_id})[0] == {job.req_id} or worker.pending_saves == 0, what=what)


def load(worker: PageWorker, job: LoadJob) -> tuple[set[str], set[int]]:
    """Start ``job`` on a decode ``worker`` and wait until it is reported finished:
    ``(loaded request ids, blocks of failed loads)``."""
    worker.start_loads([job])
    got: set[str] = set()
    wait_for(lambda: got.update(worker.finished(set())[1]) or job.req_id in got)
    return got, worker.load_errors()


def memory_params(
    *,
    tokens: int,
    block_size: int,
    layers: int,
    prefill_tp: int,
    decode_tp: int,
    engine_id: str,
    transfer_id: str = "t",
) -> dict[str, Any]:
    """The ``kv_transfer_params`` a memory-connector prefill of ``transfer_id`` returns."""
    return prefill_result(
        transfer_id=transfer_id,
        host="127.0.0.1",
        port=50151,
        num_tokens=tokens,
        block_size=block_size,
        num_layers=layers,
        tp_size=prefill_tp,
        decode_tp_size=decode_tp,
        connector_type="memory",
        engine_id=engine_id,
    )


def caches(
    layers: int, blocks: int, heads: int, block_size: int, head_size: int, seed: int | None = None
) -> dict[str, torch.Tensor]:
    """vLLM CPU caches ``[blocks, heads, block_size, 2 * head_size]`` bf16 under vLLM's layer
    names: zeros (a decode's), or random from ``seed`` (a prefill's)."""
    g = torch.Generator().manual_seed(seed) if seed is not None else None
    out = {}
    for i in range(layers):
        t = torch.zeros(blocks, heads, block_size, 2 * head_size, dtype=torch.bfloat16)
        if g is not None:
            t.copy_(torch.randn(t.shape, generator=g))
        out[f"model.layers.{i}.self_attn.attn"] = t
    return out
