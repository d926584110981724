"""Walk vLLM's attention backend registry and check kvferry's reading of each backend's cache.

Run by the vLLM venv's interpreter (KVFERRY_VLLM_PYTHON), never imported by pytest:

    python backend_proc.py OUT_JSON

For every member of vLLM's ``AttentionBackendEnum``: the name its class gives (``get_name()``,
where the class imports here; else the member's name) and kvferry's verdict
(:func:`kvferry.core.backends.backend_layout`). For each backend kvferry moves, a cache is
built through vLLM's own view builder (``create_kv_cache_views``, in each stride order the
check covers) and written the way that backend's cache-write kernel writes it: the CPU
backend through vLLM's own ``cpu_attn_reshape_and_cache`` op (the ISA vLLM picks here); the
dense GPU backends as ``reshape_and_cache_flash`` addresses it (slot ``s`` -> block ``s // B``,
row ``s % B`` of ``kv_cache.transpose(1, 2).split(head_size, -1)``, what their
``do_kv_cache_update`` passes the CUDA op; the op itself needs a GPU); the MLA backends through
vLLM's own CPU MLA write (``CPUMLAImpl.do_kv_cache_update``, the torch form of
``concat_and_cache_mla``). kvferry's per-token K/V (``split_engine_cache``) must equal what was
written; the control reads the same bytes another way and must differ.
"""

from __future__ import annotations

import json
import sys
import traceback


def _views(spec, layout, num_blocks):
    import torch
    from vllm.v1.kv_cache_interface import KVCacheTensor, create_kv_cache_views

    page = spec.page_size_bytes
    raw = torch.zeros(page * num_blocks, dtype=torch.int8)
    tensor = KVCacheTensor(size=raw.numel(), layers=["layer"], layer_stride=page * num_blocks, block_stride=page)
    [view] = create_kv_cache_views(raw, spec, num_blocks, layout, tensor)
    return view


def _same(a, b) -> bool:
    import torch

    return a.shape == b.shape and torch.equal(a.contiguous().view(torch.int16), b.contiguous().view(torch.int16))


