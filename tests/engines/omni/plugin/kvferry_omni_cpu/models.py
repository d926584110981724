"""The AR stage's model: vLLM's Llama with a ``forward`` that takes the extra keyword arguments
vllm-omni's AR runner passes to every model (vLLM's own Llama refuses them)."""

from __future__ import annotations

from typing import Any

import torch
from vllm.model_executor.models.llama import LlamaForCausalLM

#: the architecture name in the tiny model's config.json; the AR stage (vLLM) and the diffusion
#: stage (vllm-omni's diffusion registry) each resolve it to their own class
ARCH = "KVFerryTinyLlamaForCausalLM"


class KVFerryTinyLlamaForCausalLM(LlamaForCausalLM):
    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        intermediate_tensors: Any = None,
        inputs_embeds: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> Any:
        return super().forward(input_ids, positions, intermediate_tensors, inputs_embeds)
