"""A Mamba / gated-delta-net layer's recurrent state, saved from and written into vLLM's cache.

vLLM 0.32 hands a connector a Mamba layer's cache as the raw bytes of its pages, ``[num_blocks,
1, 1, state bytes]`` int8 (``create_kv_cache_views`` of a ``MambaSpec``): each block holds the
layer's state tensors packed one after the other (conv state, then SSM / temporal state: the
layer's ``get_state_shape`` and ``get_state_dtype``, in ``MambaSpec.shapes`` / ``dtypes``), and
the layer cuts them out itself (``MambaBase.bind_kv_cache``). A block's stride may be longer
than its state (``page_size_padded``: the pool's one page size); only the state's bytes move.

A request's state is one block (groups.state_pages says which); its payload is that block's
state bytes, one ``uint8`` tensor ``[1, 1, state bytes]`` (checksummed as page payloads are),
with metadata ``layout`` :data:`STATE_LAYOUT`, ``state`` (the shapes and dtypes,
:meth:`StateSpec.describe`), ``group``, ``first_page`` (the block's index in the group's
table) and ``num_tokens`` (the tokens the state has seen). :func:`write_state` writes it into
the decode's block bit for bit, after checking it is this layer's state of these shapes and
dtypes for the tokens the load brings (else :class:`StateLoadError`, a ``layout`` failure) and
its checksum (else PayloadError, ``corrupt``). The state is sharded over TP ranks by vLLM's own
rule, so it moves between equal TP sizes only, rank to rank.
"""

from __future__ import annotations

from collections.abc import Sequence
from math import prod
from typing import Any

import attrs
import torch

from kvferry.adapters.torch_decode import dtype_name, verify_deferred
from kvferry.adapters.torch_frames import dest_views, finish_payload_in
from kvferry.app.vllm.group_pages import GroupLoadError
from kvferry.app.vllm.groups import GroupPages
from kvferry.core.errors import ConfigError, PayloadError
from kvferry.core.header import LayoutTemplate, kv_layout_template

__all__ = ["STATE_LAYOUT", "StateSpec", "StateLoadError", "StateWriter", "state_view", "write_state"]

#: The ``layout`` of a recurrent-state payload.
STATE_LAYOUT = "vllm_state"


class StateLoadError(GroupLoadError):
    """A state payload that is not this layer's state (shapes, dtypes, tokens, block)."""


def _itemsize(dtype: str) -> int:
    return torch.empty((), dtype=getattr(torch, dtype)).element_size()


@attrs.frozen
class StateSpec:
    """One Mamba layer's state tensors: ``shapes`` and ``dtypes`` (torch names), in the order
    vLLM packs them in a block."""

    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]

    @property
    def nbytes(self) -> int:
        """Bytes of one block's state (vLLM's ``MambaSpec.state_content_size_bytes``)."""
        return sum(prod(s) * _itemsize(d) for s, d in zip(self.shapes, self.dtypes))

    def describe(self) -> dict[str, Any]:
        """What a payload says of the state (metadata ``state``)."""
        return {"shapes": [list(s) for s in self.shapes], "dtypes": list(self.dtypes)}

    @classmethod
    def of(cls, spec: Any) -> StateSpec:
        """From vLLM's ``MambaSpec`` (by attribute: ``shapes``, ``dtypes``)."""
        shapes = tuple(tuple(int(x) for x in s) for s in spec.shapes)
        dtypes = tuple(d if isinstance(d, str) else dtype_name(d) for d in spec.dtypes)
        if len(shapes) != len(dtypes) or not shapes:
            raise ConfigError(f"MambaSpec: {len(shapes)} state shapes and {len(dtypes)} dtypes")
        return cls(shapes, dtypes)

    def split(self, block: torch.Tensor) -> list[torch.Tensor]:
        """One block's state bytes (``[nbytes]`` uint8) as its state tensors (views)."""
        out, offset = [], 0
        for shape, dtype in zip(self.shapes, self.dtypes):
            n = prod(shape) * _itemsize(dtype)
            out.append(block[offset : offset + n].view(getattr(torch, dtype)).view(shape))
            offset += n
        return out


