"""Typed transfer configuration parsed from the reference's ``omni_kv_config`` dict (SPEC 7).

Input shape (every key optional; defaults are the reference's ``OmniKVCacheConfig``)::

    {"connector_config": {"type": "zmq", "zmq_port": 50051, ...},
     "omni_from_stage": 0, "omni_to_stage": 1, "stage_id": 1,
     "engine_input_source": [0], "need_send_cache": False, "need_recv_cache": True,
     "recv_timeout": 30.0, "rank_mapping": {"from_tp": 2, "to_tp": 4},
     "enable_kv_async_prefetch": False, "kv_prefetch_min_free_mem_ratio": 0.0,
     "num_kv_heads": 4, "kv_layout": "flash"}

``num_kv_heads`` (the model's KV heads, all ranks together) and ``kv_layout`` (the paged
cache's layout name, :mod:`kvferry.core.layouts`) are kvferry's: without a head count, ranks
are routed by the reference's rank map (replicated heads need it, see docs/routing.md); without
a layout name, the layout is recognised by shape as the reference did, ambiguous shapes refused.

Unknown keys are ignored (engine configs carry more). An invalid value raises ConfigError
naming the key (``rank_mapping.from_tp``, ``connector_config.zmq_port`` ...). Environment
values are passed in as a mapping: the base port may be ``"${KV_BASE_PORT}"`` (strict
expansion) and the replica id comes from ``VLLM_OMNI_REPLICA_ID``.
"""

from __future__ import annotations

import copy
import types
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import attrs

from kvferry.core.addressing import DEFAULT_BASE_PORT, expand_base_port, replica_id_from_env
from kvferry.core.errors import ConfigError
from kvferry.core.layouts import LayoutSpec, layout_spec
from kvferry.core.validate import check_int, check_number

__all__ = [
    "REPLICA_ID_ENV",
    "DEFAULT_RECV_TIMEOUT_S",
    "TransferConfig",
    "extract_omni_kv_config",
    "connector_config_from_kv_transfer",
]

Stage = int | str
_T = TypeVar("_T")
#: Environment variable holding the replica id (invalid or negative -> 0).
REPLICA_ID_ENV = "VLLM_OMNI_REPLICA_ID"
DEFAULT_RECV_TIMEOUT_S = 30.0
_EMPTY_ENV: Mapping[str, str] = types.MappingProxyType({})


def _stage(key: str, value: Any) -> Stage | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ConfigError(f"{key} must be a stage id (int or string), got {value!r}")
    if isinstance(value, int) and value < 0:
        raise ConfigError(f"{key} must be >= 0, got {value}")
    if isinstance(value, str) and not value.strip():
        raise ConfigError(f"{key} must not be an empty string")
    return value


def _flag(key: str, value: Any) -> bool:
    if value is None:
        return False
    if not isinstance(value, bool):
        raise ConfigError(f"{key} must be true or false, got {value!r}")
    return value


def _number(key: str, value: Any, default: float) -> float:
    if value is None:
        return default
    return check_number(key, value)


def _timeout(key: str, value: Any) -> float:
    if value is None:
        return DEFAULT_RECV_TIMEOUT_S
    return check_number(key, value, minimum=0.0, expected="a finite number >= 0 seconds")


def _ratio(key: str, value: Any) -> float:
    if value is None:
        return 0.0
    return check_number(key, value, minimum=0.0, maximum=1.0, expected="a number within [0, 1]")


def _tp(key: str, value: Any) -> int:
    if value is None:
        return 1
    if isinstance(value, str) and value.strip().isascii() and value.strip().isdigit():
        value = int(value.strip())  # the reference read these with int()
    return check_int(key, value, 1)


def _port(key: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{key} must be an integer port, got {value!r}")
    return expand_base_port(value, _EMPTY_ENV, key)


def _replica(key: str, value: Any) -> int:
    return check_int(key, value, 0)


def _sources(key: str, value: Any) -> tuple[Stage, ...]:
    if value is None:
        return ()
    if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)):
        raise ConfigError(f"{key} must be a list of stage ids, got {value!r}")
    out = []
    for i, item in enumerate(value):
        stage = _stage(f"{key}[{i}]", item)
        if stage is None:
            raise ConfigError(f"{key}[{i}] must be a stage id, got None")
        out.append(stage)
    return tuple(out)


def _heads(key: str, value: Any) -> int | None:
    if value is None:
        return None
    return check_int(f"{key} (the model's KV heads)", value, 1)


