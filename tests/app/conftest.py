"""Fixtures for the manager's behaviour tests: everything injected, nothing monkeypatched.

- :class:`FakeTime`: an injected clock (``monotonic``) and sleep (``sleep`` advances the clock
  and records each delay). Thread-safe, so a prefetch worker may sleep on it too.
- :class:`PagedModel`: a synthetic full-head paged KV cache; ``rank_cache`` gives one sender
  rank's head shard in any SPEC 4 layout, ``expected`` the tensors a receiver rank must get.
- :class:`SpyConnector` / :class:`BlockingSpyConnector`: wrap a real connector and record every
  call. The plain spy offers the base Connector protocol plus FramesPut (the manager polls
  ``get`` and sends frames); the blocking one also forwards ``get_blocking`` and ``reserve``. Knobs:
  scripted put results, hidden keys, a gate that holds a key's get, an exception on get.
- ``make_sender`` / ``make_receiver``: typed managers wired to a connector and a FakeTime.
- ``check_kv``: an applied KV cache is exactly a receiver rank's share of a :class:`PagedModel`.
- ``closing``: a fixture; managers handed to it are closed after the test.
- ``rank_kwargs``: a stage rank's manager arguments (TP rank/size, groups, clock, sleep).
- ``run_ranks``: run one function per rank of an :class:`InProcessWorld` on threads, with each
  rank's :class:`StageGroups`; bounded joins, exceptions re-raised in the test thread.

Test modules reach the helper classes and functions through the ``kit`` fixture (importing
``conftest`` by name is ambiguous when several test directories have one).
"""

from __future__ import annotations

import threading
import types
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pytest
import torch

from kvferry.adapters.collectives import InProcessWorld, build_parallel_groups
from kvferry.app.manager import KVTransferManager, StageGroups
from kvferry.app.registry import create_connector
from kvferry.core.config import TransferConfig
from kvferry.core.roles import GroupLayout

LAYOUTS = ("kv_dim0", "kv_dim1", "packed", "tuple")
#: The layout name (``kv_layout``) each test layout is sent with: ``packed`` must be named, its
#: shape is also vLLM CPU's; the others are named too, as an engine would.
LAYOUT_NAMES = {"kv_dim0": "flash", "kv_dim1": "flashinfer", "packed": "packed", "tuple": "tuple"}
#: (from_tp, to_tp) pairs the receive tests cover (SPEC 2.1: equal, fan-out, fan-in).
TOPOLOGIES = ((1, 1), (1, 2), (2, 4), (4, 2), (2, 1), (4, 8))
THREAD_JOIN_S = 20.0


# ------------------------------------------------------------------------------------- time
class FakeTime:
    """Injected monotonic clock (seconds) whose ``sleep`` advances it and records the delay."""

    def __init__(self, start: float = 1000.0) -> None:
        self._now = start
        self.start = start
        self.sleeps: list[float] = []
        self._lock = threading.Lock()

    def monotonic(self) -> float:
        with self._lock:
            return self._now

    def sleep(self, seconds: float) -> None:
        with self._lock:
            self.sleeps.append(seconds)
            self._now += seconds

    def advance(self, seconds: float) -> None:
        with self._lock:
            self._now += seconds

    @property
    def elapsed(self) -> float:
        return self.monotonic() - self.start


@pytest.fixture
def fake_time() -> FakeTime:
    return FakeTime()


