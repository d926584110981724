"""The one composition root: a config dict in, a ready :class:`KVTransferManager` out.

Engines (and kvferry's own demo) call :func:`build_manager` with the reference's
``omni_kv_config`` dict, this rank's TP rank/size and its collective groups. Environment
values are read here, once, and passed into the pure core (strict ``${VAR}`` expansion of the
base port; the replica id). A sending stage's connector is created at once, so a missing
package or a port already in use fails at start (SPEC 9.12), not on the first request.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from typing import Any

from kvferry.adapters.platform import memory_info
from kvferry.app.manager import KVTransferManager, StageGroups
from kvferry.app.registry import check_connector_config, create_connector
from kvferry.core.config import TransferConfig

__all__ = ["build_manager", "free_memory_ratio"]

logger = logging.getLogger(__name__)


def free_memory_ratio(device: Any = None) -> float | None:
    """Free / total memory of ``device`` (None: the default device); None when unknown."""
    try:
        info = memory_info(device)
    except Exception:
        return None
    return info.free_ratio if getattr(info, "known", True) else None


def build_manager(
    omni_kv_config: Mapping[str, Any] | TransferConfig,
    *,
    tp_rank: int = 0,
    tp_size: int = 1,
    dp_rank: int = 0,
    groups: StageGroups | None = None,
    connector: Any = None,
    connector_factory: Callable[[dict[str, Any]], Any] = create_connector,
    env: Mapping[str, str] | None = None,
    start: bool = True,
    **options: Any,
) -> KVTransferManager:
    """Build (and by default start) one rank's manager.

    Raises ConfigError for an invalid config (naming the key) and, with ``start=True``,
    ConnectorUnavailable when a sending stage's connector cannot be created.
    """
    env = os.environ if env is None else env
    config = (
        omni_kv_config
        if isinstance(omni_kv_config, TransferConfig)
        else TransferConfig.from_omni_kv_config(omni_kv_config, env)
    )
    if (
        connector is None
        and connector_factory is create_connector
        and (config.need_send_cache or config.need_recv_cache)
    ):
        check_connector_config(config.connector_config)  # a name that cannot be served fails at start
    manager = KVTransferManager(
        config,
        tp_rank=tp_rank,
        tp_size=tp_size,
        dp_rank=dp_rank,
        groups=groups or StageGroups(),
        connector=connector,
        connector_factory=connector_factory,
        free_memory_ratio=free_memory_ratio,
        **options,
    )
    if start:
        manager.start()
    return manager
