"""The reference's KV port constants (its ``utils/initialization``), from kvferry's core.

A sender rank's port is ``base + KV_TRANSFER_PORT_OFFSET + replica*KV_REPLICA_PORT_STRIDE +
rank*KV_RANK_PORT_STRIDE + stage`` (:func:`kvferry.app.compat.kv_utils.kv_zmq_port`).
"""

from kvferry.core.addressing import KV_RANK_PORT_STRIDE, KV_REPLICA_PORT_STRIDE, KV_TRANSFER_PORT_OFFSET

__all__ = ["KV_TRANSFER_PORT_OFFSET", "KV_RANK_PORT_STRIDE", "KV_REPLICA_PORT_STRIDE"]
