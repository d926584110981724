"""One vLLM instance in its own process, driven over stdin/stdout (one JSON object a line):
the instance server of ``kvferry demo --engine vllm``, ``kvferry bench --engine vllm`` and the
vLLM engine tests (whose child, ``tests/engines/vllm/engine_proc.py``, adds its own ops through
:func:`serve`'s ``more_ops``). Needs vLLM (the ``vllm`` extra); never imported by kvferry
itself, only run as ``python -m kvferry.app.demo.vllm_instance``:

    python -m kvferry.app.demo.vllm_instance make-model DIR SEED [LAYERS]   # a tiny random Llama (transformers)
    python -m kvferry.app.demo.vllm_instance serve CONFIG_JSON              # then {"op": ...} lines

The serve config: ``model``; ``kv_role`` (no connector without it) with ``extra`` (its
``kv_connector_extra_config``), ``connector`` and ``module`` (the connector class and its module
path; default kvferry's, ``module`` null for one of vLLM's own), ``kv_buffer_device``,
``policy`` (``kv_load_failure_policy``; vLLM's default without it); ``prefix_caching`` (default
off), ``tp`` (tensor_parallel_size, default 1), ``dtype`` (default bfloat16), ``kv_cache_dtype``
(default auto), ``block_size``,
``max_len`` (max_model_len), ``max_num_seqs`` (defaults: :data:`TINY`, 4),
``max_num_batched_tokens`` (default: ``max_len``, at least 2048; below a prompt's length vLLM
computes the prompt in chunks of it) and ``attention_backend`` (vLLM's choice without it).

Ops: ``generate`` (``prompts``, ``params`` (kv_transfer_params or null each), ``max_tokens``,
optionally ``logprobs`` (how many top tokens' log-probabilities to return per output token);
prompts run one at a time (no batch effects), each timed from the call to its output; the
reply's ``seconds`` is all of them), ``loads`` (the decode connector's recent loads: bytes,
start and end on the same monotonic clock), ``metrics`` (kvferry's counters on this instance:
``{name or name{kind}: value}``), ``stats`` (the same after one more engine step, so the last
transfers are in), ``exit``. The ready line carries the connector's ``engine_id`` (null
without one) and ``startup_s``. Replies: ``{"ok": true, ...}`` or ``{"ok": false, "error": ...}``.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable, Mapping
from typing import Any, TextIO

#: The tiny model's geometry (2 KiB of KV per token: 4 layers x 2 KV heads x 32 x 2 x bf16).
TINY = {"layers": 4, "kv_heads": 2, "head_dim": 32, "block_size": 32, "max_len": 2048}

#: One op of the serving loop: ``(llm, message) -> reply`` (``ok`` is added).
Op = Callable[[Any, dict[str, Any]], dict[str, Any]]


def save_random_model(path: str, seed: int, model_class: Any, config: Any) -> None:
    """A ``model_class(config)`` of random weights (torch seeded with ``seed``), in bf16, saved
    by transformers at ``path``: every tiny model the demo and the engine tests make."""
    import torch

    torch.manual_seed(seed)
    model_class(config).to(torch.bfloat16).save_pretrained(path)


def make_model(path: str, seed: int, layers: int = TINY["layers"], max_len: int = TINY["max_len"], **more: Any) -> None:
    """The tiny random Llama of :data:`TINY` (``layers`` and ``max_len`` aside; ``more``: other
    LlamaConfig fields, e.g. ``layer_types`` and ``sliding_window``)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        **more,
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=TINY["kv_heads"],
        head_dim=TINY["head_dim"],
        max_position_embeddings=max_len,
        initializer_range=0.3,
        tie_word_embeddings=False,
    )
    save_random_model(path, seed, LlamaForCausalLM, config)


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


def build_llm(cfg: dict[str, Any]) -> Any:
    """The ``vllm.LLM`` of a serve config (the keys in the module docstring)."""
    from vllm import LLM
    from vllm.config import KVTransferConfig

    kv = None
    if cfg.get("kv_role"):
        more: dict[str, Any] = {}
        if cfg.get("kv_buffer_device"):
            more["kv_buffer_device"] = cfg["kv_buffer_device"]
        if cfg.get("policy"):
            more["kv_load_failure_policy"] = cfg["policy"]
        kv = KVTransferConfig(
            kv_connector=cfg.get("connector", "KVFerryConnector"),
            kv_connector_module_path=cfg.get("module", "kvferry.app.vllm"),
            kv_role=cfg["kv_role"],
            kv_connector_extra_config=cfg.get("extra", {}),
            **more,
        )
    max_len = int(cfg.get("max_len", TINY["max_len"]))
    return LLM(
        model=cfg["model"],
        skip_tokenizer_init=True,
        dtype=cfg.get("dtype", "bfloat16"),
        block_size=int(cfg.get("block_size", TINY["block_size"])),
        kv_cache_dtype=cfg.get("kv_cache_dtype", "auto"),
        max_model_len=max_len,
        max_num_seqs=int(cfg.get("max_num_seqs", 4)),
        max_num_batched_tokens=int(cfg.get("max_num_batched_tokens", max(max_len, 2048))),
        enable_prefix_caching=bool(cfg.get("prefix_caching", False)),  # off: every local run computes its prompt
        kv_transfer_config=kv,
        tensor_parallel_size=int(cfg.get("tp", 1)),
        disable_log_stats=False,
        seed=0,
        # eager: no torch.compile warm-up (minutes on a busy 2-core machine), the same on every
        # instance, so prefill, decode and a reference compute alike
        compilation_config={"mode": 0},
        # e.g. an MLA model names CPU_MLA: on a CPU with AMX vLLM would pick AMX_MLA, which kvferry refuses
        **({"attention_config": {"backend": cfg["attention_backend"]}} if cfg.get("attention_backend") else {}),
    )


