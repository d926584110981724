"""One vLLM instance in its own process, driven over stdin/stdout (one JSON object a line).

Run by the vLLM venv's interpreter (KVFERRY_VLLM_PYTHON), never imported by pytest. The
instance server is the library's (:mod:`kvferry.app.demo.vllm_instance`, its ops and config
keys); this file adds the tests' settings, their inspections of the engine and their commands:

    python engine_proc.py make-model DIR SEED      # a tiny random Llama saved by transformers
    python engine_proc.py make-mla-model DIR SEED LAYERS  # a tiny random DeepSeek-V2 (MLA) saved by transformers
    python engine_proc.py make-hybrid-model DIR SEED WINDOW  # the tiny Llama, layers alternating full / sliding window
    python engine_proc.py make-mamba-model DIR SEED    # a tiny Granite 4 hybrid, Mamba2 and attention layers
    python engine_proc.py serve CONFIG_JSON        # then: {"op": "generate", ...} lines (and pages/latents/tokens)
    python engine_proc.py hf-kv DIR PROMPTS_JSON OUT   # transformers' past_key_values of each prompt
    python engine_proc.py write-pages ISA OUT      # vLLM's CPU kernel writes known K/V into pages
    python engine_proc.py compat-kv DIR OUT        # compat manager from a vLLM config reads the model's K/V

Replies: ``{"ok": true, ...}`` or ``{"ok": false, "error": ...}``, one line per request.
"""

from __future__ import annotations

import json
import sys

from kvferry.app.demo import vllm_instance as instance

#: The tests' max_model_len (and their models' max_position_embeddings).
MAX_LEN = 1024


def make_model(path: str, seed: int, **config: object) -> None:
    """The library's tiny random Llama (:func:`kvferry.app.demo.vllm_instance.make_model`), at
    the tests' ``max_model_len``; ``config``: more LlamaConfig fields."""
    instance.make_model(path, seed, max_len=MAX_LEN, **config)


def make_mla_model(path: str, seed: int, layers: int) -> None:
    """A tiny random DeepSeek-V2 of ``layers`` layers: MLA attention, dense MLPs only
    (``first_k_dense_replace`` = every layer), no q LoRA. vLLM's CPU MLA kernel compiles only
    for a 576-wide latent (``kv_lora_rank`` 512 + ``qk_rope_head_dim`` 64, docs/layouts.md), so
    those two are DeepSeek's own; everything else is small."""
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

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
        max_position_embeddings=MAX_LEN,
        initializer_range=0.3,
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
    )
    instance.save_random_model(path, seed, DeepseekV2ForCausalLM, config)


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


def make_mamba_model(path: str, seed: int) -> None:
    """A tiny random Granite 4 hybrid (``GraniteMoeHybridForCausalLM``): 4 layers, Mamba2 and
    attention alternating (``layer_types``), dense MLPs only (no experts). vLLM makes a
    full-attention group and a Mamba group (conv state and SSM state per layer)."""
    from transformers import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM

    config = GraniteMoeHybridConfig(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        shared_intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        layer_types=["mamba", "attention", "mamba", "attention"],
        mamba_n_heads=8,
        mamba_d_head=32,
        mamba_d_state=16,
        mamba_n_groups=1,
        mamba_d_conv=4,
        mamba_expand=2,
        mamba_chunk_size=64,
        num_local_experts=0,
        num_experts_per_tok=0,
        position_embedding_type="rope",
        max_position_embeddings=MAX_LEN,
        initializer_range=0.3,
        tie_word_embeddings=False,
    )
    instance.save_random_model(path, seed, GraniteMoeHybridForCausalLM, config)


SAVES: dict[str, tuple[int, ...]] = {}  # transfer id -> prefill blocks (from the step metadata)
LOADS: list[tuple[int, ...]] = []  # decode blocks each load filled, in order
GROUP_JOBS: list[dict] = []  # with several KV cache groups: each save's and load's pages per group
STATES: list[dict] = []  # Mamba state blocks in the engine's own cache, as saved and as written


