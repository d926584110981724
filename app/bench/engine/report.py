"""The figures of ``kvferry bench --engine vllm``: per row and prompt length the median time to
first token of every run, its ratio to the floor, whether a kvferry row beats every peer, the
KV bytes moved and their rate against memcpy; the text table and the plot (pure functions
except :func:`write_plot`)."""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = [
    "failure_text",
    "KV_BYTES_PER_TOKEN",
    "expected_kv_bytes",
    "ratio",
    "tie_gap",
    "NEAR_TIE",
    "beats",
    "crossover",
    "summarise",
    "fmt",
    "render_engine_table",
    "write_engine_plot",
]

#: The bench's model: 8 layers x (K, V) x 2 KV heads x head dim 32 x bf16.
KV_BYTES_PER_TOKEN = 8 * 2 * 2 * 32 * 2
BLOCK_SIZE = 32


def expected_kv_bytes(tokens: int, per_token: int = KV_BYTES_PER_TOKEN, block_size: int = BLOCK_SIZE) -> int:
    """The KV bytes of a prompt of ``tokens`` as whole pages move: tokens rounded up to blocks."""
    return -(-tokens // block_size) * block_size * per_token


#: A remote decode computes the prompt's last token alone over the loaded KV (another kernel than
#: its reference's), and a TP 2 decode with another reduction order: its greedy token may flip
#: where the reference's top two log-probabilities are this close (nats; in the runs of
#: docs/vllm.md the top log-probabilities differed by up to 0.36).
NEAR_TIE = 0.5


def tie_gap(token: int, ref_logprobs: Sequence[Sequence[float]]) -> float | None:
    """How far below the reference's top log-probability its log-probability of ``token`` is
    (``ref_logprobs``: ``[[token, logprob], ...]``, its top ones); None when ``token`` is not
    among them."""
    by_token = {int(t): float(lp) for t, lp in ref_logprobs}
    if token not in by_token:
        return None
    return max(by_token.values()) - by_token[token]


def ratio(value: float | None, base: float | None) -> float | None:
    """``value / base``, None when either is missing or ``base`` is not positive."""
    if value is None or base is None or not base > 0:
        return None
    return value / base


def beats(value: float | None, others: Sequence[float | None]) -> bool | None:
    """Whether ``value`` is below every figure in ``others`` that exists (None: nothing to beat
    or no value)."""
    present = [o for o in others if o is not None]
    if value is None or not present:
        return None
    return all(value < o for o in present)


def crossover(
    lengths: Sequence[int], remote: Mapping[int, float | None], local: Mapping[int, float | None]
) -> int | None:
    """The shortest prompt length from which ``remote`` is below ``local`` at that length and
    every longer one measured (None: not even at the longest)."""
    found: int | None = None
    for n in sorted(lengths, reverse=True):
        r, loc = remote.get(n), local.get(n)
        if r is None or loc is None or not r < loc:
            break
        found = n
    return found


def _median(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


def summarise(report: dict[str, Any]) -> dict[str, Any]:
    """Add each cell's medians and comparisons, and per row the crossover; returns ``report``.

    ``report["rows"]``: ``{name: {"status", "kind", "cells": {str(length): {"ttft_ms": [...],
    ...}}}}`` as the command fills them."""
    from kvferry.app.bench.engine.peers import KVFERRY_ROWS, PEERS, REFERENCE

    rows: dict[str, Any] = report["rows"]
    lengths: list[int] = report["lengths"]
    memcpy = report.get("memcpy_gbps")

    def med(name: str, n: int) -> float | None:
        row = rows.get(name)
        if not row or row.get("status") != "ok":
            return None
        cell = row["cells"].get(str(n))
        return cell.get("median_ms") if cell else None

    for row in rows.values():
        for cell in row.get("cells", {}).values():
            cell["median_ms"] = _median(cell["ttft_ms"])  # of the requests that produced a token
            cell["min_ms"] = min(cell["ttft_ms"]) if cell["ttft_ms"] else None
            cell["max_ms"] = max(cell["ttft_ms"]) if cell["ttft_ms"] else None
            if cell.get("gbps"):
                cell["median_gbps"] = _median(cell["gbps"])
                cell["vs_memcpy"] = ratio(cell["median_gbps"], memcpy)
    for name, row in rows.items():
        if row.get("status") != "ok":
            continue
        for n in lengths:
            cell = row["cells"].get(str(n))
            if cell is None:
                continue
            cell["vs_floor"] = ratio(cell["median_ms"], med("floor", n))
            cell["vs_local"] = ratio(cell["median_ms"], med(REFERENCE[name], n))
            if name in KVFERRY_ROWS:
                cell["beats_peers"] = beats(cell["median_ms"], [med(p, n) for p in PEERS])
        if name not in ("local", "local_tp2", "floor"):
            ref = REFERENCE[name]
            row["beats_recompute_from"] = crossover(
                lengths, {n: med(name, n) for n in lengths}, {n: med(ref, n) for n in lengths}
            )
    return report


def _differing(same: Sequence[bool], gaps: Sequence[float | None]) -> str:
    """``same/runs``, then how many of the others were near ties of the reference (``+Nt``)."""
    ties = sum(1 for ok, gap in zip(same, gaps) if not ok and gap is not None and gap <= NEAR_TIE)
    return f"{sum(same)}/{len(same)}" + (f"+{ties}t" if ties else "")


def failure_text(exc: BaseException) -> str:
    """What a bench row that failed says of ``exc``: one line, at most about 900 characters
    (the start and the end of a longer one: a server's log tail ends with the cause)."""
    text = " ".join(str(exc).split())
    return text if len(text) <= 900 else text[:300] + " ... " + text[-600:]


def fmt(value: float | None, digits: int = 1) -> str:
    """``value`` with ``digits`` decimals, ``-`` when there is none (the bench tables' cells)."""
    return "-" if value is None else f"{value:.{digits}f}"


def render_engine_table(report: dict[str, Any]) -> str:
    """The text summary: one line per row and length."""
    lines = [
        f"kvferry bench --engine vllm: {report['model']}",
        f"D's time to first token (ms, median of {report['runs']} runs, min-max), max_tokens=1; "
        f"memcpy limit {fmt(report.get('memcpy_gbps'), 2)} GB/s",
        "",
        f"{'row':<36} {'tokens':>6} {'median':>8} {'min-max':>15} {'x floor':>8} {'x local':>8} "
        f"{'beats peers':>11} {'tokens ok':>9} {'KV MB':>7} {'GB/s':>6} {'x memcpy':>8}",
    ]
    for row in report["rows"].values():
        if row.get("status") != "ok":
            lines.append(f"{row['label']:<36} {row['status'].upper()}: {row.get('reason', '')}")
            continue
        for n in report["lengths"]:
            cell = row["cells"].get(str(n))
            if cell is None:
                continue
            same = cell.get("identical")
            ok = "-" if not same else ("yes" if all(same) else _differing(same, cell.get("tie_gap") or []))
            kv = cell.get("kv_bytes") or []
            bp = cell.get("beats_peers")
            lines.append(
                f"{row['label']:<36} {n:>6} {fmt(cell['median_ms']):>8} "
                f"{fmt(cell['min_ms']) + '-' + fmt(cell['max_ms']):>15} {fmt(cell.get('vs_floor'), 2):>8} "
                f"{fmt(cell.get('vs_local'), 2):>8} {('-' if bp is None else 'yes' if bp else 'no'):>11} {ok:>9} "
                f"{(fmt(statistics.median(kv) / 1e6, 2) if kv else '-'):>7} {fmt(cell.get('median_gbps'), 2):>6} "
                f"{fmt(cell.get('vs_memcpy'), 2):>8}"
            )
    lines.append("")
    for row in report["rows"].values():
        if "beats_recompute_from" in row:
            at = row["beats_recompute_from"]
            lines.append(
                f"{row['label']}: "
                + ("beats recompute at no length measured" if at is None else f"beats recompute from {at} tokens")
            )
    lines.append("")
    lines.append(
        f"tokens ok: identical runs / runs; +Nt: runs whose token was a near tie of the reference's (its top two "
        f"log-probabilities within {NEAR_TIE}), accepted: a remote decode computes the last prompt token alone"
    )
    failures = report.get("failures", [])
    ties = sum(
        1
        for row in report["rows"].values()
        for cell in row.get("cells", {}).values()
        for same, gap in zip(cell.get("identical") or [], cell.get("tie_gap") or [])
        if not same and gap is not None and gap <= NEAR_TIE
    )
    if failures:
        lines.append("FAILED: " + "; ".join(failures))
    elif ties:
        lines.append(f"OK: every remote row's tokens equal its reference's, but for {ties} near ties")
    else:
        lines.append("OK: every remote row's tokens equal its reference's (local D, or local D TP 2)")
    return "\n".join(lines) + "\n"


def write_engine_plot(report: dict[str, Any], path: str) -> str | None:
    """TTFT against prompt length, one line per row that ran (log y); returns what drew it, or
    None when matplotlib (the ``bench`` extra) is missing and nothing was written."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(8, 5))
    for row in report["rows"].values():
        if row.get("status") != "ok":
            continue
        xs = [n for n in report["lengths"] if str(n) in row["cells"]]
        ys = [row["cells"][str(n)]["median_ms"] for n in xs]
        style = "-" if row["kind"] == "kvferry" else ("--" if row["kind"] == "peer" else ":")
        ax.plot(xs, ys, style, marker="o", label=row["label"])
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("D's time to first token (ms, median)")
    ax.set_yscale("log")
    ax.set_title("vLLM decode instance: time to first token by source of the prompt's KV")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return f"matplotlib {matplotlib.__version__}"
