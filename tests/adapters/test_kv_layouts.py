"""Named cache layouts: each built the way its engine writes it, read back per token bit for bit."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvferry.adapters.kv_layouts import AmbiguousLayout, split_named, split_unnamed, vllm_pages_to_tokens
from kvferry.adapters.paged_cache import extract_request, plan_extraction
from kvferry.core.errors import ConfigError
from kvferry.core.layouts import LAYOUT_NAMES, check_layer_shape, layout_spec, shape_candidates

N, B, H, D, L = 7, 4, 3, 8, 12


def _truth(seed: int = 0, dtype: torch.dtype = torch.bfloat16) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    k = torch.randint(-30000, 30000, (N, B, H, D), generator=gen, dtype=torch.int16).view(dtype)
    v = torch.randint(-30000, 30000, (N, B, H, D), generator=gen, dtype=torch.int16).view(dtype)
    return k, v


def _vllm_cpu_vec_pages(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """What vLLM's CPU attention (AVX2 ``vec`` kernel) writes: per (block, head) page, K as
    [head_dim][block_size] then V as [block_size][head_dim] (ENGINES.md), element by element."""
    out = torch.empty(N, H, B, 2 * D, dtype=k.dtype)
    flat = out.view(N, H, 2 * B * D)
    for n in range(N):
        for h in range(H):
            for tok in range(B):
                for dim in range(D):
                    flat[n, h, dim * B + tok] = k[n, tok, h, dim]
                    flat[n, h, B * D + tok * D + dim] = v[n, tok, h, dim]
    return out


def _engine_layer(name: str, k: torch.Tensor, v: torch.Tensor):
    if name == "flash":
        return torch.stack([k, v])
    if name == "flashinfer":
        return torch.stack([k, v], dim=1)
    if name == "flash_hnd":
        return torch.stack([k.transpose(1, 2), v.transpose(1, 2)]).contiguous()
    if name == "flashinfer_hnd":
        return torch.stack([k.transpose(1, 2), v.transpose(1, 2)], dim=1).contiguous()
    if name == "packed":
        return torch.cat([k, v], dim=-1).transpose(1, 2).contiguous()
    if name == "tuple":
        return (k.clone(), v.clone())
    if name == "vllm_cpu":
        return _vllm_cpu_vec_pages(k, v)
    if name == "vllm_cpu_pages_hnd":  # the same pages as (K regions, V regions)
        regions = _vllm_cpu_vec_pages(k, v).view(N, H, 2, B * D)
        return (regions[:, :, 0].contiguous(), regions[:, :, 1].contiguous())
    raise AssertionError(name)


def _per_token(blocks: torch.Tensor, ids: list[int], tokens: int) -> torch.Tensor:
    return blocks[torch.tensor(ids)].flatten(0, 1)[:tokens]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16)


IDS, TOKENS = [5, 0, 3, 2], 14


@pytest.mark.parametrize(
    "name", [n if not n.startswith("vllm_cpu") else f"{n}:avx2" for n in LAYOUT_NAMES if n != "mla"]
)
def test_each_layout_reads_back_per_token_k_and_v(name: str) -> None:
    k, v = _truth()
    layer = _engine_layer(name.partition(":")[0], k, v)
    key_blocks, value_blocks = split_named(layer, name, block_size=B, heads=H, head_dim=D)
    assert value_blocks is not None
    assert key_blocks.shape == value_blocks.shape == (N, B, H, D)
    assert torch.equal(_bits(_per_token(key_blocks, IDS, TOKENS)), _bits(_per_token(k, IDS, TOKENS)))
    assert torch.equal(_bits(_per_token(value_blocks, IDS, TOKENS)), _bits(_per_token(v, IDS, TOKENS)))


def test_vllm_cpu_pages_read_as_packed_come_out_wrong() -> None:
    """The control: the same bytes under the packed reading are not the engine's K/V."""
    k, v = _truth(1)
    pages = _vllm_cpu_vec_pages(k, v)
    key_blocks, value_blocks = split_named(pages, "packed", block_size=B)
    assert value_blocks is not None
    assert not torch.equal(_bits(key_blocks), _bits(k))
    assert not torch.equal(_bits(value_blocks), _bits(v))