def _watch_states() -> None:
    """Record the sha256 of every Mamba state block in the engine's own cache: on a prefill as
    kvferry's saver gathers it, on a decode right after kvferry's loader wrote it (vLLM's next
    step then runs the prompt's last token and overwrites the block in place, so this is the
    only moment the written state can be read). The bytes are read from the cache tensors
    themselves, not from kvferry's payload. Engine core in this process (MP off, TP 1)."""
    import hashlib

    import torch

    from kvferry.app.vllm import loader, state_pages

    def digest(t):
        return hashlib.sha256(t.contiguous().view(torch.uint8).cpu().numpy().tobytes()).hexdigest()

    gather, write = state_pages.StateWriter.gather, loader.write_state

    def gather_recorded(self, view, index, dest, layout):
        gather(self, view, index, dest, layout)
        blocks = view.index_select(0, index.to(view.device))
        tid, layer = layout.header.request_id, layout.header.metadata["layer"]
        STATES.append({"side": "save", "transfer_id": tid, "layer": layer, "sha256": digest(blocks)})

    def write_recorded(view, spec, decoded, layer_idx, group, target, num_tokens):
        written = write(view, spec, decoded, layer_idx, group, target, num_tokens)
        block = view[target.block_ids[0]]
        STATES.append({"side": "load", "transfer_id": decoded.request_id, "layer": layer_idx, "sha256": digest(block)})
        return written

    state_pages.StateWriter.gather = gather_recorded
    loader.write_state = write_recorded


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
        for kind, jobs in (("save", meta.plan.saves), ("load", meta.plan.loads)):
            for job in jobs:
                if job.groups:
                    pages = [[g.group, g.first_page, list(g.block_ids)] for g in job.groups]
                    GROUP_JOBS.append({"kind": kind, "req_id": job.req_id, "groups": pages})
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


def _group_specs(llm) -> tuple:
    connector = llm.llm_engine.engine_core.engine_core.scheduler.connector
    return tuple(getattr(connector, "groups", ()))


def _group_labels(llm) -> list[str]:
    return [g.label for g in _group_specs(llm)]


def _blocks(msg: dict, num_tokens: int | None, block_size: int) -> list[int]:
    """The prefill's pages of ``msg``'s transfer, or the decode's of its last load: the first
    ``msg["blocks"]`` of them, or those holding the first ``num_tokens`` tokens."""
    blocks = list(SAVES[msg["transfer_id"]]) if "transfer_id" in msg else list(LOADS[-1])
    return blocks[: msg["blocks"]] if num_tokens is None else blocks[: -(-num_tokens // block_size)]


def inspection_ops(cfg: dict):
    """The tests' inspections of a serving instance (``pages``, ``latents``, ``tokens``), each
    over every rank through ``collective_rpc``; the plans they read are captured once the
    engine is up."""
    bs = cfg.get("block_size", 32)

    def ops(llm) -> dict:
        _capture_plans(llm)
        _watch_states()
        return {
            # only full pages, not recomputed; per decode rank's heads
            "pages": lambda llm, m: {
                "ranks": llm.collective_rpc(_page_hashes, args=(_blocks(m, None, bs), m.get("slices")))
            },
            "latents": lambda llm, m: {
                "ranks": llm.collective_rpc(_latent_hashes, args=(_blocks(m, m["num_tokens"], bs), m["num_tokens"]))
            },
            "tokens": lambda llm, m: {
                "ranks": llm.collective_rpc(_token_hashes, args=(_blocks(m, m["num_tokens"], bs), m["num_tokens"]))
            },
            # the KV cache groups the connector found (and the tokens a page of each holds),
            # the jobs' pages per group, the Mamba state blocks saved and written
            "groups": lambda llm, m: {
                "groups": _group_labels(llm),
                "block_sizes": [g.block_size for g in _group_specs(llm)],
                "jobs": GROUP_JOBS,
                "states": STATES,
            },
        }

    return ops


def serve(cfg_json: str) -> None:
    """The library's instance server at the tests' settings: every prompt is handed off unless
    a test sets the threshold (its prompts are short), failed loads recompute unless a test
    sets the policy, a 1024-token model length, 8 sequences."""
    cfg = json.loads(cfg_json)
    cfg = {"policy": "recompute", "max_len": MAX_LEN, "max_num_seqs": 8, **cfg}
    if cfg.get("kv_role"):
        cfg["extra"] = {"kv_recompute_threshold": 0, **cfg.get("extra", {})}
    instance.serve_main(json.dumps(cfg), more_ops=inspection_ops(cfg))


COMMANDS = {
    "make-model": lambda a: make_model(a[0], int(a[1])),
    "make-mla-model": lambda a: make_mla_model(a[0], int(a[1]), int(a[2])),
    # vLLM's Llama reads layer_types / sliding_window
    "make-hybrid-model": lambda a: make_model(
        a[0], int(a[1]), layer_types=["full_attention", "sliding_attention"] * 2, sliding_window=int(a[2])
    ),
    "make-mamba-model": lambda a: make_mamba_model(a[0], int(a[1])),
    "hf-kv": lambda a: hf_kv(*a),
    "compat-kv": lambda a: compat_kv(*a),
    "write-pages": lambda a: write_pages(*a),
    "serve": lambda a: serve(a[0]),
}

if __name__ == "__main__":
    COMMANDS[sys.argv[1]](sys.argv[2:])