def _generate(llm: Any, msg: dict[str, Any]) -> dict[str, Any]:
    from vllm import SamplingParams

    results = []
    first = time.monotonic()
    for prompt, params in zip(msg["prompts"], msg["params"]):  # one at a time: no batch effects
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
        c = res.outputs[0]
        out = {
            "tokens": list(c.token_ids),
            "finish_reason": c.finish_reason,
            "started": t,
            "seconds": seconds,
            "kv_transfer_params": res.kv_transfer_params,
        }
        if msg.get("logprobs"):  # per output token, the top ones: [[token, logprob], ...]
            out["logprobs"] = [[[int(tok), float(lp.logprob)] for tok, lp in step.items()] for step in c.logprobs or []]
        results.append(out)
    return {"results": results, "seconds": time.monotonic() - first}


def _loads_op(llm: Any, _msg: dict[str, Any]) -> dict[str, Any]:
    tp = llm.llm_engine.vllm_config.parallel_config.tensor_parallel_size
    ranks = [_loads()] if tp == 1 else llm.collective_rpc(_loads)
    return {"loads": ranks[0], "ranks": ranks}


def _stats_op(llm: Any, _msg: dict[str, Any]) -> dict[str, Any]:
    from vllm import SamplingParams

    llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=1), use_tqdm=False)
    return {"stats": _stats(llm)}


#: The ops every instance answers (``exit`` aside).
OPS: dict[str, Op] = {
    "generate": _generate,
    "loads": _loads_op,
    "metrics": lambda llm, _msg: {"metrics": _stats(llm)},
    "stats": _stats_op,
}


def serve(
    cfg: dict[str, Any],
    proto: TextIO,
    *,
    more_ops: Callable[[Any], Mapping[str, Op]] | None = None,
    lines: Any = None,
) -> None:
    """Start the instance of ``cfg``, say it is ready on ``proto``, then answer each JSON line
    of ``lines`` (default stdin) until ``exit``. ``more_ops(llm)``, called once the engine is
    up, adds ops (a test's inspections of the engine); an op that raises is answered
    ``{"ok": false, "error": ...}`` and the loop goes on."""
    t0 = time.monotonic()
    llm = build_llm(cfg)
    ops = {**OPS, **(more_ops(llm) if more_ops is not None else {})}
    used = getattr(getattr(llm.llm_engine, "vllm_config", None), "kv_transfer_config", None)
    engine_id = used.engine_id if used is not None else None
    _say(proto, {"ok": True, "ready": True, "engine_id": engine_id, "startup_s": time.monotonic() - t0})
    for line in sys.stdin if lines is None else lines:
        msg = json.loads(line)
        op = msg.get("op")
        if op == "exit":
            _say(proto, {"ok": True})
            return
        try:
            reply = {"ok": True, **ops[op](llm, msg)} if op in ops else {"ok": False, "error": f"unknown op {op!r}"}
        except Exception as exc:  # reported to the driver, which fails with it
            reply = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        _say(proto, reply)


def _say(proto: TextIO, msg: dict[str, Any]) -> None:
    proto.write(json.dumps(msg) + "\n")
    proto.flush()


def serve_main(cfg_json: str, *, more_ops: Callable[[Any], Mapping[str, Op]] | None = None) -> None:
    """:func:`serve` with the protocol on the real stdout: vLLM logs to stdout, so everything
    else goes to stderr."""
    real = os.dup(1)
    os.dup2(2, 1)
    serve(json.loads(cfg_json), os.fdopen(real, "w", buffering=1), more_ops=more_ops)


def main(argv: list[str]) -> None:
    if argv[0] == "make-model":
        make_model(argv[1], int(argv[2]), *(int(a) for a in argv[3:4]))
    elif argv[0] == "serve":
        serve_main(argv[1])
    else:
        raise SystemExit(f"unknown command {argv[0]!r}")


if __name__ == "__main__":
    main(sys.argv[1:])
