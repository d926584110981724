"""What the connector's ``register_kv_caches`` decides for layers of each backend, asked of vLLM.

Run by the vLLM venv's interpreter, never imported by pytest:

    python connector_layouts_proc.py OUT_JSON

Layers are vLLM ``AttentionLayerBase`` objects in a config's static forward context whose
backend is one of vLLM's real backend classes (they import on the CPU build); the caches are
CPU tensors of the logical ``[num_blocks, heads, block_size, content]`` shape (in the stride
order given). For each case: the layout kvferry reads, or the refusal's message.
"""

from __future__ import annotations

import json
import sys
from types import SimpleNamespace


def main(out: str) -> None:
    import torch
    from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from kvferry.app.vllm.connector import _page_layouts
    from kvferry.core.errors import ConfigError

    class Layer(AttentionLayerBase):
        def __init__(self, backend):
            self.backend = backend

        def get_attn_backend(self):
            return self.backend

        def get_kv_cache_spec(self, vllm_config):
            return None

    def case(member: str, shape, *, nhd: bool = False, cache_dtype: str = "auto") -> dict:
        backend = AttentionBackendEnum[member].get_class()
        names = [f"model.layers.{i}.self_attn.attn" for i in range(2)]
        config = SimpleNamespace(
            compilation_config=SimpleNamespace(static_forward_context={n: Layer(backend) for n in names}),
            cache_config=SimpleNamespace(cache_dtype=cache_dtype, get_resolved_kv_cache_layout=None),
        )
        n, h, b, c = shape
        if nhd:
            caches = {name: torch.zeros(n, b, h, c, dtype=torch.bfloat16).transpose(1, 2) for name in names}
        else:
            caches = {name: torch.zeros(n, h, b, c, dtype=torch.bfloat16) for name in names}
        kv_cache_config = SimpleNamespace(kv_cache_layout="LBNHC" if nhd else "LBHNC")
        try:
            got = _page_layouts(config, caches, kv_cache_config)
        except ConfigError as exc:
            return {"refused": str(exc)}
        return {"layout": got.label, "backend": got.backend}

    result = {
        "CPU_ATTN": case("CPU_ATTN", (8, 2, 32, 64)),
        "FLASH_ATTN": case("FLASH_ATTN", (8, 2, 16, 64)),
        "FLASH_ATTN_fp8": case("FLASH_ATTN", (8, 2, 16, 64), cache_dtype="fp8"),
        "FLASH_ATTN_nhd": case("FLASH_ATTN", (8, 2, 16, 64), nhd=True),
        "TRITON_ATTN": case("TRITON_ATTN", (8, 2, 16, 64)),
        "TRITON_MLA": case("TRITON_MLA", (8, 1, 16, 576)),
        "CPU_MLA": case("CPU_MLA", (8, 1, 16, 576)),
        "CPU_MLA_nhd": case("CPU_MLA", (8, 1, 16, 576), nhd=True),
        "AMX_MLA": case("AMX_MLA", (8, 1, 32, 576)),
        "FLEX_ATTENTION": case("FLEX_ATTENTION", (8, 2, 16, 64)),
        "ROCM_AITER_FA": case("ROCM_AITER_FA", (8, 2, 16, 64)),
    }
    with open(out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
