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

from harness import made_once

from kvferry.app.bench.engine import served
from kvferry.app.bench.engine.served import (
    PROXY,
    WARM,
    Served,
    kvferry_counters,
    kvferry_transfer_config,
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
    "TIE_NATS",
    "departs_at_a_tie",
    "tie_gap",
    "not_plain",
    "pd_behind_proxy",
]


def make_serve_model(py: str, path: Path, seed: int) -> Path:
    """The serve tests' tiny random Llama with a tokenizer (the bench's
    :func:`~kvferry.app.bench.engine.served.make_serve_model`): made at ``path``, or the one
    this session made already (``harness.made_once``)."""
    return made_once((py, "serve", seed), path, lambda at: served.make_serve_model(py, at, seed))


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


#: Two tokens whose log-probabilities in the plain server's answer lie this close (nats) are a
#: tie: vLLM CPU's kernels are not batch-invariant, and another batch, or KV computed in another
#: batch (a prefill's), may pick either. The logits are bf16: near the top their log-probabilities
#: step by 1/16, so this admits equal ones and one step apart (docs/vllm.md, "Which tokens a
#: serve test accepts", has the measurements).
TIE_NATS = 0.1


def _departure(got: list[int], reference: list[int]) -> int | None:
    """The first token where ``got`` is not ``reference`` (None: equal as far as both go)."""
    return next((i for i, (g, r) in enumerate(zip(got, reference)) if g != r), None)


def _top(choice: dict[str, Any]) -> list[dict[int, float]]:
    """Per output token, its top tokens' log-probabilities (``return_tokens_as_token_ids``)."""
    return [{int(t.split(":", 1)[1]): lp for t, lp in step.items()} for step in choice["logprobs"]["top_logprobs"]]


def tie_gap(got: list[int], reference: list[int], top: list[dict[int, float]]) -> float | None:
    """How far below the reference's own token ``got``'s token lies, in the reference's top
    log-probabilities, where ``got`` first departs from ``reference`` (0.0 where it does not
    depart; None where the two differ in length or ``got``'s token is not in the top)."""
    if len(got) != len(reference):
        return None
    at = _departure(got, reference)
    if at is None:
        return 0.0
    if got[at] not in top[at]:
        return None
    return top[at][reference[at]] - top[at][got[at]]


def departs_at_a_tie(got: list[int], reference: list[int], top: list[dict[int, float]]) -> bool:
    """Whether ``got`` is ``reference`` up to a token where it takes another of the reference's
    top tokens, at most :data:`TIE_NATS` below the reference's own (``top``: the reference's top
    log-probabilities per token); after that token the two continue other texts."""
    gap = tie_gap(got, reference, top)
    return gap is not None and gap <= TIE_NATS


def not_plain(plain: dict[str, Any], answers: Sequence[tuple[list[int], list[int]]]) -> tuple[list[str], list[int]]:
    """Of ``(prompt, tokens)`` pairs, those whose tokens are not the plain server's (``plain``:
    :func:`plain_reference`'s ``reference``, ``batched`` and ``top``): neither its answer alone
    nor in its own batch, nor departing from the answer alone at a tie (:func:`departs_at_a_tie`);
    each described for an assertion's message. And the prompts' lengths whose tokens departed
    at a tie."""
    wrong: list[str] = []
    ties: list[int] = []
    for prompt, got in answers:
        key = tuple(prompt)
        ref = plain["reference"][key]
        if got == ref or got == plain["batched"].get(key):
            continue
        if departs_at_a_tie(got, ref, plain["top"][key]):
            ties.append(len(prompt))
            continue
        at = _departure(got, ref)
        at = min(len(got), len(ref)) if at is None else at
        top = plain["top"][key][at] if at < len(plain["top"][key]) else {}
        batched = plain["batched"].get(key)
        wrong.append(f"{len(prompt)} tokens: {got} against {ref} (batched {batched}), top at {at}: {top}")
    return wrong, ties


def plain_answers(
    plain: Served, alone: list[list[int]], batch: list[list[int]], tokens: int
) -> tuple[dict[tuple[int, ...], list[int]], dict[tuple[int, ...], Any], dict[tuple[int, ...], Any]]:
    """A plain server's greedy token ids for every prompt of ``alone`` and ``batch``, each asked
    alone, and its streams for ``batch`` asked all at once (its own batch: vLLM CPU's kernels are
    not batch-invariant near a logit tie, so a burst is compared with both); and, per prompt
    asked alone, the top log-probabilities of each token (:func:`departs_at_a_tie`)."""
    choices = {
        tuple(p): plain.complete(p, tokens, logprobs=4, return_tokens_as_token_ids=True) for p in [*alone, *batch]
    }
    reference = {p: c["token_ids"] for p, c in choices.items()}
    top = {p: _top(c) for p, c in choices.items()}
    with ThreadPoolExecutor(len(batch)) as pool:
        batched = list(pool.map(lambda p: plain.stream(p, tokens), batch))
    return reference, {tuple(p): b for p, b in zip(batch, batched)}, top


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
    and alone, its :func:`plain_answers`, then closed. Returns ``reference``, ``batched``,
    ``top``, ``batch_gaps`` (:func:`tie_gap` of each batched answer that is not the answer
    alone), its ``startup_s`` and its ``metrics`` at the end."""
    plain = start_server(py, model, name=name, root=root, cpu=cpu, args=args)
    try:
        ready(startup_s, plain)
        reference, batched, top = plain_answers(plain, alone, batch, tokens)
        # where the plain server's own batch departs from its answers alone: how far below
        # (the measure TIE_NATS bounds; reported by the tests, None: out of the top tokens)
        gaps = [tie_gap(b, reference[p], top[p]) for p, b in batched.items() if b != reference[p]]
        return {
            "reference": reference,
            "batched": batched,
            "top": top,
            "batch_gaps": [None if g is None else round(g, 4) for g in gaps],
            "startup_s": plain.startup_s,
            "metrics": plain.metrics(),
        }
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
