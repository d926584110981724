"""kvferry.app: the manager, compatibility layer, registry, wiring and command line.

The typed API is :class:`KVTransferManager` (built by :func:`build_manager`); the reference's
names are in :mod:`kvferry.app.compat`.
"""

from kvferry.app.manager import KVCache, KVTransferManager, StageGroups
from kvferry.app.receive import ReceiveResult
from kvferry.app.registry import available_connectors, create_connector, register_connector
from kvferry.app.wiring import build_manager

__version__ = "0.1.0"

__all__ = [
    "KVCache",
    "KVTransferManager",
    "ReceiveResult",
    "StageGroups",
    "__version__",
    "available_connectors",
    "build_manager",
    "create_connector",
    "register_connector",
]
