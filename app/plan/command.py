"""``kvferry plan``: every rank's keys, ports and head slices for one stage pair.

The tool an operator runs when sender and receiver disagree: it prints exactly what
:func:`kvferry.core.plan.stage_plan` computes, which is what both stages compute at run time.
Wrong input exits with status 2 and one line on stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from collections.abc import Callable, Sequence
from typing import TextIO

from kvferry.core.addressing import DEFAULT_BASE_PORT, expand_base_port, replica_id_from_env
from kvferry.core.errors import KVFerryError
from kvferry.core.models import MODELS, ModelGeometry, model_geometry
from kvferry.core.plan import RECEIVER, SENDER, RankPlan, stage_plan, to_json_records

__all__ = ["configure", "run"]

#: Environment variable holding the replica id (the reference's name).
REPLICA_ENV = "VLLM_OMNI_REPLICA_ID"
_CANONICAL_INT = re.compile(r"0|[1-9][0-9]*")


class _UsageError(Exception):
    """A command-line value is wrong; the message is one line naming the option."""


def configure(parser: argparse.ArgumentParser) -> Callable[[argparse.Namespace], int]:
    """Add ``kvferry plan``'s options to ``parser``; return the runner (``args -> exit status``)."""
    add = parser.add_argument
    add("--from-stage", default="0", help="sender stage id, 0..15 (default 0)")
    add("--to-stage", default="1", help="receiver stage id (default 1)")
    add("--from-tp", default="1", help="sender stage TP size (default 1)")
    add("--to-tp", default="1", help="receiver stage TP size (default 1)")
    add(
        "--heads",
        default=None,
        help="KV heads of the full model (optional; adds head ranges); may be below a TP size "
        "(each head is then replicated on TP/heads ranks)",
    )
    add("--model", default=None, help=f"a known model's KV geometry instead of --heads ({', '.join(MODELS)})")
    add(
        "--base-port",
        default=str(DEFAULT_BASE_PORT),
        help=f"configured base port; may be '${{VAR}}' expanded from the environment (default {DEFAULT_BASE_PORT})",
    )
    add("--replica", default=None, help=f"replica id (default: ${REPLICA_ENV}, else 0)")
    add("--dp-rank", default="0", help="data-parallel rank of both stages (default 0)")
    add("--request-id", default="req-0", help="request id to build keys for (default req-0)")
    add("--json", action="store_true", help="print a JSON list of per-rank records")
    return run


def run(
    args: argparse.Namespace,
    *,
    env: dict[str, str] | None = None,
    out: TextIO | None = None,
    err: TextIO | None = None,
) -> int:
    """Print the plan for ``args``; 0 on success, 2 (one line on ``err``) for wrong input."""
    environ = dict(os.environ) if env is None else env
    out = sys.stdout if out is None else out
    err = sys.stderr if err is None else err
    try:
        model = _model(args)
        plans = _plans(args, environ, model)
    except (_UsageError, KVFerryError) as exc:
        message = " ".join(str(exc).split())
        print(f"kvferry plan: error: {message}", file=err)
        return 2
    if args.json:
        json.dump(to_json_records(plans), out, indent=2)
        out.write("\n")
    else:
        out.write(render_table(plans, args.request_id, model=model))
    return 0


def _int_option(name: str, text: str, minimum: int) -> int:
    value = text.strip()
    if not _CANONICAL_INT.fullmatch(value) or int(value) < minimum:
        raise _UsageError(f"{name} must be an integer >= {minimum}, got {text!r}")
    return int(value)


def _stage_option(text: str) -> int | str:
    """Stage ids that are canonical decimal numbers are ints; others stay strings."""
    value = text.strip()
    if not value:
        raise _UsageError("stage ids must not be empty")
    return int(value) if _CANONICAL_INT.fullmatch(value) else value


def _model(args: argparse.Namespace) -> ModelGeometry | None:
    name = getattr(args, "model", None)
    if name is None:
        return None
    if args.heads is not None:
        raise _UsageError("--model and --heads both give the KV heads: pass one of them")
    return model_geometry(name)


