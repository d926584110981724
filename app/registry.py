"""Connectors by name: ``create_connector({"type": name, ...}) -> Connector``.

A registry entry maps a name to a target ``"module.path:Attribute"`` (imported lazily, so an
optional connector's heavy package is loaded only when that connector is asked for) or to a
callable. The target is called with the whole config dict; a class with a ``from_config``
classmethod is built through it.

vllm-omni's connector names (what its deploy configs write, e.g. ``SharedMemoryConnector``)
are served too, by one rule (:data:`REFERENCE_CONNECTORS`, docs/compat.md): when ``vllm_omni``
is importable, by vllm-omni's own class, built through its public ``OmniConnectorFactory`` with
the config vllm-omni's manager would give it (so a kvferry stage and a vllm-omni stage of one
deployment speak the same protocol); otherwise such a name cannot be served and
:meth:`ConnectorRegistry.check` (called when a manager is built) raises ConfigError naming
``connector_config.type`` and the names that can be.

Failures are values the caller sees, and are remembered:

- an unknown ``type`` raises :class:`~kvferry.core.errors.ConfigError` naming
  ``connector_config.type`` and listing the names available (a local misuse);
- an import or constructor failure raises :class:`~kvferry.core.errors.ConnectorUnavailable`
  with the cause chained. The failure is remembered per (name, config): asking again raises the
  same error at once without importing or constructing again, so a hot path that retries
  cannot pay the cost (or the side effects) each time. :meth:`ConnectorRegistry.forget_failures`
  clears the memory (e.g. after installing the missing package).
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import logging
import threading
from collections.abc import Callable, Mapping
from typing import Any

import attrs

from kvferry.core.errors import ConfigError, ConnectorUnavailable
from kvferry.core.ports import Connector

__all__ = [
    "BUILTIN_CONNECTORS",
    "REFERENCE_CONNECTORS",
    "ReferenceConnector",
    "reference_connector_config",
    "check_connector_config",
    "SERVING_CONNECTORS",
    "connector_role_config",
    "ConnectorRegistry",
    "default_registry",
    "create_connector",
    "register_connector",
    "available_connectors",
    "connector_failures",
]

logger = logging.getLogger(__name__)

#: Built-in connectors (module paths are imported only when the connector is created).
BUILTIN_CONNECTORS: dict[str, str] = {
    "memory": "kvferry.adapters.connectors.memory.connector:MemoryConnector",
    "shm": "kvferry.adapters.connectors.shm.connector:ShmConnector",
    "zmq": "kvferry.adapters.connectors.zmq.connector:ZmqConnector",
    "mooncake": "kvferry.adapters.connectors.mooncake.connector:MooncakeConnector",
    "nixl": "kvferry.adapters.connectors.nixl.connector:NixlConnector",
}


@attrs.frozen
class ReferenceConnector:
    """How kvferry serves one of vllm-omni's connector names.

    ``transfer_engine``: vllm-omni's manager gives this connector its stages, role and (on a
    sender) the rank's port (its ``TRANSFER_ENGINE_CONNECTOR_NAMES``); kvferry does the same
    (:func:`reference_connector_config`). ``alias_of``: vllm-omni registers the name as another
    name's alias. ``note``: what the operator should know (platform, package)."""

    name: str
    transfer_engine: bool = False
    alias_of: str | None = None
    note: str = ""


