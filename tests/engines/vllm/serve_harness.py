"""``vllm serve`` servers and vLLM's toy P/D proxy as the tests start them: the servers, the
proxy, the model and kvferry's counters come from :mod:`kvferry.app.bench.engine.served` (one
home, shared with ``kvferry bench --engine vllm --serve``); this file adds what only the tests
use."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from kvferry.app.bench.engine.served import (
    PROXY,
    WARM,
    Served,
    kvferry_counters,
    kvferry_transfer_config,
    make_serve_model,
    ready,
    start_proxy,
    start_server,
)

__all__ = [
    "PROXY",
    "WARM",
    "Served",
    "kvferry_counters",
    "make_serve_model",
    "ready",
    "start_proxy",
    "start_server",
    "counters_when",
    "free_gib",
    "serve_kv",
    "plain_answers",
    "plain_reference",
    "pd_behind_proxy",
]


def counters_when(
    server: Served, done: Callable[[dict[str, float]], bool], timeout_s: float = 60
) -> tuple[dict[str, float], int]:
    """:func:`kvferry_counters` again until ``done`` holds for them (a save that ends after the
    step of the last counter request shows in the next: each try is one more step), at most
    ``timeout_s``; the last counters and how many requests it took (each computed 3 tokens)."""
    deadline = time.monotonic() + timeout_s
    tries = 1
    out = kvferry_counters(server)
    while not done(out) and time.monotonic() < deadline:
        out = kvferry_counters(server)
        tries += 1
    return out, tries


def free_gib() -> float:
    """Memory the kernel says is available now, GiB (before more servers start)."""
    with open("/proc/meminfo") as f:
        info = {line.split(":")[0]: int(line.split()[1]) for line in f}
    return info["MemAvailable"] / (1 << 20)


def serve_kv(
    role: str,
    base_port: int,
    threshold: int,
    load_timeout_s: float,
    *,
    policy: str = "recompute",
    producer: dict[str, Any] | None = None,
    **common: Any,
) -> dict[str, Any]:
    """The serve tests' ``--kv-transfer-config``: ``base_port``, ``kv_recompute_threshold`` and
    ``common`` on both sides, ``producer``'s keys on the prefill, ``load_timeout_s`` on the decode,
    failure policy ``policy``."""
    extra: dict[str, Any] = {"base_port": base_port, "kv_recompute_threshold": threshold, **common}
    if role == "kv_producer":
        extra.update(producer or {})
    else:
        extra["load_timeout_s"] = load_timeout_s
    return kvferry_transfer_config(role, extra, policy)


def plain_answers(
    plain: Served, alone: list[list[int]], batch: list[list[int]], tokens: int
) -> tuple[dict[tuple[int, ...], list[int]], dict[tuple[int, ...], Any]]:
    """A plain server's greedy token ids for every prompt of ``alone`` and ``batch``, each asked
    alone, and its streams for ``batch`` asked all at once (its own batch: vLLM CPU's kernels are
    not batch-invariant near a logit tie, so a burst is compared with both)."""
    reference = {tuple(p): plain.complete(p, tokens)["token_ids"] for p in [*alone, *batch]}
    with ThreadPoolExecutor(len(batch)) as pool:
        batched = list(pool.map(lambda p: plain.stream(p, tokens), batch))
    return reference, {tuple(p): b for p, b in zip(batch, batched)}


def plain_reference(
    py: str,
    model: Path,
    root: Path,
    startup_s: float,
    alone: list[list[int]],
    batch: list[list[int]],
    tokens: int,
    *,
    name: str = "plain",
    cpu: str = "0",
    args: Sequence[str] = (),
) -> dict[str, Any]:
    """The reference of a serve test: a plain server (``start_server`` keywords) started first
    and alone, its :func:`plain_answers`, then closed. Returns ``reference``, ``batched``, its
    ``startup_s`` and its ``metrics`` at the end."""
    plain = start_server(py, model, name=name, root=root, cpu=cpu, args=args)
    try:
        ready(startup_s, plain)
        reference, batched = plain_answers(plain, alone, batch, tokens)
        return {"reference": reference, "batched": batched, "startup_s": plain.startup_s, "metrics": plain.metrics()}
    finally:
        plain.close()


@contextmanager
def pd_behind_proxy(
    py: str,
    model: Path,
    root: Path,
    startup_s: float,
    prefill: dict[str, Any],
    decode: dict[str, Any],
) -> Iterator[dict[str, Served]]:
    """A prefill and a decode server (``start_server`` keywords each), ready, behind vLLM's toy
    proxy; all three closed on exit."""
    servers: list[Served] = []
    try:
        servers.append(start_server(py, model, root=root, **prefill))
        servers.append(start_server(py, model, root=root, **decode))
        ready(startup_s, *servers)
        proxy = start_proxy(py, servers[:1], servers[1:], root=root)
        servers.append(proxy)
        proxy.wait_ready(60)
        yield {"prefill": servers[0], "decode": servers[1], "proxy": proxy}
    finally:
        for s in reversed(servers):
            s.close()