# ---------------------------------------------------------------------------------- KV cache
class PagedModel:
    """A full-head paged KV cache: per layer key/value blocks ``[num_blocks, block_size, heads,
    head_dim]``. Sender rank ``r`` of a TP group of ``tp`` holds heads ``[r*h/tp, (r+1)*h/tp)``."""

    def __init__(
        self,
        *,
        num_layers: int = 3,
        num_blocks: int = 12,
        block_size: int = 4,
        heads: int = 8,
        head_dim: int = 4,
        dtype: torch.dtype = torch.float32,
        seed: int = 0,
    ) -> None:
        gen = torch.Generator().manual_seed(seed)
        shape = (num_blocks, block_size, heads, head_dim)

        def fresh() -> torch.Tensor:
            if dtype.is_floating_point:
                return torch.randn(shape, generator=gen).to(dtype)
            return torch.randint(-100, 100, shape, generator=gen).to(dtype)

        self.keys = [fresh() for _ in range(num_layers)]
        self.values = [fresh() for _ in range(num_layers)]
        self.num_layers, self.num_blocks, self.block_size = num_layers, num_blocks, block_size
        self.heads, self.head_dim, self.dtype = heads, head_dim, dtype

    def heads_of(self, rank: int, tp: int) -> tuple[int, int]:
        per = self.heads // tp
        return rank * per, (rank + 1) * per

    def rank_cache(self, rank: int = 0, tp: int = 1, layout: str = "kv_dim0") -> list[Any]:
        """Sender rank ``rank``'s cache, one entry per layer, in ``layout`` (see LAYOUTS)."""
        lo, hi = self.heads_of(rank, tp)
        out: list[Any] = []
        for k, v in zip(self.keys, self.values):
            k, v = k[:, :, lo:hi].contiguous(), v[:, :, lo:hi].contiguous()
            if layout == "kv_dim0":
                out.append(torch.stack([k, v]))
            elif layout == "kv_dim1":
                out.append(torch.stack([k, v], dim=1))
            elif layout == "packed":  # [blocks, heads, block_size, 2*head_dim]
                out.append(torch.cat([k, v], dim=-1).transpose(1, 2).contiguous())
            elif layout == "tuple":
                out.append((k, v))
            else:
                raise ValueError(layout)
        return out

    def expected(
        self, block_ids: Sequence[int], seq_len: int, rank: int = 0, tp: int = 1
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The ``[tokens, heads/tp, head_dim]`` tensors receiver rank ``rank`` of ``tp`` owns."""
        lo, hi = self.heads_of(rank, tp)
        ids = [b for b in block_ids if 0 <= b < self.num_blocks]

        def pick(t: torch.Tensor) -> torch.Tensor:
            return t[ids].reshape(-1, self.heads, self.head_dim)[:seq_len, lo:hi]

        return [pick(k) for k in self.keys], [pick(v) for v in self.values]


def bits_equal(a: Any, b: Any) -> bool:
    """Same dtype, shape and bytes (NaN-safe, -0.0-safe)."""
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
        return False
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))
    )


def check_kv(kv: Any, model: PagedModel, spec: dict[str, Any], rank: int, tp: int) -> None:
    """``kv`` (an applied ``KVCache``) holds exactly what receiver rank ``rank`` of ``tp`` must
    get of ``model``'s request ``spec`` (``block_ids``, ``seq_len``), bit for bit."""
    keys, values = model.expected(spec["block_ids"], spec["seq_len"], rank, tp)
    assert kv is not None and len(kv.key_cache) == len(keys)
    assert all(bits_equal(a, b) for a, b in zip(kv.key_cache, keys))
    assert all(bits_equal(a, b) for a, b in zip(kv.value_cache, values))


def assert_kv_equal(payload: dict[str, Any], keys: list[torch.Tensor], values: list[torch.Tensor]) -> None:
    blocks = payload["layer_blocks"]
    assert len(blocks["key_cache"]) == len(keys) and len(blocks["value_cache"]) == len(values)
    for i, (got, want) in enumerate(zip(blocks["key_cache"], keys)):
        assert bits_equal(got, want), f"key layer {i} differs"
    for i, (got, want) in enumerate(zip(blocks["value_cache"], values)):
        assert bits_equal(got, want), f"value layer {i} differs"


@pytest.fixture
def paged_model() -> Callable[..., PagedModel]:
    """Factory: ``paged_model(**geometry) -> PagedModel``."""
    return PagedModel


# -------------------------------------------------------------------------------- requests
def make_request(
    request_id: Any = "req-1", *, sender_info: Any = None, sampling_params: bool = True, cfg_kv_request_ids: Any = None
) -> types.SimpleNamespace:
    """A duck-typed engine request (and its sampling params)."""
    req = types.SimpleNamespace(request_id=request_id, past_key_values=None, kv_metadata=None)
    if sender_info is not None:
        req.kv_sender_info = sender_info
    if sampling_params:
        req.sampling_params = types.SimpleNamespace(
            past_key_values=None, kv_metadata=None, cfg_kv_request_ids=cfg_kv_request_ids
        )
    return req


@pytest.fixture
def fake_request() -> Callable[..., types.SimpleNamespace]:
    return make_request


# ------------------------------------------------------------------------------- connectors
class SpyConnector:
    """The base Connector protocol over ``inner``, recording calls (no blocking get, no reserve).

    ``put_script``: results returned by the next puts instead of storing (consumed in order);
    ``hidden``: keys whose gets return None; ``get_error``: raised by every get;
    ``gates``: key -> Event a get of that key waits on (bounded) before reading.
    """

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.puts: list[tuple[str, Any]] = []
        self.gets: list[tuple[str, Any, str]] = []  # (key, metadata, thread name)
        self.put_script: list[Any] = []
        self.hidden: set[str] = set()
        self.get_error: Exception | None = None
        self.gates: dict[str, threading.Event] = {}
        self.entered: dict[str, threading.Event] = {}
        self.sender_updates: list[tuple[str, int]] = []
        self._lock = threading.Lock()

    def _record_get(self, key: str, metadata: Any) -> Any:
        with self._lock:
            self.gets.append((key, metadata, threading.current_thread().name))
            entered = self.entered.setdefault(key, threading.Event())
        entered.set()
        gate = self.gates.get(key)
        if gate is not None:
            assert gate.wait(THREAD_JOIN_S), f"gate for {key} never opened"
        if self.get_error is not None:
            raise self.get_error
        return None if key in self.hidden else True

    def put(self, from_stage: Any, to_stage: Any, put_key: str, data: Any) -> Any:
        with self._lock:
            self.puts.append((put_key, data))
            scripted = self.put_script.pop(0) if self.put_script else None
        if scripted is not None:
            return scripted
        return self.inner.put(from_stage=from_stage, to_stage=to_stage, put_key=put_key, data=data)

    def put_frames(self, from_stage: Any, to_stage: Any, put_key: str, frames: Any) -> Any:
        """The FramesPut ability of kvferry's connectors (recorded like a put)."""
        with self._lock:
            self.puts.append((put_key, frames))
            scripted = self.put_script.pop(0) if self.put_script else None
        if scripted is not None:
            return scripted
        return self.inner.put_frames(from_stage, to_stage, put_key, frames)

    def get(self, from_stage: Any, to_stage: Any, get_key: str, metadata: Any = None) -> Any:
        if self._record_get(get_key, metadata) is None:
            return None
        return self.inner.get(from_stage=from_stage, to_stage=to_stage, get_key=get_key, metadata=metadata)

    def cleanup(self, request_id: str) -> None:
        self.inner.cleanup(request_id)

    def health(self) -> dict[str, Any]:
        return self.inner.health()

    def close(self) -> None:
        self.inner.close()

    @property
    def get_keys(self) -> list[str]:
        return [k for k, _, _ in self.gets]

    def hold(self, key: str) -> tuple[threading.Event, threading.Event]:
        """Hold the gets of ``key`` on a gate: ``(gate, entered)``; ``entered`` is set once a
        get of it waits on the gate, ``gate.set()`` lets it go on."""
        gate = self.gates[key] = threading.Event()
        entered = self.entered[key] = threading.Event()
        return gate, entered


class BlockingSpyConnector(SpyConnector):
    """:class:`SpyConnector` that also forwards the optional BlockingGet and Reservable abilities."""

    def get_blocking(
        self, from_stage: Any, to_stage: Any, get_key: str, metadata: Any = None, *, timeout_s: float
    ) -> Any:
        if self._record_get(get_key, metadata) is None:
            return None
        return self.inner.get_blocking(from_stage, to_stage, get_key, metadata, timeout_s=timeout_s)

    def reserve(self, from_stage: Any, to_stage: Any, put_key: str, nbytes: int) -> Any:
        with self._lock:
            self.puts.append((put_key, nbytes))
        return self.inner.reserve(from_stage, to_stage, put_key, nbytes)


class SenderAwareSpy(SpyConnector):
    """A spy that can be told its default sender (the SenderAware ability)."""

    def update_sender_info(self, host: str, port: int) -> None:
        self.sender_updates.append((host, port))


def pool_is_empty(connector: Any) -> bool:
    """True when the memory connector holds no payload, reservation or unreleased buffer."""
    h = connector.health()
    return h["used_bytes"] == 0 and h["live_regions"] == 0 and h["reserved"] == 0 and h["entries"] == 0


@pytest.fixture
def memory_connector() -> Iterator[Any]:
    """An in-memory connector (pool of 8 MiB) from the registry; closed after the test."""
    conn = create_connector({"type": "memory", "pool_bytes": 8 << 20})
    yield conn
    conn.close()


@pytest.fixture
def memory_connector_factory() -> Iterator[Callable[..., Any]]:
    """Factory: ``memory_connector_factory(**config)``; every connector is closed after the test."""
    made: list[Any] = []

    def make(**config: Any) -> Any:
        conn = create_connector({"type": "memory", "pool_bytes": 8 << 20, **config})
        made.append(conn)
        return conn

    yield make
    for conn in made:
        conn.close()


# --------------------------------------------------------------------------------- managers
def sender_config(from_tp: int = 1, to_tp: int = 1, **overrides: Any) -> TransferConfig:
    fields: dict[str, Any] = dict(
        connector_config={"type": "memory"},
        from_stage=0,
        to_stage=1,
        need_send_cache=True,
        from_tp=from_tp,
        to_tp=to_tp,
    )
    fields.update(overrides)
    return TransferConfig(**fields)


def receiver_config(from_tp: int = 1, to_tp: int = 1, **overrides: Any) -> TransferConfig:
    fields: dict[str, Any] = dict(
        connector_config={"type": "memory"},
        from_stage=0,
        to_stage=1,
        stage_id=1,
        need_recv_cache=True,
        from_tp=from_tp,
        to_tp=to_tp,
        recv_timeout=5.0,
    )
    fields.update(overrides)
    return TransferConfig(**fields)


@pytest.fixture
def make_sender(fake_time: FakeTime) -> Callable[..., KVTransferManager]:
    """``make_sender(connector, from_tp=1, to_tp=1, rank=0, config=None, **manager_kwargs)``."""

    def make(
        connector: Any = None,
        from_tp: int = 1,
        to_tp: int = 1,
        rank: int = 0,
        config: TransferConfig | None = None,
        **kwargs: Any,
    ) -> KVTransferManager:
        kwargs.setdefault("clock", fake_time)
        kwargs.setdefault("sleep", fake_time.sleep)
        return KVTransferManager(
            config or sender_config(from_tp, to_tp), tp_rank=rank, tp_size=from_tp, connector=connector, **kwargs
        )

    return make


@pytest.fixture
def make_receiver(fake_time: FakeTime) -> Callable[..., KVTransferManager]:
    """``make_receiver(connector, from_tp=1, to_tp=1, rank=0, config=None, **manager_kwargs)``."""

    def make(
        connector: Any = None,
        from_tp: int = 1,
        to_tp: int = 1,
        rank: int = 0,
        config: TransferConfig | None = None,
        **kwargs: Any,
    ) -> KVTransferManager:
        kwargs.setdefault("clock", fake_time)
        kwargs.setdefault("sleep", fake_time.sleep)
        return KVTransferManager(
            config or receiver_config(from_tp, to_tp), tp_rank=rank, tp_size=to_tp, connector=connector, **kwargs
        )

    return make


def send_all(
    model: PagedModel,
    connector: Any,
    from_tp: int,
    to_tp: int,
    requests: dict[str, dict],
    layout: str = "kv_dim0",
    fake: FakeTime | None = None,
) -> list[Any]:
    """Every sender rank sends ``requests`` through ``connector``; returns all outcomes."""
    fake = fake or FakeTime()
    outcomes: list[Any] = []
    for rank in range(from_tp):
        m = KVTransferManager(
            sender_config(from_tp, to_tp, kv_layout=LAYOUT_NAMES[layout]),
            tp_rank=rank,
            tp_size=from_tp,
            connector=connector,
            clock=fake,
            sleep=fake.sleep,
        )
        outcomes += m.send_requests(requests, model.rank_cache(rank, from_tp, layout), model.block_size, "float32")
    return outcomes


@pytest.fixture
def closing() -> Iterator[Callable[[Any], Any]]:
    """``closing(manager) -> manager``: every manager handed to it is closed after the test."""
    made: list[Any] = []

    def keep(manager: Any) -> Any:
        made.append(manager)
        return manager

    yield keep
    for m in made:
        m.close()


# ------------------------------------------------------------------------------- collectives
def rank_kwargs(groups: StageGroups, fake: FakeTime) -> dict[str, Any]:
    """A stage rank's manager arguments: its TP rank and size (0 of 1 without a TP group), its
    groups, and the injected clock and sleep."""
    tp = groups.tp
    return {
        "tp_rank": tp.rank if tp is not None else 0,
        "tp_size": tp.size if tp is not None else 1,
        "groups": groups,
        "clock": fake,
        "sleep": fake.sleep,
    }


def stage_groups(world: InProcessWorld, rank: int, layout: GroupLayout) -> StageGroups:
    """Rank ``rank``'s world/TP/SP/CFG groups of ``layout`` (TP fastest, then SP, then CFG)."""
    g = build_parallel_groups(layout, rank, world.group(rank), lambda ranks: world.new_group(ranks, rank))
    return StageGroups(world=g.world, tp=g.tp, cfg=g.cfg, sp=g.sp)


def run_ranks(layout: GroupLayout, fn: Callable[[int, StageGroups], Any], join_s: float = THREAD_JOIN_S) -> list[Any]:
    """Run ``fn(rank, groups)`` on one thread per rank of ``layout``; results in rank order.

    Groups are built up front (in-process group creation does not block). A rank that does not
    finish within ``join_s`` fails the test; the first exception of any rank is re-raised.
    """
    world = InProcessWorld(layout.world_size)
    groups = [stage_groups(world, r, layout) for r in range(layout.world_size)]
    results: list[Any] = [None] * layout.world_size
    errors: list[BaseException | None] = [None] * layout.world_size

    def main(rank: int) -> None:
        try:
            results[rank] = fn(rank, groups[rank])
        except BaseException as exc:  # handed to the test thread below
            errors[rank] = exc

    threads = [threading.Thread(target=main, args=(r,), name=f"rank{r}", daemon=True) for r in range(layout.world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(join_s)
    stuck = [t.name for t in threads if t.is_alive()]
    assert not stuck, f"ranks did not finish within {join_s} s: {stuck}"
    for exc in errors:
        if exc is not None:
            raise exc
    return results


@pytest.fixture
def in_process_world() -> Callable[..., list[Any]]:
    """``in_process_world(layout, fn) -> results``: see :func:`run_ranks`."""
    return run_ranks


@pytest.fixture
def kit() -> types.SimpleNamespace:
    """The helpers above, for test modules: ``kit.SpyConnector(inner)``, ``kit.make_request()``..."""
    return types.SimpleNamespace(
        FakeTime=FakeTime,
        PagedModel=PagedModel,
        SpyConnector=SpyConnector,
        BlockingSpyConnector=BlockingSpyConnector,
        SenderAwareSpy=SenderAwareSpy,
        bits_equal=bits_equal,
        assert_kv_equal=assert_kv_equal,
        check_kv=check_kv,
        rank_kwargs=rank_kwargs,
        make_request=make_request,
        pool_is_empty=pool_is_empty,
        sender_config=sender_config,
        receiver_config=receiver_config,
        send_all=send_all,
        stage_groups=stage_groups,
        run_ranks=run_ranks,
        LAYOUTS=LAYOUTS,
        TOPOLOGIES=TOPOLOGIES,
        LAYOUT_NAMES=LAYOUT_NAMES,
    )
