"""KV geometries of real models, by name (what ``kvferry plan/demo --model NAME`` read).

Each entry is what the model's published config gives for its KV cache: decoder layers, KV heads
(``num_key_value_heads``), head dim, the cache dtype engines serve it in, and for MLA models
(DeepSeek-V2/V3) the latent width ``kv_lora_rank + qk_rope_head_dim`` that replaces heads: an
MLA layer caches one ``[tokens, latent_dim]`` tensor, identical on every TP rank, and no value.
"""

from __future__ import annotations

import attrs

from kvferry.core.errors import ConfigError

__all__ = ["ModelGeometry", "MODELS", "model_geometry"]


@attrs.frozen
class ModelGeometry:
    """One model's KV cache geometry. ``kv_heads``/``head_dim`` are None for MLA models."""

    name: str
    layers: int
    kv_heads: int | None
    head_dim: int | None
    dtype: str = "bfloat16"
    kv_lora_rank: int | None = None
    qk_rope_head_dim: int | None = None

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank is not None

    @property
    def latent_dim(self) -> int | None:
        """``kv_lora_rank + qk_rope_head_dim`` for MLA models (576 for DeepSeek-V2/V3)."""
        if self.kv_lora_rank is None or self.qk_rope_head_dim is None:
            return None
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def layout(self) -> str:
        """The cache layout kvferry reads it with by default (``mla`` or ``flash``)."""
        return "mla" if self.is_mla else "flash"

    def kv_bytes_per_token(self, itemsize: int = 2) -> int:
        """Bytes of KV one token takes in the whole model (all layers, all heads, K and V)."""
        if self.is_mla:
            assert self.latent_dim is not None
            return self.layers * self.latent_dim * itemsize
        assert self.kv_heads is not None and self.head_dim is not None
        return self.layers * 2 * self.kv_heads * self.head_dim * itemsize


_TABLE = (
    ModelGeometry("llama-3.1-8b", 32, 8, 128),
    ModelGeometry("llama-3.1-70b", 80, 8, 128),
    ModelGeometry("qwen2.5-1.5b", 28, 2, 128),
    ModelGeometry("qwen2.5-7b", 28, 4, 128),
    ModelGeometry("qwen2.5-72b", 80, 8, 128),
    ModelGeometry("qwen2.5-omni-7b", 28, 4, 128),  # the thinker (the stage that hands KV on)
    ModelGeometry("mistral-7b", 32, 8, 128),
    ModelGeometry("deepseek-v2-lite", 27, None, None, kv_lora_rank=512, qk_rope_head_dim=64),
    ModelGeometry("deepseek-v3", 61, None, None, kv_lora_rank=512, qk_rope_head_dim=64),
)
#: Every known model by name.
MODELS = {m.name: m for m in _TABLE}


def model_geometry(name: str) -> ModelGeometry:
    """The geometry of ``name`` (case-insensitive); ConfigError listing the known names."""
    if not isinstance(name, str) or name.strip().lower() not in MODELS:
        raise ConfigError(f"unknown model {name!r} (known: {', '.join(MODELS)})")
    return MODELS[name.strip().lower()]