def _plans(args: argparse.Namespace, env: dict[str, str], model: ModelGeometry | None = None) -> tuple[RankPlan, ...]:
    replica = (
        replica_id_from_env(env.get(REPLICA_ENV)) if args.replica is None else _int_option("--replica", args.replica, 0)
    )
    return stage_plan(
        _stage_option(args.from_stage),
        _stage_option(args.to_stage),
        _int_option("--from-tp", args.from_tp, 1),
        _int_option("--to-tp", args.to_tp, 1),
        num_heads=_heads(args, model),
        base_port=expand_base_port(args.base_port, env, field="--base-port"),
        replica=replica,
        dp_rank=_int_option("--dp-rank", args.dp_rank, 0),
        request_id=args.request_id,
    )


def _heads(args: argparse.Namespace, model: ModelGeometry | None) -> int | None:
    if model is not None:  # an MLA latent routes as one head every rank holds
        return 1 if model.is_mla else model.kv_heads
    return None if args.heads is None else _int_option("--heads", args.heads, 1)


def _geometry_line(model: ModelGeometry | None, heads: int | None, s: int, t: int) -> str | None:
    if model is not None and model.is_mla:
        return (
            f"model {model.name}: MLA latent of {model.latent_dim} per token and layer ({model.layers} layers); "
            f"every rank holds it whole: each receiver gets it from one sender, never sliced"
        )
    if heads is None:
        return None
    named = f"model {model.name}: " if model is not None else ""
    notes = [
        f"{side} replicate each head on {tp // heads} ranks"
        for side, tp in (("senders", s), ("receivers", t))
        if tp > heads
    ]
    return f"{named}{heads} KV heads" + (f"; {', '.join(notes)}" if notes else "")


def _span(start: int | None, stop: int | None) -> str:
    return "-" if start is None else f"{start}:{stop}"


def _table(header: Sequence[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in [list(header), *rows]) for i in range(len(header))]
    lines = ["  ".join(h.ljust(w) for h, w in zip(header, widths)).rstrip()]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    return lines


def render_table(plans: Sequence[RankPlan], request_id: str, *, model: ModelGeometry | None = None) -> str:
    """The human-readable plan: a summary, a sender table and a receiver table. A sender replica
    that serves no receiver is listed with no key."""
    senders = [p for p in plans if p.role == SENDER]
    receivers = [p for p in plans if p.role == RECEIVER]
    first, last = senders[0], receivers[0]
    s, t = first.tp_size, last.tp_size
    kind = "same TP" if s == t else (f"fan-in x{s // t}" if s > t else f"fan-out x{t // s}")
    lines = [
        f"request {request_id!r}: stage {first.stage} (TP {s}) -> stage {last.stage} (TP {t}), {kind}",
        f"replica {first.replica}, dp rank {first.dp_rank}; advertised (rank 0) port {first.port}; "
        f"head ranges are start:stop of the full model's KV heads",
    ]
    heads = None
    if first.head_start is not None:
        heads = max(p.head_stop or 0 for p in plans)
    geometry = _geometry_line(model, heads, s, t)
    if geometry is not None:
        lines.append(geometry)
    lines += ["", f"senders (stage {first.stage})"]
    rows = []
    for p in senders:
        if not p.routes:
            rows.append(
                [
                    str(p.tp_rank),
                    str(p.port),
                    _span(p.head_start, p.head_stop),
                    "(none: another replica serves)",
                    "-",
                    "-",
                    "-",
                ]
            )
        for i, r in enumerate(p.routes):
            h = r.heads
            rows.append(
                [
                    str(p.tp_rank) if i == 0 else "",
                    str(p.port) if i == 0 else "",
                    _span(p.head_start, p.head_stop) if i == 0 else "",
                    r.key,
                    str(r.peer_rank),
                    "-" if h is None else _span(h.abs_head_start, h.abs_head_stop),
                    "-" if h is None else f"{h.offset_in_shard}/{h.num_slices}",
                ]
            )
    lines += _table(["rank", "binds", "heads", "puts key", "to", "key heads", "slice"], rows)
    lines += ["", f"receivers (stage {last.stage})"]
    rows = []
    for p in receivers:
        for i, r in enumerate(p.routes):
            h = r.heads
            rows.append(
                [
                    str(p.tp_rank) if i == 0 else "",
                    _span(p.head_start, p.head_stop) if i == 0 else "",
                    r.key,
                    "-" if r.peer_rank is None else str(r.peer_rank),
                    str(r.port),
                    "-" if h is None else _span(h.abs_head_start, h.abs_head_stop),
                    str(i),
                ]
            )
    lines += _table(["rank", "heads", "gets key", "from", "pulls port", "key heads", "merge"], rows)
    return "\n".join(lines) + "\n"
