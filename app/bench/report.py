"""The benchmark's text table and its JSON file (non-finite numbers written as ``null``)."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from typing import Any, TextIO

from kvferry.app.bench.model import RATIO_NAMES

__all__ = ["render_table", "render_bars", "write_json", "json_safe"]

#: Figures in table order with their labels.
_FIGURE_LABELS: tuple[tuple[str, str], ...] = (
    ("memcpy", "limit: memcpy, 1 thread, reused buffer"),
    ("raw_zmq", "limit: raw zmq tcp PUSH/PULL copy=False"),
    ("raw_tcp", "limit: raw tcp sendall / recv_into reused buffer"),
    ("memcpy_cpu", "CPU time: memcpy, 1 thread"),
    ("extraction_cpu", "CPU time: kvferry extraction"),
    ("mooncake_raw", "limit: raw mooncake batched write"),
    ("nixl_raw_read", "limit: raw NIXL READ (same agent pair as nixl_pair_get)"),
    ("nixl_pair_get", "kvferry nixl commit + get + release, interleaved with the raw READ"),
    ("extraction", "kvferry extraction (gather into buffer)"),
    ("kvferry_encode", "kvferry encode (frames)"),
    ("kvferry_decode", "kvferry decode (views, one buffer)"),
    ("kvferry_decode_frames", "kvferry decode (views, frames)"),
    ("kvferry_codec", "kvferry encode + decode"),
    ("checksum_encode", "kvferry encode with checksums"),
    ("checksum_decode", "kvferry decode verifying checksums"),
    ("checksum_gather_finish", "kvferry gather + header with checksums"),
    ("shm_direct_1", "kvferry shm primitives e2e, 1 request"),
    ("shm_e2e_1", "kvferry shm e2e, 1 request"),
    ("shm_e2e_n", "kvferry shm e2e, N requests"),
    ("homo_2_2", "kvferry shm TP 2->2 (2 payloads)"),
    ("hetero_2_4", "kvferry shm TP 2->4 (4 half payloads)"),
    ("replicated_2_8", "kvferry shm TP 2->8, replicated heads (8 quarter payloads)"),
    ("mla_2_4", "kvferry shm TP 2->4, MLA latent (4 half payloads, no values)"),
    ("zmq_direct_1", "kvferry zmq tcp primitives e2e, 1 request"),
    ("zmq_e2e_1", "kvferry zmq tcp e2e, 1 request"),
    ("zmq_e2e_n", "kvferry zmq tcp e2e, N requests"),
    ("mooncake_direct_1", "kvferry mooncake primitives e2e, 1 request"),
    ("mooncake_e2e_1", "kvferry mooncake e2e, 1 request"),
    ("mooncake_e2e_n", "kvferry mooncake e2e, N requests"),
    ("nixl_direct_1", "kvferry nixl primitives e2e, 1 request"),
    ("nixl_e2e_1", "kvferry nixl e2e, 1 request"),
    ("nixl_e2e_n", "kvferry nixl e2e, N requests"),
    ("shm_e2e_1_copy", "copying receive: shm e2e, 1 request"),
    ("zmq_e2e_1_copy", "copying receive: zmq tcp e2e, 1 request"),
    ("wake", "limit: a bare wake, one datagram to a waiting peer"),
    ("readiness_shm", "readiness, small request, shm (from the put)"),
    ("readiness_shm_from_call", "readiness, small request, shm (from the send call)"),
    ("readiness_shm_copy", "readiness, small request, shm, copying receive"),
    ("readiness_shm_direct", "readiness, small request, shm primitives"),
    ("readiness_zmq", "readiness, small request, zmq (from the put)"),
    ("readiness_zmq_from_call", "readiness, small request, zmq (from the send call)"),
    ("readiness_zmq_direct", "readiness, small request, zmq primitives"),
    ("readiness_mooncake", "readiness, small request, mooncake"),
    ("readiness_nixl", "readiness, small request, nixl"),
    ("readiness_baseline", "readiness, small request, baseline"),
    ("baseline_extract", "baseline extraction (index + cat)"),
    ("baseline_encode", "baseline encode (tobytes + join)"),
    ("baseline_decode", "baseline decode (frombuffer)"),
    ("baseline_e2e", "baseline e2e (zmq tcp, sleep-poll)"),
)


def json_safe(value: Any) -> Any:
    """``value`` with every non-finite float replaced by None (strict JSON)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def write_json(report: dict[str, Any], path: str) -> None:
    with open(path, "w") as handle:
        json.dump(json_safe(report), handle, indent=2, allow_nan=False)
        handle.write("\n")


