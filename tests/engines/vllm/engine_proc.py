"""One vLLM instance in its own process, driven over stdin/stdout (one JSON object a line).

Run by the vLLM venv's interpreter (KVFERRY_VLLM_PYTHON), never imported by pytest:

    python engine_proc.py make-model DIR SEED      # a tiny random Llama saved by transformers
    python engine_proc.py make-mla-model DIR SEED LAYERS  # a tiny random DeepSeek-V2 (MLA) saved by transformers
    python engine_proc.py serve CONFIG_JSON        # then: {"op": "generate", ...} lines
    python engine_proc.py hf-kv DIR PROMPTS_JSON OUT   # transformers' past_key_values of each prompt
    python engine_proc.py write-pages ISA OUT      # vLLM's CPU kernel writes known K/V into pages
    python engine_proc.py compat-kv DIR OUT        # compat manager from a vLLM config reads the model's K/V

Replies: ``{"ok": true, ...}`` or ``{"ok": false, "error": ...}``, one line per request.
"""

from __future__ import annotations

import json
import os
import sys
import time


def make_model(path: str, seed: int) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=1024,
        initializer_range=0.3,
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
    )
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(path)


def make_mla_model(path: str, seed: int, layers: int) -> None:
    """A tiny random DeepSeek-V2 of ``layers`` layers: MLA attention, dense MLPs only
    (``first_k_dense_replace`` = every layer), no q LoRA. vLLM's CPU MLA kernel compiles only
    for a 576-wide latent (``kv_lora_rank`` 512 + ``qk_rope_head_dim`` 64, docs/layouts.md), so
    those two are DeepSeek's own; everything else is small."""
    import torch
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    torch.manual_seed(seed)
    config = DeepseekV2Config(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        moe_intermediate_size=64,
        num_hidden_layers=layers,
        first_k_dense_replace=layers,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=None,
        kv_lora_rank=512,
        qk_rope_head_dim=64,
        qk_nope_head_dim=32,
        v_head_dim=32,
        n_routed_experts=4,
        n_shared_experts=1,
        num_experts_per_tok=2,
        max_position_embeddings=1024,
        initializer_range=0.3,
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
    )
    model = DeepseekV2ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(path)


def _model_kv(path: str, prompts: list[list[int]]) -> list:
    """Per prompt, per layer, transformers' post-RoPE K and V ``[tokens, kv_heads, head_dim]``
    (``use_cache=True``, eager attention, the model's bf16)."""
    import torch
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(path, dtype=torch.bfloat16, attn_implementation="eager").eval()
    result = []
    with torch.no_grad():
        for prompt in prompts:
            cache = model(torch.tensor([prompt]), use_cache=True).past_key_values
            layers = getattr(cache, "layers", None)
            if layers is not None:
                kv = [(layer.keys, layer.values) for layer in layers]
            else:
                kv = list(zip(cache.key_cache, cache.value_cache))
            result.append([(k[0].transpose(0, 1).contiguous(), v[0].transpose(0, 1).contiguous()) for k, v in kv])
    return result


def hf_kv(path: str, prompts_json: str, out: str) -> None:
    """:func:`_model_kv` of the prompts, saved with torch.save."""
    import torch

    torch.save(_model_kv(path, json.loads(prompts_json)), out)


