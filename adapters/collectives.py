"""Collective groups (the :class:`~kvferry.core.ports.CollectiveGroup` port) and a data-only
object codec (SPEC 6, 3.2).

- :class:`InProcessWorld` / :class:`InProcessGroup`: threads are ranks; real blocking
  semantics (a sender waits until its receivers took the message, like gloo); a peer that
  never arrives raises :class:`~kvferry.core.errors.TransferTimeout` at the deadline.
- :class:`TorchDistGroup`: torch.distributed (gloo on CPU, NCCL when the group's backend is
  NCCL). Objects move in two phases: their size as an int64 tensor, then their bytes as a
  uint8 tensor. ``src``/``dst`` are group-local; they are translated to the global ranks
  torch.distributed expects. Timeouts use the async work handle's ``wait(timeout)``. After a
  timeout the torch group may hold a pending operation: treat it as broken.
- objects travel through :mod:`kvferry.adapters.object_codec` (msgpack, never pickle;
  plain data and tensors only), re-exported here.
- :func:`build_parallel_groups`: TP / SP / CFG sub-groups from a
  :class:`~kvferry.core.roles.GroupLayout`
  (``world_rank = ((cfg_rank * sp_size) + sp_rank) * tp_size + tp_rank``).

Both implementations pass the same contract suite (``tests/contract/test_collective_contract.py``).
"""

from __future__ import annotations

import datetime
import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import attrs

from kvferry.adapters.object_codec import MAX_OBJECT_BYTES, decode_object, encode_object
from kvferry.core.errors import ConfigError, PayloadError, RoutingError, TransferError, TransferTimeout
from kvferry.core.roles import GroupLayout
from kvferry.core.validate import check_int, check_seconds

__all__ = [
    "MAX_OBJECT_BYTES",
    "encode_object",
    "decode_object",
    "InProcessWorld",
    "InProcessGroup",
    "TorchDistGroup",
    "ParallelGroups",
    "build_parallel_groups",
]

logger = logging.getLogger(__name__)

_FAILED = -1  # size sentinel: the source could not encode its object


def _check_peer(name: str, peer: Any, size: int) -> int:
    if isinstance(peer, bool) or not isinstance(peer, int) or not 0 <= peer < size:
        raise RoutingError(f"{name} must be a rank of the group (0..{size - 1}), got {peer!r}")
    return peer


def _check_size(size: Any) -> None:
    check_int("size", size, 1)


def _encode_or_failure(obj: Any) -> tuple[bytes | None, Exception | None]:
    """``(bytes, None)``, or ``(None, error)`` when ``obj`` cannot be sent: the caller still
    tells its peers (a failure sentinel) so that no rank waits for a message that never comes."""
    try:
        data = encode_object(obj)
    except ConfigError as exc:
        return None, exc
    if len(data) > MAX_OBJECT_BYTES:
        return None, ConfigError(f"object of {len(data)} bytes exceeds MAX_OBJECT_BYTES")
    return data, None


def _source_failed(src: int) -> TransferError:
    return TransferError(f"group rank {src} could not encode its object (it raised locally)")


def _check_timeout(timeout_s: Any) -> float:
    return check_seconds("timeout_s", timeout_s)


def _torch() -> Any:
    import torch

    return torch


# ---------------------------------------------------------------------------------------------
# in-process group (threads are ranks)


@attrs.define(eq=False)
class _Slot:
    value: Any = None
    present: bool = False
    takers_left: int = 0