def test_mla_latent_is_the_key_and_the_value_is_absent() -> None:
    gen = torch.Generator().manual_seed(2)
    latent = torch.randn(N, B, L, generator=gen).to(torch.bfloat16)
    key_blocks, value_blocks = split_named(latent, "mla", block_size=B, head_dim=L)
    assert value_blocks is None
    assert torch.equal(_bits(_per_token(key_blocks, IDS, TOKENS)), _bits(_per_token(latent, IDS, TOKENS)))


@pytest.mark.parametrize("isa", [None, "amx", "neon", "vec16"])
def test_vllm_cpu_with_an_unknown_isa_is_refused_not_misread(isa: str | None) -> None:
    k, v = _truth()
    name = "vllm_cpu" if isa is None else f"vllm_cpu:{isa}"
    with pytest.raises(ConfigError, match="vllm_cpu.*refusing rather than reading it as 'packed'"):
        split_named(_vllm_cpu_vec_pages(k, v), name, block_size=B)


def test_unknown_name_lists_the_known_ones() -> None:
    with pytest.raises(ConfigError, match="unknown layout 'nhd'.*flash, flashinfer.*vllm_cpu"):
        layout_spec("nhd")
    with pytest.raises(ConfigError, match="takes no isa"):
        layout_spec("flash:avx2")
    assert layout_spec({"name": "vllm_cpu", "isa": "AVX2"}).isa == "avx2"


def test_shape_mismatch_says_which_dimension_differs() -> None:
    k, v = _truth()
    layer = torch.stack([k, v])
    with pytest.raises(ConfigError, match=r"layer 3: layout 'flash' .* dim 2 \(block_size\) is 4, expected 16"):
        split_named(layer, "flash", block_size=16, layer=3)
    with pytest.raises(ConfigError, match=r"dim 3 \(heads\) is 3, expected 2"):
        split_named(layer, "flash", block_size=B, heads=2)
    with pytest.raises(ConfigError, match=r"layout 'flashinfer' .* dim 1 \(kv\) is 7, expected 2"):
        split_named(layer, "flashinfer", block_size=B)
    with pytest.raises(ConfigError, match=r"layout 'mla' is \[num_blocks, block_size, latent_dim\] \(3-D\), got a 5-D"):
        split_named(layer, "mla", block_size=B)
    with pytest.raises(ConfigError, match=r"dim 3 \(2\*head_dim\) is odd"):
        check_layer_shape("packed", (N, H, B, 7), block_size=B)


def test_unnamed_shapes_two_layouts_could_mean_are_refused_naming_them() -> None:
    k, v = _truth()
    packed = _engine_layer("packed", k, v)
    with pytest.raises(AmbiguousLayout, match="fits layouts 'packed', 'vllm_cpu'"):
        split_unnamed(packed, block_size=B)
    two_blocks = torch.zeros(2, 2, B, H, D)
    with pytest.raises(AmbiguousLayout, match="'flash', 'flashinfer'"):
        split_unnamed(two_blocks, block_size=B)
    # heads == block_size: HND dimension order is never guessed, so this is flash
    square = torch.stack([torch.zeros(N, B, B, D), torch.ones(N, B, B, D)])
    key, value = split_unnamed(square, block_size=B)
    assert not key.any() and bool(value.all())
    # the reference's unambiguous shapes still read as before
    key, value = split_unnamed(torch.stack([k, v]), block_size=B)
    assert torch.equal(_bits(key), _bits(k)) and torch.equal(_bits(value), _bits(v))
    key, value = split_unnamed(torch.stack([k, v], dim=1), block_size=B)
    assert torch.equal(_bits(value), _bits(v))
    # an MLA latent is never guessed: skipped with a reason that says to name it
    reason = split_unnamed(torch.zeros(N, B, L), block_size=B)
    assert isinstance(reason, str) and "'mla'" in reason


