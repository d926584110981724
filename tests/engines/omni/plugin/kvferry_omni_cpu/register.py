"""vllm-omni general plugin (runs in every vllm-omni process): registers the tiny model with
vLLM's and vllm-omni's model registries, the probe pipeline with the diffusion registry, and the
two-stage pipeline topology ``kvferry_tiny`` (BAGEL's: AR stage 0 sends KV at prefill end,
diffusion stage 1 receives it). ``KVFERRY_OMNI_SENDER`` / ``KVFERRY_OMNI_RECEIVER`` (``reference``
or ``kvferry``) choose whose ``OmniKVTransferManager`` the AR and the diffusion runner build;
``KVFERRY_OMNI_KV_LAYOUT``, when set, adds ``kv_layout`` to stage 0's ``omni_kv_config`` (kvferry's
name for the cache layout the AR stage writes; vllm-omni's manager does not read the key)."""

from __future__ import annotations

import logging
import os

logger = logging.getLogger(__name__)

_done = False

SIDES = {
    "KVFERRY_OMNI_SENDER": "vllm_omni.worker.gpu_ar_model_runner",
    "KVFERRY_OMNI_RECEIVER": "vllm_omni.diffusion.worker.diffusion_model_runner",
}


def _sender_kv_config() -> dict[str, object]:
    config: dict[str, object] = {"need_send_cache": True, "kv_transfer_criteria": {"type": "prefill_finished"}}
    layout = os.environ.get("KVFERRY_OMNI_KV_LAYOUT")
    if layout:
        config["kv_layout"] = layout
    return config


def _pipeline() -> object:
    from vllm_omni.config.stage_config import PipelineConfig, StageExecutionType, StagePipelineConfig

    from kvferry_omni_cpu.models import ARCH

    return PipelineConfig(
        model_type="kvferry_tiny",
        model_arch=ARCH,
        hf_architectures=(ARCH,),
        stages=(
            StagePipelineConfig(
                stage_id=0,
                model_stage="thinker",
                execution_type=StageExecutionType.LLM_AR,
                input_sources=(),
                final_output=True,
                final_output_type="text",
                owns_tokenizer=True,
                model_arch=ARCH,
                engine_output_type="text",
                omni_kv_config=_sender_kv_config(),
            ),
            StagePipelineConfig(
                stage_id=1,
                model_stage="dit",
                execution_type=StageExecutionType.DIFFUSION,
                input_sources=(0,),
                final_output=True,
                final_output_type="text",
                omni_kv_config={"need_recv_cache": True},
            ),
        ),
    )


def _use_managers() -> None:
    """Put kvferry's compat manager where a runner module builds the reference's, per side."""
    import importlib

    for env, module_name in SIDES.items():
        side = os.environ.get(env, "reference")
        if side == "reference":
            continue
        if side != "kvferry":
            raise ValueError(f"{env}={side!r}: expected 'reference' or 'kvferry'")
        from kvferry.app.compat import OmniKVTransferManager

        module = importlib.import_module(module_name)
        module.OmniKVTransferManager = OmniKVTransferManager  # type: ignore[attr-defined]
        logger.info("%s: kvferry's OmniKVTransferManager in %s", env, module_name)


def register() -> None:
    global _done
    if _done:
        return
    _done = True
    from vllm.model_executor.models import ModelRegistry
    from vllm_omni.config.pipeline_registry import register_pipeline
    from vllm_omni.diffusion.registry import register_diffusion_model
    from vllm_omni.model_executor.models.registry import OmniModelRegistry

    from kvferry_omni_cpu.models import ARCH

    ModelRegistry.register_model(ARCH, "kvferry_omni_cpu.models:KVFerryTinyLlamaForCausalLM")
    OmniModelRegistry.register_model(ARCH, "kvferry_omni_cpu.models:KVFerryTinyLlamaForCausalLM")
    register_diffusion_model(
        ARCH, "kvferry_omni_cpu.probe", "KVFerryProbePipeline", post_process_func_name="get_post_process_func"
    )
    register_pipeline(_pipeline())
    _use_managers()
