"""kvferry.app: the manager, compatibility layer, registry, wiring and command line.

The typed API is :class:`KVTransferManager` (built by :func:`build_manager`); the reference's
names are in :mod:`kvferry.app.compat`.

The names below are imported on first access, so importing a torch-free module of this package
(:mod:`kvferry.app.vllm.params`, the hand-off a proxy builds; :mod:`kvferry.app.plan`) does not
load torch through this package (a test checks it).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvferry.app.manager import KVCache, KVTransferManager, StageGroups
    from kvferry.app.receive import ReceiveResult
    from kvferry.app.registry import available_connectors, create_connector, register_connector
    from kvferry.app.stage import Distribution, DistributionStatus, Prefetched, PrefetchStart, PrefetchStatus
    from kvferry.app.wiring import build_manager

__version__ = "0.1.0"

_LAZY = {
    "KVCache": "kvferry.app.manager",
    "KVTransferManager": "kvferry.app.manager",
    "StageGroups": "kvferry.app.manager",
    "ReceiveResult": "kvferry.app.receive",
    "available_connectors": "kvferry.app.registry",
    "create_connector": "kvferry.app.registry",
    "register_connector": "kvferry.app.registry",
    "build_manager": "kvferry.app.wiring",
    "Distribution": "kvferry.app.stage",
    "DistributionStatus": "kvferry.app.stage",
    "Prefetched": "kvferry.app.stage",
    "PrefetchStart": "kvferry.app.stage",
    "PrefetchStatus": "kvferry.app.stage",
}

__all__ = [
    "Distribution",
    "DistributionStatus",
    "KVCache",
    "KVTransferManager",
    "PrefetchStart",
    "PrefetchStatus",
    "Prefetched",
    "ReceiveResult",
    "StageGroups",
    "__version__",
    "available_connectors",
    "build_manager",
    "create_connector",
    "register_connector",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
