"""vLLM's MooncakeConnector, loadable on CPU-only torch (``kv_connector_module_path`` of the
bench's Mooncake row; imported only inside a vLLM instance process).

Its worker asks ``torch.accelerator.current_device_index()``, which raises without an
accelerator; here that call answers 0 when it would raise, and nothing else changes.
"""

from __future__ import annotations

from typing import Any

import torch

_current = torch.accelerator.current_device_index


def _index(*args: Any, **kwargs: Any) -> int:
    try:
        return int(_current(*args, **kwargs))
    except RuntimeError:
        return 0


torch.accelerator.current_device_index = _index  # type: ignore[assignment]

from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.mooncake_connector import (  # noqa: E402
    MooncakeConnector,
)

__all__ = ["MooncakeConnector"]
