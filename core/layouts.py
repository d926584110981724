"""Named layouts of a paged KV cache layer, in plain integers (what each dimension means).

An engine names the layout its cache uses instead of leaving kvferry to guess it from the shape.
The tensor adapters turn a named layer into ``[num_blocks, block_size, *token_shape]`` key and
value block views (``adapters/kv_layouts.py``); this module only knows names, dimension names,
and how to check a shape against them. ``N`` = blocks, ``B`` = block size (tokens per block),
``H`` = KV heads of the rank, ``D`` = head dim, ``L`` = MLA latent width.

========================  ===========================  ==============================================
name                      shape (one layer)            meaning
========================  ===========================  ==============================================
``flash``                 ``[2, N, B, H, D]``          FlashAttention: K/V on dim 0
``flashinfer``            ``[N, 2, B, H, D]``          FlashInfer: K/V on dim 1
``flash_hnd``             ``[2, N, H, B, D]``          ``flash`` with heads outside tokens (HND)
``flashinfer_hnd``        ``[N, 2, H, B, D]``          ``flashinfer`` with heads outside tokens
``packed``                ``[N, H, B, 2*D]``           FlashAttention packed: K = first half of D
``tuple``                 ``(K, V)``, each ``[N, B, H, D]``   separate tensors
``mla``                   ``[N, B, L]``                one latent per token (no heads, no V)
``vllm_cpu``              ``[N, H, B, 2*D]``           vLLM CPU: per (block, head) a K region then a
                                                       V region, element order set by the kernel ISA
``vllm_cpu_pages_hnd``    ``(K, V)``, each ``[N, H, B*D]``  the K regions and the V regions of such pages
                                                       (kvferry's vLLM connector's payload)
========================  ===========================  ==============================================

A permuted view of a ``flash``/``flashinfer`` tensor (vLLM's stride orders) is still that
layout: kvferry reads views through their strides. The ``*_hnd`` names are for tensors whose
*dimensions* are in HND order.

``vllm_cpu`` per-token decoding depends on the ISA the engine's CPU kernel wrote with
(:data:`VLLM_CPU_ISAS`); an unknown ISA is refused, never read as ``packed`` (same shape).
``vllm_cpu_pages_hnd`` is decoded per token for the ISAs of :data:`VLLM_CPU_PAGE_ISAS`, whose
element order inside a region :func:`vllm_page_order` gives.

Without a name, only the reference's layouts are recognised, by the reference's shape rules,
and a shape that two known layouts could both mean is refused naming the candidates
(:func:`shape_candidates`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from kvferry.core.errors import ConfigError
from kvferry.core.validate import check_int

__all__ = [
    "KV_LATENT_KEY",
    "LAYOUT_NAMES",
    "REFERENCE_LAYOUTS",
    "VLLM_CPU_ISAS",
    "VLLM_CPU_PAGE_ISAS",
    "VLLM_PAGES",
    "LayoutSpec",
    "RegionOrder",
    "PageOrder",
    "vllm_page_order",
    "reblock_span",
    "layout_spec",
    "layout_dims",
    "check_layer_shape",
    "shape_candidates",
]

#: Every layout name kvferry knows, with its dimension names (``tuple``: each tensor's).
_DIMS: dict[str, tuple[str, ...]] = {
    "flash": ("kv", "num_blocks", "block_size", "heads", "head_dim"),
    "flashinfer": ("num_blocks", "kv", "block_size", "heads", "head_dim"),
    "flash_hnd": ("kv", "num_blocks", "heads", "block_size", "head_dim"),
    "flashinfer_hnd": ("num_blocks", "kv", "heads", "block_size", "head_dim"),
    "packed": ("num_blocks", "heads", "block_size", "2*head_dim"),
    "tuple": ("num_blocks", "block_size", "heads", "head_dim"),
    "mla": ("num_blocks", "block_size", "latent_dim"),
    "vllm_cpu": ("num_blocks", "heads", "block_size", "2*head_dim"),
    "vllm_cpu_pages_hnd": ("num_blocks", "heads", "block_size*head_dim"),
}
LAYOUT_NAMES: tuple[str, ...] = tuple(_DIMS)
#: Metadata flag of a payload whose key caches are MLA latents (values absent, never sliced).
KV_LATENT_KEY = "kv_latent"
#: What the reference recognised by shape (and what kvferry still recognises without a name).
REFERENCE_LAYOUTS: tuple[str, ...] = ("flash", "flashinfer", "packed", "tuple")
#: vLLM CPU kernel ISAs whose page order kvferry can decode per token, with their aliases:
#: ``vec`` (AVX2): K dimension-major ``[head_dim][block_size]``, V token-major.
VLLM_CPU_ISAS: Mapping[str, str] = {"vec": "vec", "avx2": "vec"}
#: The layout of kvferry's vLLM connector payloads: a layer's K regions and V regions, each
#: ``[num_blocks, heads, block_size * head_dim]`` (the pages of a ``vllm_cpu`` cache, split).
VLLM_PAGES = "vllm_cpu_pages_hnd"
#: vLLM CPU kernel ISAs whose region order :func:`vllm_page_order` knows (vLLM's kernel names,
#: with aliases): ``vec`` K ``[D][B]``, V ``[B][D]``; ``amx`` (bf16, AMX tiles of 16 rows, two
#: elements a pair) K ``[B/16][D/2][16][2]`` over (token, dim), V ``[D/16][B/2][16][2]`` over
#: (dim, token).
VLLM_CPU_PAGE_ISAS: Mapping[str, str] = {"vec": "vec", "avx2": "vec", "amx": "amx"}
_ISA_LAYOUTS = ("vllm_cpu", VLLM_PAGES)


@attrs.frozen
class LayoutSpec:
    """A layout name and, for ``vllm_cpu``, the ISA of the kernel that wrote the cache."""

    name: str
    isa: str | None = None

    @property
    def has_value(self) -> bool:
        """False for ``mla``: the payload carries the latent as the key, the value is absent."""
        return self.name != "mla"

    @property
    def has_heads(self) -> bool:
        return self.name != "mla"

    @property
    def decodable(self) -> bool:
        """True when per-token K/V can be read (``vllm_cpu`` and ``vllm_cpu_pages_hnd`` need a
        known ISA)."""
        if self.name == VLLM_PAGES:
            return self.isa in VLLM_CPU_PAGE_ISAS
        return self.name != "vllm_cpu" or self.isa in VLLM_CPU_ISAS


def layout_spec(value: Any, field: str = "kv_layout") -> LayoutSpec | None:
    """Parse a configured layout: None, a name (``"flash"``, ``"vllm_cpu:avx2"``), a mapping
    ``{"name": ..., "isa": ...}`` or a :class:`LayoutSpec`. ConfigError naming ``field`` for an
    unknown name (listing the known ones) or an ISA given to a layout that has none."""
    if value is None or isinstance(value, LayoutSpec):
        return value
    isa: Any = None
    if isinstance(value, Mapping):
        unknown = sorted(set(value) - {"name", "isa"})
        if unknown:
            raise ConfigError(f"{field} has unknown keys {unknown} (known: name, isa)")
        name, isa = value.get("name"), value.get("isa")
    elif isinstance(value, str):
        name, sep, rest = value.strip().partition(":")
        isa = rest.strip() if sep else None
    else:
        raise ConfigError(f"{field} must be a layout name or a mapping, got {value!r}")
    if not isinstance(name, str) or name.strip() not in _DIMS:
        raise ConfigError(f"{field}: unknown layout {name!r} (known: {', '.join(LAYOUT_NAMES)})")
    name = name.strip()
    if isa is not None:
        if not isinstance(isa, str) or not isa.strip():
            raise ConfigError(f"{field}.isa must be a non-empty string, got {isa!r}")
        if name not in _ISA_LAYOUTS:
            raise ConfigError(
                f"{field}: layout {name!r} takes no isa (only {' and '.join(_ISA_LAYOUTS)} do), got {isa!r}"
            )
        isa = isa.strip().lower()
    return LayoutSpec(name, isa)


def layout_dims(name: str) -> tuple[str, ...]:
    """The dimension names of a layout (``tuple``: of each of its two tensors)."""
    spec = layout_spec(name)
    assert spec is not None
    return _DIMS[spec.name]


def check_layer_shape(
    name: str,
    shape: tuple[int, ...],
    *,
    block_size: int,
    heads: int | None = None,
    head_dim: int | None = None,
    latent_dim: int | None = None,
    layer: int | None = None,
) -> None:
    """ConfigError saying which dimension differs when ``shape`` (of one tensor; for ``tuple``
    each of the two) does not fit layout ``name``. ``heads``/``head_dim``/``latent_dim``
    are checked when given (the rank's KV heads, not the model's)."""
    dims = layout_dims(name)
    where = f"layer {layer}: " if layer is not None else ""
    spelled = "[" + ", ".join(dims) + "]"
    if len(shape) != len(dims):
        raise ConfigError(
            f"{where}layout {name!r} is {spelled} ({len(dims)}-D), got a {len(shape)}-D tensor {list(shape)}"
        )
    expected: dict[str, int | None] = {
        "kv": 2,
        "block_size": block_size,
        "heads": heads,
        "head_dim": head_dim,
        "2*head_dim": None if head_dim is None else 2 * head_dim,
        "block_size*head_dim": None if head_dim is None else block_size * head_dim,
        "latent_dim": latent_dim,
    }
    for index, (dim, size) in enumerate(zip(dims, shape)):
        want = expected.get(dim)
        if want is not None and size != want:
            raise ConfigError(
                f"{where}layout {name!r} is {spelled}: dim {index} ({dim}) is {size}, expected {want} "
                f"(shape {list(shape)})"
            )
        if dim == "2*head_dim" and size % 2:
            raise ConfigError(
                f"{where}layout {name!r} is {spelled}: dim {index} (2*head_dim) is odd ({size}) (shape {list(shape)})"
            )
        if dim == "block_size*head_dim" and (block_size < 1 or size % block_size):
            raise ConfigError(
                f"{where}layout {name!r} is {spelled}: dim {index} (block_size*head_dim) is {size}, not a "
                f"multiple of block_size {block_size} (shape {list(shape)})"
            )


def shape_candidates(shape: tuple[int, ...], block_size: int | None) -> tuple[str, ...]:
    """The known layouts an *unnamed* tensor of ``shape`` could mean, in :data:`LAYOUT_NAMES`
    order.

    The rules for the reference's layouts are the reference's (``flash``: rank >= 3 and dim 0 is
    2; ``flashinfer``: rank >= 3 and dim 1 is 2; ``packed``: 4-D, dim 2 is ``block_size``, last
    dim even); ``mla``: 3-D with dim 1 the block size; ``vllm_cpu``: the ``packed`` rule (the CPU
    backend hands out exactly that shape). The ``*_hnd`` names are never candidates: engines
    present an HND cache as a strided view of the NHD shape (which reads correctly as
    ``flash``/``flashinfer``), so a tensor with HND *dimensions* only comes with its name, and
    counting them would refuse every unnamed cache whose heads equal its block size.
    """
    rank = len(shape)
    out = []
    if rank >= 3 and shape[0] == 2:
        out.append("flash")
    if rank >= 3 and shape[1] == 2:
        out.append("flashinfer")
    if block_size is not None:
        if rank == 4 and shape[2] == block_size and shape[3] % 2 == 0:
            out += ["packed", "vllm_cpu"]
        if rank == 3 and shape[1] == block_size:
            out.append("mla")
    return tuple(n for n in LAYOUT_NAMES if n in out)


@attrs.frozen
class RegionOrder:
    """How one K (or V) region of ``block_size * head_dim`` elements is ordered: viewed as
    ``shape`` (row-major) and permuted by ``perm``, it reads ``[block_size, head_dim]`` (token,
    dim) once the permuted dimensions are merged (the first ``token_dims`` of them make the
    token, the rest the dim)."""

    shape: tuple[int, ...]
    perm: tuple[int, ...]
    token_dims: int

    def offset(self, token: int, dim: int) -> int:
        """The element offset of ``(token, dim)`` inside the region."""
        sizes = [self.shape[p] for p in self.perm]
        token_sizes, dim_sizes = sizes[: self.token_dims], sizes[self.token_dims :]
        digits = _digits(token, token_sizes) + _digits(dim, dim_sizes)
        index = [0] * len(self.shape)
        for position, axis in enumerate(self.perm):
            index[axis] = digits[position]
        out = 0
        for size, i in zip(self.shape, index):
            out = out * size + i
        return out


def _digits(value: int, sizes: list[int]) -> list[int]:
    out = []
    for size in reversed(sizes):
        out.append(value % size)
        value //= size
    return out[::-1]


@attrs.frozen
class PageOrder:
    """The element order of a ``vllm_cpu`` page's K region and V region for one kernel ISA."""

    isa: str
    key: RegionOrder
    value: RegionOrder


