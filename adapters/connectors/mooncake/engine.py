"""The transfer engine behind the mooncake connector: lazy loading, one registered pool, transfers.

``mooncake`` is an optional extra (``pip install kvferry[mooncake]``; its native library also
needs the system package ``libibverbs1`` even for TCP). It is imported only when a connector is
created; a missing package or system library raises
:class:`~kvferry.core.errors.ConnectorUnavailable` that says what to install.

One :class:`EnginePool` per connector: an engine initialised in P2P-handshake mode (no metadata
server) and ONE memory region of ``pool_bytes`` bytes, allocated and registered once and reused
for every payload. By default the engine itself is shared by every connector of the process
with the same ``(host, protocol, device_name)`` (:func:`shared_engine`): starting one costs
about a second and tearing one down another second, and one engine serves any number of
registered pools (a transfer between two pools of one engine goes through the same transport).
Transfers move ``length`` bytes between a local pool address and a peer's
registered address; they return False on any engine failure (peer gone, address not
registered), never raise for a remote fault.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import attrs

from kvferry.core.errors import ConfigError, ConnectorUnavailable
from kvferry.core.validate import check_int

__all__ = [
    "INSTALL_HINT",
    "unavailable_message",
    "load_engine_class",
    "start_engine",
    "shared_engine",
    "EnginePool",
    "bench_raw_transfer",
    "payload_pattern",
    "throughput_summary",
]

logger = logging.getLogger(__name__)

INSTALL_HINT = (
    "install the optional extra: pip install 'kvferry[mooncake]' "
    "(package mooncake-transfer-engine-non-cuda, or mooncake-transfer-engine for CUDA)"
)
_SYSTEM_HINT = (
    "install the system library the engine links against: apt-get install -y libibverbs1 "
    "(needed even for the tcp protocol)"
)
#: Chunk size (bytes) of one batched transfer request; 16 MiB measured best over loopback TCP.
DEFAULT_CHUNK_BYTES = 16 << 20


def unavailable_message(error: BaseException) -> str:
    """What to install, given the exception that importing ``mooncake.engine`` raised."""
    text = str(error)
    if "ibverbs" in text or ".so" in text or isinstance(error, OSError):
        return f"mooncake transfer engine cannot load its native library ({text}); {_SYSTEM_HINT}"
    return f"mooncake transfer engine is not installed ({text}); {INSTALL_HINT}"


def load_engine_class() -> type:
    """Import ``mooncake.engine.TransferEngine`` lazily; ConnectorUnavailable says what's missing."""
    # The engine logs every handshake at INFO through glog on stderr; keep errors only unless
    # the operator chose a level.
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    try:
        from mooncake.engine import TransferEngine  # type: ignore[import-not-found]
    except (ImportError, OSError) as exc:
        raise ConnectorUnavailable(unavailable_message(exc)) from exc
    return TransferEngine


def start_engine(host: str, protocol: str, device_name: str, factory: Callable[[], Any] | None = None) -> Any:
    """A new engine initialised in P2P-handshake mode; ConnectorUnavailable when it fails."""
    engine = (factory if factory is not None else load_engine_class())()
    rc = engine.initialize(host, "P2PHANDSHAKE", protocol, device_name)
    if rc != 0:
        raise ConnectorUnavailable(
            f"mooncake engine failed to initialise on {host!r} with protocol {protocol!r} "
            f"(device {device_name!r}): return code {rc}"
        )
    return engine


_SHARED: dict[tuple[str, str, str], Any] = {}
_SHARED_LOCK = threading.Lock()


def shared_engine(host: str, protocol: str, device_name: str) -> Any:
    """The process-wide engine for ``(host, protocol, device_name)``, started on first use and
    kept until the process exits (pools are registered on it and unregistered on close)."""
    key = (host, protocol, device_name)
    with _SHARED_LOCK:
        engine = _SHARED.get(key)
        if engine is None:
            engine = _SHARED[key] = start_engine(host, protocol, device_name)
        return engine


