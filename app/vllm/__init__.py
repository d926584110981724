"""kvferry inside vLLM: ``KVFerryConnector``, a v1 KV connector for disaggregated prefill and
decode (docs/vllm.md).

``kv_connector_module_path="kvferry.app.vllm"``, ``kv_connector="KVFerryConnector"``. The
connector class is imported on first access, so importing this package (or
:mod:`kvferry.app.vllm.params`, the hand-off a proxy builds) never imports vLLM.
"""

from __future__ import annotations

from typing import Any

from kvferry.app.vllm.params import (
    PARAMS_VERSION,
    ConnectorSettings,
    DecodeSource,
    parse_decode_params,
    parse_prefill_params,
    prefill_result,
)

__all__ = [
    "KVFerryConnector",
    "PARAMS_VERSION",
    "ConnectorSettings",
    "DecodeSource",
    "parse_decode_params",
    "parse_prefill_params",
    "prefill_result",
]


def __getattr__(name: str) -> Any:
    if name == "KVFerryConnector":
        from kvferry.app.vllm.connector import KVFerryConnector

        return KVFerryConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
