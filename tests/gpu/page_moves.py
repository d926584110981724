"""One request's pages saved by kvferry's prefill worker and loaded by its decode worker
(:class:`kvferry.app.vllm.worker.PageWorker`, the connector's own saver and loader), on
caches written by cache_writers in a backend's layout, on any device.

The source tokens come from a seeded generator on the CPU, so a decode in another process
rebuilds them and checks its cache's bytes against them (decode_peer.py)."""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping
from typing import Any

import torch
from cache_writers import LAYOUTS, cache_layout_label, new_cache, read_tokens, slots_of, write_tokens

from kvferry.app.vllm.params import ConnectorSettings, parse_decode_params, prefill_result
from kvferry.app.vllm.worker import LoadJob, PageWorker, SaveJob

LAYERS, HEADS, HEAD, LATENT = 4, 8, 128, 576
K_SCALES, V_SCALES = [0.5, 0.25, 0.125, 0.0625], [1.0, 0.75, 0.5, 0.375]


def layer_names() -> list[str]:
    return [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]


def source_tokens(layout: str, num_tokens: int, seed: int, dtype: torch.dtype) -> list[torch.Tensor]:
    """Per layer, the request's per-token rows (random bytes for an FP8 ``uint8`` cache)."""
    latent = LAYOUTS[layout][1]
    shape = (num_tokens, LATENT) if latent else (num_tokens, HEADS, 2 * HEAD)
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.uint8:
        return [torch.randint(0, 256, shape, generator=g, dtype=torch.uint8) for _ in range(LAYERS)]
    return [torch.randn(shape, generator=g).to(dtype) for _ in range(LAYERS)]


def caches(layout: str, num_blocks: int, block_size: int, dtype: torch.dtype, device: Any) -> dict[str, torch.Tensor]:
    latent = LAYOUTS[layout][1]
    heads, width = (1, LATENT) if latent else (HEADS, 2 * HEAD)
    return {n: new_cache(layout, num_blocks, heads, block_size, width, dtype, device) for n in layer_names()}


def worker(connector: Mapping[str, Any], base_port: int, producer: bool, layout: str, fp8: str | None) -> PageWorker:
    extra = {"connector": dict(connector), "base_port": base_port, "load_timeout_s": 60.0}
    if "pool_bytes" in connector:  # the prefill's pool (a connector setting of the worker's)
        extra["pool_bytes"] = connector["pool_bytes"]
        extra["connector"] = {k: v for k, v in connector.items() if k != "pool_bytes"}
    settings = ConnectorSettings.from_extra_config(extra)
    w = PageWorker(settings, tp_rank=0, tp_size=1, total_kv_heads=HEADS, producer=producer, consumer=not producer)
    w.latent, w.cache_layout, w.fp8 = LAYOUTS[layout][1], cache_layout_label(layout, fp8), fp8
    if fp8 is not None:
        w.kv_scales = lambda: (K_SCALES, V_SCALES)
    return w


def wait(pred, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    tick = threading.Event()
    while not pred():
        if time.monotonic() > deadline:
            raise TimeoutError("timed out")
        tick.wait(0.002)


def save(
    connector: Mapping[str, Any],
    base_port: int,
    layout: str,
    block_ids: list[int],
    num_tokens: int,
    *,
    seed: int,
    block_size: int,
    num_blocks: int,
    dtype: torch.dtype,
    device: Any,
    fp8: str | None = None,
) -> tuple[PageWorker, dict[str, torch.Tensor], dict[str, Any], float]:
    """A prefill worker that has saved the request: (worker, its caches, the decode's
    ``kv_transfer_params``, seconds from the save's start until every layer was out)."""
    src = caches(layout, num_blocks, block_size, dtype, device)
    slots = slots_of(block_ids, block_size, num_tokens, device)
    for layer, tokens in zip(src.values(), source_tokens(layout, num_tokens, seed, dtype)):
        write_tokens(layer, tokens.to(device), slots)
    p = worker(connector, base_port, True, layout, fp8)
    p.register(src)
    if device != "cpu":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    p.begin_step([SaveJob("r", "t", tuple(block_ids), num_tokens, 1)])
    for name, t in src.items():
        p.save_layer(name, t)
    p.end_step()
    wait(lambda: p.finished({"r"})[0] == {"r"})
    seconds = time.perf_counter() - t0
    params = prefill_result(
        transfer_id="t",
        host="127.0.0.1",
        port=p.settings.sender_port(0, 1),
        num_tokens=num_tokens,
        block_size=block_size,
        num_layers=LAYERS,
        tp_size=1,
        decode_tp_size=1,
        connector_type=str(connector["type"]),
        engine_id="e",
    )
    return p, src, params, seconds


def load(
    connector: Mapping[str, Any],
    base_port: int,
    layout: str,
    params: dict[str, Any],
    block_ids: list[int],
    *,
    block_size: int,
    num_blocks: int,
    dtype: torch.dtype,
    device: Any,
    fp8: str | None = None,
) -> tuple[PageWorker, dict[str, torch.Tensor], float, set[int]]:
    """A decode worker that has loaded the request: (worker, its caches, seconds, the blocks
    of a failed load)."""
    d = worker(connector, base_port, False, layout, fp8)
    dst = caches(layout, num_blocks, block_size, dtype, device)
    d.register(dst)
    t0 = time.perf_counter()
    d.start_loads([LoadJob("r", parse_decode_params(params), tuple(block_ids), 0)])
    got: set[str] = set()
    wait(lambda: got.update(d.finished(set())[1]) or "r" in got)
    if device != "cpu":
        torch.cuda.synchronize()
    return d, dst, time.perf_counter() - t0, d.load_errors()


def tokens_equal(
    layout: str, cache: Mapping[str, torch.Tensor], block_ids: list[int], num_tokens: int, seed: int, dtype: torch.dtype
) -> list[bool]:
    """Per layer: the cache's tokens in ``block_ids`` are the seeded source's, byte for byte."""
    latent = LAYOUTS[layout][1]
    first = next(iter(cache.values()))
    slots = slots_of(block_ids, first.shape[2], num_tokens, first.device)
    out = []
    for layer, want in zip(cache.values(), source_tokens(layout, num_tokens, seed, dtype)):
        got = read_tokens(layer, slots, latent=latent).cpu()
        out.append(bool(torch.equal(got.contiguous().view(torch.uint8), want.contiguous().view(torch.uint8))))
    return out
