"""vLLM's attention backends as kvferry layouts: which backends kvferry moves, read how.

Data and one pure function, no vLLM: the names are vLLM's (``AttentionBackendEnum`` member
names, which its backend classes return from ``get_name()``), the layouts kvferry's
(:mod:`kvferry.core.layouts`). vLLM 0.32 hands every attention layer to a connector as one
logical ``[num_blocks, heads, block_size, content]`` view (``content`` = K then V per token
for a dense cache, the latent for MLA with ``heads`` = 1), in the physical stride order of its
``KVCacheLayout`` (``LBHNC`` = HND, ``LBNHC`` = NHD, ...). What the content means is the
backend's:

=================  ===================  ====================================================
backends           kvferry layout       how a token's K/V are found
=================  ===================  ====================================================
FLASH_ATTN,        ``packed``           ``t.transpose(1, 2).split(head_dim, -1)``: what
FLASHINFER,                             ``reshape_and_cache_flash`` writes; any stride order
TRITON_ATTN                             (read through strides)
CPU_ATTN           ``vllm_cpu:<isa>``   per (block, head) a K region then a V region, in the
                                        order of the CPU kernel ``isa`` (``vec``, ``amx``);
                                        ``LBHNC`` only
FLASHMLA,          ``mla``              ``t.squeeze(1)``: one latent per token
TRITON_MLA,
CPU_MLA
=================  ===================  ====================================================

Any other backend is refused with an error naming it and these. Cache dtypes: unquantised
(``auto``, ``float16``, ``bfloat16``, ``float32``) everywhere; per-tensor FP8 (``fp8`` =
``fp8_e4m3``, ``fp8_e5m2``) for the dense backends, whose FP8 cache is the same layout in one
byte per element (vLLM allocates it as ``uint8``) and whose scales are one per layer tensor,
outside the cache (the connector sends them beside the pages and the receiver compares them
with its own: :func:`kvferry.core.scales.scales_mismatch`). On the CPU kernel an FP8 cache
moves page for page only (its FP8 page order is not measured: ``per_token`` False, so no
re-blocking or re-laying). FP8 MLA (FlashMLA's ``fp8_ds_mla`` packs scales into the latent)
is refused.
"""

from __future__ import annotations

from collections.abc import Mapping

import attrs

from kvferry.core.errors import ConfigError
from kvferry.core.layouts import VLLM_CPU_PAGE_ISAS, LayoutSpec
from kvferry.core.scales import fp8_format

__all__ = [
    "MOVED_BACKENDS",
    "PLAIN_CACHE_DTYPES",
    "FP8_CACHE_DTYPES",
    "BackendLayout",
    "backend_layout",
]

#: vLLM backend name -> the kvferry layout its caches are read in.
MOVED_BACKENDS: Mapping[str, str] = {
    "FLASH_ATTN": "packed",
    "FLASHINFER": "packed",
    "TRITON_ATTN": "packed",
    "CPU_ATTN": "vllm_cpu",
    "FLASHMLA": "mla",
    "TRITON_MLA": "mla",
    "CPU_MLA": "mla",
}
#: ``cache_dtype`` values of an unquantised cache (the model's dtype or a named float).
PLAIN_CACHE_DTYPES: tuple[str, ...] = ("auto", "float16", "bfloat16", "float32", "half", "float", "bf16", "fp16")
#: Per-tensor FP8 cache dtypes (one scale per layer tensor, outside the cache).
FP8_CACHE_DTYPES: tuple[str, ...] = ("fp8", "fp8_e4m3", "fp8_e5m2")
#: vLLM ``KVCacheLayout`` names (physical stride orders) the CPU kernel writes.
_CPU_STRIDE_ORDERS = ("LBHNC",)


