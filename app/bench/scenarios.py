"""Cross-process measurements of ``kvferry bench``: one sender peer, one receiver peer.

Every repetition: the receiver starts its receive command and announces it waits, then the
sender runs; the figure is ``receiver done - sender started`` on the machine's monotonic clock
(so it includes the sender's extraction and encoding, the transport, and the receiver's
decoding: what a request's KV costs end to end). Readiness latency is ``receiver has it -
sender's put`` per payload (the moment the encoded payload is handed to the transport: the
baseline's socket send, a connector's ``put`` or reservation ``commit``); a manager's send also
reports when its ``send_requests`` call started (``call_latency``: readiness including the
sender's extraction and encoding). Page faults are counted by each side over its own part;
peak RSS is each side's VmHWM over the timed repetitions (reset after the warm-up) minus its
RSS at the reset. CPU time (user + system, every thread of the process) is counted by the
sender from before its command until the receiver is done, by the receiver until it holds
everything: what a path costs the machine, which other work on a busy machine inflates far
less than wall time. Every scenario checks crc32s of what arrived against what was sent.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

import attrs

from kvferry.app.bench.model import BenchSettings, Stat
from kvferry.app.bench.proc import Peer
from kvferry.core.errors import ConfigError, KVFerryError
from kvferry.core.head_slices import fan_out_slice, slice_bounds
from kvferry.core.ids import connector_key
from kvferry.core.routing import route_heads
from kvferry.core.topology import TPTopology, source_ranks

__all__ = ["Scenario", "ScenarioResult", "run_scenario", "one_repetition", "key_items", "manager_items", "tp_items"]

logger = logging.getLogger(__name__)
_MB = 1e6


@attrs.frozen
class Scenario:
    """One measured path. ``send``/``recv`` build a repetition's command arguments from its
    index; ``expected`` lists ``(cache, request, heads)`` whose crc32s the receiver must see,
    in receive order; ``nbytes`` is the KV tensor bytes one repetition moves. ``limit``, when
    set, runs one repetition of the ratio's limit (returning its seconds) before every
    repetition of this path, so the two alternate (app/bench/pairs.py)."""

    label: str
    send_cmd: str
    recv_cmd: str
    send: Callable[[int], dict[str, Any]]
    recv: Callable[[int], dict[str, Any]]
    nbytes: int
    expected: tuple[tuple[str, int, tuple[int, int] | None], ...] = ()
    reps: int | None = None
    limit: Callable[[], float] | None = None


@attrs.frozen
class ScenarioResult:
    """Stats of one scenario: ``time`` (s), ``latency`` (s, per payload), ``faults_per_mb`` of
    each side, ``rss_delta_kb`` of each side, whether the data checked out, and where the time
    went: ``sender_busy`` (the sender's command, s) and ``receiver_tail`` (receiver done minus
    sender done, s); and what it cost in CPU time: ``sender_cpu`` (the sender process, every
    thread, from before its command until the receiver is done) and ``receiver_cpu`` (the
    receiver process until it holds everything); ``limit_time``: the limit's repetitions that
    alternated with the timed ones (same order), when the scenario had a ``limit``."""

    label: str
    time: Stat
    latency: Stat
    sender_faults_per_mb: Stat
    receiver_faults_per_mb: Stat
    sender_rss_delta_kb: int
    receiver_rss_delta_kb: int
    held_nbytes: int
    checked: bool | None
    sender_busy: Stat | None = None
    receiver_tail: Stat | None = None
    call_latency: Stat | None = None
    sender_cpu: Stat | None = None
    receiver_cpu: Stat | None = None
    limit_time: Stat | None = None


def key_items(tag: str, rep: int, requests: int, cache: str = "main") -> tuple[list[dict], list[dict]]:
    """Send and receive items for ``requests`` whole-request payloads (TP 1 -> 1 keys)."""
    sends, recvs = [], []
    for r in range(requests):
        rid = f"{tag}-{rep}-{r}"
        key = connector_key(rid, 0, 0, 0, 0)
        sends.append({"request": r, "key": key, "rid": rid})
        recvs.append({"key": key})
    return sends, recvs


def manager_items(tag: str, rep: int, requests: int) -> tuple[list[dict], list[dict]]:
    """Manager send and receive items for ``requests`` requests between TP 1 and TP 1."""
    rids = [f"{tag}-{rep}-{r}" for r in range(requests)]
    return (
        [{"rank": 0, "request": r, "rid": rid} for r, rid in enumerate(rids)],
        [{"rank": 0, "rid": rid} for rid in rids],
    )


def tp_items(
    tag: str,
    rep: int,
    from_tp: int,
    to_tp: int,
    heads: int,
    *,
    num_kv_heads: int | None = None,
    cache: str = "main",
) -> tuple[list[dict], list[dict], tuple[tuple[str, int, tuple[int, int] | None], ...]]:
    """Manager items for one request across TP ``from_tp -> to_tp`` (fan-out or equal
    sizes): sender rank ``r`` holds request ``r`` of the ``main`` cache (one rank's
    ``heads``); every receiver rank receives; the third element is what each must hold
    (``(cache, request, head range or None)``), from the same functions the library routes by.
    With ``num_kv_heads`` (the model's, replicated heads included; 1 for an MLA latent) by
    :func:`kvferry.core.routing.route_heads`; ``cache`` may name a view (``"main:latent"``)."""
    rid = f"{tag}-{rep}"
    sends = [{"rank": r, "request": r, "rid": rid} for r in range(from_tp)]
    recvs, expected = [], []
    if num_kv_heads is not None:
        routing = route_heads(from_tp, to_tp, num_kv_heads)
        for t in range(to_tp):
            reads = routing.reads(t)
            if len(reads) != 1:
                raise ConfigError("the benchmark's TP cases are fan-out or equal sizes, not fan-in")
            (x,) = reads
            recvs.append({"rank": t, "rid": rid})
            expected.append((cache, x.source_rank, (x.head_start, x.head_stop) if x.is_sliced else None))
        return sends, recvs, tuple(expected)
    for t in range(to_tp):
        source = source_ranks(TPTopology(from_tp, to_tp, t))
        if len(source) != 1:
            raise ConfigError("the benchmark's TP cases are fan-out or equal sizes, not fan-in")
        offset, slices = fan_out_slice(from_tp, to_tp, t)
        part = slice_bounds(heads, offset, slices) if slices > 1 else None
        recvs.append({"rank": t, "rid": rid})
        expected.append(("main", source[0], part))
    return sends, recvs, tuple(expected)


def _per_mb(faults: int, nbytes: int) -> float:
    return faults / (nbytes / _MB) if nbytes else 0.0


def one_repetition(sender: Peer, receiver: Peer, scenario: Scenario, timeout: float, index: int = 0) -> float:
    """One repetition of ``scenario`` (its repetition ``index``), nothing else counted: its
    seconds, as :func:`run_scenario` times them (a limit's step between a path's repetitions)."""
    ident = receiver.begin(scenario.recv_cmd, timeout_s=timeout, **scenario.recv(index))
    receiver.wait_ready(ident, timeout)
    try:
        sent = sender.call(scenario.send_cmd, timeout, **scenario.send(index))
    finally:
        got = receiver.result(ident, timeout + 30)
    _check_waiting(scenario, got)
    return float(got["t_done"] - sent["t_go"])


def _check_waiting(scenario: Scenario, got: Mapping[str, Any]) -> None:
    """Say so when a receiver announced before every rank asked for its payload (the sender
    then started against a rank still starting: that repetition measured more than the path)."""
    missing = got.get("ranks_not_waiting") or 0
    if missing:
        logger.warning(
            "%s: %s receiver rank(s) had not asked for their payload when the sender started "
            "(after %.1f s); this repetition includes their start",
            scenario.label,
            missing,
            got.get("announce_wait_s", 0.0),
        )


def run_scenario(
    sender: Peer,
    receiver: Peer,
    scenario: Scenario,
    settings: BenchSettings,
    *,
    receiver_baseline_kb: int | None = None,
) -> ScenarioResult:
    """Run ``warmup`` + ``reps`` repetitions; raises TransferError when a peer fails.

    Peak RSS deltas are measured from the RSS at the end of the warm-up, or for the receiver
    from ``receiver_baseline_kb`` when given (its RSS before it received anything).
    """
    timeout = settings.timeout_s
    reps = scenario.reps or settings.reps
    times, latencies, s_faults, r_faults, busy, tail, from_call = [], [], [], [], [], [], []
    s_cpu: list[float] = []
    r_cpu: list[float] = []
    crcs: list[int] = []
    limits: list[float] = []
    s_reset: dict[str, Any] = {"rss_kb": 0}
    r_reset: dict[str, Any] = {"rss_kb": 0}
    for i in range(settings.warmup + reps):
        timed = i >= settings.warmup
        if i == settings.warmup:
            s_reset = sender.call("rss_reset", timeout)
            r_reset = receiver.call("rss_reset", timeout)
        limit_s = scenario.limit() if scenario.limit is not None else None
        ident = receiver.begin(scenario.recv_cmd, timeout_s=timeout, **scenario.recv(i))
        receiver.wait_ready(ident, timeout)
        try:
            cpu0 = sender.call("cpu", timeout)["cpu_s"]
            sent = sender.call(scenario.send_cmd, timeout, **scenario.send(i))
        except KVFerryError:
            try:  # the receiver waits out its own deadline; collect it so the channel stays in step
                receiver.result(ident, timeout + 30)
            except KVFerryError as late:
                logger.info("receiver after a failed send: %s", late)
            raise
        got = receiver.result(ident, timeout + 30)
        _check_waiting(scenario, got)
        if not timed:
            continue
        if limit_s is not None:
            limits.append(limit_s)
        s_cpu.append(sender.call("cpu", timeout)["cpu_s"] - cpu0)  # the serving threads' work too
        if "cpu_s" in got:
            r_cpu.append(got["cpu_s"])
        times.append(got["t_done"] - sent["t_go"])
        if "t_end" in sent:
            busy.append(sent["t_end"] - sent["t_go"])
            tail.append(got["t_done"] - sent["t_end"])
        latencies += [h - p for h, p in zip(got.get("t_have", []), sent.get("t_put", []))]
        from_call += [h - c for h, c in zip(got.get("t_have", []), sent.get("t_call", []))]
        s_faults.append(_per_mb(sent.get("faults", 0), scenario.nbytes))
        r_faults.append(_per_mb(got.get("faults", 0), scenario.nbytes))
        crcs = list(got.get("crc", []))
    s_peak, r_peak = sender.call("rss_peak", timeout), receiver.call("rss_peak", timeout)
    checked = None
    if scenario.expected and crcs:
        expected = [
            sender.call("expected_crc", timeout, cache=c, request=r, heads=None if h is None else list(h))["crc"]
            for c, r, h in scenario.expected
        ]
        checked = expected == crcs
        if not checked:
            logger.error("%s: received data does not match what was sent", scenario.label)
    r_base = r_reset["rss_kb"] if receiver_baseline_kb is None else receiver_baseline_kb
    return ScenarioResult(
        scenario.label,
        Stat.of(times),
        Stat.of(latencies or times),
        Stat.of(s_faults, "faults/MB"),
        Stat.of(r_faults, "faults/MB"),
        s_peak["hwm_kb"] - s_reset["rss_kb"],
        r_peak["hwm_kb"] - r_base,
        scenario.nbytes,
        checked,
        Stat.of(busy) if busy else None,
        Stat.of(tail) if tail else None,
        Stat.of(from_call) if from_call else None,
        Stat.of(s_cpu),
        Stat.of(r_cpu) if r_cpu else None,
        Stat.of(limits) if limits else None,
    )
