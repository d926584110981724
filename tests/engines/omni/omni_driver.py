"""Runs under the omni venv's interpreter (``KVFERRY_OMNI_PYTHON``), driven by test_omni_pipeline.py.

    omni_driver.py make-model DIR     a tiny random Llama (weights saved by transformers) + tokenizer
    omni_driver.py isa                the attention kernel vLLM CPU picks here for the tiny model (JSON)
    omni_driver.py run SPEC.json      one orchestrator: vllm-omni's ``Omni`` over the deploy yaml the
                                      spec names, every prompt through AR stage -> diffusion stage;
                                      then, the orchestrator closed, the model's own forwards with
                                      transformers (prompt + probe, and the probe alone); writes
                                      the spec's ``out`` JSON

The spec's ``env`` (``KVFERRY_OMNI_SENDER`` / ``KVFERRY_OMNI_RECEIVER``) is set before vllm-omni is
imported; the stage processes inherit it.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

ARCH = "KVFerryTinyLlamaForCausalLM"
#: tiny, and within vLLM CPU's attention kernel (head size 64); 2 KV heads so K/V layouts matter
GEOMETRY = {
    "vocab_size": 512,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "max_position_embeddings": 1024,
}

#: vLLM CPU's default block size (the deploy yaml leaves it as it is)
CPU_BLOCK_SIZE = 128


def make_model(path: Path) -> None:
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(1234)
    config = LlamaConfig(**GEOMETRY, initializer_range=0.3, torch_dtype="bfloat16", tie_word_embeddings=False)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(path)
    # save_pretrained writes the class's own name; both stages resolve the model by this one
    config_path = path / "config.json"
    saved = json.loads(config_path.read_text())
    saved["architectures"] = [ARCH]
    config_path.write_text(json.dumps(saved, indent=2))
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, GEOMETRY["vocab_size"])}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(path)


def _texts(obj: Any, depth: int = 0) -> list[str]:
    """Every string in an output object that holds a probe result (the probe's JSON)."""
    if depth > 6:
        return []
    if isinstance(obj, str):
        return [obj] if '"logits"' in obj else []
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _texts(v, depth + 1)]
    if isinstance(obj, list | tuple):
        return [t for v in obj for t in _texts(v, depth + 1)]
    if hasattr(obj, "__dict__"):
        return _texts(vars(obj), depth + 1)
    return []


def expected(model_dir: str, prompts: list[list[int]], probe: int) -> dict[str, Any]:
    """The model's own forwards (transformers, bf16 as the stages run): prompt + probe, the probe
    alone; and the probe pipeline's own result over the KV transformers computes for the prompt
    (a check of the probe itself, with no transfer in between)."""
    from types import SimpleNamespace

    import torch
    from kvferry_omni_cpu.probe import KVFerryProbePipeline
    from transformers import LlamaForCausalLM

    lm = LlamaForCausalLM.from_pretrained(model_dir, torch_dtype=torch.bfloat16).eval()
    pipeline = KVFerryProbePipeline(od_config=SimpleNamespace(model=model_dir))
    own = []
    with torch.inference_mode():
        full = [lm(input_ids=torch.tensor([p + [probe]])).logits[0, -1].float().tolist() for p in prompts]
        alone = lm(input_ids=torch.tensor([[probe]])).logits[0, -1].float().tolist()
        for p in prompts:
            cache = lm(input_ids=torch.tensor([p]), use_cache=True).past_key_values
            layers = [cache.layers[i] for i in range(len(cache.layers))]
            kv = SimpleNamespace(
                key_cache=[layer.keys[0].permute(1, 0, 2) for layer in layers],
                value_cache=[layer.values[0].permute(1, 0, 2) for layer in layers],
            )
            own.append(pipeline.probe(kv)["logits"])
    return {"full": full, "alone": alone, "probe_own_kv": own}


def attention_isa() -> str:
    """vLLM's own choice (its CPU attention backend's rule) for a bf16 cache, the CPU platform's
    default block size and the tiny model's head size."""
    import torch
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    return str(_get_attn_isa(torch.bfloat16, CPU_BLOCK_SIZE, GEOMETRY["head_dim"]))


def run(spec: dict[str, Any]) -> dict[str, Any]:
    os.environ.update(spec.get("env", {}))
    from kvferry_omni_cpu.probe import PROBE_TOKEN
    from vllm import SamplingParams
    from vllm_omni.entrypoints.omni import Omni
    from vllm_omni.inputs.data import OmniDiffusionSamplingParams
    from vllm_omni.plugins import load_omni_general_plugins

    # the orchestrator resolves the pipeline before any stage process loads plugins: register
    # the out-of-tree one here (the stage processes load the same plugins themselves)
    load_omni_general_plugins()
    t0 = time.monotonic()
    omni = Omni(model=spec["model"], deploy_config=spec["deploy"], stage_init_timeout=600, init_timeout=900)
    started_s = time.monotonic() - t0
    results: list[dict[str, Any]] = []
    try:
        prompts = [{"prompt_token_ids": p} for p in spec["prompts"]]
        params = [SamplingParams(max_tokens=2, temperature=0.0), OmniDiffusionSamplingParams()]
        t1 = time.monotonic()
        outputs = omni.generate(prompts, params, use_tqdm=False)
        generate_s = time.monotonic() - t1
        for out in outputs:
            texts = _texts(out)
            results.append(
                {
                    "request_id": out.request_id,
                    "stage_id": out.stage_id,
                    "final_output_type": out.final_output_type,
                    "error": out.error,
                    "prompt_token_ids": out.prompt_token_ids,
                    "probe": json.loads(texts[0]) if texts else None,
                }
            )
    finally:
        omni.close()
    return {
        "started_s": started_s,
        "generate_s": generate_s,
        "outputs": results,
        "expected": expected(spec["model"], spec["prompts"], PROBE_TOKEN),
    }


def main(argv: list[str]) -> int:
    if argv[0] == "make-model":
        make_model(Path(argv[1]))
        return 0
    if argv[0] == "isa":
        print(json.dumps({"isa": attention_isa()}))
        return 0
    if argv[0] == "run":
        spec = json.loads(Path(argv[1]).read_text())
        result = run(spec)
        Path(spec["out"]).write_text(json.dumps(result))
        return 0
    raise SystemExit(f"unknown command {argv[0]!r}")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