def save_report(
    report: dict[str, Any], json_path: str, plot_path: str, draw: Callable[[dict[str, Any], str], Any], err: TextIO
) -> tuple[bool, Any]:
    """Write ``report`` as JSON and draw its plot (``draw(report, plot_path)``, whose result is
    returned: what drew it). ``(False, None)`` when a file cannot be written, said on ``err``."""
    try:
        write_json(report, json_path)
        return True, draw(report, plot_path)
    except OSError as exc:
        print(f"kvferry bench: error: cannot write the report: {exc}", file=err)
        return False, None


def save_and_say(
    report: dict[str, Any],
    json_path: str,
    plot_path: str,
    draw: Callable[[dict[str, Any], str], Any],
    out: TextIO,
    err: TextIO,
) -> bool:
    """:func:`save_report`, then a line on ``out`` naming the JSON and the plot (or why there is
    no plot: matplotlib is the bench extra). False when a file could not be written."""
    written, drawer = save_report(report, json_path, plot_path, draw, err)
    if written:
        plot = f"{plot_path} (drawn by {drawer})" if drawer else "no plot (needs matplotlib: the bench extra)"
        print(f"wrote {json_path}; {plot}", file=out)
    return written


def _time(seconds: float) -> str:
    if seconds >= 1:
        return f"{seconds:.2f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds * 1e6:.1f} us"


