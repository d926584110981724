"""The shm connector's configuration and its sender side (segment, pool, control thread).

:class:`ShmConfig` reads the config dict (see docs/connectors.md); :func:`start_sender` creates
what a sender owns: ONE segment of ``pool_bytes`` (0600, pre-faulted), the control endpoint
claimed in the namespace's runtime directory, a :class:`~kvferry.adapters.connectors.memory.pool.LocalPool` over the
segment and the :class:`~.server.ControlServer` thread serving it. :class:`SenderSide`
removes all of it on close (or from the connector's finalizer).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import attrs

from kvferry.adapters.connectors.memory.pool import LocalPool, PoolSettings
from kvferry.adapters.connectors.shm.segment import (
    SHM_DIR,
    Segment,
    check_namespace,
    claim_control,
    create_segment,
    default_namespace,
    discard_segment,
    remove_quietly,
    runtime_dir,
)
from kvferry.adapters.connectors.shm.server import ControlServer
from kvferry.core.errors import ConfigError
from kvferry.core.validate import check_number, check_port

__all__ = ["SHM_DEFAULT_POOL_BYTES", "ROLES", "ShmConfig", "SenderSide", "start_sender"]

SHM_DEFAULT_POOL_BYTES = 256 << 20
ROLES = ("sender", "receiver")


def _port(config: Mapping[str, Any], *keys: str) -> int | None:
    for key in keys:
        value = config.get(key)
        if value is None:
            continue
        return check_port(f"shm config {key!r}", value, expected="a port number 1..65535")
    return None


@attrs.frozen
class ShmConfig:
    """Typed shm config (bytes, seconds). ``port`` tags a sender (None: a unique tag, reachable
    only through ``put`` metadata); ``sender_port`` is a receiver's default sender."""

    role: str
    namespace: str
    port: int | None
    sender_port: int | None
    runtime_base: str | None
    shm_dir: str
    rpc_timeout_s: float
    pool: PoolSettings

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> ShmConfig:
        role = config.get("role", "receiver")
        if role not in ROLES:
            raise ConfigError(f"shm config 'role' must be one of {ROLES}, got {role!r}")
        rpc = config.get("rpc_timeout_s", 2.0)
        check_number("shm config 'rpc_timeout_s'", rpc, above=0.0, maximum=1e6, expected="positive seconds")
        for key in ("runtime_dir", "shm_dir"):
            if config.get(key) is not None and not isinstance(config[key], str):
                raise ConfigError(f"shm config {key!r} must be a path string")
        return cls(
            role=role,
            namespace=check_namespace(config.get("namespace") or default_namespace()),
            port=_port(config, "port"),
            sender_port=_port(config, "sender_port", "sender_zmq_port"),
            runtime_base=config.get("runtime_dir"),
            shm_dir=config.get("shm_dir") or SHM_DIR,
            rpc_timeout_s=float(rpc),
            pool=PoolSettings.from_config(config, default_pool_bytes=SHM_DEFAULT_POOL_BYTES),
        )


@attrs.define(eq=False)
class SenderSide:
    """Everything a sender owns; closed by ShmConnector.close or by its finalizer at exit."""

    segment: Segment
    pool: LocalPool
    server: ControlServer
    socket_path: str
    owner_file: str
    directory: str
    owner_pid: int = attrs.field(factory=os.getpid)
    closed: bool = False

    def close(self) -> None:
        if self.closed or os.getpid() != self.owner_pid:  # a forked child owns nothing
            return
        self.closed = True
        discard_segment(self.segment)  # names first: nothing may leak, whatever follows
        remove_quietly(self.socket_path)
        remove_quietly(self.owner_file)
        try:
            os.rmdir(self.directory)
        except OSError:
            pass  # other senders of the namespace still live there
        self.pool.close()
        self.server.stop()
        self.segment.unmap()


def start_sender(config: ShmConfig) -> SenderSide:
    cfg = config
    segment = create_segment(cfg.namespace, cfg.port, cfg.pool.pool_bytes, cfg.shm_dir)
    try:
        tag = str(cfg.port) if cfg.port is not None else f"x{os.getpid()}{segment.name[-8:]}"
        sock, owner = claim_control(cfg.namespace, tag, segment.name, cfg.runtime_base)
    except BaseException:
        discard_segment(segment)
        segment.unmap()
        raise
    pool = LocalPool.create(cfg.pool, storage=segment.tensor[: cfg.pool.pool_bytes], name="shm")
    server = ControlServer(pool, segment.name, segment.nbytes, "ipc://" + sock)
    side = SenderSide(segment, pool, server, sock, owner, runtime_dir(cfg.namespace, cfg.runtime_base))
    try:
        server.start()
    except BaseException:
        side.close()
        raise
    return side