def write_pages(isa: str, out: str) -> None:
    """Random bf16 K/V ``[tokens, heads, head_dim]`` written by vLLM's own
    ``cpu_attn_reshape_and_cache`` (kernel ``isa``) into a ``[blocks, heads, block_size,
    2*head_size]`` cache through a shuffled slot mapping; saves the truth, the slots and the cache."""
    import torch
    import vllm._custom_ops as ops

    g = torch.Generator().manual_seed(5)
    blocks, heads, bs, d, tokens = 6, 2, 32, 64, 150
    k = torch.randn(tokens, heads, d, generator=g).to(torch.bfloat16)
    v = torch.randn(tokens, heads, d, generator=g).to(torch.bfloat16)
    order = torch.randperm(blocks, generator=g)[: -(-tokens // bs)]
    slots = torch.cat([b * bs + torch.arange(bs) for b in order.tolist()])[:tokens]
    cache = torch.zeros(blocks, heads, bs, 2 * d, dtype=torch.bfloat16)
    kc, vc = cache.view(blocks, heads, 2 * bs, d).chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(k, v, kc, vc, slots, isa)
    torch.save({"k": k, "v": v, "blocks": order, "cache": cache, "block_size": bs}, out)


def compat_kv(path: str, out: str) -> None:
    """kvferry's compat manager built from a real vLLM CPU engine config (``from_vllm_config``,
    as vllm-omni's AR runner builds it), its ``kv_layout`` taken from the engine; then the
    model's own K/V (transformers, post-RoPE) written into a paged cache by vLLM's own CPU
    kernel (the ISA vLLM picks here) and extracted through that layout. Saves the layout, the
    truth and what kvferry extracted, and the same extraction under the reference's reading
    (``packed``, the control)."""
    from types import SimpleNamespace

    import torch
    import vllm._custom_ops as ops
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    from kvferry.adapters.paged_cache import extract_request
    from kvferry.app.compat import OmniKVTransferManager

    bs = 32
    vllm_config = EngineArgs(
        model=path, skip_tokenizer_init=True, dtype="bfloat16", block_size=bs, max_model_len=1024
    ).create_engine_config()
    omni = {"connector_config": {"type": "memory"}, "need_send_cache": True, "from_stage": 0, "to_stage": 1}
    manager = OmniKVTransferManager.from_vllm_config(
        vllm_config, model_config=SimpleNamespace(omni_kv_config=omni), tp_rank=0, tp_size=1
    )
    layout = manager.manager.config.kv_layout
    prompt = list(range(3, 3 + 100))
    [truth] = _model_kv(path, [prompt])
    heads, d = truth[0][0].shape[1:]
    isa = str(_get_attn_isa(torch.bfloat16, bs, d, "auto"))
    blocks = [5, 2, 7, 0]
    slots = torch.cat([b * bs + torch.arange(bs) for b in blocks])[: len(prompt)]
    caches = []
    for k, v in truth:
        c = torch.zeros(8, heads, bs, 2 * d, dtype=torch.bfloat16)
        kc, vc = c.view(8, heads, 2 * bs, d).chunk(2, dim=2)
        ops.cpu_attn_reshape_and_cache(k, v, kc, vc, slots, isa)
        caches.append(c)
    from kvferry.core.errors import ConfigError

    try:
        got = extract_request(caches, blocks, len(prompt), bs, cache_dtype=torch.bfloat16, layout=layout)
        got_kv, refused = [(k, v) for k, v in zip(got.key_cache, got.value_cache)], None
    except ConfigError as exc:  # the amx order: the whole-cache extraction refuses it (docs/compat.md)
        got_kv, refused = None, str(exc)
    packed = extract_request(caches, blocks, len(prompt), bs, cache_dtype=torch.bfloat16, layout="packed")
    torch.save(
        {
            "layout": None if layout is None else [layout.name, layout.isa],
            "isa": isa,
            "truth": truth,
            "got": got_kv,
            "refused": refused,
            "packed": [(k, v) for k, v in zip(packed.key_cache, packed.value_cache)],
        },
        out,
    )


PROTO = sys.stdout
SAVES: dict[str, tuple[int, ...]] = {}  # transfer id -> prefill blocks (from the step metadata)
LOADS: list[tuple[int, ...]] = []  # decode blocks each load filled, in order


def _capture_plans(llm) -> None:
    """Record the blocks kvferry's plans name (engine core in this process: MP off)."""
    connector = llm.llm_engine.engine_core.engine_core.scheduler.connector
    if connector is None:
        return
    build = connector.build_connector_meta

    def capture(scheduler_output):
        meta = build(scheduler_output)
        for job in meta.plan.saves:
            SAVES[job.transfer_id] = job.block_ids
        for job in meta.plan.loads:
            LOADS.append(job.block_ids)
        return meta

    connector.build_connector_meta = capture


def _page_hashes(worker, block_ids, slices):
    """Per layer, the sha256 of pages ``block_ids`` of each head slice (None: all heads)."""
    import hashlib

    import torch

    out = []
    for layer in worker.model_runner.kv_caches:
        pages = layer[torch.tensor(block_ids, dtype=torch.long)]
        row = []
        for sl in slices or [None]:
            part = pages if sl is None else pages[:, sl[0] : sl[1]]
            row.append(hashlib.sha256(part.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest())
        out.append(row)
    first = worker.model_runner.kv_caches[0]
    return {"heads": int(first.shape[1]), "dtype": str(first.dtype).replace("torch.", ""), "hashes": out}


def _latent_hashes(worker, block_ids, num_tokens):
    """Per layer of an MLA cache ``[blocks, 1, block_size, latent]``, the sha256 of the first
    ``num_tokens`` tokens' latents in pages ``block_ids`` (a partial last page included)."""
    import hashlib

    import torch

    out = []
    for layer in worker.model_runner.kv_caches:
        latents = layer[torch.tensor(block_ids, dtype=torch.long)].reshape(-1, layer.shape[-1])[:num_tokens]
        out.append(hashlib.sha256(latents.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest())
    return {"shape": list(worker.model_runner.kv_caches[0].shape), "hashes": out}


def _token_hashes(worker, block_ids, num_tokens):
    """Per layer, the sha256 of the first ``num_tokens`` tokens' K and of their V in pages
    ``block_ids``, read per token by kvferry (the page order of the kernel vLLM picked): equal
    across instances of other block sizes exactly when the tokens' K/V are."""
    import hashlib

    import torch

    from kvferry.adapters.kv_layouts import vllm_pages_to_tokens
    from kvferry.app.vllm.backends import kernel_isa

    out = []
    for layer in worker.model_runner.kv_caches:
        n, h, bs, two_d = layer.shape
        isa = kernel_isa(layer.dtype, bs, two_d // 2, "auto")
        pages = layer[torch.tensor(block_ids, dtype=torch.long)].view(len(block_ids), h, 2, bs * two_d // 2)
        k, v = vllm_pages_to_tokens(pages[:, :, 0], pages[:, :, 1], block_size=bs, num_tokens=num_tokens, isa=isa)
        out.append([hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest() for t in (k, v)])
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    # this rank's last load (ok, bytes written): [] on a prefill
    loads = [[r.ok, r.nbytes] for r in list(get_kv_transfer_group().page_worker.recent_loads)[-1:]]
    return {"isa": isa, "block_size": bs, "hashes": out, "last_load": loads}


def serve(cfg: dict) -> None:
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    t0 = time.monotonic()
    kv = None
    if cfg.get("kv_role"):
        kv = KVTransferConfig(
            kv_connector="KVFerryConnector",
            kv_connector_module_path="kvferry.app.vllm",
            kv_role=cfg["kv_role"],
            # every prompt is handed off unless a test sets the threshold (its prompts are short)
            kv_connector_extra_config={"kv_recompute_threshold": 0, **cfg.get("extra", {})},
            kv_load_failure_policy=cfg.get("policy", "recompute"),
        )
    llm = LLM(
        model=cfg["model"],
        skip_tokenizer_init=True,
        dtype=cfg.get("dtype", "bfloat16"),
        block_size=cfg.get("block_size", 32),
        kv_cache_dtype=cfg.get("kv_cache_dtype", "auto"),
        max_model_len=1024,
        max_num_seqs=8,
        max_num_batched_tokens=2048,
        enable_prefix_caching=cfg.get("prefix_caching", False),
        kv_transfer_config=kv,
        tensor_parallel_size=cfg.get("tp", 1),
        disable_log_stats=False,
        seed=0,
        # eager: no torch.compile warm-up (minutes on a busy 2-core machine); every instance of a
        # test runs the same way, so prefill, decode and reference compute alike
        compilation_config={"mode": 0},
        # an MLA model names CPU_MLA: on a CPU with AMX vLLM would pick AMX_MLA, which kvferry refuses
        **({"attention_config": {"backend": cfg["attention_backend"]}} if cfg.get("attention_backend") else {}),
    )
    _capture_plans(llm)
    out = PROTO
    out.write(json.dumps({"ok": True, "ready": True, "startup_s": time.monotonic() - t0}) + "\n")
    out.flush()
    for line in sys.stdin:
        msg = json.loads(line)
        op = msg.get("op")
        try:
            if op == "exit":
                out.write(json.dumps({"ok": True}) + "\n")
                out.flush()
                break
            if op == "generate":
                sp = []
                for params in msg["params"]:
                    extra = {"kv_transfer_params": params} if params is not None else None
                    sp.append(
                        SamplingParams(max_tokens=msg["max_tokens"], temperature=0.0, ignore_eos=True, extra_args=extra)
                    )
                t = time.monotonic()
                results = []
                for prompt, p in zip(msg["prompts"], sp):  # one at a time: no batch effects
                    [res] = llm.generate([{"prompt_token_ids": prompt}], p, use_tqdm=False)
                    c = res.outputs[0]
                    results.append(
                        {
                            "tokens": list(c.token_ids),
                            "finish_reason": c.finish_reason,
                            "kv_transfer_params": res.kv_transfer_params,
                        }
                    )
                reply = {"ok": True, "results": results, "seconds": time.monotonic() - t}
            elif op == "pages":
                # prefill: its pages of a transfer, per decode rank's heads; decode: each rank's
                # pages of its last load. Only the first ``blocks`` pages (full, not recomputed).
                if "transfer_id" in msg:
                    blocks = list(SAVES[msg["transfer_id"]][: msg["blocks"]])
                else:
                    blocks = list(LOADS[-1][: msg["blocks"]])
                reply = {"ok": True, "ranks": llm.collective_rpc(_page_hashes, args=(blocks, msg.get("slices")))}
            elif op == "latents":
                # an MLA cache's per-token latents of the first ``num_tokens`` tokens: the prefill's
                # of a transfer, or the decode's of its last load
                blocks = list(SAVES[msg["transfer_id"]]) if "transfer_id" in msg else list(LOADS[-1])
                blocks = blocks[: -(-msg["num_tokens"] // cfg.get("block_size", 32))]
                reply = {"ok": True, "ranks": llm.collective_rpc(_latent_hashes, args=(blocks, msg["num_tokens"]))}
            elif op == "tokens":
                # per-token K/V hashes of the first ``num_tokens`` tokens: the prefill's pages of a
                # transfer, or the decode's pages of its last load
                blocks = list(SAVES[msg["transfer_id"]]) if "transfer_id" in msg else list(LOADS[-1])
                bs = cfg.get("block_size", 32)
                blocks = blocks[: -(-msg["num_tokens"] // bs)]
                reply = {"ok": True, "ranks": llm.collective_rpc(_token_hashes, args=(blocks, msg["num_tokens"]))}
            elif op == "metrics":
                reply = {
                    "ok": True,
                    "metrics": [
                        [m.name, m.labels, getattr(m, "value", None)] for m in llm.get_metrics() if "kvferry" in m.name
                    ],
                }
            else:
                reply = {"ok": False, "error": f"unknown op {op!r}"}
        except Exception as exc:  # reported to the test, which fails with it
            reply = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        out.write(json.dumps(reply) + "\n")
        out.flush()


if __name__ == "__main__":
    if sys.argv[1] == "make-model":
        make_model(sys.argv[2], int(sys.argv[3]))
    elif sys.argv[1] == "make-mla-model":
        make_mla_model(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
    elif sys.argv[1] == "hf-kv":
        hf_kv(sys.argv[2], sys.argv[3], sys.argv[4])
    elif sys.argv[1] == "compat-kv":
        compat_kv(sys.argv[2], sys.argv[3])
    elif sys.argv[1] == "write-pages":
        write_pages(sys.argv[2], sys.argv[3])
    elif sys.argv[1] == "serve":
        # vLLM logs to stdout; the protocol needs it: send everything else to stderr
        real = os.dup(1)
        os.dup2(2, 1)
        PROTO = os.fdopen(real, "w", buffering=1)
        serve(json.loads(sys.argv[2]))
