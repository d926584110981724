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

A read is bounded: its chunks go out as batches of their own and are polled until they end or
the read's limit passes (``transfer_timeout_s``, or less where the caller's deadline is nearer).
The engine cannot end a read it started, so a read still under way at its limit is handed to the
pool's late reads (:class:`LateReads`), polled until the engine ends it; only then is the local
space it writes into given back (the caller's ``ended``). Nor does the engine bound its first
submission to a peer (a metadata exchange with it): that one runs in a helper thread. The
engine's synchronous read, used before, had no deadline of its own: a sender host killed
mid-read once held a receiving rank (and its TP group, in the consensus) past its deadline.
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
from kvferry.core.recent import Recent
from kvferry.core.validate import check_int

__all__ = [
    "INSTALL_HINT",
    "unavailable_message",
    "load_engine_class",
    "start_engine",
    "shared_engine",
    "EnginePool",
    "LateReads",
    "poll_pause",
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
#: The most seconds one read may take before it is given up on (see :class:`LateReads`).
DEFAULT_TRANSFER_TIMEOUT_S = 10.0
#: What the engine's ``transfer_check_status`` says of a batch: still running, done (then freed).
#: -1 is failed (freed too); -2 the engine's own timeout, which it does not free (a batch id
#: lost, never polled again).
_RUNNING, _DONE = 0, 1
#: Peers a pool remembers as reached (the oldest forgotten first: its next read's start is bounded).
_PEERS_KEPT = 256
#: Pools closed with reads under way: kept allocated (and registered) until the process exits.
_KEPT: list[Any] = []


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


def poll_pause(spins: int) -> None:
    """Pause between two status checks of a transfer in flight: none for the first checks
    (small reads end within microseconds), then growing to 1 ms (large reads)."""
    if spins > 64:
        time.sleep(min(1e-3, 1e-5 * (spins - 64)))


def read_pause(elapsed_s: float) -> None:
    """Pause between two status checks of a mooncake read that has run ``elapsed_s``: none for
    its first 10 ms (the engine's own synchronous read spins as long as a read lasts, and a
    status check lets other threads run; a sleep here would end well after a read of a few
    megabytes did), then a sleep of a fiftieth of the time so far, at most 1 ms."""
    if elapsed_s >= 0.01:
        time.sleep(min(1e-3, elapsed_s / 50))


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
        """Read ``length`` bytes at ``remote_addr`` of ``peer`` into the pool at ``local_offset``
        (:meth:`read_spans` of one span); False on any remote fault (each pool says how)."""
        return self.read_spans(peer, [(local_offset, remote_addr, length)])

    def read_stats(self) -> dict[str, int]:
        """What a connector's ``health()`` reports of this pool's reads (none here)."""
        return {}

    def read_spans(
        self,
        peer: str,
        spans: Sequence[tuple[int, int, int]],
        within_s: float | None = None,
        ended: Callable[[], None] | None = None,
    ) -> bool:
        """Every ``(local_offset, remote_addr, length)`` span of ``peer``, all or nothing
        (False where one fails). ``within_s``: the most seconds the caller can wait for the
        read (a blocking get's deadline); the read returns False by then (or by the pool's own
        transfer deadline, whichever is nearer). Each pool reads with its engine.

        ``ended``, where the read fails: called once when the pool no longer writes into the
        spans' local bytes (the caller gives that space back there, never sooner): before this
        returns, or later, from the pool's own thread, for a read the engine could not end
        (mooncake: :class:`LateReads`). Never called after a read that succeeded."""
        raise NotImplementedError

    def check_span(self, local_offset: int, length: int) -> None:
        """ConfigError unless ``[local_offset, local_offset + length)`` lies inside the pool."""
        if local_offset < 0 or length < 0 or local_offset + length > self.pool_bytes:
            raise ConfigError(f"span [{local_offset}, +{length}) lies outside the pool")


@attrs.define(eq=False)
class _LateRead:
    """One read left under way: its batches not yet seen ended, the hook that gives its space
    back, and whether the engine is still starting it (its batches not known yet)."""

    batches: list[int]
    ended: Callable[[], None] | None
    starting: bool = False


@attrs.define(eq=False)
class LateReads:
    """Reads an engine could not end by their limit: their batches, polled by a thread of their
    own (started when the first comes, gone when none is left) until the engine ends each, then
    the read's ``ended`` called (its local space given back). A read the engine was still
    starting at its limit (:meth:`starting`) is polled once its start returns (:meth:`started`).
    ``in_flight`` of them now, ``abandoned`` and ``ended`` since the start: a pool's health."""

    engine: Any
    #: seconds between two polls of the late reads (they are rare; none of them is waited on)
    every_s: float = 0.005
    abandoned: int = 0
    ended: int = 0
    _reads: list[_LateRead] = attrs.field(init=False, factory=list)
    _lock: threading.Lock = attrs.field(init=False, factory=threading.Lock)
    _thread: threading.Thread | None = attrs.field(init=False, default=None)
    _stop: threading.Event = attrs.field(init=False, factory=threading.Event)

    @property
    def in_flight(self) -> int:
        with self._lock:
            return len(self._reads)

    def add(self, batches: list[int], ended: Callable[[], None] | None) -> None:
        """Poll ``batches`` (none polled to its end yet) until each has ended, then call ``ended``."""
        self._keep(_LateRead(list(batches), ended))

    def starting(self, ended: Callable[[], None] | None) -> _LateRead:
        """A read whose start (the engine's submission) has not returned: kept, not polled,
        until :meth:`started` gives its batches."""
        read = _LateRead([], ended, starting=True)
        self._keep(read)
        return read

    def started(self, read: _LateRead, batches: list[int]) -> None:
        """``read``'s start returned with ``batches`` (none: nothing to wait for)."""
        with self._lock:
            read.batches[:] = batches
            read.starting = False

    def _keep(self, read: _LateRead) -> None:
        with self._lock:
            self.abandoned += 1
            self._reads.append(read)
            if self._stop.is_set() or (self._thread is not None and self._thread.is_alive()):
                return
            self._thread = threading.Thread(target=self._run, name="kvferry-mooncake-late-reads", daemon=True)
            self._thread.start()

    def stop(self) -> int:
        """Stop polling; the reads still under way (their ``ended`` never called)."""
        self._stop.set()
        thread = self._thread
        if thread is not None:
            thread.join(timeout=10.0)
        with self._lock:
            return len(self._reads)

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            with self._lock:
                reads = [r for r in self._reads if not r.starting]
            done = []
            for read in reads:
                # a batch whose status is not "running" was freed by that check: never asked again
                read.batches[:] = [b for b in read.batches if self.engine.transfer_check_status(b) == _RUNNING]
                if read.batches:
                    continue
                done.append(read)
                if read.ended is not None:
                    try:
                        read.ended()
                    except Exception:  # a caller's hook: this thread must go on polling the others
                        logger.exception("mooncake: giving back the space of a late read failed")
            with self._lock:  # a read leaves the count once its space is back
                self._reads = [r for r in self._reads if all(r is not d for d in done)]
                self.ended += len(done)
                if not self._reads:  # add() starts a new thread once this one is gone
                    self._thread = None
                    return


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
    transfer_timeout_s: float = DEFAULT_TRANSFER_TIMEOUT_S
    _closed: bool = False
    #: reads started (each of one or more spans), and those still under way at their limit
    reads: int = attrs.field(init=False, default=0)
    late: LateReads = attrs.field(init=False)
    #: peers the engine started a read from without waiting (their connection made)
    _reached: Recent[str, bool] = attrs.field(init=False, factory=lambda: Recent(_PEERS_KEPT))
    _peers_lock: threading.Lock = attrs.field(init=False, factory=threading.Lock)

    def __attrs_post_init__(self) -> None:
        self.late = LateReads(self.engine)

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
        transfer_timeout_s: float = DEFAULT_TRANSFER_TIMEOUT_S,
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
        return cls(engine, tensor, host, protocol, int(engine.get_rpc_port()), chunk_bytes, transfer_timeout_s)

    def read_spans(
        self,
        peer: str,
        spans: Sequence[tuple[int, int, int]],
        within_s: float | None = None,
        ended: Callable[[], None] | None = None,
    ) -> bool:
        """:meth:`TensorPool.read_spans`: every chunk of every span a batch of its own, all
        submitted (by a helper thread, waited for until the limit, for a peer not read from
        since its last failed read: :meth:`_submit_within`), then polled until each ends or the
        limit (``transfer_timeout_s``, or ``within_s`` where less) passes. A chunk that fails
        ends the read at once. Chunks still under way then go to the late reads (the engine
        cannot end them), and ``ended`` is called when the last of them has ended."""
        for off, _, length in spans:
            self.check_span(off, length)
        base, chunk = self.base, self.chunk_bytes
        pieces = [(base + off + at, addr + at, n) for off, addr, length in spans for at, n in _chunks(length, chunk)]
        if not pieces:
            return True
        if self._closed:
            if ended is not None:
                ended()
            return False
        limit = self.transfer_timeout_s if within_s is None else min(self.transfer_timeout_s, max(within_s, 0.0))
        deadline = time.monotonic() + limit
        self.reads += 1
        if self._peer_reached(peer):
            pending, ok = self._submit(peer, pieces)
        else:  # the engine connects to a peer it has not read from in its first submission
            submitted = self._submit_within(peer, pieces, deadline, ended)
            if submitted is None:
                logger.warning(
                    "mooncake read from %s: the engine did not start it in %.1f s (the peer does not answer its "
                    "handshake; the read's space comes back when it does: health late_reads)",
                    peer,
                    limit,
                )
                return False
            pending, ok = submitted
        if ok:
            self._peer_reached(peer, True)
        engine, started = self.engine, time.monotonic()
        while pending and ok:
            still = []
            for batch in pending:
                state = engine.transfer_check_status(batch)  # a batch that ended is freed by it
                if state == _RUNNING:
                    still.append(batch)
                elif state != _DONE:
                    ok = False  # failed, or the engine's own timeout (not freed: see _DONE)
            pending = still
            if pending and time.monotonic() >= deadline:
                ok = False
                logger.warning(
                    "mooncake read from %s not done in %.1f s (the get's deadline, or transfer_timeout_s: raise it "
                    "for reads that need longer; the space comes back when the engine ends it: health late_reads)",
                    peer,
                    limit,
                )
                break
            read_pause(time.monotonic() - started)
        if ok:
            return True
        self._peer_reached(peer, False)  # its next read's start is bounded again
        if pending:
            self.late.add(pending, ended)
        elif ended is not None:
            ended()
        return False

    def _submit(self, peer: str, pieces: list[tuple[int, int, int]]) -> tuple[list[int], bool]:
        """Every ``(local address, remote address, length)`` a batch of its own: the batches
        started, and whether all were (the engine refuses one for an unknown or unreachable
        peer; the ones before it still run)."""
        batches: list[int] = []
        for local, remote, n in pieces:
            try:
                batch = self.engine.batch_transfer_async_read(peer, [local], [remote], [n])
            except (RuntimeError, ValueError, TypeError) as exc:  # engine binding errors
                logger.warning("mooncake read from %s raised %s", peer, exc)
                batch = 0
            if not batch:
                return batches, False
            batches.append(batch)
        return batches, True

    def _submit_within(
        self, peer: str, pieces: list[tuple[int, int, int]], deadline: float, ended: Callable[[], None] | None
    ) -> tuple[list[int], bool] | None:
        """:meth:`_submit` in a thread of its own, waited for until ``deadline``: the engine's
        first submission to a peer exchanges metadata with it and waits for a peer that does
        not answer (a frozen process) with no limit of its own. None when it has not returned
        by then: the read is the late reads' (polled once its submission returns)."""
        box: list[tuple[list[int], bool]] = []
        late: list[_LateRead] = []
        lock, returned = threading.Lock(), threading.Event()

        def run() -> None:
            result = self._submit(peer, pieces)
            with lock:
                box.append(result)
                read = late[0] if late else None
            returned.set()
            if read is not None:
                self.late.started(read, result[0])

        threading.Thread(target=run, name="kvferry-mooncake-submit", daemon=True).start()
        returned.wait(max(0.0, deadline - time.monotonic()))
        with lock:
            if box:
                return box[0]
            late.append(self.late.starting(ended))
        return None

    def _peer_reached(self, peer: str, reached: bool | None = None) -> bool:
        """Whether ``peer`` was reached (its reads start without waiting); with ``reached``,
        remember that first."""
        with self._peers_lock:
            if reached is True:
                self._reached.note(peer, True)
            elif reached is False:
                self._reached.pop(peer)
            return peer in self._reached

    def read_stats(self) -> dict[str, int]:
        """Reads started (``engine_reads``); those not ended by their limit and still polled
        until the engine ends them, their pool space given back then (``late_reads``), and
        since the start (``late_reads_abandoned``, ``late_reads_ended``)."""
        return {
            "engine_reads": self.reads,
            "late_reads": self.late.in_flight,
            "late_reads_abandoned": self.late.abandoned,
            "late_reads_ended": self.late.ended,
        }

    def write(self, peer: str, local_offset: int, remote_addr: int, length: int) -> bool:
        """Write ``length`` pool bytes at ``local_offset`` to ``remote_addr`` of ``peer``
        (the engine's synchronous batch write: the raw bench's limit, no deadline)."""
        if self._closed:
            return False
        self.check_span(local_offset, length)
        if length == 0:
            return True
        pieces = _chunks(length, self.chunk_bytes)
        local = [self.base + local_offset + off for off, _ in pieces]
        remotes = [remote_addr + off for off, _ in pieces]
        sizes = [size for _, size in pieces]
        try:
            rc = self.engine.batch_transfer_sync_write(peer, local, remotes, sizes)
        except (RuntimeError, ValueError, TypeError) as exc:  # engine binding errors
            logger.warning("mooncake transfer with %s raised %s", peer, exc)
            return False
        return rc == 0

    def close(self) -> None:
        """Unregister the pool. Idempotent. The engine object is dropped with the connector.
        A pool with reads still under way stays registered and allocated until the process
        exits (the engine may still write into it), said in a warning."""
        if self._closed:
            return
        self._closed = True
        left = self.late.stop()
        if left:
            logger.warning(
                "mooncake pool closed with %d reads still under way: its %d bytes stay registered "
                "and allocated until the process exits (the engine may still write into them)",
                left,
                self.pool_bytes,
            )
            _KEPT.append(self.tensor)
            return
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
