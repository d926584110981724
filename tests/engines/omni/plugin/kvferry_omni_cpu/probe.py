"""The diffusion stage's pipeline: the tiny model's next-token logits over the KV it received.

vllm-omni's diffusion runner receives the AR stage's KV through its ``OmniKVTransferManager``
(``receive_multi_kv_cache_distributed``) and hands it to the pipeline as
``req.sampling_params.past_key_values`` (``key_cache``/``value_cache``: one tensor per layer,
``[tokens, kv_heads, head_dim]``), as BAGEL's pipeline gets it. This pipeline loads the same
tiny Llama with transformers, puts the received K/V in a transformers cache and runs one probe
token after them; its output (as text, the path every stage's text output takes back to the
caller) is JSON: whether KV came, its length, and the probe's logits. Over the right KV these
equal the logits of the model's own forward over prompt + probe; without KV they are the probe's
logits alone (what the test checks it against).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from vllm_omni.diffusion.data import DiffusionOutput

logger = logging.getLogger(__name__)

#: the token run after the received KV
PROBE_TOKEN = 5


def _kv_layers(kv: Any) -> tuple[list[torch.Tensor], list[torch.Tensor]] | None:
    keys = getattr(kv, "key_cache", None) if kv is not None else None
    values = getattr(kv, "value_cache", None) if kv is not None else None
    if not keys or not values or any(t is None for t in (*keys, *values)):
        return None
    return list(keys), list(values)


class KVFerryProbePipeline(nn.Module):
    def __init__(self, *, od_config: Any, prefix: str = "") -> None:
        super().__init__()
        from transformers import LlamaForCausalLM

        self.od_config = od_config
        self.lm = LlamaForCausalLM.from_pretrained(od_config.model, torch_dtype=torch.bfloat16).eval()
        self.device = torch.device("cpu")
        self.weights_sources: tuple[Any, ...] = ()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        # the weights came with from_pretrained above
        for _ in weights:
            pass
        return {name for name, _ in self.named_parameters()}

    @torch.inference_mode()
    def probe(self, kv: Any) -> dict[str, Any]:
        from transformers import DynamicCache

        cfg = self.lm.config
        layers = _kv_layers(kv)
        cache = None
        seq_len = 0
        shapes: list[list[int]] = []
        if layers is not None:
            keys, values = layers
            cache = DynamicCache(config=cfg)
            for i, (k, v) in enumerate(zip(keys, values, strict=True)):
                shapes.append(list(k.shape))
                k = k.to(torch.bfloat16).reshape(k.shape[0], cfg.num_key_value_heads, -1)
                v = v.to(torch.bfloat16).reshape(v.shape[0], cfg.num_key_value_heads, -1)
                cache.update(k.permute(1, 0, 2).unsqueeze(0), v.permute(1, 0, 2).unsqueeze(0), i)
            seq_len = int(keys[0].shape[0])
        ids = torch.tensor([[PROBE_TOKEN]])
        out = self.lm(
            input_ids=ids,
            position_ids=torch.tensor([[seq_len]]),
            past_key_values=cache,
            use_cache=cache is not None,
        )
        logits = out.logits[0, -1].float()
        return {"kv": layers is not None, "seq_len": seq_len, "shapes": shapes, "logits": logits.tolist()}

    def forward(self, req: Any) -> DiffusionOutput:
        sampling = req.sampling_params
        result = self.probe(getattr(sampling, "past_key_values", None))
        result["request_ids"] = [str(r) for r in (getattr(req, "request_ids", None) or [])]
        logger.info("probe: kv=%s seq_len=%s shapes=%s", result["kv"], result["seq_len"], result["shapes"][:1])
        text = json.dumps(result)
        return DiffusionOutput(output={"payload": {"text": text}, "metadata": {"text": {"text_output": text}}})


def get_post_process_func(od_config: Any) -> Any:
    def post_process(x: Any) -> Any:
        return x

    return post_process
