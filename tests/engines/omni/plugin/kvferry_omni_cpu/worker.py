"""vllm-omni's AR worker and runner on vLLM's CPU worker and runner.

``GPUARModelRunner`` (vllm-omni's AR runner: the KV send at prefill end, hidden-state outputs)
and vLLM's ``CPUModelRunner`` both derive from vLLM's ``GPUModelRunner``; combined, vllm-omni's
overrides run on top of the CPU runner's (no CUDA streams or events, CPU tensors). The worker is
vLLM's ``CPUWorker`` with vllm-omni's worker mixin (plugins in the worker process), building the
combined runner in place of the CPU one, as vllm-omni's XPU worker does for XPU.
"""

from __future__ import annotations

from vllm.v1.worker.cpu_model_runner import CPUModelRunner
from vllm.v1.worker.cpu_worker import CPUWorker
from vllm_omni.worker.gpu_ar_model_runner import GPUARModelRunner
from vllm_omni.worker.mixins import OmniWorkerMixin


class CPUARModelRunner(GPUARModelRunner, CPUModelRunner):
    def _sync_device(self) -> None:
        return None


class CPUARWorker(OmniWorkerMixin, CPUWorker):
    model_runner_cls = CPUARModelRunner

    def init_device(self) -> None:
        super().init_device()
        self.model_runner = self.model_runner_cls(self.vllm_config, self.device)
