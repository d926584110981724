"""What vLLM chose for each attention layer, read from vLLM itself, as kvferry layouts.

The one place that asks vLLM which attention backend each layer runs (the layer's
``get_attn_backend()`` in the engine's static forward context; for an engine config without
layers, vLLM's own backend selector), which CPU kernel ISA its CPU backend writes with
(vLLM's ``_get_attn_isa``), which physical stride order it allocated (``KVCacheLayout``) and the
cache dtype, and turns the answer into a kvferry layout through the pure table
:func:`kvferry.core.backends.backend_layout` (refusals name the layer, the backend and what
kvferry moves). Used by the connector's ``register_kv_caches`` and by
:meth:`kvferry.app.compat.OmniKVTransferManager.from_vllm_config`. Imports vLLM lazily.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

from kvferry.core.backends import BackendLayout, backend_layout
from kvferry.core.errors import ConfigError

__all__ = [
    "backend_name",
    "kernel_isa",
    "layer_backends",
    "layer_layouts",
    "layer_scales",
    "engine_layout",
    "stride_order",
]

logger = logging.getLogger(__name__)


def kernel_isa(dtype: Any, block_size: int, head_size: int, cache_dtype: str | None) -> str | None:
    """The CPU attention kernel vLLM writes a cache of this geometry with (``amx``, ``vec``,
    ``vec16``, ...), by vLLM's own choice; None when this vLLM cannot say (not the CPU build,
    or another vLLM)."""
    try:
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa
    except Exception:  # noqa: BLE001 - not the CPU build or another vLLM: vLLM cannot say
        return None
    try:
        return str(_get_attn_isa(dtype, int(block_size), int(head_size), cache_dtype))
    except Exception as exc:  # noqa: BLE001 - vLLM refuses this geometry itself (fp8 without AVX-512)
        logger.warning("vLLM names no CPU attention kernel for this cache: %s", exc)
        return None


def stride_order(vllm_config: Any, kv_cache_config: Any = None) -> str | None:
    """vLLM's resolved ``KVCacheLayout`` name (``LBHNC``, ``LBNHC``, ...), None if unknown."""
    layout = getattr(kv_cache_config, "kv_cache_layout", None)
    if layout:
        return str(getattr(layout, "name", layout))
    get = getattr(getattr(vllm_config, "cache_config", None), "get_resolved_kv_cache_layout", None)
    if get is None:
        return None
    try:
        return str(get().name)
    except Exception:  # noqa: BLE001 - outside an engine the platform may not resolve it
        return None


def backend_name(cls: Any) -> str:
    """vLLM's registry name of an attention backend class: the ``AttentionBackendEnum`` member
    whose (not overridden) class path is this class's. A class the registry does not list under
    its own path keeps its ``get_name()`` prefixed with ``unregistered:``, so that it is never
    read as the backend it may call itself (ROCm's AITER FlashAttention names itself
    ``FLASH_ATTN``; an override registered for a member is another class)."""
    path = f"{cls.__module__}.{cls.__qualname__}"
    try:
        from vllm.v1.attention.backends.registry import AttentionBackendEnum
    except ImportError:
        AttentionBackendEnum = None  # noqa: N806 - another vLLM: no registry to look in
    for member in AttentionBackendEnum or ():
        if member.value and member.value == path and not member.is_overridden():
            return str(member.name)
    return f"unregistered:{cls.get_name()}"


def layer_backends(vllm_config: Any, layer_names: list[str] | None) -> dict[str, str]:
    """``{layer name: vLLM backend name}`` for the attention layers vLLM built (all of them for
    ``layer_names`` None; names it has no attention layer object for are left out)."""
    from vllm.config import get_layers_from_vllm_config
    from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase

    layers = get_layers_from_vllm_config(vllm_config, AttentionLayerBase, layer_names)  # type: ignore[type-abstract]
    return {name: backend_name(layer.get_attn_backend()) for name, layer in layers.items()}


