"""Scenarios of the collective-group contract, run on every rank of a world.

Each scenario is ``fn(ctx) -> JSON-able value`` and runs on all ranks at once (threads for the
in-process group, processes for gloo). ``ctx`` has ``rank``, ``size``, ``world`` (the world
group handle) and ``new_group(ranks)`` (collective: every rank calls it, in the same order;
None for non-members). :func:`run_scenario` wraps the result (or the exception) identically
for both runners, so the contract test asserts one thing for every implementation.
"""

from __future__ import annotations

import contextlib
import pickle
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from kvferry.adapters.collectives import build_parallel_groups
from kvferry.core.errors import KVFerryError
from kvferry.core.roles import GroupLayout

WORLD_SIZE = 4
OP_TIMEOUT_S = 20.0
#: Deadline of the "peer never arrives" scenarios, and the slack allowed on top of it.
SHORT_TIMEOUT_S = 0.5
TIMEOUT_SLACK_S = 2.0


class Ctx:
    def __init__(self, rank: int, size: int, world: Any, new_group: Callable[[tuple[int, ...]], Any]) -> None:
        self.rank, self.size, self.world, self.new_group = rank, size, world, new_group
        self.started: float | None = None

    def mark(self) -> None:
        """Start the clock here (after group creation): ``elapsed`` times only what follows."""
        self.started = time.monotonic()


class NotData:
    """An object the data-only codec must refuse (pickle would have taken it)."""