@attrs.define(eq=False)
class InProcessWorld:
    """A world of ``size`` ranks living in one process; hand each thread its own handle.

    ``group(rank)`` is the world group's handle for ``rank``; ``new_group(ranks, rank)`` a
    sub-group's handle (None when ``rank`` is not a member). As with torch.distributed, group
    ranks follow the sorted world ranks, and the k-th ``new_group`` call with the same ranks on
    different members yields the same group (non-members need not call).
    """

    size: int = attrs.field(validator=lambda i, a, v: _check_size(v))
    _cond: threading.Condition = attrs.field(factory=threading.Condition, init=False)
    _slots: dict[tuple, _Slot] = attrs.field(factory=dict, init=False)
    _created: dict[tuple, int] = attrs.field(factory=dict, init=False)

    def group(self, rank: int) -> InProcessGroup:
        _check_peer("rank", rank, self.size)
        return InProcessGroup(self, ("world",), tuple(range(self.size)), rank)

    def new_group(self, ranks: Sequence[int], world_rank: int) -> InProcessGroup | None:
        members = tuple(sorted(ranks))  # group rank = index in sorted ranks, as in torch
        if not members or len(set(members)) != len(members):
            raise RoutingError(f"group ranks must be distinct and non-empty, got {members!r}")
        for r in members:
            _check_peer("group rank", r, self.size)
        if world_rank not in members:
            return None
        with self._cond:
            nth = self._created.get((members, world_rank), 0)
            self._created[(members, world_rank)] = nth + 1
        return InProcessGroup(self, ("sub", members, nth), members, members.index(world_rank))

    def _put(self, key: tuple, value: Any, takers: int, deadline: float, what: str) -> None:
        with self._cond:
            slot = self._slots.setdefault(key, _Slot())
            slot.value, slot.present, slot.takers_left = value, True, takers
            self._cond.notify_all()
            if not self._cond.wait_for(lambda: slot.takers_left == 0, _remaining(deadline)):
                slot.value, slot.present = None, False  # late receivers time out too
                raise TransferTimeout(f"{what}: peers did not arrive before the deadline")
            self._slots.pop(key, None)

    def _take(self, key: tuple, deadline: float, what: str) -> Any:
        with self._cond:
            slot = self._slots.setdefault(key, _Slot())
            if not self._cond.wait_for(lambda: slot.present, _remaining(deadline)):
                raise TransferTimeout(f"{what}: the source did not arrive before the deadline")
            slot.takers_left -= 1
            self._cond.notify_all()
            return slot.value


def _remaining(deadline: float) -> float:
    return max(0.0, deadline - time.monotonic())


@attrs.define(eq=False)
class InProcessGroup:
    """One rank's handle on an in-process group. Use it from one thread only."""

    _world: InProcessWorld
    _gid: tuple
    ranks: tuple[int, ...]
    _rank: int
    _seq: int = attrs.field(default=0, init=False)
    _p2p: dict[tuple[str, int], int] = attrs.field(factory=dict, init=False)

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def size(self) -> int:
        return len(self.ranks)

    def _bcast(self, value: Any, src: int, timeout_s: float, what: str) -> Any:
        _check_peer("src", src, self.size)
        deadline = time.monotonic() + _check_timeout(timeout_s)
        self._seq += 1
        key = (self._gid, "bcast", self._seq)
        what = f"{what} (group rank {self._rank}, src {src})"
        if self._rank == src:
            self._world._put(key, value, self.size - 1, deadline, what)
            return None
        return self._world._take(key, deadline, what)

    def _next(self, direction: str, peer: int) -> int:
        n = self._p2p.get((direction, peer), 0) + 1
        self._p2p[(direction, peer)] = n
        return n

    def _send(self, value: Any, dst: int, timeout_s: float, what: str) -> None:
        _check_peer("dst", dst, self.size)
        deadline = time.monotonic() + _check_timeout(timeout_s)
        key = (self._gid, "p2p", self._rank, dst, self._next("send", dst))
        self._world._put(key, value, 1, deadline, f"{what} (group rank {self._rank} -> {dst})")

    def _recv(self, src: int, timeout_s: float, what: str) -> Any:
        _check_peer("src", src, self.size)
        deadline = time.monotonic() + _check_timeout(timeout_s)
        key = (self._gid, "p2p", src, self._rank, self._next("recv", src))
        return self._world._take(key, deadline, f"{what} (group rank {self._rank} <- {src})")

    def broadcast_object(self, obj: Any, src: int, *, timeout_s: float) -> Any:
        data, error = _encode_or_failure(obj) if self._rank == src else (None, None)
        got = self._bcast(data, src, timeout_s, "broadcast_object")
        if error is not None:
            raise error
        if self._rank == src:
            return obj
        if got is None:
            raise _source_failed(src)
        return decode_object(got)

    def broadcast_tensor(self, tensor: Any, src: int, *, timeout_s: float) -> Any:
        got = self._bcast(tensor.detach().clone() if self._rank == src else None, src, timeout_s, "broadcast_tensor")
        return tensor if self._rank == src else _fill(tensor, got)

    def send_object(self, obj: Any, dst: int, *, timeout_s: float) -> None:
        data, error = _encode_or_failure(obj)
        self._send(data, dst, timeout_s, "send_object")
        if error is not None:
            raise error

    def recv_object(self, src: int, *, timeout_s: float) -> Any:
        got = self._recv(src, timeout_s, "recv_object")
        if got is None:
            raise _source_failed(src)
        return decode_object(got)

    def send_tensor(self, tensor: Any, dst: int, *, timeout_s: float) -> None:
        self._send(tensor.detach().clone(), dst, timeout_s, "send_tensor")

    def recv_tensor(self, tensor: Any, src: int, *, timeout_s: float) -> Any:
        return _fill(tensor, self._recv(src, timeout_s, "recv_tensor"))