def layer_layouts(
    vllm_config: Any, kv_caches: Mapping[str, Any], kv_cache_config: Any = None
) -> dict[str, BackendLayout]:
    """``{layer name: BackendLayout}`` of every registered cache, from what vLLM chose.
    ConfigError (at start) naming the first layer kvferry cannot read, its backend and what
    kvferry moves; a layer whose backend vLLM cannot name is refused too (never guessed)."""
    names = list(kv_caches)
    backends = layer_backends(vllm_config, names)
    cache_dtype = getattr(getattr(vllm_config, "cache_config", None), "cache_dtype", "auto")
    order = stride_order(vllm_config, kv_cache_config)
    out: dict[str, BackendLayout] = {}
    for name in names:
        backend = backends.get(name)
        if backend is None:
            raise ConfigError(
                f"layer {name!r}: vLLM names no attention backend for it (not an attention layer of the "
                f"engine's forward context); kvferry reads a cache only in the layout its backend writes"
            )
        isa = None
        t = kv_caches[name]
        if backend == "CPU_ATTN":
            shape = tuple(getattr(t, "shape", ()))
            if len(shape) != 4:
                raise ConfigError(f"layer {name!r}: CPU_ATTN cache of shape {list(shape)}, expected 4-D")
            # vLLM picks the kernel for the model's dtype (an FP8 cache is a uint8 tensor)
            fp8_bytes = str(t.dtype) == "torch.uint8"
            dtype = getattr(getattr(vllm_config, "model_config", None), "dtype", None) if fp8_bytes else None
            isa = kernel_isa(dtype or t.dtype, shape[2], shape[3] // 2, cache_dtype)
        out[name] = backend_layout(backend, cache_dtype=cache_dtype, isa=isa, stride_order=order, layer=name)
    return out


def layer_scales(vllm_config: Any, names: list[str]) -> Callable[[], tuple[list[float], list[float | None] | None]]:
    """A reader of the FP8 scales of the attention layers ``names`` (in that order): each
    call returns ``(k_scale, v_scale)`` as vLLM's layers hold them now (``_k_scale_float`` /
    ``_v_scale_float``, the host copies its backends pass to their kernels; vLLM may compute
    them on the first forward with ``calculate_kv_scales``). ConfigError at start naming a
    layer vLLM has no attention layer for, or one without the scales."""
    from vllm.config import get_layers_from_vllm_config
    from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase

    found = get_layers_from_vllm_config(vllm_config, AttentionLayerBase, names)  # type: ignore[type-abstract]
    layers = []
    for name in names:
        layer = found.get(name)
        if layer is None or not hasattr(layer, "_k_scale_float"):
            raise ConfigError(
                f"layer {name!r}: an FP8 cache moves with its layer's k_scale/v_scale, and vLLM's layer "
                f"has none (_k_scale_float)"
            )
        layers.append(layer)

    def read() -> tuple[list[float], list[float | None] | None]:
        k = [float(layer._k_scale_float) for layer in layers]
        v = [
            None if getattr(layer, "_v_scale_float", None) is None else float(layer._v_scale_float) for layer in layers
        ]
        return k, v

    read()
    return read


def engine_layout(vllm_config: Any) -> BackendLayout:
    """The layout an engine config's attention layers are written in, before any cache exists
    (the AR stage of vllm-omni builds its KV manager from the config alone): the backend from
    the config's attention layers when the model is built, else vLLM's own selector for the
    model's head size, dtype, cache dtype and MLA-ness on this platform; for CPU_ATTN the
    kernel ISA vLLM picks for the configured block size. ConfigError when vLLM cannot name
    the backend or kvferry does not move it."""
    model = getattr(vllm_config, "model_config", None)
    cache = getattr(vllm_config, "cache_config", None)
    if model is None or cache is None:
        raise ConfigError("vllm_config has no model_config / cache_config: the cache layout cannot be told")
    cache_dtype = getattr(cache, "cache_dtype", "auto")
    backend = _configured_backend(vllm_config)
    isa = None
    if backend == "CPU_ATTN":
        block_size = int(getattr(cache, "block_size", 0) or 0)
        isa = kernel_isa(model.dtype, block_size, int(model.get_head_size()), cache_dtype)
    return backend_layout(backend, cache_dtype=cache_dtype, isa=isa, stride_order=stride_order(vllm_config))


def _configured_backend(vllm_config: Any) -> str:
    from_layers = set(layer_backends(vllm_config, None).values()) if _has_layers(vllm_config) else set()
    if len(from_layers) == 1:
        return from_layers.pop()
    if len(from_layers) > 1:
        raise ConfigError(f"the engine runs several attention backends ({sorted(from_layers)}); name kv_layout")
    model, cache = vllm_config.model_config, vllm_config.cache_config
    from vllm.config import set_current_vllm_config  # ImportError without vLLM: the caller says so
    from vllm.v1.attention.selector import get_attn_backend

    try:
        with set_current_vllm_config(vllm_config):
            chosen = get_attn_backend(
                head_size=model.get_head_size(),
                dtype=model.dtype,
                kv_cache_dtype=cache.cache_dtype,
                use_mla=bool(getattr(model, "use_mla", False)),
            )
    except Exception as exc:  # noqa: BLE001 - vLLM's selector raises many kinds; the reason is kept
        raise ConfigError(f"vLLM could not name the attention backend of this engine config: {exc}") from exc
    return backend_name(chosen)


def _has_layers(vllm_config: Any) -> bool:
    context = getattr(getattr(vllm_config, "compilation_config", None), "static_forward_context", None)
    return bool(context)