def state_view(layer: torch.Tensor, spec: StateSpec, name: str = "") -> torch.Tensor:
    """A Mamba layer's cache as ``[num_blocks, state bytes]`` uint8 (a view: writes reach the
    cache). ConfigError naming the layer unless it is vLLM's ``[num_blocks, 1, 1, bytes]`` (or
    ``[num_blocks, bytes]``) of a one-byte dtype whose bytes are ``spec``'s state."""
    where = f"layer {name!r}" if name else "a Mamba layer"
    t = layer
    if isinstance(t, torch.Tensor) and t.dim() == 4 and t.shape[1] == 1 and t.shape[2] == 1:
        t = t[:, 0, 0]
    if not isinstance(t, torch.Tensor) or t.dim() != 2 or t.element_size() != 1:
        shape = tuple(layer.shape) if isinstance(layer, torch.Tensor) else type(layer).__name__
        raise ConfigError(
            f"{where}: kvferry moves a Mamba layer's cache as vLLM's raw pages [num_blocks, 1, 1, bytes] "
            f"(int8/uint8); got {shape}"
        )
    if t.shape[1] != spec.nbytes or t.stride(1) != 1:
        raise ConfigError(
            f"{where}: {t.shape[1]} bytes of state per block, its MambaSpec (shapes {list(spec.shapes)}, "
            f"dtypes {list(spec.dtypes)}) holds {spec.nbytes}"
        )
    return t.view(torch.uint8)


@attrs.define
class StateWriter:
    """Gathers a layer's state blocks into a payload (one template per state size)."""

    align: int = 64
    checksums: str | None = None
    _templates: dict[tuple[int, int], LayoutTemplate] = attrs.field(init=False, factory=dict)

    def layout(self, transfer_id: str, block_ids: Sequence[int], spec: StateSpec, metadata: dict[str, Any]) -> Any:
        key = (len(block_ids), spec.nbytes)
        tpl = self._templates.get(key)
        if tpl is None:
            keys = [("uint8", (len(block_ids), 1, spec.nbytes))]
            tpl = kv_layout_template(keys, [None], align=self.align, checksums=self.checksums)
            self._templates[key] = tpl
        meta = {**metadata, "layout": STATE_LAYOUT, "state": spec.describe()}
        return tpl.layout(transfer_id, list(block_ids), meta)

    def gather(self, view: torch.Tensor, index: torch.Tensor, dest: torch.Tensor, layout: Any) -> None:
        """Copy the blocks ``view[index]`` (a :func:`state_view`) into ``dest`` (1-D uint8 of
        ``layout.total_nbytes``) and write the header in front."""
        out = dest_views(dest, layout)[0]
        assert out is not None
        out = out.view(torch.uint8).view(index.numel(), view.shape[1])
        out.copy_(view.index_select(0, index.to(view.device)).to(out.device))
        finish_payload_in(dest, layout)


def write_state(
    view: torch.Tensor,
    spec: StateSpec,
    decoded: Any,
    layer_idx: int,
    group: int,
    target: GroupPages,
    num_tokens: int,
) -> int:
    """Write ``decoded`` (a state payload) into ``target``'s one block of ``view`` (a
    :func:`state_view`); ``num_tokens``: the tokens this load brings, which the state must have
    seen. Returns the bytes written. StateLoadError (``layout``) for a payload that is not this
    layer's state of these shapes and dtypes, for these tokens and this block; PayloadError for
    a malformed or corrupt one (its checksum is checked before anything is written)."""
    meta = decoded.metadata or {}
    if meta.get("layout") != STATE_LAYOUT:
        raise StateLoadError(f"layer {layer_idx}: payload layout {meta.get('layout')!r}, this layer holds Mamba state")
    if meta.get("layer") != layer_idx:
        raise PayloadError(f"layer {layer_idx}: payload is for layer {meta.get('layer')!r}")
    if meta.get("group") != group:
        theirs = meta.get("group")
        raise StateLoadError(f"layer {layer_idx}: payload of KV cache group {theirs!r}, this layer's is {group}")
    theirs = meta.get("state")
    if theirs != spec.describe():
        raise StateLoadError(f"layer {layer_idx}: the prefill's state is {theirs!r}, this layer's {spec.describe()!r}")
    if meta.get("num_tokens") != num_tokens:
        raise StateLoadError(
            f"layer {layer_idx}: the prefill's state has seen {meta.get('num_tokens')!r} tokens, this load brings "
            f"{num_tokens} (a recurrent state cannot be rewound: the prefill must compute all but the last token)"
        )
    if len(target.block_ids) != 1 or meta.get("first_page") != target.first_page:
        raise StateLoadError(
            f"layer {layer_idx}: the prefill's state is in block {meta.get('first_page')!r} of its table, this "
            f"decode's in {target.first_page} ({len(target.block_ids)} blocks)"
        )
    if decoded.num_layers != 1 or decoded.value_cache[0] is not None:
        raise PayloadError(f"layer {layer_idx}: expected one state tensor")
    src = decoded.key_cache[0]
    if src is None or tuple(src.shape) != (1, 1, spec.nbytes) or src.dtype != torch.uint8:
        shape = None if src is None else tuple(src.shape)
        raise PayloadError(f"layer {layer_idx}: state tensor {shape}, expected (1, 1, {spec.nbytes}) uint8")
    if getattr(decoded, "unverified", None):
        verify_deferred(decoded)
    view[target.block_ids[0]].copy_(src.reshape(spec.nbytes).to(view.device))
    return spec.nbytes