def _describe(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return {
            "tensor": str(value.dtype),
            "shape": list(value.shape),
            "values": value.to(torch.float64).reshape(-1).tolist(),
        }
    if isinstance(value, bytes):
        return {"bytes": value.hex()}
    if isinstance(value, tuple):
        return {"tuple": [_describe(v) for v in value]}
    if isinstance(value, list):
        return [_describe(v) for v in value]
    if isinstance(value, dict):
        return {"dict": [[_describe(k), _describe(v)] for k, v in value.items()]}
    return value


SAMPLE = {
    "roles": ("cfg_text", "cfg_img"),
    "nested": [1, -2, 3.5, None, True, "x", b"\x00\xff"],
    7: {"deep": ("a", ("b",))},
    "kv": torch.arange(12, dtype=torch.float32).reshape(3, 4),
    "half": torch.tensor([1.5, -2.0], dtype=torch.bfloat16),
    "empty": torch.empty(0, 8, dtype=torch.int64),
}
EXPECTED_SAMPLE = _describe(SAMPLE)


def broadcast_object(ctx: Ctx) -> Any:
    src = 1
    got = ctx.world.broadcast_object(SAMPLE if ctx.rank == src else None, src, timeout_s=OP_TIMEOUT_S)
    return _describe(got)


def broadcast_none_and_scalars(ctx: Ctx) -> Any:
    out = []
    for src, value in enumerate([None, 0, "", {"k": []}][: ctx.size]):
        got = ctx.world.broadcast_object(value if ctx.rank == src else "wrong", src, timeout_s=OP_TIMEOUT_S)
        out.append(_describe(got))
    return out


def broadcast_tensor(ctx: Ctx) -> Any:
    src = ctx.size - 1
    buf = (
        torch.arange(6, dtype=torch.int32).reshape(2, 3) * 7
        if ctx.rank == src
        else torch.zeros(2, 3, dtype=torch.int32)
    )
    got = ctx.world.broadcast_tensor(buf, src, timeout_s=OP_TIMEOUT_S)
    return {"same_object": got is buf, "value": _describe(got)}


def _pairs(ctx: Ctx, send: Callable[[int, int], None], recv: Callable[[int], Any]) -> Any:
    """Even ranks send to rank+1 then receive its answer; odd ranks do the mirror image."""
    peer = ctx.rank + 1 if ctx.rank % 2 == 0 else ctx.rank - 1
    if ctx.rank % 2 == 0:
        send(peer, ctx.rank)
        return recv(peer)
    got = recv(peer)
    send(peer, ctx.rank)
    return got


def p2p_object(ctx: Ctx) -> Any:
    def send(dst: int, me: int) -> None:
        ctx.world.send_object(
            {"from": me, "roles": ("a", me), "t": torch.full((2,), float(me))}, dst, timeout_s=OP_TIMEOUT_S
        )

    return _describe(_pairs(ctx, send, lambda src: ctx.world.recv_object(src, timeout_s=OP_TIMEOUT_S)))


def p2p_tensor(ctx: Ctx) -> Any:
    out = []
    for dtype in (torch.float32, torch.bfloat16, torch.int64, torch.uint8):

        def send(dst: int, me: int, dtype: torch.dtype = dtype) -> None:
            ctx.world.send_tensor((torch.arange(5) + 10 * me).to(dtype), dst, timeout_s=OP_TIMEOUT_S)

        def recv(src: int, dtype: torch.dtype = dtype) -> Any:
            buf = torch.zeros(5, dtype=dtype)
            got = ctx.world.recv_tensor(buf, src, timeout_s=OP_TIMEOUT_S)
            return {"same_object": got is buf, "value": _describe(got)}

        out.append(_pairs(ctx, send, recv))
    return out


def sub_groups(ctx: Ctx) -> Any:
    """TP groups {0,1},{2,3}; CFG groups {0,2},{1,3}: group-local ranks map to the right peers."""
    layout = GroupLayout(tp_size=2, sp_size=1, cfg_size=2)
    groups = build_parallel_groups(layout, ctx.rank, ctx.world, ctx.new_group)
    tp, cfg, sp = groups.tp, groups.cfg, groups.sp
    from_tp1 = tp.broadcast_object({"tp_src_world_rank": ctx.rank} if tp.rank == 1 else None, 1, timeout_s=OP_TIMEOUT_S)
    if cfg.rank == 1:
        cfg.send_object({"cfg_sender_world_rank": ctx.rank}, 0, timeout_s=OP_TIMEOUT_S)
        from_cfg = None
    else:
        from_cfg = cfg.recv_object(1, timeout_s=OP_TIMEOUT_S)
    t = torch.tensor([float(ctx.rank)]) if cfg.rank == 0 else torch.zeros(1)
    cfg.broadcast_tensor(t, 0, timeout_s=OP_TIMEOUT_S)
    solo = sp.broadcast_object("alone", 0, timeout_s=OP_TIMEOUT_S)
    return {
        "tp": [tp.rank, tp.size],
        "cfg": [cfg.rank, cfg.size],
        "sp": [sp.rank, sp.size],
        "from_tp1": from_tp1,
        "from_cfg": from_cfg,
        "cfg_tensor": t.item(),
        "solo": solo,
    }


def recv_from_absent_peer(ctx: Ctx) -> Any:
    """Rank 1 waits for an object rank 0 never sends: TransferTimeout at the deadline."""
    group = ctx.new_group((0, 1))
    ctx.mark()
    if ctx.rank == 1:
        return group.recv_object(0, timeout_s=SHORT_TIMEOUT_S)
    return "absent"


def broadcast_from_absent_source(ctx: Ctx) -> Any:
    """Every rank but 0 waits for a broadcast rank 0 never starts."""
    group = ctx.new_group(tuple(range(ctx.size)))
    ctx.mark()
    if ctx.rank == 0:
        return "absent"
    return group.broadcast_object(None, 0, timeout_s=SHORT_TIMEOUT_S)


def broadcast_to_absent_peer(ctx: Ctx) -> Any:
    """Rank 0 broadcasts to a group whose rank 1 never arrives: the source times out too."""
    group = ctx.new_group((0, 1))
    ctx.mark()
    if ctx.rank == 0:
        return group.broadcast_object({"big": b"x" * 4096}, 0, timeout_s=SHORT_TIMEOUT_S)
    return "absent"


def source_cannot_encode(ctx: Ctx) -> Any:
    """The source holds a non-data object: it raises at once and the others are told (no hang)."""
    group = ctx.new_group(tuple(range(ctx.size)))
    ctx.mark()
    return _describe(group.broadcast_object({"x": NotData()} if ctx.rank == 0 else None, 0, timeout_s=OP_TIMEOUT_S))


def sender_cannot_encode(ctx: Ctx) -> Any:
    group = ctx.new_group((0, 1))
    ctx.mark()
    if ctx.rank == 0:
        group.send_object(NotData(), 1, timeout_s=OP_TIMEOUT_S)
    elif ctx.rank == 1:
        return group.recv_object(0, timeout_s=OP_TIMEOUT_S)
    return "idle"


def still_usable_after_failures(ctx: Ctx) -> Any:
    return broadcast_object(ctx)


SCENARIOS: dict[str, Callable[[Ctx], Any]] = {
    fn.__name__: fn
    for fn in (
        broadcast_object,
        broadcast_none_and_scalars,
        broadcast_tensor,
        p2p_object,
        p2p_tensor,
        sub_groups,
        recv_from_absent_peer,
        broadcast_from_absent_source,
        broadcast_to_absent_peer,
        source_cannot_encode,
        sender_cannot_encode,
        still_usable_after_failures,
    )
}


def _refuse(*args: Any, **kwargs: Any) -> Any:
    raise AssertionError("pickle was used on a collective path")


@contextlib.contextmanager
def no_pickle() -> Iterator[None]:
    """Make every pickle entry point (also torch.distributed's cached aliases) raise."""
    targets: list[tuple[Any, str]] = [(pickle, n) for n in ("dumps", "loads", "dump", "load", "Pickler", "Unpickler")]
    c10d = sys.modules.get("torch.distributed.distributed_c10d")
    if c10d is not None:
        targets += [(c10d, n) for n in ("_pickler", "_unpickler") if hasattr(c10d, n)]
    saved = [(obj, name, getattr(obj, name)) for obj, name in targets]
    for obj, name, _ in saved:
        setattr(obj, name, _refuse)
    try:
        yield
    finally:
        for obj, name, original in saved:
            setattr(obj, name, original)


def run_scenario(name: str, ctx: Ctx) -> dict[str, Any]:
    """``{"ok": value, "elapsed": s}`` or ``{"raised": class name, "kvferry": bool, ...}``."""
    ctx.started = None
    start = time.monotonic()
    try:
        value = SCENARIOS[name](ctx)
    except Exception as exc:  # the contract compares what was raised on each rank
        return {
            "raised": type(exc).__name__,
            "kvferry": isinstance(exc, KVFerryError),
            "msg": str(exc)[:300],
            "elapsed": time.monotonic() - (ctx.started or start),
        }
    return {"ok": value, "elapsed": time.monotonic() - (ctx.started or start)}
