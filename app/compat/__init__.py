"""The reference's public names (REFERENCE_API.md), so an engine switches by changing imports.

Routing helpers, the payload codec, the config dataclass and the manager all keep the
reference's meaning; kvferry's typed API (:mod:`kvferry.app.manager`) sits underneath.
"""

from kvferry.app.compat.codec import KVCacheTransferData, KVPrefetchConsumeError, OmniKVCacheConfig
from kvferry.app.compat.kv_utils import (
    KV_RANK_PORT_STRIDE,
    KV_REPLICA_PORT_STRIDE,
    KV_TRANSFER_PORT_OFFSET,
    KVTPTopology,
    LayerKV,
    build_rank_aware_recv_keys,
    build_rank_aware_send_keys,
    clear_parallel_state,
    expand_env_int,
    get_kv_connector_key,
    get_kv_source_ranks,
    get_kv_target_ranks,
    get_local_tp_rank,
    get_omni_replica_id,
    get_tp_world_size,
    kv_zmq_port,
    merge_received_rank_shards,
    normalize_layer_kv,
    set_parallel_state,
    slice_kv_tensor_heads,
    slice_layer_blocks,
    slice_received_rank_shard,
    validate_kv_tp_topology,
)
from kvferry.app.compat.manager import OmniKVTransferManager, ReceiveRole, TransferTopoConfig

__all__ = [
    "KV_RANK_PORT_STRIDE",
    "KV_REPLICA_PORT_STRIDE",
    "KV_TRANSFER_PORT_OFFSET",
    "LayerKV",
    "ReceiveRole",
    "TransferTopoConfig",
    "expand_env_int",
    "KVCacheTransferData",
    "KVPrefetchConsumeError",
    "KVTPTopology",
    "OmniKVCacheConfig",
    "OmniKVTransferManager",
    "build_rank_aware_recv_keys",
    "build_rank_aware_send_keys",
    "clear_parallel_state",
    "get_kv_connector_key",
    "get_kv_source_ranks",
    "get_kv_target_ranks",
    "get_local_tp_rank",
    "get_omni_replica_id",
    "get_tp_world_size",
    "kv_zmq_port",
    "merge_received_rank_shards",
    "normalize_layer_kv",
    "set_parallel_state",
    "slice_kv_tensor_heads",
    "slice_layer_blocks",
    "slice_received_rank_shard",
    "validate_kv_tp_topology",
]