def test_candidates_rules() -> None:
    assert shape_candidates((2, N, B, H, D), B) == ("flash",)
    assert shape_candidates((N, 2, H, B, D), B) == ("flashinfer",)
    assert shape_candidates((2, 2, 3, 4), 3) == ("flash", "flashinfer", "packed", "vllm_cpu")
    assert shape_candidates((N, B, L), B) == ("mla",)
    assert shape_candidates((N, H, B, 2 * D), None) == ()


@pytest.mark.parametrize(
    "name", [n if not n.startswith("vllm_cpu") else f"{n}:avx2" for n in LAYOUT_NAMES if n != "mla"]
)
def test_extraction_api_takes_the_layout_name(name: str) -> None:
    """plan_extraction / extract_request with a name: per-token K/V bit for bit, any layout."""
    k, v = _truth(3)
    layers = [_engine_layer(name.partition(":")[0], k, v)] * 2
    result = extract_request(layers, IDS, TOKENS, B, cache_dtype="bfloat16", layout=name)
    for layer in range(2):
        assert torch.equal(_bits(result.key_cache[layer]), _bits(_per_token(k, IDS, TOKENS)))
        assert torch.equal(_bits(result.value_cache[layer]), _bits(_per_token(v, IDS, TOKENS)))
    assert "kv_latent" not in result.metadata


def test_extraction_of_an_mla_latent_has_keys_only_and_the_flag() -> None:
    gen = torch.Generator().manual_seed(4)
    latent = torch.randint(-30000, 30000, (N, B, L), generator=gen, dtype=torch.int16).view(torch.bfloat16)
    plan = plan_extraction([latent, latent], IDS, TOKENS, B, cache_dtype="bfloat16", layout="mla")
    assert plan.values == (None, None) and plan.metadata["kv_latent"] is True and plan.shard_heads is None
    keys, values = plan.materialize()
    assert values == [None, None]
    assert torch.equal(_bits(keys[1]), _bits(_per_token(latent, IDS, TOKENS)))


def test_extraction_refuses_ambiguous_and_mismatched_caches() -> None:
    k, v = _truth()
    with pytest.raises(AmbiguousLayout, match="layer 0: .*'packed', 'vllm_cpu'"):
        plan_extraction([_engine_layer("packed", k, v)], IDS, TOKENS, B, cache_dtype="x")
    with pytest.raises(ConfigError, match=r"layer 1: layout 'flash' .* dim 2 \(block_size\) is 4, expected 8"):
        plan_extraction(
            [torch.zeros(2, N, 8, H, D), torch.stack([k, v])], IDS, TOKENS, 8, cache_dtype="x", layout="flash"
        )
    with pytest.raises(ConfigError, match="unknown layout 'fa3'"):
        plan_extraction([torch.stack([k, v])], IDS, TOKENS, B, cache_dtype="x", layout="fa3")
    with pytest.raises(ConfigError, match="vllm_cpu"):
        plan_extraction([_vllm_cpu_vec_pages(k, v)], IDS, TOKENS, B, cache_dtype="x", layout="vllm_cpu")