def _chunks(length: int, chunk: int) -> list[tuple[int, int]]:
    """``(offset, size)`` pieces covering ``[0, length)`` in order, each <= ``chunk`` bytes."""
    return [(off, min(chunk, length - off)) for off in range(0, length, chunk)]


def pool_tensor(pool_bytes: int, device: str = "cpu") -> Any:
    """A fresh 1-D ``uint8`` pool of ``pool_bytes`` on ``device``; on the host every page is
    faulted in now (written once), not by the first payloads (``torch.zeros`` of a large size
    maps untouched zero pages: each first write there faults)."""
    import torch

    tensor = torch.empty(pool_bytes, dtype=torch.uint8, device=device)
    if device == "cpu":
        tensor.zero_()
    return tensor


class TensorPool:
    """``base`` and ``pool_bytes`` of a pool held as the 1-D ``uint8`` tensor ``tensor``."""

    __slots__ = ()
    tensor: Any

    @property
    def base(self) -> int:
        """Address of the pool's first byte."""
        return int(self.tensor.data_ptr())

    @property
    def pool_bytes(self) -> int:
        return int(self.tensor.numel())

    def read(self, peer: str, local_offset: int, remote_addr: int, length: int) -> bool:
        """Read ``length`` bytes at ``remote_addr`` of ``peer`` into the pool at ``local_offset``;
        False on any remote fault (each pool says how)."""
        raise NotImplementedError

    def read_spans(self, peer: str, spans: Sequence[tuple[int, int, int]], within_s: float | None = None) -> bool:
        """Every ``(local_offset, remote_addr, length)`` span of ``peer``, all or nothing (False
        at the first that fails). Span by span here; a pool whose engine takes a list of spans
        in one request overrides it. ``within_s``: the most seconds the caller can wait for the
        read (a blocking get's deadline); a pool whose engine polls a read it started ends it by
        then (nixl), one whose engine reads synchronously cannot and ignores it (mooncake)."""
        return all(self.read(peer, off, addr, n) for off, addr, n in spans)


@attrs.define(eq=False)
class EnginePool(TensorPool):
    """An initialised transfer engine plus one registered pool of ``pool_bytes`` bytes.

    ``tensor`` is the pool as a 1-D ``uint8`` torch tensor (CPU, or the device named by
    ``device``); ``base`` is its address. Invariant: every address handed to the engine lies in
    ``[base, base + pool_bytes)`` of this pool or in a peer's registered region.
    """

    engine: Any
    tensor: Any
    host: str
    protocol: str
    rpc_port: int
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    _closed: bool = False

    @classmethod
    def create(
        cls,
        *,
        host: str,
        pool_bytes: int,
        protocol: str = "tcp",
        device_name: str = "",
        device: str = "cpu",
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        shared: bool = True,
        engine_factory: Callable[[], Any] | None = None,
    ) -> EnginePool:
        """Get an engine (the shared one unless ``shared`` is False or ``engine_factory`` is
        given) and register a freshly allocated pool of ``pool_bytes`` bytes on it.

        Raises ConnectorUnavailable when the engine cannot be loaded or initialised, and
        ConfigError for an impossible pool (size, device).
        """
        import torch

        if protocol not in ("tcp", "rdma"):
            raise ConfigError(f"mooncake protocol must be 'tcp' or 'rdma', got {protocol!r}")
        check_int("mooncake pool_bytes", pool_bytes, 1)
        if shared and engine_factory is None:
            engine = shared_engine(host, protocol, device_name)
        else:
            engine = start_engine(host, protocol, device_name, engine_factory)
        location = "*"  # the engine's word for "find out yourself" (host memory here)
        if device != "cpu":
            if not torch.cuda.is_available():
                raise ConfigError(f"mooncake pool device {device!r} requested but CUDA is unavailable")
            location = str(torch.device(device))  # e.g. "cuda:0"
        tensor = pool_tensor(pool_bytes, device)
        rc = engine.register_memory(tensor.data_ptr(), pool_bytes, location)
        if rc != 0:
            raise ConnectorUnavailable(f"mooncake engine could not register {pool_bytes} bytes: rc {rc}")
        return cls(engine, tensor, host, protocol, int(engine.get_rpc_port()), chunk_bytes)

    def read(self, peer: str, local_offset: int, remote_addr: int, length: int) -> bool:
        """Read ``length`` bytes at ``remote_addr`` of ``peer`` ("host:rpc_port") into the pool."""
        return self._transfer(peer, local_offset, remote_addr, length, write=False)

    def write(self, peer: str, local_offset: int, remote_addr: int, length: int) -> bool:
        """Write ``length`` pool bytes at ``local_offset`` to ``remote_addr`` of ``peer``."""
        return self._transfer(peer, local_offset, remote_addr, length, write=True)

    def _transfer(self, peer: str, local_offset: int, remote: int, length: int, *, write: bool) -> bool:
        if self._closed:
            return False
        if local_offset < 0 or length < 0 or local_offset + length > self.pool_bytes:
            raise ConfigError(f"span [{local_offset}, +{length}) lies outside the pool")
        if length == 0:
            return True
        pieces = _chunks(length, self.chunk_bytes)
        local = [self.base + local_offset + off for off, _ in pieces]
        remotes = [remote + off for off, _ in pieces]
        sizes = [size for _, size in pieces]
        call = self.engine.batch_transfer_sync_write if write else self.engine.batch_transfer_sync_read
        try:
            rc = call(peer, local, remotes, sizes)
        except (RuntimeError, ValueError, TypeError) as exc:  # engine binding errors
            logger.warning("mooncake transfer with %s raised %s", peer, exc)
            return False
        return rc == 0

    def close(self) -> None:
        """Unregister the pool. Idempotent. The engine object is dropped with the connector."""
        if self._closed:
            return
        self._closed = True
        try:
            self.engine.unregister_memory(self.base)
        except (RuntimeError, ValueError, TypeError) as exc:
            logger.warning("mooncake unregister_memory failed: %s", exc)


