"""The reference's routing helpers, with the reference's names and return conventions.

Every number here comes from kvferry's core (``core.topology``, ``core.ids``,
``core.addressing``, ``core.head_slices``) and every tensor operation from
``adapters.torch_frames``; this module only translates: reference argument names, ``list``
instead of ``tuple`` results, plain-dict payloads, and the process-global state the reference
read from vLLM.

Parallel state. The reference asked vLLM for the tensor-parallel rank and world size. kvferry
has no global parallel state, so this module keeps a small process-wide holder that the
composition root (the manager's wiring) fills with :func:`set_parallel_state` and empties with
:func:`clear_parallel_state`. Without it, :func:`get_local_tp_rank` reads ``LOCAL_RANK`` and
:func:`get_tp_world_size` says 1. torch.distributed's *world* rank and size are deliberately not
used as a fallback: the world group also holds other stages, pipeline ranks and replicas, so its
rank is not a TP rank (SPEC 6), and guessing wrong would route KV to the wrong keys.

Errors: local misuse raises kvferry's ``RoutingError`` / ``ConfigError``, both ``ValueError``,
which is what the reference raised and what its callers catch.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs
import torch

from kvferry.adapters.paged_cache import normalize_layer_kv
from kvferry.adapters.torch_frames import merge_layers, slice_heads, slice_layers
from kvferry.core.addressing import (
    KV_RANK_PORT_STRIDE,
    KV_REPLICA_PORT_STRIDE,
    KV_TRANSFER_PORT_OFFSET,
    expand_env_text,
    kv_port,
    replica_id_from_env,
)
from kvferry.core.config import REPLICA_ID_ENV
from kvferry.core.errors import ConfigError, RoutingError
from kvferry.core.head_slices import TP_HEAD_SLICE_KEY, applied_head_slice, fan_out_slice, tp_head_slice_record
from kvferry.core.ids import RecvKeyHook, SendKeyHook, connector_key, recv_keys, send_keys
from kvferry.core.topology import TPTopology, source_ranks, target_ranks, validate_topology
from kvferry.core.validate import check_int

__all__ = [
    "KVTPTopology",
    "LayerKV",
    "KV_TRANSFER_PORT_OFFSET",
    "KV_RANK_PORT_STRIDE",
    "KV_REPLICA_PORT_STRIDE",
    "expand_env_int",
    "LOCAL_RANK_ENV",
    "set_parallel_state",
    "clear_parallel_state",
    "get_parallel_state",
    "get_local_tp_rank",
    "get_tp_world_size",
    "get_omni_replica_id",
    "kv_zmq_port",
    "validate_kv_tp_topology",
    "get_kv_target_ranks",
    "get_kv_source_ranks",
    "get_kv_connector_key",
    "build_rank_aware_send_keys",
    "build_rank_aware_recv_keys",
    "slice_kv_tensor_heads",
    "slice_layer_blocks",
    "merge_received_rank_shards",
    "slice_received_rank_shard",
    "normalize_layer_kv",
]

logger = logging.getLogger(__name__)

#: Environment variable the TP rank falls back to when no parallel state was set.
LOCAL_RANK_ENV = "LOCAL_RANK"

#: One layer of a paged cache as an engine hands it over: one tensor (stacked or packed K/V)
#: or a ``(key, value)`` pair (the reference's type alias).
LayerKV = torch.Tensor | tuple[torch.Tensor, torch.Tensor]


def expand_env_int(value: Any, field_name: str, env: Mapping[str, str] | None = None) -> int:
    """An integer setting that may name environment variables (``"${BASE_PORT}"``, ``"$X"``).

    A string is expanded strictly (``env``, default ``os.environ`` read now): an unset
    variable raises ConfigError (a ValueError) naming it and ``field_name``; the result, or a
    non-string value, must then be an integer (``int()``), else ConfigError "<field_name> must
    be an integer after environment expansion". Unlike the reference, a bool is refused.
    """
    if isinstance(value, bool):
        raise ConfigError(f"{field_name} must be an integer after environment expansion, got {value!r}")
    text = expand_env_text(value, os.environ if env is None else env, field_name) if isinstance(value, str) else value
    try:
        return int(text)
    except (TypeError, ValueError):
        raise ConfigError(f"{field_name} must be an integer after environment expansion, got {text!r}") from None


# ---------------------------------------------------------------------------------- topology
def _size(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    check_int(attribute.name, value, 1, RoutingError, expected="a positive integer")


def _rank(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    check_int(attribute.name, value, 0, RoutingError, expected="a non-negative integer")


@attrs.frozen
class KVTPTopology:
    """The reference's topology value: TP sizes (>= 1) of both stages and one local rank (>= 0).

    Building one checks sizes and rank only (ValueError); divisibility is checked by
    :func:`validate_kv_tp_topology` and by every rank-map helper. :meth:`to_core` gives the
    equivalent :class:`kvferry.core.topology.TPTopology`.
    """

    source_tp_size: int = attrs.field(validator=_size)
    target_tp_size: int = attrs.field(validator=_size)
    local_rank: int = attrs.field(validator=_rank)

    @property
    def is_heterogeneous(self) -> bool:
        """True when the two stages run different TP sizes."""
        return self.source_tp_size != self.target_tp_size

    @property
    def ratio(self) -> int:
        """``larger // smaller`` (>= 1)."""
        return self.to_core().ratio

    def to_core(self) -> TPTopology:
        """The same topology as kvferry's core value."""
        return TPTopology(self.source_tp_size, self.target_tp_size, self.local_rank)

    @classmethod
    def from_core(cls, topo: TPTopology) -> KVTPTopology:
        """The reference value for a core topology."""
        return cls(topo.source_tp, topo.target_tp, topo.local_rank)