def _connector(key: str, value: Any) -> Mapping[str, Any] | None:
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise ConfigError(f"{key} must be a mapping, got {type(value).__name__}")
    if not value:
        return None
    kind = value.get("type")
    if not isinstance(kind, str) or not kind.strip():
        raise ConfigError(f"{key}.type must name a connector (a non-empty string), got {kind!r}")
    return types.MappingProxyType(copy.deepcopy(dict(value)))


def _engine_input_source(value: Any) -> tuple[Stage, ...]:
    return _sources("engine_input_source", value)


def _recv_timeout(value: Any) -> float:
    return _timeout("recv_timeout", value)


def _prefetch_ratio(value: Any) -> float:
    return _ratio("kv_prefetch_min_free_mem_ratio", value)


def _frozen_connector(value: Any) -> Mapping[str, Any] | None:
    if isinstance(value, types.MappingProxyType) or value is None:
        return value
    return _connector("connector_config", value)


def _validate(check: Callable[[str, Any], _T]) -> Callable[[Any, attrs.Attribute[_T], _T], None]:
    def validator(instance: Any, attribute: attrs.Attribute[_T], value: _T) -> None:
        if check(attribute.name, value) != value:
            raise ConfigError(f"{attribute.name} must be given in normal form, got {value!r}")

    return validator


