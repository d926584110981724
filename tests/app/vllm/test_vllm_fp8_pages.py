"""FP8 caches through the vLLM connector's workers, without vLLM: pages move as their bytes,
every payload carries the format and every layer's scales, and a decode whose scales (or
format) differ fails the load (``layout``) before it writes anything.

Caches are CPU tensors of torch's float8 dtypes and, as vLLM allocates an FP8 cache, of
``uint8`` with the format named (``PageWorker.fp8``), in the dense backends' ``packed`` page
(each token's K then V, ``[num_blocks, heads, block_size, 2 * head_size]``)."""

from __future__ import annotations

import itertools
import logging
import threading
import time

import pytest
import torch

from kvferry.app.vllm.params import ConnectorSettings, parse_decode_params, prefill_result
from kvferry.app.vllm.worker import LoadJob, PageWorker, SaveJob
from kvferry.core.errors import ConfigError

BLOCKS, HEADS, HEAD, LAYERS = 10, 2, 32, 3
_names = itertools.count()
NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
K_SCALES, V_SCALES = [0.0625, 0.125, 0.03125], [0.25, 0.5, 0.1875]


def _fp8_caches(dtype: torch.dtype, bs: int, seed: int | None) -> dict[str, torch.Tensor]:
    """Random bytes as an FP8 cache (every bit pattern, NaNs included: bytes are what moves)."""
    g = torch.Generator().manual_seed(seed) if seed is not None else None
    out = {}
    for name in NAMES:
        raw = torch.zeros(BLOCKS, HEADS, bs, 2 * HEAD, dtype=torch.uint8)
        if g is not None:
            raw.copy_(torch.randint(0, 256, raw.shape, generator=g, dtype=torch.uint8))
        out[name] = raw if dtype == torch.uint8 else raw.view(dtype)
    return out


def _worker(name: str, producer: bool, fmt: str, scales: tuple[list[float], list[float]], layout: str) -> PageWorker:
    settings = ConnectorSettings.from_extra_config(
        {"connector": {"type": "memory", "shared_name": name}, "load_timeout_s": 2.0}
    )
    w = PageWorker(settings, tp_rank=0, tp_size=1, total_kv_heads=HEADS, producer=producer, consumer=not producer)
    w.fp8, w.cache_layout, w.kv_scales = fmt, layout, lambda: scales
    if layout.startswith("vllm_cpu:"):
        w.kernel_isa = layout.split(":", 1)[1].split("/", 1)[0]
    return w