#: vllm-omni 0.30.0's connector names (its ``OmniConnectorFactory`` registrations, read from the
#: released package's ``distributed/omni_connectors/factory.py``). Each is served by vllm-omni's
#: own class when ``vllm_omni`` is importable (same protocol as a vllm-omni stage), else it is a
#: ConfigError at start. The one table of names; docs/compat.md shows it.
REFERENCE_CONNECTORS: dict[str, ReferenceConnector] = {
    r.name: r
    for r in (
        ReferenceConnector("SharedMemoryConnector", note="one host; POSIX segments named by key"),
        ReferenceConnector("MooncakeTransferEngineConnector", transfer_engine=True, note="needs mooncake"),
        ReferenceConnector("MooncakeStoreConnector", note="needs a mooncake store"),
        ReferenceConnector("MooncakeConnector", alias_of="MooncakeStoreConnector", note="needs a mooncake store"),
        ReferenceConnector("NixlConnector", transfer_engine=True, note="needs nixl"),
        ReferenceConnector("MoriTransferEngineConnector", transfer_engine=True, note="needs mori (ROCm)"),
        ReferenceConnector("YuanrongConnector", note="needs yuanrong"),
        ReferenceConnector("YuanrongTransferEngineConnector", transfer_engine=True, note="NPU platform only"),
    )
}


def _vllm_omni_importable() -> bool:
    try:
        return importlib.util.find_spec("vllm_omni") is not None
    except (ImportError, ValueError):
        return False


def build_reference_connector(name: str, extra: dict[str, Any]) -> Any:
    """vllm-omni's own connector ``name``, through its public factory (as its manager builds it:
    ``ConnectorSpec(name, extra)`` with ``extra`` the config without ``type``)."""
    from vllm_omni.distributed.omni_connectors.factory import OmniConnectorFactory
    from vllm_omni.distributed.omni_connectors.utils.config import ConnectorSpec

    return OmniConnectorFactory.create_connector(ConnectorSpec(name=name, extra=extra))


def reference_connector_config(
    cfg: dict[str, Any], *, role: str, from_stage: Any, to_stage: Any, sender_port: int | None
) -> dict[str, Any]:
    """The config vllm-omni's manager gives a connector of one of its transfer-engine names:
    ``from_stage``/``to_stage`` as strings ("0"/"1" when unset), ``role``, and on a sender the
    rank's own port (SPEC 2.3) as ``zmq_port``; a NIXL receiver loses ``zmq_port`` (it would
    listen on it). Other names get ``cfg`` unchanged. A new dict; ``cfg`` is not modified."""
    out = dict(cfg)
    entry = REFERENCE_CONNECTORS.get(str(out.get("type")))
    if entry is None or not entry.transfer_engine:
        return out
    out["from_stage"] = "0" if from_stage is None else str(from_stage)
    out["to_stage"] = "1" if to_stage is None else str(to_stage)
    out["role"] = role
    if role == "sender" and sender_port is not None:
        out["zmq_port"] = sender_port
    elif entry.name == "NixlConnector":
        out.pop("zmq_port", None)
    return out


#: kvferry's connectors that serve payloads from the sender's process: told their role, a sender
#: its own port and bind host, a receiver nothing of a sender (it arrives with each request).
SERVING_CONNECTORS = frozenset({"zmq", "shm", "mooncake", "nixl"})


def connector_role_config(
    cfg: Mapping[str, Any],
    *,
    role: str,
    sender_port: int | None,
    host: str,
    from_stage: Any = None,
    to_stage: Any = None,
) -> dict[str, Any]:
    """The one rule for a rank's connector config (the manager's and the vLLM connector's).

    kvferry's serving connectors: ``role``; a sender binds ``sender_port`` (its rank's port,
    SPEC 2.3; the base port ``zmq_port`` is dropped) on ``host`` unless the config names one; a
    receiver loses ``port``/``sender_host``/``sender_port`` (its sender is request-scoped).
    vllm-omni's names: :func:`reference_connector_config`. Others (memory, a registered
    connector): the config unchanged. A new dict; ``cfg`` is not modified."""
    out = dict(cfg)
    kind = str(out.get("type"))
    if kind in REFERENCE_CONNECTORS:
        port = sender_port if role == "sender" else None
        return reference_connector_config(out, role=role, from_stage=from_stage, to_stage=to_stage, sender_port=port)
    if kind not in SERVING_CONNECTORS:
        return out
    out.pop("zmq_port", None)
    out["role"] = role
    if role == "sender":
        out.setdefault("host", host)
        out["port"] = sender_port
    else:
        for key in ("port", "sender_host", "sender_port"):
            out.pop(key, None)
    return out