@attrs.frozen
class TransferConfig:
    """The kvferry view of one stage's transfer configuration (all values validated).

    Field names follow the reference's ``OmniKVCacheConfig`` (``from_stage`` is
    ``omni_from_stage`` in the dict). ``connector_config`` is a read-only deep copy; use
    :meth:`connector_dict` for a fresh mutable copy. ``base_port`` is the expanded
    ``connector_config["zmq_port"]`` (default 50051); ``replica_id`` the value read from
    ``VLLM_OMNI_REPLICA_ID``. ``empty_reason`` is set (and nothing is sent or received) when
    no configuration was found.
    """

    connector_config: Mapping[str, Any] | None = attrs.field(default=None, converter=_frozen_connector, hash=False)
    from_stage: Stage | None = attrs.field(default=None, validator=_validate(_stage))
    to_stage: Stage | None = attrs.field(default=None, validator=_validate(_stage))
    stage_id: Stage | None = attrs.field(default=None, validator=_validate(_stage))
    engine_input_source: tuple[Stage, ...] = attrs.field(default=(), converter=_engine_input_source)
    need_send_cache: bool = attrs.field(default=False, validator=_validate(_flag))
    need_recv_cache: bool = attrs.field(default=False, validator=_validate(_flag))
    recv_timeout: float = attrs.field(default=DEFAULT_RECV_TIMEOUT_S, converter=_recv_timeout)
    from_tp: int = attrs.field(default=1, validator=_validate(_tp))
    to_tp: int = attrs.field(default=1, validator=_validate(_tp))
    enable_kv_async_prefetch: bool = attrs.field(default=False, validator=_validate(_flag))
    kv_prefetch_min_free_mem_ratio: float = attrs.field(default=0.0, converter=_prefetch_ratio)
    base_port: int = attrs.field(default=DEFAULT_BASE_PORT, validator=_validate(_port))
    replica_id: int = attrs.field(default=0, validator=_validate(_replica))
    empty_reason: str | None = None
    #: The model's KV heads (all TP ranks together); None: route by the reference's rank map.
    num_kv_heads: int | None = attrs.field(default=None, validator=_validate(_heads))
    #: The paged cache's layout (:func:`kvferry.core.layouts.layout_spec`); None: by shape.
    kv_layout: LayoutSpec | None = attrs.field(default=None, converter=layout_spec)

    # ----------------------------------------------------------------------------------------
    # named constructors

    @classmethod
    def empty(cls, reason: str) -> TransferConfig:
        """A configuration that sends and receives nothing; ``reason`` says why."""
        return cls(empty_reason=reason)

    @classmethod
    def from_omni_kv_config(cls, d: Mapping[str, Any], env: Mapping[str, str] = _EMPTY_ENV) -> TransferConfig:
        """Parse the reference's ``omni_kv_config`` dict; ConfigError names any invalid key."""
        if not isinstance(d, Mapping):
            raise ConfigError(f"omni_kv_config must be a mapping, got {type(d).__name__}")
        rank_mapping = d.get("rank_mapping")
        if rank_mapping is None:
            rank_mapping = {}
        if not isinstance(rank_mapping, Mapping):
            raise ConfigError(f"rank_mapping must be a mapping, got {rank_mapping!r}")
        connector = _connector("connector_config", d.get("connector_config"))
        base_port = DEFAULT_BASE_PORT
        if connector is not None and connector.get("zmq_port") is not None:
            base_port = expand_base_port(connector["zmq_port"], env, "connector_config.zmq_port")
        return cls(
            connector_config=connector,
            from_stage=_stage("omni_from_stage", d.get("omni_from_stage")),
            to_stage=_stage("omni_to_stage", d.get("omni_to_stage")),
            stage_id=_stage("stage_id", d.get("stage_id")),
            engine_input_source=_sources("engine_input_source", d.get("engine_input_source")),
            need_send_cache=_flag("need_send_cache", d.get("need_send_cache")),
            need_recv_cache=_flag("need_recv_cache", d.get("need_recv_cache")),
            recv_timeout=_timeout("recv_timeout", d.get("recv_timeout")),
            from_tp=_tp("rank_mapping.from_tp", rank_mapping.get("from_tp")),
            to_tp=_tp("rank_mapping.to_tp", rank_mapping.get("to_tp")),
            enable_kv_async_prefetch=_flag("enable_kv_async_prefetch", d.get("enable_kv_async_prefetch")),
            kv_prefetch_min_free_mem_ratio=_ratio(
                "kv_prefetch_min_free_mem_ratio", d.get("kv_prefetch_min_free_mem_ratio")
            ),
            base_port=base_port,
            replica_id=replica_id_from_env(env.get(REPLICA_ID_ENV)),
            num_kv_heads=_heads("num_kv_heads", d.get("num_kv_heads")),
            kv_layout=layout_spec(d.get("kv_layout"), "kv_layout"),
        )

    @classmethod
    def from_model_config(cls, model_config: Any, env: Mapping[str, str] = _EMPTY_ENV) -> TransferConfig:
        """From an engine's model config whose ``omni_kv_config`` attribute is the dict.

        No such attribute, or not a mapping -> :meth:`empty` saying so.
        """
        omni = extract_omni_kv_config(model_config)
        if omni is None:
            return cls.empty(f"{type(model_config).__name__} has no omni_kv_config mapping")
        return cls.from_omni_kv_config(omni, env)

    @classmethod
    def from_vllm_config(
        cls, vllm_config: Any, model_config: Any = None, env: Mapping[str, str] = _EMPTY_ENV
    ) -> TransferConfig:
        """SPEC 7: ``model_config.omni_kv_config`` first; else a non-empty connector dict under
        ``vllm_config.kv_transfer_config`` (``omni_connector_config`` or
        ``kv_connector_extra_config["omni_connector_config"]``) as ``connector_config``;
        else :meth:`empty` saying so."""
        if model_config is not None and extract_omni_kv_config(model_config) is not None:
            return cls.from_model_config(model_config, env)
        kv_transfer = getattr(vllm_config, "kv_transfer_config", None)
        connector = connector_config_from_kv_transfer(kv_transfer)
        if connector is not None:
            return cls.from_omni_kv_config({"connector_config": connector}, env)
        return cls.empty(
            "no omni_kv_config on the model config and no omni_connector_config in vllm_config.kv_transfer_config"
        )

    # ----------------------------------------------------------------------------------------
    # derived values

    @property
    def is_empty(self) -> bool:
        return self.empty_reason is not None

    @property
    def connector_type(self) -> str | None:
        """The connector's registry name (``connector_config["type"]``), or None."""
        return None if self.connector_config is None else str(self.connector_config["type"])

    def connector_dict(self) -> dict[str, Any] | None:
        """A fresh, mutable deep copy of ``connector_config`` (None when unset)."""
        return None if self.connector_config is None else copy.deepcopy(dict(self.connector_config))

    @property
    def recv_from_stage(self) -> Stage | None:
        """First of ``engine_input_source``; else ``stage_id - 1`` when stage_id is an int;
        else ``from_stage``."""
        if self.engine_input_source:
            return self.engine_input_source[0]
        if isinstance(self.stage_id, int):
            return self.stage_id - 1
        return self.from_stage

    @property
    def send_stages(self) -> tuple[str, str] | tuple[None, None]:
        """``(str(from_stage), str(to_stage))``, or ``(None, None)`` when either is unset."""
        if self.from_stage is None or self.to_stage is None:
            return (None, None)
        return (str(self.from_stage), str(self.to_stage))

    @property
    def recv_stages(self) -> tuple[str, str] | tuple[None, None]:
        """``(str(recv_from_stage), str(stage_id))``, or ``(None, None)`` when either is unset."""
        source = self.recv_from_stage
        if source is None or self.stage_id is None:
            return (None, None)
        return (str(source), str(self.stage_id))

    def effective_tp(self, detected_tp_size: int) -> tuple[int, int]:
        """``(from_tp, to_tp)`` to route with: the configured sizes, or the run-time TP size
        for both when both configured sizes are <= 1."""
        detected = _tp("detected_tp_size", detected_tp_size)
        if self.from_tp <= 1 and self.to_tp <= 1:
            return (detected, detected)
        return (self.from_tp, self.to_tp)

    @property
    def receiver_pool_on_device(self) -> bool:
        """True when ``connector_config["memory_pool_device"]`` is not ``"cpu"``."""
        if self.connector_config is None:
            return False
        return str(self.connector_config.get("memory_pool_device", "cpu")).lower() != "cpu"

    def async_prefetch(self, has_cfg_collector: bool) -> bool:
        """Effective prefetch flag: requested, receiving, and not force-disabled by a CFG
        collector or a device-resident receiver pool (SPEC 7)."""
        return (
            self.enable_kv_async_prefetch
            and self.need_recv_cache
            and not has_cfg_collector
            and not self.receiver_pool_on_device
        )

    def notes(self) -> tuple[str, ...]:
        """Non-fatal inconsistencies worth a warning at start (empty when all is coherent)."""
        out: list[str] = []
        if self.empty_reason is not None:
            out.append(f"KV transfer disabled: {self.empty_reason}")
        if self.need_send_cache and self.send_stages == (None, None):
            out.append("need_send_cache is set but omni_from_stage / omni_to_stage are not")
        if self.need_recv_cache and self.recv_stages == (None, None):
            out.append("need_recv_cache is set but the receive stages cannot be derived")
        if (self.need_send_cache or self.need_recv_cache) and self.connector_config is None:
            out.append("KV transfer is requested but connector_config is not set")
        if self.enable_kv_async_prefetch and not self.need_recv_cache:
            out.append("enable_kv_async_prefetch has no effect: this stage does not receive")
        return tuple(out)

    def reference_fields(self) -> dict[str, Any]:
        """The reference ``OmniKVCacheConfig`` field values (plain, mutable copies)."""
        return {
            "connector_config": self.connector_dict(),
            "from_stage": self.from_stage,
            "to_stage": self.to_stage,
            "stage_id": self.stage_id,
            "engine_input_source": list(self.engine_input_source),
            "need_recv_cache": self.need_recv_cache,
            "need_send_cache": self.need_send_cache,
            "recv_timeout": self.recv_timeout,
            "from_tp": self.from_tp,
            "to_tp": self.to_tp,
            "enable_kv_async_prefetch": self.enable_kv_async_prefetch,
            "kv_prefetch_min_free_mem_ratio": self.kv_prefetch_min_free_mem_ratio,
        }


def extract_omni_kv_config(model_config: Any) -> Mapping[str, Any] | None:
    """The ``omni_kv_config`` mapping of a (duck-typed) model config, or None."""
    value = getattr(model_config, "omni_kv_config", None)
    return value if isinstance(value, Mapping) else None


def _lookup(obj: Any, name: str) -> Any:
    if isinstance(obj, Mapping):
        return obj.get(name)
    return getattr(obj, name, None)


def connector_config_from_kv_transfer(kv_transfer_config: Any) -> Mapping[str, Any] | None:
    """The non-empty connector dict nested in an engine's ``kv_transfer_config`` (an object or
    a mapping): ``omni_connector_config`` first, then
    ``kv_connector_extra_config["omni_connector_config"]``; None when neither is there."""
    if not kv_transfer_config:
        return None
    direct = _lookup(kv_transfer_config, "omni_connector_config")
    if isinstance(direct, Mapping) and direct:
        return direct
    extra = _lookup(kv_transfer_config, "kv_connector_extra_config")
    if isinstance(extra, Mapping):
        nested = extra.get("omni_connector_config")
        if isinstance(nested, Mapping) and nested:
            return nested
    return None