def _wait(pred, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    tick = threading.Event()
    while not pred():
        assert time.monotonic() < deadline, "timed out"
        tick.wait(0.01)


def _prefill(name: str, caches: dict[str, torch.Tensor], blocks: tuple[int, ...], tokens: int, **kw) -> PageWorker:
    p = _worker(name, True, **kw)
    p.register(caches)
    p.begin_step([SaveJob("r", "t", blocks, tokens, 1)])
    for layer_name, t in caches.items():
        p.save_layer(layer_name, t)
    p.end_step()
    _wait(lambda: p.finished({"r"})[0] == {"r"})
    return p


def _load(d: PageWorker, tokens: int, bs: int, blocks: tuple[int, ...]) -> set[int]:
    params = prefill_result(
        transfer_id="t",
        host="127.0.0.1",
        port=50151,
        num_tokens=tokens,
        block_size=bs,
        num_layers=LAYERS,
        tp_size=1,
        decode_tp_size=1,
        connector_type="memory",
        engine_id="e",
    )
    d.start_loads([LoadJob("r", parse_decode_params(params), blocks, 0)])
    got: set[str] = set()
    _wait(lambda: got.update(d.finished(set())[1]) or "r" in got)
    return d.load_errors()


def _token_bytes(cache: torch.Tensor, blocks: tuple[int, ...], tokens: int) -> torch.Tensor:
    """``[tokens, heads, 2 * head]`` bytes of a packed cache, read per token (FlashAttention's
    ``t.transpose(1, 2)`` view: slot ``block * B + row``)."""
    raw = cache.view(torch.uint8)
    return raw[list(blocks)].transpose(1, 2).reshape(-1, HEADS, 2 * HEAD)[:tokens]


FORMATS = [(torch.float8_e4m3fn, "fp8_e4m3"), (torch.float8_e5m2, "fp8_e5m2"), (torch.uint8, "fp8_e4m3")]


@pytest.mark.parametrize(("dtype", "fmt"), FORMATS)
def test_fp8_pages_move_as_their_bytes_with_their_scales(dtype: torch.dtype, fmt: str) -> None:
    name, tokens, p_blocks, d_blocks = f"fp8-{next(_names)}", 50, (4, 0, 7, 2), (1, 9, 3, 6)
    src = _fp8_caches(dtype, 16, seed=1)
    kw = {"fmt": fmt, "scales": (K_SCALES, V_SCALES), "layout": f"packed/LBHNC/{fmt}"}
    p = _prefill(name, src, p_blocks, tokens, **kw)
    d = _worker(name, False, **kw)
    try:
        dst = _fp8_caches(dtype, 16, seed=None)
        d.register(dst)
        assert _load(d, tokens, 16, d_blocks) == set() and d.stats.peek().get("failures_layout") is None
        for layer_name in NAMES:
            want = src[layer_name].view(torch.uint8)[list(p_blocks)]
            assert torch.equal(dst[layer_name].view(torch.uint8)[list(d_blocks)], want)  # bit for bit
            assert not torch.equal(src[layer_name].view(torch.uint8)[list(reversed(p_blocks))], want)  # control
            assert not dst[layer_name].view(torch.uint8)[[b for b in range(BLOCKS) if b not in d_blocks]].any()
    finally:
        d.close()
        p.close()


@pytest.mark.parametrize(("src_bs", "dst_bs"), [(16, 32), (32, 16)])
def test_fp8_pages_of_another_block_size_are_reblocked_byte_for_byte_per_token(src_bs: int, dst_bs: int) -> None:
    name, tokens = f"fp8-{next(_names)}", 45
    p_blocks, d_blocks = (5, 2, 8)[: -(-tokens // src_bs)], (0, 6, 3)[: -(-tokens // dst_bs)]
    kw = {"fmt": "fp8_e4m3", "scales": (K_SCALES, V_SCALES), "layout": "packed/LBHNC/fp8_e4m3"}
    src = _fp8_caches(torch.float8_e4m3fn, src_bs, seed=2)
    p = _prefill(name, src, p_blocks, tokens, **kw)
    d = _worker(name, False, **kw)
    try:
        dst = _fp8_caches(torch.float8_e4m3fn, dst_bs, seed=None)
        d.register(dst)
        assert _load(d, tokens, src_bs, d_blocks) == set()
        for layer_name in NAMES:
            want = _token_bytes(src[layer_name], p_blocks, tokens)
            assert torch.equal(_token_bytes(dst[layer_name], d_blocks, tokens), want)
            # control: the sender's pages copied as they are would be other tokens
            as_is = src[layer_name].view(torch.uint8)[list(p_blocks)].reshape(-1)[: want.numel()]
            assert not torch.equal(as_is, want.reshape(-1))
    finally:
        d.close()
        p.close()


@pytest.mark.parametrize("differs", ["k_scale", "v_scale", "format", "layers"])
def test_a_decode_whose_scales_differ_fails_the_load_naming_the_layer_and_writes_nothing(
    differs: str, caplog: pytest.LogCaptureFixture
) -> None:
    name, tokens, blocks = f"fp8-{next(_names)}", 40, (1, 2, 3)
    kw = {"fmt": "fp8_e4m3", "scales": (K_SCALES, V_SCALES), "layout": "packed/LBHNC/fp8_e4m3"}
    p = _prefill(name, _fp8_caches(torch.uint8, 16, seed=3), blocks, tokens, **kw)
    k, v, fmt = list(K_SCALES), list(V_SCALES), "fp8_e4m3"
    if differs == "k_scale":
        k[2] *= 2
    elif differs == "v_scale":
        v[1] = 0.5000001
    elif differs == "format":
        fmt = "fp8_e5m2"  # the same uint8 cache, other numbers
    d = _worker(name, False, fmt=fmt, scales=(k, v), layout=f"packed/LBHNC/{fmt}")
    if differs == "layers":  # a decode of another model: the scales of two layers
        d.kv_scales = lambda: (k[:2], v[:2])
        with pytest.raises(ConfigError, match="kv_scales: 2 k_scale entries for 3 layers"):
            d.register(_fp8_caches(torch.uint8, 16, seed=None))
        p.close()
        return
    try:
        dst = _fp8_caches(torch.uint8, 16, seed=None)
        d.register(dst)
        with caplog.at_level(logging.ERROR, logger="kvferry.app.vllm.loader"):
            assert _load(d, tokens, 16, blocks) == set(blocks)
        assert d.stats.peek() == {"failures_layout": 1}
        assert all(not t.any() for t in dst.values())  # no layer written, not even those before
        text = caplog.text
        if differs == "format":
            assert "fp8_e4m3, this cache is fp8_e5m2" in text and NAMES[0] in text
        else:
            layer = 2 if differs == "k_scale" else 1
            assert f"layer {layer} ({NAMES[layer]})" in text and "FP8 scales differ" in text
    finally:
        d.close()
        p.close()


def test_an_fp8_cache_needs_its_scales_at_start() -> None:
    w = _worker(f"fp8-{next(_names)}", True, fmt="fp8_e4m3", scales=([], []), layout="packed/LBHNC/fp8_e4m3")
    w.kv_scales = None
    with pytest.raises(ConfigError, match="kv_scales: an FP8 cache"):
        w.register(_fp8_caches(torch.uint8, 16, seed=None))
    # a float8 tensor is FP8 without being told
    w2 = _worker(f"fp8-{next(_names)}", True, fmt="", scales=([], []), layout="packed/LBHNC")
    w2.fp8, w2.kv_scales = None, None
    with pytest.raises(ConfigError, match=r"kv_scales: an FP8 cache \(fp8_e5m2\)"):
        w2.register(_fp8_caches(torch.float8_e5m2, 16, seed=None))


def test_fp8_cpu_kernel_pages_of_another_block_size_are_refused() -> None:
    # the CPU kernel's FP8 page order is not measured: page for page only
    name, tokens = f"fp8-{next(_names)}", 40
    kw = {"fmt": "fp8_e4m3", "scales": (K_SCALES, V_SCALES), "layout": "vllm_cpu:vec/LBHNC/fp8_e4m3"}
    p = _prefill(name, _fp8_caches(torch.uint8, 32, seed=4), (0, 1), tokens, **kw)
    d = _worker(name, False, **kw)
    try:
        dst = _fp8_caches(torch.uint8, 64, seed=None)
        d.register(dst)
        assert _load(d, tokens, 32, (5,)) == {5}
        assert d.stats.peek() == {"failures_layout": 1}
        assert all(not t.any() for t in dst.values())
    finally:
        d.close()
        p.close()
