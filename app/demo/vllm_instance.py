"""One vLLM instance of ``kvferry demo --engine vllm``, in its own process, driven over
stdin/stdout (one JSON object a line). Needs vLLM (the ``vllm`` extra); never imported by
kvferry itself, only run as ``python -m kvferry.app.demo.vllm_instance``:

    python -m kvferry.app.demo.vllm_instance make-model DIR SEED [LAYERS]   # a tiny random Llama (transformers)
    python -m kvferry.app.demo.vllm_instance serve CONFIG_JSON              # then {"op": ...} lines

The serve config: ``model``; ``kv_role`` (no connector without it) with ``extra`` (its
``kv_connector_extra_config``), ``connector`` and ``module`` (the connector class and its module
path; default kvferry's, ``module`` null for one of vLLM's own), ``kv_buffer_device``;
``prefix_caching`` (default off) and ``tp`` (tensor_parallel_size, default 1).

Ops: ``generate`` (``prompts``, ``params`` (kv_transfer_params or null each), ``max_tokens``,
optionally ``logprobs`` (how many top tokens' log-probabilities to return per output token);
prompts run one at a time, each timed from the call to its output), ``loads`` (the decode
connector's recent loads: bytes, start and end on the same monotonic clock), ``stats``
(kvferry's counters on this instance, after one more engine step so the last transfers are
in), ``exit``. The ready line carries the connector's ``engine_id`` (null without one).
Replies: ``{"ok": true, ...}`` or ``{"ok": false, "error": ...}``.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

#: The tiny model's geometry (2 KiB of KV per token: 4 layers x 2 KV heads x 32 x 2 x bf16).
TINY = {"layers": 4, "kv_heads": 2, "head_dim": 32, "block_size": 32, "max_len": 2048}


def make_model(path: str, seed: int, layers: int = TINY["layers"]) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=TINY["kv_heads"],
        head_dim=TINY["head_dim"],
        max_position_embeddings=TINY["max_len"],
        initializer_range=0.3,
        tie_word_embeddings=False,
    )
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(path)


def _stats(llm: Any) -> dict[str, float]:
    out: dict[str, float] = {}
    for m in llm.get_metrics():
        if "kvferry" in m.name:
            kind = (m.labels or {}).get("kind")
            out[f"{m.name}{{{kind}}}" if kind else m.name] = float(getattr(m, "value", 0) or 0)
    return out


def _loads(_worker: Any = None) -> list[dict[str, Any]]:
    """The decode connector's recent loads in this process (kvferry's page worker; called
    directly with TP 1 and MP off, else on each rank through ``collective_rpc``)."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    worker = get_kv_transfer_group().page_worker
    return [
        {
            "req_id": r.req_id,
            "nbytes": r.nbytes,
            "started": r.started,
            "ended": r.ended,
            "ok": r.ok,
            "reported": r.reported,
        }
        for r in (worker.recent_loads if worker is not None else ())
    ]


def serve(cfg: dict[str, Any], proto: Any) -> None:
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    kv = None
    if cfg.get("kv_role"):
        more = {"kv_buffer_device": cfg["kv_buffer_device"]} if cfg.get("kv_buffer_device") else {}
        kv = KVTransferConfig(
            kv_connector=cfg.get("connector", "KVFerryConnector"),
            kv_connector_module_path=cfg.get("module", "kvferry.app.vllm"),
            kv_role=cfg["kv_role"],
            kv_connector_extra_config=cfg.get("extra", {}),
            **more,
        )
    tp = int(cfg.get("tp", 1))
    llm = LLM(
        model=cfg["model"],
        skip_tokenizer_init=True,
        dtype="bfloat16",
        block_size=TINY["block_size"],
        max_model_len=TINY["max_len"],
        max_num_seqs=4,
        max_num_batched_tokens=TINY["max_len"],
        enable_prefix_caching=bool(cfg.get("prefix_caching", False)),  # off: every local run computes its prompt
        kv_transfer_config=kv,
        tensor_parallel_size=tp,
        disable_log_stats=False,
        seed=0,
        compilation_config={"mode": 0},  # eager: no compile warm-up, the same on every instance
    )
    used = getattr(getattr(llm.llm_engine, "vllm_config", None), "kv_transfer_config", None) or kv
    engine_id = used.engine_id if used is not None else None
    proto.write(json.dumps({"ok": True, "ready": True, "engine_id": engine_id}) + "\n")
    proto.flush()
    for line in sys.stdin:
        msg = json.loads(line)
        op = msg.get("op")
        try:
            if op == "exit":
                proto.write(json.dumps({"ok": True}) + "\n")
                proto.flush()
                return
            if op == "generate":
                results = []
                for prompt, params in zip(msg["prompts"], msg["params"]):
                    extra = {"kv_transfer_params": params} if params is not None else None
                    sp = SamplingParams(
                        max_tokens=msg["max_tokens"],
                        temperature=0.0,
                        ignore_eos=True,
                        extra_args=extra,
                        logprobs=msg.get("logprobs"),
                    )
                    t = time.monotonic()
                    [res] = llm.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)
                    seconds = time.monotonic() - t
                    out = {
                        "tokens": list(res.outputs[0].token_ids),
                        "started": t,
                        "seconds": seconds,
                        "kv_transfer_params": res.kv_transfer_params,
                    }
                    if msg.get("logprobs"):  # per output token, the top ones: [[token, logprob], ...]
                        out["logprobs"] = [
                            [[int(tok), float(lp.logprob)] for tok, lp in step.items()]
                            for step in res.outputs[0].logprobs or []
                        ]
                    results.append(out)
                reply: dict[str, Any] = {"ok": True, "results": results}
            elif op == "loads":
                ranks = [_loads()] if tp == 1 else llm.collective_rpc(_loads)
                reply = {"ok": True, "loads": ranks[0], "ranks": ranks}
            elif op == "stats":
                llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=1), use_tqdm=False)
                reply = {"ok": True, "stats": _stats(llm)}
            else:
                reply = {"ok": False, "error": f"unknown op {op!r}"}
        except Exception as exc:  # reported to the driver, which fails with it
            reply = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        proto.write(json.dumps(reply) + "\n")
        proto.flush()


def main(argv: list[str]) -> None:
    if argv[0] == "make-model":
        make_model(argv[1], int(argv[2]), *(int(a) for a in argv[3:4]))
    elif argv[0] == "serve":
        real = os.dup(1)  # vLLM logs to stdout; the protocol gets the real one, the rest stderr
        os.dup2(2, 1)
        serve(json.loads(argv[1]), os.fdopen(real, "w", buffering=1))
    else:
        raise SystemExit(f"unknown command {argv[0]!r}")


if __name__ == "__main__":
    main(sys.argv[1:])