def _slots(num_blocks: int, bs: int, tokens: int, gen):
    import torch

    order = torch.randperm(num_blocks, generator=gen)[: -(-tokens // bs)]
    return torch.cat([b * bs + torch.arange(bs) for b in order.tolist()])[:tokens]


def _dense(kind: str, verdict, order_name: str) -> dict:
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheLayout

    from kvferry.adapters.kv_layouts import split_engine_cache

    gen = torch.Generator().manual_seed(7)
    nb, bs, heads, d, tokens = 6, 32, 2, 64, 150
    spec = FullAttentionSpec(block_size=bs, num_kv_heads=heads, head_size=d, dtype=torch.bfloat16)
    view = _views(spec, KVCacheLayout[order_name], nb)
    k = torch.randn(tokens, heads, d, generator=gen).to(torch.bfloat16)
    v = torch.randn(tokens, heads, d, generator=gen).to(torch.bfloat16)
    slots = _slots(nb, bs, tokens, gen)
    isa = None
    if kind == "cpu":
        import vllm._custom_ops as ops

        isa = verdict.layout.isa
        kc, vc = view.view(nb, heads, 2 * bs, d).chunk(2, dim=2)  # what CPUAttentionBackendImpl passes
        ops.cpu_attn_reshape_and_cache(k, v, kc, vc, slots, isa)
    else:
        key_cache, value_cache = view.transpose(1, 2).split(d, dim=-1)  # the backends' do_kv_cache_update
        key_cache[slots // bs, slots % bs] = k  # reshape_and_cache_flash's addressing
        value_cache[slots // bs, slots % bs] = v
    kb, vb = split_engine_cache(view, verdict.layout, block_size=bs)
    ok = _same(kb.flatten(0, 1)[slots], k) and _same(vb.flatten(0, 1)[slots], v)
    # control: the same bytes read as the cache of the other family (CPU pages as packed, packed
    # as the CPU kernel's pages; for NHD, also as HND)
    from kvferry.core.layouts import LayoutSpec

    wrong = LayoutSpec("packed") if kind == "cpu" else LayoutSpec("vllm_cpu", "vec")
    contiguous = view if view.is_contiguous() else view.permute(0, 2, 1, 3).contiguous().view(view.shape)
    kw, vw = split_engine_cache(contiguous, wrong, block_size=bs)
    control = not _same(kw.flatten(0, 1)[slots], k)
    return {"ok": ok, "control_differs": control, "isa": isa, "stride_order": order_name}


def _mla(verdict) -> dict:
    import torch
    from vllm.v1.attention.backends.mla.cpu_mla import CPUMLAImpl
    from vllm.v1.kv_cache_interface import KVCacheLayout, MLAAttentionSpec

    from kvferry.adapters.kv_layouts import split_engine_cache

    gen = torch.Generator().manual_seed(9)
    nb, bs, rank, pe, tokens = 6, 16, 512, 64, 70
    spec = MLAAttentionSpec(block_size=bs, num_kv_heads=1, head_size=rank + pe, dtype=torch.bfloat16)
    view = _views(spec, KVCacheLayout.LBHNC, nb)
    kv_c = torch.randn(tokens, rank, generator=gen).to(torch.bfloat16)
    k_pe = torch.randn(tokens, 1, pe, generator=gen).to(torch.bfloat16)
    slots = _slots(nb, bs, tokens, gen)
    # the layer binds view.squeeze(1) ([B, H=1, N, C] -> [B, N, C]); the impl writes into that
    CPUMLAImpl.do_kv_cache_update(None, kv_c, k_pe, view.squeeze(1), slots, "auto", None)  # type: ignore[arg-type]
    kb, vb = split_engine_cache(view, verdict.layout, block_size=bs)
    latent = torch.cat([kv_c, k_pe.squeeze(1)], dim=-1)
    ok = vb is None and _same(kb.flatten(0, 1)[slots], latent)
    control = not _same(kb.flatten(0, 1)[slots.flip(0)], latent)  # another slot order reads other rows
    return {"ok": ok, "control_differs": control, "stride_order": "LBHNC"}


def _one_kernel_library() -> None:
    """Load the build of vLLM's kernels this CPU gets, and keep a GPU backend's import from
    loading another. vLLM CPU ships three (``_C``: AVX-512 with BF16, ``_C_AVX512``,
    ``_C_AVX2``), each registering torch's ``_C`` namespace; the ROCm platform module, imported
    by a ROCm backend's class, runs ``import vllm._C`` for its side effect. Where the platform
    loaded another build (an AVX2-only host), that second registration aborts the process
    (``Only a single TORCH_LIBRARY can be used to register the namespace _C``), so the walk
    ended with no output. Only the import's side effect is wanted there, and that library is
    loaded already: ``vllm._C`` is then bound to an empty module."""
    import types

    from vllm.platforms import current_platform

    current_platform.import_kernels()
    if "vllm._C" not in sys.modules:
        sys.modules["vllm._C"] = types.ModuleType("vllm._C")


def main(out: str) -> None:
    import torch
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    _one_kernel_library()

    from kvferry.app.vllm.backends import backend_name
    from kvferry.core.backends import backend_layout
    from kvferry.core.errors import ConfigError

    here_isa = str(_get_attn_isa(torch.bfloat16, 32, 64, "auto"))
    result = {}
    for member in AttentionBackendEnum:
        row: dict = {"member": member.name}
        try:
            name = backend_name(member.get_class())  # what the connector asks: app.vllm.backends
            row["imports"] = True
        except Exception as exc:  # a class that needs a GPU package (flashinfer, aiter, ...) to import
            name, row["imports"], row["import_error"] = member.name, False, f"{type(exc).__name__}: {exc}"[:200]
        row["name"] = name
        try:
            verdict = backend_layout(name, cache_dtype="auto", isa=here_isa if name == "CPU_ATTN" else None)
        except ConfigError as exc:
            row.update(status="refused", reason=str(exc))
            result[member.name] = row
            continue
        row.update(status="moved", layout=verdict.label)
        try:
            if verdict.layout.name == "mla":
                row["checks"] = [_mla(verdict)]
            elif verdict.layout.name == "vllm_cpu":
                row["checks"] = [_dense("cpu", verdict, "LBHNC")]
            else:
                row["checks"] = [_dense("flash", verdict, order) for order in ("LBHNC", "LBNHC")]
        except Exception:
            row["checks"] = [{"ok": False, "error": traceback.format_exc()[-1500:]}]
        result[member.name] = row
    with open(out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