def _core(topo: Any) -> TPTopology:
    """A core topology from a :class:`KVTPTopology`, a core one, or any object with the
    reference's attribute names (``source_tp_size``, ``target_tp_size``, ``local_rank``)."""
    if isinstance(topo, TPTopology):
        return topo
    if isinstance(topo, KVTPTopology):
        return topo.to_core()
    try:
        return TPTopology(topo.source_tp_size, topo.target_tp_size, topo.local_rank)
    except AttributeError:
        raise RoutingError(f"not a TP topology: {topo!r}") from None


# ---------------------------------------------------------------------------- parallel state
@attrs.frozen
class _ParallelState:
    tp_rank: int
    tp_size: int


_state: _ParallelState | None = None


def set_parallel_state(tp_rank: int, tp_size: int) -> None:
    """Record this process's TP rank and TP world size (process-wide; replaces any earlier).

    Called by the composition root once the engine's TP group is known. Raises ConfigError
    unless ``tp_size >= 1`` and ``0 <= tp_rank < tp_size``.
    """
    global _state
    for name, value in (("tp_rank", tp_rank), ("tp_size", tp_size)):
        check_int(name, value, -(2**63))  # the type; the bounds together below
    if tp_size < 1 or not 0 <= tp_rank < tp_size:
        raise ConfigError(f"need tp_size >= 1 and 0 <= tp_rank < tp_size, got tp_rank={tp_rank}, tp_size={tp_size}")
    _state = _ParallelState(tp_rank, tp_size)


def clear_parallel_state() -> None:
    """Forget the recorded TP rank and size (the helpers fall back to the environment)."""
    global _state
    _state = None


def get_parallel_state() -> tuple[int, int] | None:
    """``(tp_rank, tp_size)`` as recorded by :func:`set_parallel_state`, or None."""
    state = _state
    return None if state is None else (state.tp_rank, state.tp_size)


def get_local_tp_rank() -> int:
    """TP rank: the recorded parallel state; else env ``LOCAL_RANK``; else 0.

    A ``LOCAL_RANK`` that is not a non-negative integer raises ConfigError naming it (the
    reference's ``int()`` raised ValueError too).
    """
    state = _state
    if state is not None:
        return state.tp_rank
    raw = os.environ.get(LOCAL_RANK_ENV)
    if raw is None or not raw.strip():
        return 0
    try:
        value = int(raw.strip())
    except ValueError:
        raise ConfigError(f"{LOCAL_RANK_ENV} must be an integer, got {raw!r}") from None
    return check_int(LOCAL_RANK_ENV, value, 0)