def _config_key(name: str, config: Mapping[str, Any]) -> str:
    """A stable identity for (name, config); non-JSON values (a clock) count by identity."""
    return name + "|" + json.dumps(config, sort_keys=True, default=lambda v: f"<{type(v).__name__}@{id(v):x}>")


def _resolve(target: Any) -> Callable[[dict[str, Any]], Any]:
    if not isinstance(target, str):
        factory = target
    else:
        module_name, sep, attr = target.partition(":")
        if not sep or not module_name or not attr:
            raise ConfigError(f"connector target must look like 'package.module:Name', got {target!r}")
        factory = getattr(importlib.import_module(module_name), attr)
    from_config = getattr(factory, "from_config", None) if isinstance(factory, type) else None
    return from_config if from_config is not None else factory


@attrs.define(eq=False)
class ConnectorRegistry:
    """Names -> connector targets, plus the failures seen so far. Thread-safe."""

    _targets: dict[str, Any] = attrs.field(factory=lambda: dict(BUILTIN_CONNECTORS), alias="targets")
    #: Builds vllm-omni's connector ``(name, extra)``; the default imports vllm-omni's factory.
    reference_factory: Callable[[str, dict[str, Any]], Any] = build_reference_connector
    #: Whether vllm-omni's names can be served here (default: ``vllm_omni`` is importable).
    reference_available: Callable[[], bool] = _vllm_omni_importable
    _failures: dict[str, ConnectorUnavailable] = attrs.field(init=False, factory=dict)
    _lock: threading.Lock = attrs.field(init=False, factory=threading.Lock)

    def register(self, name: str, target: Any, *, replace: bool = True) -> None:
        """Register ``target`` (``"module:Attr"`` or a callable taking the config dict) under
        ``name``. With ``replace=False`` an existing name is a ConfigError."""
        if not isinstance(name, str) or not name:
            raise ConfigError(f"connector name must be a non-empty string, got {name!r}")
        if not (callable(target) or (isinstance(target, str) and ":" in target)):
            raise ConfigError(f"connector target for {name!r} must be 'module:Attr' or callable")
        with self._lock:
            if not replace and name in self._targets:
                raise ConfigError(f"connector {name!r} is already registered")
            self._targets[name] = target
            self._failures = {k: v for k, v in self._failures.items() if not k.startswith(name + "|")}

    def available(self) -> tuple[str, ...]:
        """Registered names, sorted (whether or not their optional package is installed)."""
        with self._lock:
            return tuple(sorted(self._targets))

    def served_by(self, name: str) -> str:
        """``"kvferry"`` (a registered name), ``"vllm-omni"`` (one of vllm-omni's names, its own
        class) or ``"none"`` (unknown, or vllm-omni's name where vllm_omni is not importable)."""
        with self._lock:
            if name in self._targets:
                return "kvferry"
        if name in REFERENCE_CONNECTORS and self.reference_available():
            return "vllm-omni"
        return "none"

    def servable(self) -> tuple[str, ...]:
        """Every name this registry can build here: its own, then vllm-omni's when importable."""
        ref = tuple(REFERENCE_CONNECTORS) if self.reference_available() else ()
        return self.available() + tuple(n for n in ref if n not in self.available())

    def unservable(self, name: Any) -> ConfigError:
        """The start-time error for a connector name that cannot be served here."""
        mine = ", ".join(self.available())
        if name in REFERENCE_CONNECTORS:
            return ConfigError(
                f"connector_config.type {name!r} is vllm-omni's connector; kvferry serves vllm-omni's names "
                f"({', '.join(REFERENCE_CONNECTORS)}) with vllm-omni's own classes, and vllm_omni is not "
                f"importable here: install vllm-omni (0.30.0) in this environment, or name one of kvferry's "
                f"connectors; available: {mine}"
            )
        ref = "" if not self.reference_available() else f"; with vllm-omni: {', '.join(REFERENCE_CONNECTORS)}"
        return ConfigError(f"unknown connector type {name!r} (connector_config.type); available: {mine}{ref}")

    def check(self, config: Mapping[str, Any] | None) -> str:
        """Fail at start for a connector config that cannot work here: ConfigError naming
        ``connector_config.type`` and the names that can be served. Returns :meth:`served_by`
        (``"none"`` only for a missing config, which is not checked)."""
        if config is None:
            return "none"
        name = config.get("type") if isinstance(config, Mapping) else None
        if not isinstance(name, str) or not name:
            raise ConfigError(f"connector_config.type must name one of {list(self.servable())}, got {name!r}")
        served = self.served_by(name)
        if served == "none":
            raise self.unservable(name)
        return served

    def failures(self) -> dict[str, str]:
        """Remembered failures: ``"name|config" -> message``."""
        with self._lock:
            return {k: str(v) for k, v in self._failures.items()}

    def forget_failures(self, name: str | None = None) -> None:
        """Allow creation to be tried again (for ``name``, or for every connector)."""
        with self._lock:
            if name is None:
                self._failures.clear()
            else:
                self._failures = {k: v for k, v in self._failures.items() if not k.startswith(name + "|")}

    def create(self, config: Mapping[str, Any]) -> Any:
        """Build the connector ``config["type"]`` names, passing it the whole config.

        Raises ConfigError (not a mapping, no ``type``, unknown name: the message lists the
        available ones) or ConnectorUnavailable (import or constructor failure; remembered).
        """
        if not isinstance(config, Mapping):
            raise ConfigError(f"connector config must be a mapping, got {type(config).__name__}")
        name = config.get("type")
        if not isinstance(name, str) or not name:
            raise ConfigError(f"connector config needs a 'type' naming one of {list(self.available())}")
        with self._lock:
            target = self._targets.get(name)
            key = _config_key(name, config)
            remembered = self._failures.get(key)
        if target is None and self.served_by(name) == "vllm-omni":
            target = self._reference_target(name)
        if target is None:
            raise self.unservable(name)
        if remembered is not None:
            raise remembered
        try:
            connector = _resolve(target)(dict(config))
            if not isinstance(connector, Connector):
                raise TypeError(f"{type(connector).__name__} does not meet the Connector contract")
        except Exception as exc:  # any failure of (possibly foreign) construction code: one type
            error = ConnectorUnavailable(f"connector {name!r} could not be created: {type(exc).__name__}: {exc}")
            error.__cause__ = exc
            with self._lock:
                self._failures[key] = error
            logger.error("%s", error)
            raise error from exc
        return connector

    def _reference_target(self, name: str) -> Callable[[dict[str, Any]], Any]:
        factory = self.reference_factory

        def build(config: dict[str, Any]) -> Any:
            return factory(name, {k: v for k, v in config.items() if k != "type"})

        return build


default_registry = ConnectorRegistry()


def create_connector(config: Mapping[str, Any], *, registry: ConnectorRegistry | None = None) -> Any:
    """Create a connector from ``{"type": name, ...}`` (see :meth:`ConnectorRegistry.create`)."""
    return (registry or default_registry).create(config)


def check_connector_config(config: Mapping[str, Any] | None, *, registry: ConnectorRegistry | None = None) -> str:
    """:meth:`ConnectorRegistry.check` on the default registry (fail at start, naming the key)."""
    return (registry or default_registry).check(config)


def register_connector(name: str, target: Any, *, replace: bool = True) -> None:
    """Register a connector in the default registry (``"module:Class"`` or a callable)."""
    default_registry.register(name, target, replace=replace)


def available_connectors() -> tuple[str, ...]:
    return default_registry.available()


def connector_failures() -> dict[str, str]:
    return default_registry.failures()
