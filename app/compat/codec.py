"""The reference's payload value, configuration value and prefetch error, on kvferry's codec.

:class:`KVCacheTransferData` writes exactly the reference's bytes (SPEC 3.1 with no kvferry
extension: no alignment padding, no format version, no checksums), so a reference receiver
decodes what a compat sender writes, byte for byte. Its decoders are kvferry's
(:func:`kvferry.adapters.torch_frames.decode_payload`): they read reference payloads and
kvferry's own (aligned, versioned, checksummed) payloads alike, return tensors that are views
of the input where possible, and raise ``PayloadError`` (a ``ValueError``) for malformed input.

:class:`OmniKVCacheConfig` is the reference's configuration dataclass; it converts to and from
kvferry's validated :class:`kvferry.core.config.TransferConfig`.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any

import torch

from kvferry.adapters.torch_frames import decode_payload, encode_bytes, encode_device_tensor
from kvferry.core.config import TransferConfig
from kvferry.core.errors import ConfigError, PayloadError, TransferError
from kvferry.core.phrases import phrase

__all__ = ["KVCacheTransferData", "KVPrefetchConsumeError", "OmniKVCacheConfig"]

#: Encoder options that reproduce the reference layout byte for byte.
_REFERENCE_LAYOUT: Mapping[str, Any] = {"align": 1, "version": False, "checksums": None}


@dataclasses.dataclass
class KVCacheTransferData:
    """The KV of one request for one (sender rank, receiver rank) pair.

    ``layer_blocks`` is ``{"key_cache": [tensor | None, ...], "value_cache": [...]}`` (per layer
    ``[tokens, heads, head_dim]``; ``value_cache`` no longer than ``key_cache``); ``metadata``
    must be JSON-serialisable.
    """

    request_id: str
    layer_blocks: dict
    block_ids: list
    metadata: dict

    def to_dict(self) -> dict[str, Any]:
        """The four fields as a plain dict (the same objects, not copies)."""
        return {
            "request_id": self.request_id,
            "layer_blocks": self.layer_blocks,
            "block_ids": self.block_ids,
            "metadata": self.metadata,
        }

    def _encode_args(self) -> tuple[Any, ...]:
        blocks = self.layer_blocks if self.layer_blocks is not None else {}
        if not isinstance(blocks, Mapping):
            raise ConfigError(f"layer_blocks must be a dict, got {type(blocks).__name__}")
        keys = list(blocks.get("key_cache") or ())
        values = list(blocks.get("value_cache") or ())
        return self.request_id, keys, values, list(self.block_ids or ()), dict(self.metadata or {})

    def to_bytes(self) -> bytes:
        """The payload in the reference layout (host bytes; device tensors are copied to the host).

        Raises ConfigError (a ValueError) for a non-tensor layer, a dtype outside the
        allow-list, more value layers than key layers, or metadata that is not JSON-able.
        """
        return encode_bytes(*self._encode_args(), **_REFERENCE_LAYOUT)

    def to_gpu_tensor(self) -> torch.Tensor:
        """The same bytes as :meth:`to_bytes`, as one 1-D uint8 tensor on the tensors' device
        (the first tensor not on the CPU). RuntimeError when no tensor is on a device."""
        return encode_device_tensor(*self._encode_args(), **_REFERENCE_LAYOUT)

    @staticmethod
    def from_bytes(raw: Any) -> dict[str, Any]:
        """Decode bytes, a bytearray or a memoryview (or kvferry frames) into the reference's
        dict: ``request_id``, ``layer_blocks`` (``key_cache``/``value_cache`` lists of length
        ``nl``, None for absent layers), ``block_ids``, ``metadata``.

        Tensors are views of ``raw`` where possible (do not write to views of read-only
        ``bytes``; clone to own them). Malformed input raises PayloadError (a ValueError).
        """
        return decode_payload(raw).to_reference_dict()

    @staticmethod
    def from_bytes_device(tensor: Any) -> dict[str, Any]:
        """Decode a payload held in a 1-D uint8 tensor; the tensors stay on its device.

        Anything else raises PayloadError (a ValueError). A non-contiguous tensor is made
        contiguous first (one copy).
        """
        if not isinstance(tensor, torch.Tensor) or tensor.dtype != torch.uint8 or tensor.dim() != 1:
            raise PayloadError(f"invalid KV payload: {phrase('device_tensor')}")
        return decode_payload(tensor.contiguous()).to_reference_dict()

    from_bytes_gpu = from_bytes_device


class KVPrefetchConsumeError(TransferError, RuntimeError):
    """A prefetched payload was taken from the connector but applying it failed.

    The data is gone from the connector, so no synchronous retry is possible; the caller must
    treat the request as having no KV. ``request_id`` names the request when known.
    """

    def __init__(self, message: str = "", *, request_id: str | None = None) -> None:
        super().__init__(message)
        self.request_id = request_id


@dataclasses.dataclass
class OmniKVCacheConfig:
    """The reference's transfer configuration (defaults are the reference's).

    Plain and mutable, as in the reference (the manager writes the resolved sender into
    ``connector_config``). :meth:`to_transfer_config` validates it into kvferry's typed
    :class:`TransferConfig`; :meth:`from_transfer_config` goes back.
    """

    connector_config: dict | None = None
    from_stage: Any = None
    to_stage: Any = None
    stage_id: Any = None
    engine_input_source: list | None = None
    need_recv_cache: bool = False
    need_send_cache: bool = False
    recv_timeout: float = 30.0
    from_tp: int = 1
    to_tp: int = 1
    enable_kv_async_prefetch: bool = False
    kv_prefetch_min_free_mem_ratio: float = 0.0

    def to_omni_kv_config(self) -> dict[str, Any]:
        """The same values in the reference's ``omni_kv_config`` dict shape (SPEC 7)."""
        return {
            "connector_config": self.connector_config,
            "omni_from_stage": self.from_stage,
            "omni_to_stage": self.to_stage,
            "stage_id": self.stage_id,
            "engine_input_source": self.engine_input_source,
            "need_recv_cache": self.need_recv_cache,
            "need_send_cache": self.need_send_cache,
            "recv_timeout": self.recv_timeout,
            "rank_mapping": {"from_tp": self.from_tp, "to_tp": self.to_tp},
            "enable_kv_async_prefetch": self.enable_kv_async_prefetch,
            "kv_prefetch_min_free_mem_ratio": self.kv_prefetch_min_free_mem_ratio,
        }

    def to_transfer_config(self, env: Mapping[str, str] | None = None) -> TransferConfig:
        """kvferry's validated configuration; ``env`` (default ``os.environ``, read at call
        time) supplies ``${VAR}`` in the base port and ``VLLM_OMNI_REPLICA_ID``.

        Raises ConfigError (a ValueError) naming the invalid key.
        """
        return TransferConfig.from_omni_kv_config(self.to_omni_kv_config(), os.environ if env is None else env)

    @classmethod
    def from_transfer_config(cls, config: TransferConfig) -> OmniKVCacheConfig:
        """The reference value of a kvferry configuration (fresh, mutable copies).

        An empty ``engine_input_source`` becomes None (the reference's default; same meaning).
        """
        fields = config.reference_fields()
        fields["engine_input_source"] = fields["engine_input_source"] or None
        return cls(**fields)