def _fill(dest: Any, value: Any) -> Any:
    if dest.shape != value.shape or dest.dtype != value.dtype:
        raise TransferError(
            f"tensor mismatch: expected {dest.dtype}{list(dest.shape)}, got {value.dtype}{list(value.shape)}"
        )
    dest.copy_(value)
    return dest


# ---------------------------------------------------------------------------------------------
# torch.distributed group


def _rank_tuple(ranks: Iterable[int]) -> tuple[int, ...]:
    return tuple(ranks)


@attrs.define(eq=False)
class TorchDistGroup:
    """A torch.distributed process group (None: the default world group) as a CollectiveGroup.

    ``ranks`` are the group's global ranks in group-rank order (read from torch when omitted).
    Staging tensors live on the current CUDA device when the backend is NCCL, else on CPU.
    """

    process_group: Any = None
    ranks: tuple[int, ...] = attrs.field(default=(), converter=_rank_tuple)
    _device: Any = attrs.field(default=None, init=False)

    def __attrs_post_init__(self) -> None:
        dist = _dist()
        if not dist.is_initialized():
            raise ConfigError("torch.distributed is not initialised; call init_process_group first")
        if not self.ranks:
            pg = self.process_group if self.process_group is not None else dist.group.WORLD
            self.ranks = tuple(dist.get_process_group_ranks(pg))
        torch = _torch()
        nccl = "nccl" in str(dist.get_backend(self.process_group)).lower() and torch.cuda.is_available()
        self._device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")

    @classmethod
    def new(
        cls, ranks: Sequence[int], *, timeout_s: float | None = None, backend: str | None = None
    ) -> TorchDistGroup | None:
        """Create a sub-group. Like ``dist.new_group``, EVERY process must call this, in the same
        order, with the same ranks; returns None on processes outside the group."""
        dist = _dist()
        members = sorted(int(r) for r in ranks)
        kwargs: dict[str, Any] = {"ranks": members, "backend": backend}
        if timeout_s is not None:
            kwargs["timeout"] = datetime.timedelta(seconds=_check_timeout(timeout_s))
        pg = dist.new_group(**kwargs)
        if dist.get_rank() not in members:
            return None
        return cls(pg, tuple(members))

    @property
    def rank(self) -> int:
        return _dist().get_rank(group=self.process_group)

    @property
    def size(self) -> int:
        return len(self.ranks)

    def _global(self, name: str, peer: int) -> int:
        return self.ranks[_check_peer(name, peer, self.size)]

    def _wait(self, work: Any, deadline: float, what: str) -> None:
        left = deadline - time.monotonic()
        try:
            work.wait(timeout=datetime.timedelta(seconds=max(left, 0.001)))
        except RuntimeError as exc:
            text = str(exc)
            if "timed out" in text.lower() or "timeout" in text.lower():
                logger.debug("%s: peer did not arrive before the deadline: %s", what, text)
                raise TransferTimeout(f"{what} timed out (group rank {self.rank}): {text}") from exc
            raise TransferError(f"{what} failed (group rank {self.rank}): {text}") from exc

    def _size_tensor(self, n: int) -> Any:
        torch = _torch()
        return torch.tensor([n], dtype=torch.int64, device=self._device)

    def _bytes_tensor(self, data: bytes | None, n: int) -> Any:
        torch = _torch()
        if data is None:
            return torch.empty(n, dtype=torch.uint8, device=self._device)
        return torch.frombuffer(bytearray(data), dtype=torch.uint8).to(self._device)

    def _received_size(self, size: Any, src: int) -> int:
        n = int(size.item())
        if n == _FAILED:
            raise _source_failed(src)
        if not 0 < n <= MAX_OBJECT_BYTES:
            raise PayloadError(f"invalid object size {n} from group rank {src}")
        return n

    def broadcast_object(self, obj: Any, src: int, *, timeout_s: float) -> Any:
        dist, g_src = _dist(), self._global("src", src)
        deadline = time.monotonic() + _check_timeout(timeout_s)
        is_src = self.rank == src
        data, error = _encode_or_failure(obj) if is_src else (None, None)
        size = self._size_tensor(len(data) if data is not None else _FAILED)
        self._wait(
            dist.broadcast(size, src=g_src, group=self.process_group, async_op=True), deadline, "broadcast_object size"
        )
        if is_src:
            if error is not None:
                raise error
            buf = self._bytes_tensor(data, 0)
        else:
            buf = self._bytes_tensor(None, self._received_size(size, src))
        self._wait(
            dist.broadcast(buf, src=g_src, group=self.process_group, async_op=True), deadline, "broadcast_object data"
        )
        return obj if is_src else decode_object(buf.cpu().numpy().tobytes())

    def send_object(self, obj: Any, dst: int, *, timeout_s: float) -> None:
        dist, g_dst = _dist(), self._global("dst", dst)
        deadline = time.monotonic() + _check_timeout(timeout_s)
        data, error = _encode_or_failure(obj)
        size = self._size_tensor(len(data) if data is not None else _FAILED)
        self._wait(dist.isend(size, dst=g_dst, group=self.process_group), deadline, "send_object size")
        if error is not None:
            raise error
        self._wait(
            dist.isend(self._bytes_tensor(data, 0), dst=g_dst, group=self.process_group), deadline, "send_object data"
        )

    def recv_object(self, src: int, *, timeout_s: float) -> Any:
        dist, g_src = _dist(), self._global("src", src)
        deadline = time.monotonic() + _check_timeout(timeout_s)
        size = self._size_tensor(0)
        self._wait(dist.irecv(size, src=g_src, group=self.process_group), deadline, "recv_object size")
        buf = self._bytes_tensor(None, self._received_size(size, src))
        self._wait(dist.irecv(buf, src=g_src, group=self.process_group), deadline, "recv_object data")
        return decode_object(buf.cpu().numpy().tobytes())

    def broadcast_tensor(self, tensor: Any, src: int, *, timeout_s: float) -> Any:
        deadline = time.monotonic() + _check_timeout(timeout_s)
        work = _dist().broadcast(tensor, src=self._global("src", src), group=self.process_group, async_op=True)
        self._wait(work, deadline, "broadcast_tensor")
        return tensor

    def send_tensor(self, tensor: Any, dst: int, *, timeout_s: float) -> None:
        deadline = time.monotonic() + _check_timeout(timeout_s)
        work = _dist().isend(tensor.contiguous(), dst=self._global("dst", dst), group=self.process_group)
        self._wait(work, deadline, "send_tensor")

    def recv_tensor(self, tensor: Any, src: int, *, timeout_s: float) -> Any:
        deadline = time.monotonic() + _check_timeout(timeout_s)
        work = _dist().irecv(tensor, src=self._global("src", src), group=self.process_group)
        self._wait(work, deadline, "recv_tensor")
        return tensor