def get_tp_world_size() -> int:
    """TP world size: the recorded parallel state, else 1."""
    state = _state
    return 1 if state is None else state.tp_size


def get_omni_replica_id() -> int:
    """Replica id from env ``VLLM_OMNI_REPLICA_ID``; unset, non-integer or negative -> 0."""
    return replica_id_from_env(os.environ.get(REPLICA_ID_ENV))


# ------------------------------------------------------------------------------------- ports
def kv_zmq_port(base_port: int, from_stage: int, local_rank: int = 0, replica_id: Any = None) -> int:
    """``base_port + 100 + replica*1024 + local_rank*16 + from_stage`` (SPEC 2.3).

    ``replica_id=None`` reads :func:`get_omni_replica_id`; a negative or non-integer replica id
    counts as 0 (the reference's reading). Unlike the reference, a stage outside ``0..15``, a
    negative rank, ``local_rank*16 >= 1024`` or a port outside ``1..65535`` raise RoutingError
    naming the field, since they would collide with another rank's or replica's port.
    """
    if replica_id is None:
        replica = get_omni_replica_id()
    elif isinstance(replica_id, int) and not isinstance(replica_id, bool):
        replica = max(replica_id, 0)
    else:
        replica = replica_id_from_env(str(replica_id))
    return kv_port(base_port, from_stage, tp_rank=local_rank, replica=replica)


# ------------------------------------------------------------------------------ rank mapping
def validate_kv_tp_topology(topo: Any) -> None:
    """ValueError (message contains "divisible" and both sizes) for an unmappable topology."""
    validate_topology(_core(topo))


def get_kv_target_ranks(topo: Any) -> list[int]:
    """Receiver ranks fed by sender rank ``topo.local_rank`` (SPEC 2.1), increasing."""
    return list(target_ranks(_core(topo)))


def get_kv_source_ranks(topo: Any) -> list[int]:
    """Sender ranks read by receiver rank ``topo.local_rank`` (SPEC 2.1), in merge order."""
    return list(source_ranks(_core(topo)))


def get_kv_connector_key(req_id: str, from_stage: Any, chunk_id: int, from_rank: int, to_rank: int) -> str:
    """``f"{req_id}_{from_stage}_{chunk_id}_{from_rank}_{to_rank}"`` (SPEC 2.2)."""
    return connector_key(req_id, from_stage, chunk_id, from_rank, to_rank)


def build_rank_aware_send_keys(
    request_id: str, from_stage: Any, to_stage: Any, topo: Any, hook: SendKeyHook | None = None
) -> list[str]:
    """Keys this sender rank puts (SPEC 2.2). A callable ``hook(request_id, from_stage,
    to_stage)`` with a non-empty result wins; a non-callable hook is ignored."""
    return list(send_keys(request_id, from_stage, to_stage, _core(topo), hook if callable(hook) else None))


def build_rank_aware_recv_keys(
    request_id: str, from_stage: Any, to_stage: Any, topo: Any, hook: RecvKeyHook | None = None
) -> list[tuple[str, int | None]]:
    """``(key, from_rank)`` pairs this receiver rank gets (SPEC 2.2), in merge order.

    A callable hook's non-empty result wins: tuples are used as is, plain strings are paired
    with the source ranks when the counts match, else with None.
    """
    return list(recv_keys(request_id, from_stage, to_stage, _core(topo), hook if callable(hook) else None))


# ------------------------------------------------------------------------------ head slicing
def slice_kv_tensor_heads(tensor: Any, offset_in_shard: int, num_slices: int) -> Any:
    """Slice ``offset_in_shard`` of ``num_slices`` equal parts of dim 1 (a view).

    None -> None; a non-tensor is returned unchanged; fewer than 2 dims, ``num_slices <= 0``,
    an offset outside ``[0, num_slices)`` or dim 1 not divisible -> ValueError.
    """
    return slice_heads(tensor, offset_in_shard, num_slices)


