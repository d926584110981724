"""Connectors by name: ``create_connector({"type": name, ...}) -> Connector``.

A registry entry maps a name to a target ``"module.path:Attribute"`` (imported lazily, so an
optional connector's heavy package is loaded only when that connector is asked for) or to a
callable. The target is called with the whole config dict; a class with a ``from_config``
classmethod is built through it.

Failures are values the caller sees, and are remembered:

- an unknown ``type`` raises :class:`~kvferry.core.errors.ConfigError` listing the names
  available (a local misuse);
- an import or constructor failure raises :class:`~kvferry.core.errors.ConnectorUnavailable`
  with the cause chained. The failure is remembered per (name, config): asking again raises the
  same error at once without importing or constructing again, so a hot path that retries
  cannot pay the cost (or the side effects) each time. :meth:`ConnectorRegistry.forget_failures`
  clears the memory (e.g. after installing the missing package).
"""

from __future__ import annotations

import importlib
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
}


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
        if target is None:
            raise ConfigError(f"unknown connector type {name!r}; available: {', '.join(self.available())}")
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


default_registry = ConnectorRegistry()


def create_connector(config: Mapping[str, Any], *, registry: ConnectorRegistry | None = None) -> Any:
    """Create a connector from ``{"type": name, ...}`` (see :meth:`ConnectorRegistry.create`)."""
    return (registry or default_registry).create(config)


def register_connector(name: str, target: Any, *, replace: bool = True) -> None:
    """Register a connector in the default registry (``"module:Class"`` or a callable)."""
    default_registry.register(name, target, replace=replace)


def available_connectors() -> tuple[str, ...]:
    return default_registry.available()


def connector_failures() -> dict[str, str]:
    return default_registry.failures()
