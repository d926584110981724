"""Small sending and receiving stages for the reliability tests: configs, caches, checks.

A sender rank's paged cache is a deterministic function of ``(seed, rank)`` (FlashAttention
layout ``[2, blocks, block_size, heads/TP, head_dim]``, random bits), so any process can
rebuild what a receiver rank must get and compare bit for bit. Payloads stay small (KBs).
"""

from __future__ import annotations

import random
from typing import Any

import attrs
import torch

from kvferry.core.head_slices import plan_heads

__all__ = [
    "Geometry",
    "omni_config",
    "sender_cache",
    "expected_layers",
    "bits_equal",
    "request_blocks",
    "received_exactly",
]


@attrs.frozen
class Geometry:
    """Model geometry of the synthetic caches (heads are the full model's KV heads)."""

    layers: int = 2
    heads: int = 8
    head_dim: int = 8
    block_size: int = 4
    num_blocks: int = 96
    dtype: str = "float16"

    @property
    def token_bytes(self) -> int:
        """Bytes one token occupies in one rank's payload when TP is 1 (K and V, every layer)."""
        return 2 * self.layers * self.heads * self.head_dim * torch.finfo(getattr(torch, self.dtype)).bits // 8


def omni_config(
    role: str,
    connector: dict[str, Any],
    *,
    from_tp: int = 1,
    to_tp: int = 1,
    recv_timeout: float = 5.0,
    base_port: int = 50051,
) -> dict[str, Any]:
    """The ``omni_kv_config`` an engine would pass for one side of a stage-0 -> stage-1 link."""
    common = {
        "connector_config": {**connector, "zmq_port": base_port},
        "rank_mapping": {"from_tp": from_tp, "to_tp": to_tp},
        "recv_timeout": recv_timeout,
    }
    if role == "sender":
        return {**common, "omni_from_stage": 0, "omni_to_stage": 1, "stage_id": 0, "need_send_cache": True}
    return {**common, "stage_id": 1, "engine_input_source": [0], "need_recv_cache": True}


def sender_cache(geom: Geometry, seed: int, rank: int, from_tp: int) -> list[torch.Tensor]:
    """Sender rank ``rank``'s per-layer cache ``[2, blocks, block_size, heads/from_tp, dim]``."""
    gen = torch.Generator().manual_seed(seed * 1000 + rank)
    shape = (2, geom.num_blocks, geom.block_size, geom.heads // from_tp, geom.head_dim)
    dtype = getattr(torch, geom.dtype)
    return [
        torch.randint(-(2**15), 2**15, shape, generator=gen, dtype=torch.int16).view(dtype) for _ in range(geom.layers)
    ]


def request_blocks(geom: Geometry, rng: random.Random, seq_len: int) -> list[int]:
    """Distinct random block ids holding ``seq_len`` tokens."""
    return rng.sample(range(geom.num_blocks), -(-seq_len // geom.block_size))


def expected_layers(
    geom: Geometry,
    caches: dict[int, list[torch.Tensor]],
    block_ids: list[int],
    seq_len: int,
    from_tp: int,
    to_tp: int,
    receiver_rank: int,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """What receiver rank ``receiver_rank`` must hold: its heads of every sender's shard."""
    plan = plan_heads(from_tp, to_tp, geom.heads)[receiver_rank]
    per_sender = geom.heads // from_tp
    ids = torch.tensor(block_ids, dtype=torch.int64)
    out: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])
    for layer in range(geom.layers):
        for which in (0, 1):
            parts = []
            for s in sorted({sl.source_rank for sl in plan.slices}):
                lo, hi = s * per_sender, (s + 1) * per_sender
                a, b = max(lo, plan.abs_head_start), min(hi, plan.abs_head_stop)
                if a < b:
                    blocks = caches[s][layer][which][:, :, a - lo : b - lo][ids]
                    parts.append(blocks.reshape(-1, *blocks.shape[2:])[:seq_len])
            out[which].append(parts[0] if len(parts) == 1 else torch.cat(parts, dim=1))
    return out


def bits_equal(a: Any, b: torch.Tensor) -> bool:
    """Bit-for-bit equality (NaN payloads included)."""
    if not isinstance(a, torch.Tensor) or a.shape != b.shape or a.dtype != b.dtype:
        return False
    bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return torch.equal(a.contiguous().view(bits), b.contiguous().view(bits))


def received_exactly(payload: dict[str, Any], expected: tuple[list[torch.Tensor], list[torch.Tensor]]) -> bool:
    """True when a receive result's layers equal ``expected`` bit for bit."""
    blocks = payload["layer_blocks"]
    keys, values = blocks["key_cache"], blocks["value_cache"]
    return (
        len(keys) == len(expected[0])
        and len(values) == len(expected[1])
        and all(bits_equal(a, b) for a, b in zip(keys, expected[0]))
        and all(bits_equal(a, b) for a, b in zip(values, expected[1]))
    )