def vllm_page_order(isa: str | None, block_size: int, head_dim: int) -> PageOrder:
    """The K and V region orders vLLM's CPU kernel ``isa`` writes (an alias of
    :data:`VLLM_CPU_PAGE_ISAS`). ConfigError for an ISA whose order is not known (or none given),
    and for sizes that kernel does not write (``amx``: block_size and head_dim multiples of 32,
    as vLLM picks it only then)."""
    kernel = VLLM_CPU_PAGE_ISAS.get((isa or "").strip().lower())
    if kernel is None:
        said = "no ISA was given" if not isa else f"ISA {isa!r} is not one of them"
        raise ConfigError(
            f"layout {VLLM_PAGES!r}: per-token K/V depend on the element order of the CPU kernel that "
            f"wrote the pages; kvferry knows {', '.join(sorted(VLLM_CPU_PAGE_ISAS))} and {said}"
        )
    for name, size in (("block_size", block_size), ("head_dim", head_dim)):
        check_int(f"layout {VLLM_PAGES!r}: {name}", size, 1, expected="a positive integer")
    b, d = block_size, head_dim
    if kernel == "vec":
        return PageOrder(kernel, RegionOrder((d, b), (1, 0), 1), RegionOrder((b, d), (0, 1), 1))
    if b % 32 or d % 32:
        raise ConfigError(
            f"layout {VLLM_PAGES!r}: the amx kernel writes block_size and head_dim multiples of 32, "
            f"got block_size {b}, head_dim {d}"
        )
    # K: (token // 16, dim // 2, token % 16, dim % 2); V: (dim // 16, token // 2, dim % 16, token % 2)
    key = RegionOrder((b // 16, d // 2, 16, 2), (0, 2, 1, 3), 2)
    value = RegionOrder((d // 16, b // 2, 16, 2), (1, 3, 0, 2), 2)
    return PageOrder(kernel, key, value)


def reblock_span(
    first_page: int, count: int, block_size: int, src_block_size: int, num_tokens: int
) -> tuple[int, int, int, int]:
    """Re-blocking a prompt's pages: ``(start, stop, src_first, src_stop)``.

    Local pages ``first_page .. first_page + count`` (``block_size`` tokens each) hold tokens
    ``[start, stop)`` of a prompt of ``num_tokens`` (``stop`` never past the prompt); the
    sender's pages of ``src_block_size`` tokens that hold them are ``[src_first, src_stop)``,
    the fewest that do. With equal block sizes the span is the local pages themselves (as far
    as the prompt reaches). ConfigError for a size below 1 or a negative page or count."""
    for name, size in (("block_size", block_size), ("src_block_size", src_block_size)):
        check_int(name, size, 1, expected="a positive integer")
    for name, value in (("first_page", first_page), ("count", count), ("num_tokens", num_tokens)):
        check_int(name, value, 0, expected="a non-negative integer")
    start = first_page * block_size
    stop = min(num_tokens, (first_page + count) * block_size)
    if stop <= start:
        first = start // src_block_size
        return start, start, first, first
    return start, stop, start // src_block_size, -(-stop // src_block_size)
