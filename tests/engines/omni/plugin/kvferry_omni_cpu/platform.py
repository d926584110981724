"""An out-of-tree vllm-omni platform for CPU (vllm-omni 0.30.0 ships none).

vllm-omni picks its platform through the ``vllm_omni.platform_plugins`` entry point group: each
plugin returns the qualified name of its platform class, or ``None`` when it does not apply. This
one applies where no CUDA device is visible (``KVFERRY_OMNI_CPU_PLATFORM=0`` turns it off).
"""

from __future__ import annotations

import os
from typing import Any

import torch
from vllm.platforms.cpu import CpuPlatform
from vllm_omni.platforms.interface import OmniPlatform, OmniPlatformEnum


def activate() -> str | None:
    if os.environ.get("KVFERRY_OMNI_CPU_PLATFORM", "1") == "0" or torch.cuda.is_available():
        return None
    return "kvferry_omni_cpu.platform.CpuOmniPlatform"


def _memory() -> tuple[int, int]:
    """(available, total) bytes of host memory."""
    pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    try:
        with open("/proc/meminfo") as f:
            info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f}
        return info.get("MemAvailable", pages), info.get("MemTotal", pages)
    except OSError:
        return pages, pages


class CpuOmniPlatform(OmniPlatform, CpuPlatform):
    """vLLM's CPU platform plus vllm-omni's interfaces, with the AR stage on CPUARWorker."""

    _omni_enum = OmniPlatformEnum.OOT

    @classmethod
    def get_omni_ar_worker_cls(cls) -> str:
        return "kvferry_omni_cpu.worker.CPUARWorker"

    @classmethod
    def get_omni_generation_worker_cls(cls) -> str:
        raise NotImplementedError("kvferry_omni_cpu runs AR and diffusion stages only")

    @classmethod
    def get_default_stage_config_path(cls) -> str:
        return "vllm_omni/model_executor/stage_configs"

    @classmethod
    def get_diffusion_attn_backend_cls(
        cls, selected_backend: str | None, head_size: int, allow_trtllm_default: bool = False
    ) -> str:
        from vllm_omni.diffusion.attention.backends.registry import DiffusionAttentionBackendEnum

        return DiffusionAttentionBackendEnum.TORCH_SDPA.get_path()

    @classmethod
    def supports_diffusion_dense_flash_attention(cls) -> bool:
        return False

    @classmethod
    def supports_torch_inductor(cls) -> bool:
        return False

    @classmethod
    def get_torch_device(cls, local_rank: int | None = None) -> torch.device:
        return torch.device("cpu")

    @classmethod
    def get_device_count(cls) -> int:
        return 1

    @classmethod
    def get_device_version(cls) -> str | None:
        return None

    @classmethod
    def set_device(cls, device: Any) -> None:
        return None

    @classmethod
    def synchronize(cls) -> None:
        return None

    @classmethod
    def empty_cache(cls) -> None:
        return None

    @classmethod
    def get_free_memory(cls, device: torch.device | None = None) -> int:
        return _memory()[0]

    @classmethod
    def get_device_memory(cls, device: torch.device | None = None) -> tuple[int, int]:
        return _memory()

    @classmethod
    def get_device_total_memory(cls, device_id: int = 0) -> int:
        return _memory()[1]

    # The diffusion runner reads the accelerator's peak-memory counters around every request;
    # host memory has none (vLLM's CPU platform leaves these unset).
    @classmethod
    def reset_peak_memory_stats(cls, device: Any = None) -> None:
        return None

    @classmethod
    def max_memory_allocated(cls, device: Any = None) -> int:
        return 0

    @classmethod
    def max_memory_reserved(cls, device: Any = None) -> int:
        return 0

    @classmethod
    def memory_allocated(cls, device: Any = None) -> int:
        return 0

    @classmethod
    def current_device(cls) -> int:
        return 0
