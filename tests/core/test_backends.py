"""vLLM attention backends -> kvferry layouts (core.backends) and the re-blocking span."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvferry.core.backends import FP8_CACHE_DTYPES, MOVED_BACKENDS, backend_layout
from kvferry.core.errors import ConfigError
from kvferry.core.layouts import LayoutSpec, reblock_span


@pytest.mark.parametrize(
    ("backend", "layout"),
    [
        ("FLASH_ATTN", "packed"),
        ("FLASHINFER", "packed"),
        ("TRITON_ATTN", "packed"),
        ("FLASHMLA", "mla"),
        ("TRITON_MLA", "mla"),
        ("CPU_MLA", "mla"),
    ],
)
def test_gpu_and_mla_backends_map_to_their_layout(backend: str, layout: str) -> None:
    got = backend_layout(backend, cache_dtype="auto", stride_order="LBNHC", layer="model.layers.0.attn")
    assert got.layout == LayoutSpec(layout) and got.backend == backend and got.stride_order == "LBNHC"
    assert got.per_token and not got.fp8


@pytest.mark.parametrize("isa", ["vec", "avx2", "amx", "AMX"])
def test_cpu_backend_takes_the_kernel_isa(isa: str) -> None:
    got = backend_layout("CPU_ATTN", isa=isa)
    assert got.layout.name == "vllm_cpu" and got.layout.isa == ("vec" if isa == "avx2" else isa.lower())
    assert got.label == f"vllm_cpu:{got.layout.isa}/LBHNC" and got.per_token


def test_cpu_backend_of_an_unknown_isa_moves_pages_but_not_tokens() -> None:
    got = backend_layout("CPU_ATTN", isa="vec16")
    assert got.layout.isa == "vec16" and not got.per_token


def test_cpu_backend_without_isa_or_in_another_order_is_refused() -> None:
    with pytest.raises(ConfigError, match="did not say"):
        backend_layout("CPU_ATTN", isa=None, layer="L0")
    with pytest.raises(ConfigError, match="LBNHC is not the CPU kernel's"):
        backend_layout("CPU_ATTN", isa="vec", stride_order="LBNHC")


@pytest.mark.parametrize("backend", ["FLEX_ATTENTION", "ROCM_ATTN", "FLASH_ATTN_DIFFKV", "TURBOQUANT", "CUSTOM"])
def test_other_backends_are_refused_naming_them_and_the_moved_ones(backend: str) -> None:
    with pytest.raises(ConfigError) as err:
        backend_layout(backend, layer="model.layers.3.self_attn.attn")
    text = str(err.value)
    assert backend in text and "model.layers.3.self_attn.attn" in text
    assert all(name in text for name in MOVED_BACKENDS)


@pytest.mark.parametrize("dtype", FP8_CACHE_DTYPES)
def test_fp8_is_moved_for_dense_backends_only(dtype: str) -> None:
    fmt = "fp8_e5m2" if dtype == "fp8_e5m2" else "fp8_e4m3"  # vLLM's "fp8" is e4m3
    got = backend_layout("FLASH_ATTN", cache_dtype=dtype)
    assert got.fp8 == fmt and got.label.endswith(f"/{fmt}") and got.per_token
    # the CPU kernel's FP8 cache moves page for page only: its FP8 page order is not measured
    cpu = backend_layout("CPU_ATTN", cache_dtype=dtype, isa="vec")
    assert cpu.fp8 == fmt and cpu.label == f"vllm_cpu:vec/LBHNC/{fmt}" and not cpu.per_token
    assert backend_layout("CPU_ATTN", isa="vec").per_token  # control: the same kernel unquantised
    for backend in ("FLASHMLA", "CPU_MLA", "TRITON_MLA"):
        with pytest.raises(ConfigError, match="FP8 kv cache .* dense backends"):
            backend_layout(backend, cache_dtype=dtype)


def test_other_quantised_caches_are_refused() -> None:
    with pytest.raises(ConfigError, match="int8_per_token_head"):
        backend_layout("FLASH_ATTN", cache_dtype="int8_per_token_head")


@given(
    first=st.integers(0, 40),
    count=st.integers(0, 40),
    bs=st.sampled_from([16, 32, 64, 128]),
    src_bs=st.sampled_from([16, 32, 64, 128]),
    num_tokens=st.integers(0, 5000),
)
def test_reblock_span_is_the_fewest_sender_pages_holding_the_local_tokens(
    first: int, count: int, bs: int, src_bs: int, num_tokens: int
) -> None:
    start, stop, s0, s1 = reblock_span(first, count, bs, src_bs, num_tokens)
    assert start == first * bs
    if min(num_tokens, (first + count) * bs) <= start:  # nothing of the prompt in these pages
        assert stop == start and s0 == s1
        return
    assert stop == min(num_tokens, (first + count) * bs)
    assert s0 * src_bs <= start < (s0 + 1) * src_bs  # the first sender page holds the first token
    assert (s1 - 1) * src_bs < stop <= s1 * src_bs  # and the last one the last
    if bs == src_bs:
        assert (s0, s1) == (first, -(-stop // bs))


def test_reblock_span_rejects_bad_sizes() -> None:
    for args in ((0, 1, 0, 32, 10), (0, 1, 32, True, 10), (-1, 1, 32, 32, 10), (0, 1, 32, 32, None)):
        with pytest.raises(ConfigError):
            reblock_span(*args)  # type: ignore[arg-type]
