"""One rank of the demo pipeline: a sender-stage or receiver-stage worker.

A worker runs as a process (default) or a thread (the in-process ``memory`` connector). Each
builds its :class:`~kvferry.app.manager.KVTransferManager` from an ``omni_kv_config`` dict
through :mod:`kvferry.app.wiring`, exactly as an engine would. Synthetic paged caches are
deterministic functions of ``(seed, sender rank)``, so a receiver rebuilds the sender's cache
and checks every tensor bit for bit. Results go to the parent over a queue as plain dicts. In a
paced run (the default) a sender waits on its gate, a semaphore the parent releases, before each
request, at most the receive deadline and 30 s, and sends nothing more once the parent's stop
event is set.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import attrs
import torch

from kvferry.app.demo.model import DemoSpec, request_plan
from kvferry.core.errors import TransferError
from kvferry.core.policy import RetryPolicy

__all__ = ["head_cache", "synthetic_cache", "expected_kv", "run_worker", "run_worker_process"]

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def head_cache(spec: DemoSpec, heads: tuple[int, int]) -> list[torch.Tensor]:
    """The model's cache for the KV heads ``heads`` (start, stop): per layer ``[2, num_blocks,
    block, heads, head_dim]``. Each head's bits come from a generator of its own, so any two ranks
    holding a head (replicas) hold the same bytes, as in an engine. MLA: per layer one latent
    ``[num_blocks, block, latent_dim]``, the same for every rank."""
    dtype = _DTYPES[spec.dtype]

    def bits(gen: torch.Generator, shape: tuple[int, ...]) -> torch.Tensor:
        # random bits reinterpreted: every bit pattern (NaNs included) must arrive exactly
        raw = torch.randint(-(2**15), 2**15, shape, generator=gen, dtype=torch.int16)
        return raw.view(dtype) if dtype.itemsize == 2 else raw.to(torch.float32).to(dtype)

    if spec.is_mla:
        gen = torch.Generator().manual_seed(spec.seed * 1000 + 999)
        return [bits(gen, (spec.num_blocks, spec.block_size, spec.latent_dim)) for _ in range(spec.layers)]
    per_head = []
    for head in range(*heads):
        gen = torch.Generator().manual_seed(spec.seed * 1000 + head)
        per_head.append([bits(gen, (2, spec.num_blocks, spec.block_size, spec.head_dim)) for _ in range(spec.layers)])
    return [torch.stack([h[layer] for h in per_head], dim=3) for layer in range(spec.layers)]


def synthetic_cache(spec: DemoSpec, sender_rank: int) -> list[torch.Tensor]:
    """Sender rank's paged cache: its heads of :func:`head_cache` (``flash`` layout; MLA: the
    latent)."""
    return head_cache(spec, spec.sender_heads(sender_rank))


def expected_kv(
    cache: list[torch.Tensor], block_ids: list[int], seq_len: int, head_range: tuple[int, int], which: int, layer: int
) -> torch.Tensor:
    """What the receiver must get for one layer: tokens of the blocks, heads of its slice.

    Computed independently of kvferry's extraction (plain advanced indexing); one copy of
    just the heads needed.
    """
    if cache[layer].dim() == 3:  # an MLA latent: the key only
        blocks = cache[layer][torch.tensor(block_ids, dtype=torch.int64)]
        return blocks.reshape(-1, *blocks.shape[2:])[:seq_len]
    heads = cache[layer][which][:, :, head_range[0] : head_range[1]]
    blocks = heads[torch.tensor(block_ids, dtype=torch.int64)]
    return blocks.reshape(-1, *blocks.shape[2:])[:seq_len]


def _stage_groups(role: str, rank: int, size: int, store_port: int, timeout_s: float) -> Any:
    from kvferry.app.manager import StageGroups

    if size <= 1:
        return StageGroups()
    import datetime

    import torch.distributed as dist

    from kvferry.adapters.collectives import TorchDistGroup

    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{store_port}",
        rank=rank,
        world_size=size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    world = TorchDistGroup()
    return StageGroups(world=world, tp=world) if role == "receiver" else StageGroups(world=world)


_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
#: A paced sender waits for its next request's turn up to the receive deadline and this long.
_GATE_GRACE_S = 30.0


def _bits_equal(a: torch.Tensor | None, b: torch.Tensor) -> bool:
    """Bit-for-bit equality (NaN payloads included), compared as integers."""
    if a is None or a.shape != b.shape or a.dtype != b.dtype:
        return False
    bits = _BITS[a.dtype.itemsize]
    return torch.equal(a.contiguous().view(bits), b.contiguous().view(bits))


def run_worker(
    role: str,
    rank: int,
    spec_dict: dict[str, Any],
    queue: Any,
    groups: Any = None,
    connector: Any = None,
    gate: Any = None,
    stop: Any = None,
) -> None:
    """Entry point of one rank; reports ``{"kind": ...}`` dicts on ``queue``. ``gate`` (a
    sender's, in a paced run): a semaphore the parent releases once per request it may send;
    ``stop``: an event the parent sets before letting every sender through when the run stops
    early, after which a sender sends nothing more."""
    torch.set_num_threads(1)
    from kvferry.adapters.platform import tune_host_allocator

    tune_host_allocator()
    logging.basicConfig(level=logging.ERROR, format=f"[{role} {rank}] %(levelname)s %(name)s: %(message)s")
    spec = DemoSpec(**spec_dict)
    try:
        if role == "sender":
            _sender(spec, rank, queue, groups, connector, gate, stop)
        else:
            _receiver(spec, rank, queue, groups, connector)
    except BaseException as exc:  # the parent must learn of every failure
        queue.put({"kind": "error", "role": role, "rank": rank, "error": f"{type(exc).__name__}: {exc}"})
        raise
    finally:
        queue.put({"kind": "done", "role": role, "rank": rank})


def run_worker_process(
    role: str, rank: int, spec_dict: dict[str, Any], queue: Any, gate: Any = None, stop: Any = None
) -> None:
    """A rank as the whole of a process: :func:`run_worker`, then the queue flushed and the
    process ended with :func:`os._exit` (0, or 1 after a failure it reported).

    The worker closed its connector and groups already, so nothing is left to release. A
    spawned process otherwise runs the whole interpreter teardown, the module GC and the C++
    static destructors of torch and of what the engine's packages load (2.5-3.8 s on the
    shared 2-core machine, with nixl or zmq alike, and far longer when several ranks end at
    once under load), which a stage's exit grace then counts as a rank that does not end. A
    forked rank ends this way already (multiprocessing's fork start method)."""
    import sys

    code = 0
    try:
        run_worker(role, rank, spec_dict, queue, gate=gate, stop=stop)
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        queue.close()
        queue.join_thread()  # every report is in the pipe before the process ends
        logging.shutdown()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(code)


def _manager(spec: DemoSpec, role: str, rank: int, groups: Any, connector: Any) -> Any:
    from kvferry.app.wiring import build_manager

    omni = spec.omni_kv_config(role)
    size = spec.from_tp if role == "sender" else spec.to_tp
    if groups is None:
        groups = _stage_groups(role, rank, size, spec.store_ports[0 if role == "sender" else 1], spec.timeout_s + 30)
    # the demo's producer waits out a full pool (back-pressure) rather than dropping requests
    retry = RetryPolicy(attempts=600, first_backoff_s=0.02, factor=1.0)
    return build_manager(
        omni, tp_rank=rank, tp_size=size, groups=groups, connector=connector, env=os.environ, retry=retry
    )


def _sender(
    spec: DemoSpec, rank: int, queue: Any, groups: Any, connector: Any, gate: Any = None, stop: Any = None
) -> None:
    manager = _manager(spec, "sender", rank, groups, connector)
    cache = synthetic_cache(spec, rank)
    queue.put({"kind": "ready", "role": "sender", "rank": rank})
    try:
        for req in request_plan(spec):
            # paced: wait until every rank is ready (the first request) or every receiver rank
            # verified the previous one; a parent that never says so ends the rank by the deadline
            if gate is not None and not gate.acquire(timeout=spec.timeout_s + _GATE_GRACE_S):
                raise TransferError(
                    f"request {req.request_id}: not let through in {spec.timeout_s + _GATE_GRACE_S:.0f} s "
                    "(the demo sends the next request once every receiver rank verified the previous one)"
                )
            if stop is not None and stop.is_set():
                break  # the run stopped early; the parent reports why
            finished = {req.request_id: {"block_ids": list(req.block_ids), "seq_len": req.seq_len}}
            t_call = time.monotonic()
            outcome = manager.send_requests(finished, cache, spec.block_size, spec.dtype)[0]
            queue.put(
                {
                    "kind": "sent",
                    "rank": rank,
                    "request_id": req.request_id,
                    "ok": outcome.ok,
                    "reason": None if outcome.ok else f"{outcome.reason.value}: {outcome.detail}",
                    "bytes": outcome.nbytes,
                    "t_call": t_call,
                    "t": time.monotonic(),
                }
            )
        if connector is None:  # hold payloads until every receiver took them or gave up
            _wait_drained(manager, spec)
    finally:
        manager.close()


def _wait_drained(manager: Any, spec: DemoSpec) -> None:
    deadline = time.monotonic() + spec.timeout_s + 5
    done_path = spec.done_file
    while time.monotonic() < deadline and not os.path.exists(done_path):
        time.sleep(0.05)


def _receiver(spec: DemoSpec, rank: int, queue: Any, groups: Any, connector: Any) -> None:
    manager = _manager(spec, "receiver", rank, groups, connector)
    own = spec.head_range(rank)
    # what this rank must end up with, generated from the model's per-head bits (not from the
    # senders' caches): right only if routing fetched exactly this rank's heads
    mine = head_cache(spec, own)
    width = own[1] - own[0]
    queue.put({"kind": "ready", "role": "receiver", "rank": rank})
    sender_info = {"host": "127.0.0.1", "zmq_port": spec.advertised_port}
    try:
        for req in request_plan(spec):
            holder = _Request(req.request_id)
            start = time.monotonic()
            # zero-copy: the tensors view the connector's pool until released below; the manager
            # distributes inside the stage (pure TP: every rank pulls, then they agree)
            dist = manager.receive_and_distribute(holder, sender_info=sender_info, zero_copy=True)
            ok = dist.ok
            t_done = time.monotonic()  # received (with TP consensus); verification follows
            exact = False
            if ok:
                kv = holder.past_key_values
                exact = all(
                    _bits_equal(
                        kv.key_cache[layer] if which == 0 else kv.value_cache[layer],
                        expected_kv(mine, list(req.block_ids), req.seq_len, (0, width), which, layer),
                    )
                    for layer in range(spec.layers)
                    for which in ((0,) if spec.is_mla else (0, 1))
                )
                if spec.is_mla:
                    exact = exact and all(v is None for v in kv.value_cache)
            res = dist.received
            if res is not None:  # verified: drop the views, then give the pool buffers back
                holder.past_key_values = None
                res.release()
            queue.put(
                {
                    "kind": "received",
                    "rank": rank,
                    "request_id": req.request_id,
                    "ok": bool(ok),
                    "bit_exact": exact,
                    "outcome": res.outcome.kind.value if res else "error",
                    "detail": res.outcome.detail if res else "",
                    "bytes": res.nbytes if res else 0,
                    "t_wait": start,
                    "t": t_done,
                    "t_verified": time.monotonic(),
                    "seconds": t_done - start,
                }
            )
    finally:
        manager.close()


@attrs.define(eq=False)
class _Request:
    request_id: str
    past_key_values: Any = None
    kv_metadata: Any = None