def _dist() -> Any:
    import torch.distributed as dist

    return dist


# ---------------------------------------------------------------------------------------------
# sub-groups from a layout


@attrs.define(eq=False)
class ParallelGroups:
    """One rank's world, TP, SP and CFG groups (None when torch did not make it a member)."""

    layout: GroupLayout
    world_rank: int
    world: Any
    tp: Any
    sp: Any
    cfg: Any


def build_parallel_groups(
    layout: GroupLayout, world_rank: int, world: Any, new_group: Callable[[tuple[int, ...]], Any]
) -> ParallelGroups:
    """Build every TP, SP and CFG group of ``layout`` in :meth:`GroupLayout.all_groups` order
    (every process must call this: torch creates groups collectively) and keep this rank's.

    ``new_group(ranks)`` makes one group (None for non-members), e.g.
    ``TorchDistGroup.new`` or ``lambda r: in_process_world.new_group(r, world_rank)``.
    ``world`` is the world group handle; its size must equal ``layout.world_size``.
    """
    if world.size != layout.world_size:
        raise ConfigError(f"world size {world.size} does not match the layout's {layout.world_size}")
    mine: dict[str, Any] = {}
    for kind in ("tp", "sp", "cfg"):
        for ranks in layout.all_groups(kind):
            group = new_group(ranks)
            if world_rank in ranks:
                mine[kind] = group
    return ParallelGroups(layout, world_rank, world, mine["tp"], mine["sp"], mine["cfg"])
