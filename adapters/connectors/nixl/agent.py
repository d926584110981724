"""The NIXL agent behind the nixl connector: lazy loading, one registered pool, one-sided READs.

``nixl`` is an optional extra (``pip install 'kvferry[nixl]'``; on a CPU-only host
``pip install --no-deps nixl-cu12==1.5.1 nixl==1.5.1``: the wheel's declared dependencies pull
a CUDA stack it does not need for host memory). It is imported only when a connector is
created; a missing package raises :class:`~kvferry.core.errors.ConfigError` saying what to
install.

One :class:`AgentPool` per connector: a NIXL agent with one backend (``UCX`` by default) and
ONE host-memory region of ``pool_bytes`` bytes, allocated and registered once and reused for
every payload. A sender's pool is what receivers read from; a receiver's is where its reads
land. :meth:`AgentPool.read` is one NIXL READ of a peer's registered bytes into the pool,
bounded by a deadline; it returns False (never raises) for any remote fault: peer unknown or
gone, address not registered, transfer error, deadline passed.

Peers are found by their control endpoint ``"host:port"``: the first read from a sender asks
``resolve(peer)`` (the connector fetches the sender's agent name and metadata over the control
channel) and adds the remote agent; a failed read forgets it, so a restarted sender is learnt
again on the next get.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs

from kvferry.adapters.connectors.mooncake.engine import TensorPool, poll_pause, pool_tensor
from kvferry.core.errors import ConfigError, ConnectorUnavailable
from kvferry.core.validate import check_int

__all__ = [
    "INSTALL_HINT",
    "load_nixl",
    "IB_SYSFS",
    "has_rdma_device",
    "default_ucx_modules",
    "UCX_TCP_CONNECT",
    "apply_ucx_env",
    "new_agent",
    "AgentPool",
    "Resolver",
]

logger = logging.getLogger(__name__)

INSTALL_HINT = (
    "install the optional extra: pip install 'kvferry[nixl]'; on a CPU-only host "
    "pip install --no-deps nixl-cu12==1.5.1 nixl==1.5.1 (the wheel's dependencies pull a CUDA stack)"
)

#: ``resolve("host:port") -> (agent name, agent metadata)`` or None (sender unreachable).
Resolver = Callable[[str], "tuple[str, bytes] | None"]


def load_nixl() -> Any:
    """Import ``nixl._api`` lazily; a ConfigError naming the extra when it is missing."""
    # nixl logs every agent and backend start at INFO on stdout (a worker's stdout may be a
    # protocol channel); warnings only unless the operator chose a level.
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    try:
        from nixl import _api  # type: ignore[import-not-found]

        _api.nixl_agent  # noqa: B018 (the stub module without a backend package lacks it)
    except (ImportError, OSError, AttributeError) as exc:
        raise ConfigError(f"the nixl connector needs the nixl package ({exc}); {INSTALL_HINT}") from exc
    return _api


#: Where Linux lists RDMA (InfiniBand/RoCE) devices; none there: UCX's IB module is of no use.
IB_SYSFS = "/sys/class/infiniband"


def has_rdma_device(sysfs: str = IB_SYSFS) -> bool:
    """True when the host lists at least one RDMA device."""
    try:
        return bool(os.listdir(sysfs))
    except OSError:
        return False


def default_ucx_modules(configured: str | None, rdma: bool) -> str | None:
    """``UCX_MODULES`` to set: the configured value; else ``"^ib"`` on a host without RDMA
    devices (nixl-cu12 1.5.1's UCX IB module loads a bundled libnl-route whose destructor
    crashes the process at exit, SIGSEGV, and without a device the module is unused); else
    None (leave UCX's default). ``""`` means leave it alone."""
    if configured is not None:
        return configured or None
    return None if rdma else "^ib"


#: UCX's TCP transport connects without blocking. Its default is a blocking ``connect()`` inside
#: the agent's ``add_remote_agent``, under the agent's lock: a sender whose wire went down while
#: the SYN was out held a receiver there for ~20 s (measured), past any request deadline, and
#: every other read of that agent with it. Non-blocking, the call returns at once and the READ
#: fails within ``transfer_timeout_s``.
UCX_TCP_CONNECT = ("UCX_TCP_CONN_NB", "y")


def apply_ucx_env(
    tls: str | None,
    net_devices: str | None,
    environ: Any = None,
    *,
    modules: str | None = None,
    rdma: bool | None = None,
) -> None:
    """Set ``UCX_TLS`` / ``UCX_NET_DEVICES`` / ``UCX_MODULES`` for this process (UCX reads them
    when the first agent starts): the first two when given, the modules as
    :func:`default_ucx_modules` says unless the environment already sets them. A given value
    that differs from one already set is a ConfigError naming the key: the process has one UCX
    configuration. Also ``UCX_TCP_CONN_NB`` (:data:`UCX_TCP_CONNECT`) unless the environment
    sets it."""
    env = os.environ if environ is None else environ
    env.setdefault(*UCX_TCP_CONNECT)
    wanted = default_ucx_modules(modules, has_rdma_device() if rdma is None else rdma)
    if wanted is not None and modules is None and "UCX_MODULES" in env:
        wanted = None  # the operator's environment wins over the default
    for key, name, value in (
        ("ucx_tls", "UCX_TLS", tls),
        ("ucx_net_devices", "UCX_NET_DEVICES", net_devices),
        ("ucx_modules", "UCX_MODULES", wanted),
    ):
        if value is None:
            continue
        current = env.get(name)
        if current is not None and current != value:
            raise ConfigError(
                f"nixl config {key!r} is {value!r} but this process already has {name}={current!r} "
                "(UCX has one configuration per process)"
            )
        env[name] = value


def new_agent(backend: str, options: Mapping[str, str], role: str) -> Any:
    """A NIXL agent with exactly ``backend`` created with ``options``; its name is unique
    (role, pid, random). ConfigError for a backend the installed plugins lack,
    ConnectorUnavailable when it fails to start."""
    api = load_nixl()
    name = f"kvferry-{role}-{os.getpid()}-{uuid.uuid4().hex[:12]}"
    conf = api.nixl_agent_config(
        backends=[],
        sync_mode=api.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT,  # gets run in several threads
    )
    try:
        agent = api.nixl_agent(name, conf)
    except Exception as exc:  # the binding raises bare exceptions of its own
        raise ConnectorUnavailable(f"nixl agent failed to start: {type(exc).__name__}: {exc}") from exc
    plugins = list(agent.get_plugin_list())
    if backend not in plugins:
        raise ConfigError(f"nixl config 'backend' {backend!r} is not an installed plugin; available: {plugins}")
    try:
        agent.create_backend(backend, dict(options))
    except Exception as exc:
        raise ConnectorUnavailable(
            f"nixl backend {backend!r} failed to start with options {dict(options)}: {type(exc).__name__}: {exc}"
        ) from exc
    return agent


@attrs.define(eq=False)
class AgentPool(TensorPool):
    """A NIXL agent plus one registered pool of ``pool_bytes`` host bytes.

    ``tensor`` is the pool as a 1-D ``uint8`` CPU tensor; ``base`` its address. Invariant: every
    local address handed to the agent lies in ``[base, base + pool_bytes)``.
    """

    agent: Any
    tensor: Any
    registration: Any
    backend: str
    rpc_port: int = 0  # the sender's control port (what lookups name as the peer's port)
    transfer_timeout_s: float = 10.0
    resolve: Resolver | None = None
    _peers: dict[str, str] = attrs.field(init=False, factory=dict)  # "host:port" -> agent name
    _lock: threading.Lock = attrs.field(init=False, factory=threading.Lock)
    counters: dict[str, int] = attrs.field(init=False, factory=dict)
    _closed: bool = attrs.field(init=False, default=False)
    _name: str = attrs.field(init=False, default="")
    #: Host memory registered besides the pool (register_tensor): ``(address, length,
    #: registration)`` each.
    _extra: list[tuple[int, int, Any]] = attrs.field(init=False, factory=list)

    def __attrs_post_init__(self) -> None:
        self._name = str(self.agent.name)

    @classmethod
    def create(
        cls,
        *,
        pool_bytes: int,
        backend: str = "UCX",
        options: Mapping[str, str] | None = None,
        role: str = "sender",
        transfer_timeout_s: float = 10.0,
    ) -> AgentPool:
        """Start an agent and register a freshly allocated, pre-faulted pool on it."""

        check_int("nixl pool_bytes", pool_bytes, 1)
        agent = new_agent(backend, options or {}, role)
        tensor = pool_tensor(pool_bytes)
        try:
            registration = agent.register_memory([(tensor.data_ptr(), pool_bytes, 0, "")], "DRAM", [backend])
        except Exception as exc:
            raise ConnectorUnavailable(f"nixl could not register {pool_bytes} bytes: {exc}") from exc
        return cls(agent, tensor, registration, backend, transfer_timeout_s=transfer_timeout_s)

    def register_tensor(self, tensor: Any) -> bool:
        """Register the host storage behind ``tensor`` with the agent (once: False when it
        already lies in registered memory). ConfigError for a device tensor or after close,
        ConnectorUnavailable when the agent refuses it."""
        if getattr(tensor, "device", None) is None or tensor.device.type != "cpu":
            raise ConfigError(f"nixl registers host memory here; got a tensor on {getattr(tensor, 'device', '?')}")
        storage = tensor.untyped_storage()
        addr, length = int(storage.data_ptr()), int(storage.nbytes())
        with self._lock:
            if self._closed:
                raise ConfigError("the nixl agent is closed")
            if length == 0 or self._covered(addr, length):
                return False
        try:
            reg = self.agent.register_memory([(addr, length, 0, "")], "DRAM", [self.backend])
        except Exception as exc:
            raise ConnectorUnavailable(f"nixl could not register {length} bytes at {addr:#x}: {exc}") from exc
        with self._lock:
            self._extra.append((addr, length, reg))
        self._count("registered_extra")
        return True

    def _covered(self, addr: int, length: int) -> bool:
        return any(a <= addr and addr + length <= a + n for a, n, _ in self._extra)

    def unregistered(self, spans: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
        """The ``(addr, length)`` spans (of positive length) that do not lie inside one range
        registered besides the pool (one look under the lock for all of them)."""
        with self._lock:
            return [(a, n) for a, n in spans if n and not self._covered(int(a), int(n))]

    @property
    def name(self) -> str:
        """This agent's name (kept after close)."""
        return self._name

    def metadata(self) -> bytes:
        """This agent's metadata: what a peer adds to reach it (with the registered pool)."""
        return bytes(self.agent.get_agent_metadata())

    def _count(self, name: str) -> None:
        with self._lock:
            self.counters[name] = self.counters.get(name, 0) + 1

    def peer_agent(self, peer: str) -> str | None:
        """The remote agent name for control endpoint ``peer``, learnt once (None: unreachable)."""
        with self._lock:
            known = self._peers.get(peer)
        if known is not None or self.resolve is None:
            return known
        got = self.resolve(peer)
        if got is None:
            return None
        name, metadata = got
        try:
            added = self.agent.add_remote_agent(metadata)
        except Exception as exc:
            logger.warning("nixl: metadata of %s (%s) rejected: %s", peer, name, exc)
            self._count("bad_metadata")
            return None
        added = added.decode() if isinstance(added, bytes) else str(added)
        if added != name:
            logger.warning("nixl: %s announced agent %r but its metadata names %r", peer, name, added)
        with self._lock:
            self._peers[peer] = added
        self._count("peers_added")
        return added

    def forget(self, peer: str) -> None:
        """Drop what is known of ``peer`` (after a failure: it may have restarted)."""
        with self._lock:
            name = self._peers.pop(peer, None)
        if name is not None:
            try:
                self.agent.remove_remote_agent(name)
            except Exception as exc:
                logger.debug("nixl: remove_remote_agent(%s) failed: %s", name, exc)

    def read_spans(
        self,
        peer: str,
        spans: Sequence[tuple[int, int, int]],
        within_s: float | None = None,
        ended: Callable[[], None] | None = None,
    ) -> bool:
        """One NIXL READ of several ``(local_offset, remote_addr, length)`` spans (one request),
        ended (False) when not done within ``transfer_timeout_s`` or ``within_s``, whichever
        is less; a READ that failed is over when this returns (its handle released, which
        cancels it): ``ended`` is called before."""
        ok = self._read_spans(peer, spans, within_s)
        if not ok and ended is not None:
            ended()
        return ok

    def _read_spans(self, peer: str, spans: Sequence[tuple[int, int, int]], within_s: float | None) -> bool:
        if self._closed:
            return False
        for off, _, length in spans:
            self.check_span(off, length)
        spans = [s for s in spans if s[2] > 0]
        if not spans:
            return True
        agent_name = self.peer_agent(peer)
        if agent_name is None:
            self._count("peer_unreachable")
            return False
        limit = self.transfer_timeout_s if within_s is None else min(self.transfer_timeout_s, max(within_s, 0.0))
        ok = self._transfer(agent_name, spans, limit)
        if not ok:
            self.forget(peer)
        return ok

    def _transfer(self, agent_name: str, spans: Sequence[tuple[int, int, int]], limit_s: float) -> bool:
        agent = self.agent
        handle = None
        self._count("reads")  # one NIXL READ request, however many spans
        try:
            local = agent.get_xfer_descs([(self.base + off, n, 0) for off, _, n in spans], "DRAM")
            remote = agent.get_xfer_descs([(addr, n, 0) for _, addr, n in spans], "DRAM")
            handle = agent.initialize_xfer("READ", local, remote, agent_name, b"", [self.backend])
            state = agent.transfer(handle)
            deadline = time.monotonic() + limit_s
            spins = 0
            while state == "PROC":
                if time.monotonic() > deadline:
                    self._count("transfer_timeouts")
                    logger.warning("nixl READ from %s not done in %.1f s", agent_name, limit_s)
                    return False
                spins += 1
                poll_pause(spins)
                state = agent.check_xfer_state(handle)
            if state != "DONE":
                self._count("transfer_errors")
                logger.warning("nixl READ from %s ended in state %s", agent_name, state)
                return False
            return True
        except Exception as exc:  # the binding raises bare nixlBind errors for remote faults
            self._count("transfer_errors")
            logger.warning("nixl READ from %s failed: %s: %s", agent_name, type(exc).__name__, exc)
            return False
        finally:
            if handle is not None:
                try:
                    agent.release_xfer_handle(handle)  # cancels a transfer still in flight
                except Exception as exc:
                    logger.warning("nixl: releasing a transfer handle failed: %s", exc)

    def close(self) -> None:
        """Forget peers, deregister the pool and destroy the agent now (its backend's
        teardown, a second or more with UCX, happens here rather than at interpreter exit,
        where it would delay the process's end). Idempotent."""
        if self._closed:
            return
        self._closed = True
        for peer in list(self._peers):
            self.forget(peer)
        for _, _, reg in self._extra:
            try:
                self.agent.deregister_memory(reg, [self.backend])
            except Exception as exc:
                logger.warning("nixl deregister_memory failed: %s", exc)
        self._extra.clear()
        try:
            self.agent.deregister_memory(self.registration, [self.backend])
        except Exception as exc:
            logger.warning("nixl deregister_memory failed: %s", exc)
        self.registration = None
        self.agent = None  # the last reference: the agent and its backend are destroyed here