def slice_layer_blocks(layer_blocks: Mapping[str, Any] | None, offset_in_shard: int, num_slices: int) -> dict:
    """``{"key_cache": [...], "value_cache": [...]}`` with every tensor head-sliced.

    A missing list (or ``layer_blocks=None``) gives an empty list; a non-mapping raises
    RoutingError.
    """
    blocks = layer_blocks or {}
    if not isinstance(blocks, Mapping):
        raise RoutingError(f"layer_blocks must be a dict, got {type(blocks).__name__}")
    return {
        "key_cache": slice_layers(blocks.get("key_cache"), offset_in_shard, num_slices),
        "value_cache": slice_layers(blocks.get("value_cache"), offset_in_shard, num_slices),
    }


def _has_layers(payload: Any) -> bool:
    return isinstance(payload, dict) and "layer_blocks" in payload


def merge_received_rank_shards(payloads: Sequence[Any], merger: Callable[[Any], Any] | None = None) -> Any:
    """Merge fan-in shards (already in source-rank order) along dim 1 (SPEC 2.4).

    A callable ``merger`` replaces everything: ``merger(payloads)``. Otherwise: no payloads ->
    None; one -> it; a first payload that is not a dict with ``layer_blocks`` -> it; else a new
    dict with ``request_id``, ``block_ids`` (a copy) and ``metadata`` (a copy) of the first and,
    per layer, the non-None tensors concatenated along dim 1 (None when all are None, the single
    one when only one, the first when they are not tensors). A later payload that is not a dict
    raises RoutingError; a dict without ``layer_blocks`` contributes no layers.
    """
    if callable(merger):
        return merger(payloads)
    if not payloads:
        return None
    if len(payloads) == 1:
        return payloads[0]
    first = payloads[0]
    if not _has_layers(first):
        return first
    per_source: list[Mapping[str, Any]] = []
    for index, payload in enumerate(payloads):
        if not isinstance(payload, dict):
            raise RoutingError(f"cannot merge KV shards: payload {index} is {type(payload).__name__}, not a dict")
        per_source.append(payload.get("layer_blocks") or {})
    return {
        "request_id": first.get("request_id"),
        "layer_blocks": {
            name: merge_layers([blocks.get(name) for blocks in per_source]) for name in ("key_cache", "value_cache")
        },
        "block_ids": list(first.get("block_ids") or ()),
        "metadata": dict(first.get("metadata") or {}),
    }


def slice_received_rank_shard(payload: Any, topo: Any, slicer: Callable[[Any], Any] | None = None) -> Any:
    """Cut this receiver rank's part out of a full fan-out shard (SPEC 2.4).

    A callable ``slicer`` replaces everything: ``slicer(payload)``. Otherwise the payload is
    returned unchanged when it is empty, when ``target_tp <= source_tp``, when it has no
    ``layer_blocks``, or when its metadata carries an applied ``tp_head_slice`` tag (a warning
    is logged if that tag names another target rank). Else a new dict (other keys kept) whose
    layers are slice ``local_rank % ratio`` of ``ratio`` and whose metadata (a copy) gains
    ``tp_head_slice`` with ``side: "receiver"``. Raises ValueError for an unmappable topology or
    a head count not divisible by the ratio.
    """
    if callable(slicer):
        return slicer(payload)
    core = _core(topo)
    if not payload or core.target_tp <= core.source_tp or not _has_layers(payload):
        return payload
    metadata = payload.get("metadata")
    tag = applied_head_slice(metadata)
    if tag is not None:
        if tag.get("target_rank") != core.local_rank:
            logger.warning(
                "request %s: payload already sliced for target rank %r, but this is rank %d; using it as is",
                payload.get("request_id"),
                tag.get("target_rank"),
                core.local_rank,
            )
        return payload
    offset, num_slices = fan_out_slice(core.source_tp, core.target_tp, core.local_rank)
    (source_rank,) = source_ranks(core)
    record = tp_head_slice_record(
        "receiver", source_rank, core.local_rank, core.source_tp, core.target_tp, offset, num_slices
    )
    sliced = dict(payload)
    sliced["layer_blocks"] = slice_layer_blocks(payload["layer_blocks"], offset, num_slices)
    sliced["metadata"] = {**(metadata if isinstance(metadata, Mapping) else {}), TP_HEAD_SLICE_KEY: record}
    return sliced
