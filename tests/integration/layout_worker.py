"""A sender rank in its own process: builds a paged cache in one layout and sends requests.

Usage: ``layout_worker.py CONNECTOR BASE_PORT LAYOUT NAMESPACE``. Prints ``{"ready": port}``,
then for each ``{"op": "send", "request_id", "block_ids", "seq_len"}`` line sends that request
through the manager (extraction, encode, put) and prints its outcome; ``{"op": "exit"}`` ends it.
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: jsonlines
from jsonlines import commands, say  # noqa: E402

from kvferry.app.wiring import build_manager  # noqa: E402

LAYERS, BLOCKS, BLOCK, HEADS, DIM = 3, 24, 16, 4, 8


def blocks(seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer ``(key_blocks, value_blocks)`` of shape ``[BLOCKS, BLOCK, HEADS, DIM]``."""
    gen = torch.Generator().manual_seed(seed)
    return [
        (
            torch.randn(BLOCKS, BLOCK, HEADS, DIM, generator=gen).to(torch.bfloat16),
            torch.randn(BLOCKS, BLOCK, HEADS, DIM, generator=gen).to(torch.bfloat16),
        )
        for _ in range(LAYERS)
    ]


def in_layout(layout: str, k: torch.Tensor, v: torch.Tensor):
    """The same K/V blocks as one engine layout of SPEC 4."""
    if layout == "flash":  # [2, blocks, block, heads, dim]
        return torch.stack([k, v])
    if layout == "flashinfer":  # [blocks, 2, block, heads, dim]
        return torch.stack([k, v], dim=1)
    if layout == "packed":  # [blocks, heads, block, 2*dim]
        return torch.cat([k.permute(0, 2, 1, 3), v.permute(0, 2, 1, 3)], dim=-1).contiguous()
    if layout == "tuple":
        return (k, v)
    raise SystemExit(f"unknown layout {layout}")


def main() -> None:
    connector, base_port, layout, namespace = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
    cfg = {"type": connector, "zmq_port": base_port}
    if connector == "shm":
        cfg["namespace"] = namespace
    manager = build_manager(
        {
            "connector_config": cfg,
            "omni_from_stage": 0,
            "omni_to_stage": 1,
            "need_send_cache": True,
            "kv_layout": layout,
        },
        env={},
    )
    caches = [in_layout(layout, k, v) for k, v in blocks(7)]
    say({"ready": manager.sender_port()})
    for cmd in commands():
        outcome = manager.send_requests(
            {cmd["request_id"]: {"block_ids": cmd["block_ids"], "seq_len": cmd["seq_len"]}}, caches, BLOCK, "bfloat16"
        )[0]
        say({"ok": outcome.ok, "detail": outcome.detail})
    manager.close()


if __name__ == "__main__":
    main()