def _rows(header: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    line = lambda r: "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))  # noqa: E731
    return [line(header), "  ".join("-" * w for w in widths), *[line(r) for r in rows]]


def _value(v: Any) -> str:
    if not isinstance(v, (int, float)) or not math.isfinite(v):
        return "n/a"
    return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"


def render_bars(report: dict[str, Any], width: int = 50) -> str:
    """The PNG's chart as text: median GB/s by path, ``#`` kvferry, ``=`` limit, ``-`` baseline."""
    from kvferry.app.bench.plot import bars_from_report

    bars = bars_from_report(report)
    if not bars:
        return ""
    peak = max(b.value for b in bars) or 1.0
    pad = max(len(b.label) for b in bars)
    mark = {"kvferry": "#", "limit": "=", "baseline": "-"}
    lines = [
        f"{b.label.ljust(pad)}  {mark.get(b.kind, '?') * max(1, round(width * b.value / peak))} {b.value:.2f}"
        for b in bars
    ]
    return "\n".join(["GB/s by path (median; # kvferry, = limit, - baseline)", *lines]) + "\n"


def _runs_line(report: dict[str, Any]) -> str:
    runs = report.get("runs") or ()
    if len(runs) <= 1:
        return ""
    loads = ", ".join(str(r.get("load_avg_at_start")) for r in runs)
    return (
        f"\n{len(runs)} whole runs: figures are medians of the runs' medians, ratios the medians of the "
        f"runs' ratios (each run's value and verdict beside); load at each run's start {loads}"
    )


#: How a verdict reads in the table (one letter per run where there are several).
_VERDICT_WORD = {"met": "met", "missed": "MISSED", "unsteady": "unsteady", "none": "n/a"}
_VERDICT_LETTER = {"met": "y", "missed": "N", "unsteady": "~", "none": "-"}


def _spread(report: dict[str, Any], name: str) -> str:
    spread = (report.get("spreads") or {}).get(name)
    paired = name in (report.get("pairs") or {})
    return ("" if spread is None else f"{100 * spread:.0f}%") + (" paired" if paired else "")


def _noise_line(report: dict[str, Any]) -> str:
    runs = report.get("runs") or ()
    noises = [r.get("noise") or {} for r in runs] if len(runs) > 1 else [report.get("noise") or {}]
    limits = sorted({k for n in noises for k in n})
    if not limits:
        return ""
    parts = [f"{k} {' / '.join('n/a' if n.get(k) is None else f'{100 * n[k]:.0f}%' for n in noises)}" for k in limits]
    max_spread = report.get("max_spread")
    return (
        "noise (the limits' own spread, interquartile range over median" + (", each run" if len(runs) > 1 else "")
        + "): " + "; ".join(parts)
        + ("" if max_spread is None else f"; a ratio whose spread is over {100 * max_spread:.0f}% is unsteady")
    )  # fmt: skip


def _wake_line(report: dict[str, Any]) -> str:
    """The small request's floor, each run: the bare wake between the peers' CPUs (median) and
    the readiness from the send call in such wakes (the median of the pairs)."""
    runs = report.get("runs") or ()
    floors = [r.get("wake_floor") or {} for r in runs] if len(runs) > 1 else [report.get("wake_floor") or {}]
    if not any(floors):
        return ""
    each = lambda key, form: " / ".join("n/a" if f.get(key) is None else form(f[key]) for f in floors)  # noqa: E731
    return (
        f"wake floor (one datagram to the waiting receiver, between the shm readiness repetitions; "
        f"{'each run' if len(floors) > 1 else 'median'}): {each('p50_ms', lambda v: f'{1e3 * v:.0f} us')}, "
        f"spread {each('spread', lambda v: f'{100 * v:.0f}%')}; readiness from the send call = "
        f"{each('readiness_in_wakes', lambda v: f'{v:.1f}')} wakes"
    )


def _ratio_rows(report: dict[str, Any]) -> list[str]:
    """The ratio table: value, target, verdict (met / missed / unsteady) and spread (paired:
    the spread of the ratio's interleaved pairs); with several runs, every run's value and
    verdict beside the median."""
    runs = report.get("ratio_runs") or {}
    several = len(report.get("runs") or ()) > 1
    verdicts = report.get("verdicts") or {}
    each = report.get("verdict_runs") or {}
    rows = []
    for name in RATIO_NAMES:
        value = report["ratios"].get(name)
        row = [name, _value(value), report["targets"][name], _VERDICT_WORD.get(verdicts.get(name, "none"), "n/a")]
        if several:
            per = runs.get(name) or {"values": []}
            row.append(" ".join(_value(v) for v in per["values"]))
            row.append(" ".join(_VERDICT_LETTER.get(v, "?") for v in each.get(name, ())))
        else:
            row.append(_spread(report, name))
        rows.append([*row, ", ".join(report["ratio_inputs"].get(name, ()))])
    count = {v: sum(verdicts.get(n) == v for n in RATIO_NAMES) for v in ("met", "missed", "unsteady")}
    summary = (
        f"of {len(RATIO_NAMES)} ratios: met {count['met']}, missed {count['missed']}, unsteady {count['unsteady']}"
        + (" (over every run: y met, N missed, ~ unsteady)" if several else "")
    )
    header = ["ratio", "median" if several else "value", "target", "verdict"]
    header += ["each run", "each"] if several else ["spread"]
    return [*_rows([*header, "from"], rows), summary, _noise_line(report), _wake_line(report)]


def connector_pair_lines(report: dict[str, Any]) -> list[str]:
    """The table of optional connectors against their own limits (interleaved pairs): with
    several runs every run's value, spread and verdict; else the one run's quartiles too."""
    out: list[str] = []
    pair_runs = report.get("connector_pair_runs") or {}
    pairs = report.get("connector_pairs") or {}
    if len(report.get("runs") or ()) > 1 and pair_runs:
        out.append("")
        header = ["connector vs its limit (interleaved pairs)", "target"]
        header += [f"run {k}" for k in range(1, len(report["runs"]) + 1)]

        def cell(v: dict[str, Any] | None) -> str:
            return f"{_value(v['value'])} (spread {_value(v['spread'])}, {v['verdict']})" if v else "-"

        rows = [
            [k, next((v["target"] for v in per_run if v), ""), *map(cell, per_run)] for k, per_run in pair_runs.items()
        ]
        out += _rows(header, rows)
    elif pairs:
        out.append("")
        out += _rows(
            ["connector vs its limit (interleaved pairs)", "value", "quartiles", "spread", "target", "verdict"],
            [
                [
                    k,
                    _value(v["value"]),
                    f"{_value(v['low'])}-{_value(v['high'])}",
                    _value(v["spread"]),
                    v["target"],
                    v["verdict"],
                ]  # fmt: skip
                for k, v in pairs.items()
            ],
        )
    return out


def render_table(report: dict[str, Any]) -> str:
    """Every figure (median, min, max, GB/s) and every ratio with its target."""
    settings, machine = report["settings"], report["machine"]
    g = settings["geometry"]
    n_req = settings["requests"]
    lines = [
        f"kvferry bench: {g['layers']} layers x K,V x [{g['tokens']}, {g['heads']}, {g['head_dim']}] "
        f"{g['dtype']} = {g['nbytes'] / 1e6:.1f} MB per request ({g['block_size']}-token blocks); "
        f"N = {n_req} requests",
        f"medians of {settings['reps']} repetitions after {settings['warmup']} warm-up "
        f"(readiness: {settings['readiness_reps']}); min..max beside" + _runs_line(report),
        f"machine: {machine['cpu_model']}, {machine['cores']} cores, {machine['memory_gb']} GB, "
        f"load {machine['load_avg_at_start']}; torch {machine['torch']} ({machine['torch_threads']} "
        f"thread(s)), pyzmq {machine['pyzmq']} / libzmq {machine['libzmq']}",
    ]
    huge = (report.get("notes") or {}).get("cache_huge_pages")
    if huge:
        lines.append(f"sender's cache: {huge}")
    placement = machine.get("placement")
    if placement:
        lines.append(f"placement: {placement['line']}")
    lines.append("")
    figures = report["figures"]
    rows = []
    for name, label in _FIGURE_LABELS:
        f = figures.get(name)
        if not f or f.get("unit") != "s":
            continue
        gbps = f.get("gbps") or {}
        speed = f"{gbps['median']:.2f}" if "median" in gbps else ""
        rows.append([label, _time(f["median"]), _time(f["min"]), _time(f["max"]), speed])
    lines += _rows(["figure", "median", "min", "max", "GB/s"], rows)
    lines.append("")
    lines += _ratio_rows(report)
    paths = report.get("paths") or {}
    if paths:
        rows = []
        for label, p in paths.items():
            busy, after = p.get("sender_busy_s"), p.get("receiver_after_sender_s")
            cpu_s, cpu_r = p.get("sender_cpu_s"), p.get("receiver_cpu_s")
            rows.append(
                [
                    label.removeprefix("kvferry "),
                    _time(p["time_s"]["median"]),
                    _time(busy["median"]) if busy else "",
                    _time(after["median"]) if after else "",
                    _time(cpu_s["median"]) if cpu_s else "",
                    _time(cpu_r["median"]) if cpu_r else "",
                    f"{p['sender_faults_per_mb']['median']:.1f}",
                    f"{p['receiver_faults_per_mb']['median']:.1f}",
                    f"{p['receiver_peak_rss_delta_mb']:.0f}",
                    f"{p['held_mb']:.0f}",
                ]
            )
        lines.append("")
        last = f"last of {len(report['runs'])} runs, " if len(report.get("runs") or ()) > 1 else ""
        lines += _rows(
            [
                f"path ({last}medians)",
                "total",
                "send call",
                "recv after",
                "cpu s",
                "cpu r",
                "faults/MB s",
                "r",
                "recv RSS+ MB",
                "held MB",
            ],
            rows,
        )
        lines.append(
            "(send call: the sender's command; recv after: receiver done - send call done, "
            "negative when the data was in before the call returned; cpu s / cpu r: CPU time of the sender "
            "process until the receiver was done / of the receiver until it held everything, every thread)"
        )
    extra = report.get("extra_ratios") or {}
    if extra:
        lines.append("")
        lines += _rows(["more ratios", "value"], [[k, _value(v)] for k, v in extra.items()])
    lines += connector_pair_lines(report)
    notes = report.get("notes", {})
    worst = [f"{k.removesuffix('_path')}: {v}" for k, v in notes.items() if k.endswith("_path")]
    if worst:
        lines += ["", "worst kvferry path per memory figure: " + "; ".join(worst)]
    ck = report.get("checksum_cost") or {}
    if ck:
        lines.append(
            f"{ck.get('algorithm', 'crc32')} checksums ({ck.get('engine', '?')}): +{ck['encode_extra_ms']:.1f} ms "
            f"to encode, {ck['decode_verify_ms']:.1f} ms to verify per request "
            f"(encode with checksums {ck.get('encode_gbps', math.nan):.2f} GB/s)"
        )
    checks = report.get("data_checks", {})
    bad = [k for k, ok in checks.items() if not ok]
    lines.append(
        "(e2e: sender's send call -> receiver holds every payload decoded; 'primitives' "
        "= extraction into the connector + views, without the manager)"
    )
    lines.append(
        f"data checks (crc32 of what arrived vs what was sent): "
        f"{'all ' + str(len(checks)) + ' ok' if not bad else 'MISMATCH in ' + ', '.join(bad)}"
    )
    for what, why in report.get("failures", {}).items():
        lines.append(f"FAILED {what}: {why[:300]}")
    return "\n".join(lines) + "\n"