@attrs.frozen
class BackendLayout:
    """What one attention layer's cache is, as vLLM chose it and kvferry reads it.

    ``backend``: vLLM's name; ``layout``: kvferry's (``vllm_cpu`` with the kernel ISA);
    ``stride_order``: vLLM's ``KVCacheLayout`` name when known; ``fp8``: a per-tensor FP8
    cache's format (``fp8_e4m3``, ``fp8_e5m2``: bytes, scales outside), None for a plain one."""

    backend: str
    layout: LayoutSpec
    stride_order: str | None = None
    fp8: str | None = None

    @property
    def per_token(self) -> bool:
        """True when kvferry can read per-token K/V (and re-block pages): every layout but a
        CPU kernel ISA whose page order it does not know (an FP8 CPU cache's among them)."""
        if self.layout.name != "vllm_cpu":
            return True
        return self.fp8 is None and self.layout.isa in VLLM_CPU_PAGE_ISAS

    @property
    def label(self) -> str:
        """One string both stages compare: layout (with ISA), stride order and FP8-ness."""
        name = self.layout.name if self.layout.isa is None else f"{self.layout.name}:{self.layout.isa}"
        parts = [name, self.stride_order or "strided"]
        if self.fp8:
            parts.append(self.fp8)
        return "/".join(parts)


def _moved() -> str:
    return ", ".join(f"{b} ({layout})" for b, layout in MOVED_BACKENDS.items())


def backend_layout(
    backend: str,
    *,
    cache_dtype: str | None = "auto",
    isa: str | None = None,
    stride_order: str | None = None,
    layer: str | None = None,
) -> BackendLayout:
    """The kvferry layout of a cache vLLM's ``backend`` wrote, or ConfigError naming the layer,
    the backend, and what kvferry moves (backends, cache dtypes, CPU ISAs, stride orders).

    ``cache_dtype``: vLLM's ``cache_config.cache_dtype`` (None: ``auto``); ``isa``: the CPU
    kernel vLLM picked (needed for ``CPU_ATTN``); ``stride_order``: the ``KVCacheLayout`` name
    (checked for ``CPU_ATTN``, recorded for the others)."""
    where = f"layer {layer!r}: " if layer else ""
    name = str(backend).strip().upper()
    layout = MOVED_BACKENDS.get(name)
    if layout is None:
        raise ConfigError(
            f"{where}attention backend {backend!r} is not one kvferry moves; it moves {_moved()} "
            f"(choose one with vLLM's attention_backend setting)"
        )
    dtype = (cache_dtype or "auto").strip().lower()
    fp8 = fp8_format(dtype)
    dense = ", ".join(b for b, lay in MOVED_BACKENDS.items() if lay != "mla")
    if fp8 is None and dtype not in PLAIN_CACHE_DTYPES:
        raise ConfigError(
            f"{where}backend {name}: kv cache dtype {cache_dtype!r} is not one kvferry moves "
            f"(unquantised: {', '.join(PLAIN_CACHE_DTYPES[:4])}; per-tensor FP8 on {dense}: "
            f"{', '.join(FP8_CACHE_DTYPES)})"
        )
    if fp8 is not None and layout == "mla":
        raise ConfigError(
            f"{where}backend {name}: an FP8 kv cache ({dtype}) is moved only for the dense backends "
            f"({dense}); use kv_cache_dtype 'auto' for MLA"
        )
    order = stride_order.strip().upper() if isinstance(stride_order, str) and stride_order.strip() else None
    if layout != "vllm_cpu":
        return BackendLayout(name, LayoutSpec(layout), order, fp8)
    if not isinstance(isa, str) or not isa.strip():
        raise ConfigError(
            f"{where}backend CPU_ATTN: the CPU kernel's page order depends on its ISA and vLLM did not say which "
            f"(kvferry knows {', '.join(sorted(VLLM_CPU_PAGE_ISAS))})"
        )
    if order is not None and order not in _CPU_STRIDE_ORDERS:
        raise ConfigError(
            f"{where}backend CPU_ATTN: stride order {order} is not the CPU kernel's ({', '.join(_CPU_STRIDE_ORDERS)})"
        )
    # An ISA whose order kvferry does not know (vec16, neon, ...) still moves page for page
    # between instances of that ISA; per-token reads and re-blocking refuse it (per_token False).
    kernel = VLLM_CPU_PAGE_ISAS.get(isa.strip().lower(), isa.strip().lower())
    return BackendLayout(name, LayoutSpec("vllm_cpu", kernel), order or "LBHNC", fp8)