# --------------------------------------------------------------- vllm_cpu_pages_hnd payloads
def _kernel_pages(isa: str, k: torch.Tensor, v: torch.Tensor, b: int, blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token ``[T, H, D]`` K/V written into ``blocks`` pages the way vLLM's CPU kernel
    ``isa`` writes them (element offsets as measured, tests/core/test_page_order.py); the slots
    after the last token hold junk, as a reused block does."""
    t_count, h, d = k.shape
    junk = torch.Generator().manual_seed(99)
    kp = torch.randint(-30000, 30000, (blocks, h, b * d), generator=junk, dtype=torch.int16).view(k.dtype)
    vp = torch.randint(-30000, 30000, (blocks, h, b * d), generator=junk, dtype=torch.int16).view(k.dtype)
    tok = torch.arange(t_count).view(-1, 1)
    dim = torch.arange(d).view(1, -1)
    tb = tok % b
    if isa == "vec":
        k_off, v_off = dim * b + tb, tb * d + dim
    else:
        k_off = ((tb // 16) * (d // 2) + dim // 2) * 32 + (tb % 16) * 2 + dim % 2
        v_off = ((dim // 16) * (b // 2) + tb // 2) * 32 + (dim % 16) * 2 + tb % 2
    page = (tok // b).expand(t_count, d)
    for head in range(h):
        kp[page, head, k_off] = k[:, head, :]
        vp[page, head, v_off] = v[:, head, :]
    return kp, vp


_page_cases = st.one_of(
    st.tuples(st.just("vec"), st.integers(1, 9), st.integers(1, 12)),
    st.tuples(st.just("amx"), st.sampled_from([32, 64]), st.sampled_from([32, 64])),
)


@settings(max_examples=30, deadline=None)
@given(_page_cases, st.integers(1, 3), st.integers(1, 100), st.integers(0, 2))
def test_vllm_pages_round_trip_per_token_and_cut_at_num_tokens(
    case: tuple[str, int, int], heads: int, tokens: int, spare: int
) -> None:
    isa, b, d = case
    blocks = -(-tokens // b) + spare  # a partial last block, and pages beyond the tokens
    gen = torch.Generator().manual_seed(tokens)
    k = torch.randint(-30000, 30000, (tokens, heads, d), generator=gen, dtype=torch.int16).view(torch.bfloat16)
    v = torch.randint(-30000, 30000, (tokens, heads, d), generator=gen, dtype=torch.int16).view(torch.bfloat16)
    kp, vp = _kernel_pages(isa, k, v, b, blocks)
    gk, gv = vllm_pages_to_tokens(kp, vp, block_size=b, num_tokens=tokens, isa=isa, heads=heads, head_dim=d)
    assert gk.shape == gv.shape == (tokens, heads, d) and gk.is_contiguous() and gv.is_contiguous()
    assert torch.equal(_bits(gk), _bits(k)) and torch.equal(_bits(gv), _bits(v))


def test_vllm_pages_read_with_the_other_isa_come_out_wrong() -> None:
    """The control: amx pages read as vec (and the reverse) are not the tokens."""
    gen = torch.Generator().manual_seed(5)
    k = torch.randint(-30000, 30000, (40, 2, 32), generator=gen, dtype=torch.int16).view(torch.bfloat16)
    v = torch.randint(-30000, 30000, (40, 2, 32), generator=gen, dtype=torch.int16).view(torch.bfloat16)
    for wrote, read in (("amx", "vec"), ("vec", "amx")):
        kp, vp = _kernel_pages(wrote, k, v, 32, 2)
        gk, gv = vllm_pages_to_tokens(kp, vp, block_size=32, num_tokens=40, isa=read)
        assert not torch.equal(_bits(gk), _bits(k)) and not torch.equal(_bits(gv), _bits(v))


def test_vllm_pages_refusals_name_the_problem() -> None:
    kp = torch.zeros(2, 1, 32 * 32, dtype=torch.bfloat16)
    with pytest.raises(ConfigError, match="num_tokens: 65 does not fit 2 pages of 32 tokens"):
        vllm_pages_to_tokens(kp, kp, block_size=32, num_tokens=65, isa="amx")
    with pytest.raises(ConfigError, match="no ISA was given"):
        vllm_pages_to_tokens(kp, kp, block_size=32, num_tokens=3, isa=None)
    with pytest.raises(ConfigError, match=r"dim 2 \(block_size\*head_dim\) is 1024, not a multiple of block_size 24"):
        vllm_pages_to_tokens(kp, kp, block_size=24, num_tokens=3, isa="vec")
    with pytest.raises(ConfigError, match=r"dim 1 \(heads\) is 1, expected 2"):
        vllm_pages_to_tokens(kp, kp, block_size=32, num_tokens=3, isa="vec", heads=2)
    with pytest.raises(ConfigError, match="key .* and value .* differ"):
        vllm_pages_to_tokens(kp, kp[:1], block_size=32, num_tokens=3, isa="vec")