def bench_raw_transfer(
    nbytes: int,
    reps: int = 5,
    *,
    host: str = "127.0.0.1",
    protocol: str = "tcp",
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
) -> dict[str, Any]:
    """The engine's own throughput: batched writes of ``nbytes`` between two pools, ``reps`` times.

    Two engines of their own in this process (loopback for tcp); one warm-up transfer is not
    timed. Returns
    ``{"nbytes", "reps", "seconds": [...], "best_gbps", "median_gbps"}`` (GB = 1e9 bytes).
    """

    def pool() -> EnginePool:
        return EnginePool.create(host=host, pool_bytes=nbytes, protocol=protocol, chunk_bytes=chunk_bytes, shared=False)

    src, dst = pool(), pool()
    try:
        src.tensor.copy_(payload_pattern(nbytes))
        peer = f"{host}:{dst.rpc_port}"
        if not src.write(peer, 0, dst.base, nbytes):
            raise ConnectorUnavailable(f"raw mooncake write to {peer} failed")
        seconds: list[float] = []
        for _ in range(reps):
            start = time.perf_counter()
            ok = src.write(peer, 0, dst.base, nbytes)
            seconds.append(time.perf_counter() - start)
            if not ok:
                raise ConnectorUnavailable(f"raw mooncake write to {peer} failed")
        if not bool((src.tensor == dst.tensor).all()):
            raise ConnectorUnavailable("raw mooncake write delivered different bytes")
        return throughput_summary(nbytes, seconds)
    finally:
        src.close()
        dst.close()


def payload_pattern(nbytes: int) -> Any:
    """``nbytes`` pseudo-random bytes (a 1-D uint8 CPU tensor), the same for the same size."""
    import torch

    gen = torch.Generator().manual_seed(nbytes)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)


def throughput_summary(nbytes: int, seconds: Sequence[float]) -> dict[str, Any]:
    """``{"nbytes", "reps", "seconds", "best_gbps", "median_gbps"}`` of timed reps (GB = 1e9 B)."""
    ordered = sorted(seconds)
    median = ordered[len(ordered) // 2]
    return {
        "nbytes": nbytes,
        "reps": len(seconds),
        "seconds": list(seconds),
        "best_gbps": nbytes / ordered[0] / 1e9,
        "median_gbps": nbytes / median / 1e9,
    }
