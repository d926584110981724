"""One rank of a kvferry receiving stage that is not vLLM: it embeds KVTransferManager (built
by kvferry.app.wiring.build_manager) and receives vLLM prefill hand-offs through
kvferry.app.vllm.receiver.VllmPageReceiver. Run by the test's own interpreter, which has no
vLLM; it checks that vLLM was never imported.

    python receiver_proc.py CONFIG_JSON     # {"rank", "tp", "num_kv_heads", "params": [...], "out", "timeout_s"}

Writes (torch.save) per hand-off: the outcome kind, detail, bytes, seconds and the received
per-layer K/V (copies), plus ``vllm_imported``.
"""

from __future__ import annotations

import json
import sys

import torch

from kvferry.app.vllm.receiver import VllmPageReceiver
from kvferry.app.wiring import build_manager
from kvferry.core.config import TransferConfig


def main(cfg: dict) -> None:
    torch.set_num_threads(1)
    config = TransferConfig(
        connector_config={"type": "shm"},
        from_stage=0,
        to_stage=1,
        stage_id=1,
        need_recv_cache=True,
        from_tp=cfg.get("prefill_tp", 1),
        to_tp=cfg["tp"],
        recv_timeout=float(cfg["timeout_s"]),
        num_kv_heads=cfg["num_kv_heads"],
    )
    manager = build_manager(config, tp_rank=cfg["rank"], tp_size=cfg["tp"])
    receiver = VllmPageReceiver.install(manager)
    results = []
    try:
        for params in cfg["params"]:
            result = receiver.receive(params, timeout_s=float(cfg["timeout_s"]))
            entry = {
                "kind": result.outcome.kind.value,
                "detail": result.outcome.detail,
                "nbytes": result.outcome.nbytes,
                "seconds": result.outcome.seconds,
            }
            if result.ok:
                blocks = result.payload["layer_blocks"]
                entry["metadata"] = dict(result.payload["metadata"])
                entry["k"] = [t.clone() for t in blocks["key_cache"]]
                entry["v"] = [t.clone() for t in blocks["value_cache"]]
                result.release()
            results.append(entry)
    finally:
        manager.close()
    torch.save(
        {"vllm_imported": any(m == "vllm" or m.startswith("vllm.") for m in sys.modules), "results": results},
        cfg["out"],
    )


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
