"""``kvferry demo --dump DIR``: a few payload files to try ``kvferry inspect`` on.

Writes the first requests of the demo as sender rank 0 would put them: in kvferry's layout
(aligned, versioned, with CRC32 checksums) and in the reference's exact layout.
"""

from __future__ import annotations

import os
from typing import Any

from kvferry.adapters.paged_cache import ExtractionSkipped, plan_extraction
from kvferry.adapters.torch_frames import encode_bytes
from kvferry.app.demo.model import DemoSpec, request_plan

__all__ = ["dump_payloads"]


def dump_payloads(spec: DemoSpec, directory: str, count: int = 2) -> list[str]:
    """Write ``count`` requests in both layouts; returns the file paths."""
    from kvferry.app.demo.worker import synthetic_cache

    os.makedirs(directory, exist_ok=True)
    cache = synthetic_cache(spec, 0)
    paths = []
    for req in request_plan(spec)[:count]:
        plan = plan_extraction(
            cache,
            list(req.block_ids),
            req.seq_len,
            spec.block_size,
            cache_dtype=spec.dtype,
            request_id=req.request_id,
            layout="mla" if spec.is_mla else "flash",
        )
        if isinstance(plan, ExtractionSkipped):
            continue
        keys, values = plan.materialize()
        layouts: dict[str, dict[str, Any]] = {
            "kvferry": {"align": 64, "checksums": "crc32"},
            "reference": {"align": 1, "version": False},
        }
        for name, options in layouts.items():
            path = os.path.join(directory, f"{req.request_id}.{name}.kv")
            with open(path, "wb") as f:
                f.write(encode_bytes(req.request_id, keys, values, plan.block_ids, plan.metadata, **options))
            paths.append(path)
    return paths
