"""``kvferry inspect FILE``: decode a KV payload file and print its header and tensor table.

Reads both the reference layout (packed, no format version) and kvferry's (aligned, ``"v"``,
optional per-tensor checksums): every check of the wire codec runs (header length, JSON,
spans, dtypes, layer indexes, shape/byte agreement), then every checksum the header carries
is verified. Exit status: 0 valid; 1 invalid payload (one line on stderr saying why; the table
of what could be read is still printed when the header itself was valid); 2 the file cannot be
read. ``--json`` prints the same as one JSON object.
"""

from __future__ import annotations

import argparse
import json
import mmap
import sys
from collections.abc import Callable
from typing import Any, TextIO

from kvferry.adapters.checksums import compute_checksum
from kvferry.core.errors import PayloadError
from kvferry.core.header import AbsentTensor, DecodedHeader, decode_header

__all__ = ["configure", "run", "inspect_buffer"]

_SHOWN_BLOCK_IDS = 16


def configure(parser: argparse.ArgumentParser) -> Callable[[argparse.Namespace], int]:
    """Add ``kvferry inspect``'s options to ``parser``; return the runner."""
    parser.add_argument("file", metavar="FILE", help="a payload file (reference or kvferry format)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--no-verify", action="store_true", help="do not verify checksums")
    return run


def _tensor_rows(decoded: DecodedHeader, buf: Any, verify: bool) -> tuple[list[dict[str, Any]], str | None]:
    """One record per descriptor, and the first checksum failure (None when all agree)."""
    header = decoded.header
    rows, error = [], None
    for entry, span in zip(header.tensors, decoded.spans):
        if isinstance(entry, AbsentTensor) or span is None:
            rows.append({"name": entry.name, "absent": True})
            continue
        status = "none"
        if entry.checksum is not None and header.checksum_algorithm is not None:
            if not verify:
                status = "not verified"
            else:
                actual = compute_checksum(header.checksum_algorithm, buf[span[0] : span[0] + span[1]])
                status = "ok" if actual == entry.checksum else f"MISMATCH (data {actual:08x})"
                if actual != entry.checksum and error is None:
                    error = (
                        f"invalid KV payload (tensor {entry.name!r}): {header.checksum_algorithm} "
                        f"mismatch: header says {entry.checksum:08x}, data has {actual:08x}"
                    )
        rows.append(
            {
                "name": entry.name,
                "layer": entry.layer,
                "dtype": entry.dtype,
                "shape": list(entry.shape),
                "bytes": entry.nbytes,
                "offset": entry.offset,
                "absolute_offset": span[0],
                "checksum": None if entry.checksum is None else f"{entry.checksum:08x}",
                "checksum_status": status,
            }
        )
    return rows, error


def inspect_buffer(buf: Any, *, verify: bool = True) -> dict[str, Any]:
    """Everything ``inspect`` reports about the payload in ``buf`` (bytes-like), as a dict:
    ``valid``, ``error`` (one line or None), and, when the header decoded, ``format``,
    ``header`` and ``tensors``."""
    view = memoryview(buf).cast("B") if not isinstance(buf, memoryview) else buf
    report: dict[str, Any] = {"total_bytes": len(view), "valid": False, "error": None}
    try:
        decoded = decode_header(view)
    except PayloadError as exc:
        report["error"] = " ".join(str(exc).split())
        return report
    h = decoded.header
    spans = [s for s in decoded.spans if s is not None]
    data_end = max((s[0] + s[1] for s in spans), default=decoded.data_start)
    padding = (data_end - decoded.data_start) - sum(s[1] for s in spans)
    kvferry = h.format_version is not None or h.checksum_algorithm is not None
    report.update(
        {
            "format": f"kvferry v{h.format_version}" if kvferry else "reference",
            "header": {
                "request_id": h.request_id,
                "num_layers": h.num_layers,
                "block_ids": len(h.block_ids),
                "block_ids_head": list(h.block_ids[:_SHOWN_BLOCK_IDS]),
                "metadata": h.metadata,
                "format_version": h.format_version,
                "checksum_algorithm": h.checksum_algorithm,
                "header_bytes": decoded.data_start,
                "data_bytes": len(view) - decoded.data_start,
                "padding_bytes": max(padding, 0),
                "trailing_bytes": len(view) - data_end,
                "present_tensors": len(spans),
                "absent_tensors": len(h.tensors) - len(spans),
            },
        }
    )
    rows, error = _tensor_rows(decoded, view, verify)
    report["tensors"] = rows
    report["valid"] = error is None
    report["error"] = error
    return report


def _render(path: str, report: dict[str, Any]) -> str:
    h = report["header"]
    ids = ", ".join(str(b) for b in h["block_ids_head"])
    more = f", ... ({h['block_ids']} in all)" if h["block_ids"] > len(h["block_ids_head"]) else ""
    lines = [
        f"{path}: {report['total_bytes']} bytes, {report['format']} payload",
        f"request id   {h['request_id']!r}",
        f"layers       {h['num_layers']} ({h['present_tensors']} tensors present, {h['absent_tensors']} absent)",
        f"block ids    [{ids}{more}]",
        f"metadata     {json.dumps(h['metadata'], sort_keys=True)}",
        f"checksums    {h['checksum_algorithm'] or 'none'}",
        f"layout       header {h['header_bytes']} B, data {h['data_bytes']} B "
        f"(padding {h['padding_bytes']} B, trailing {h['trailing_bytes']} B)",
        "",
    ]
    table = [["name", "layer", "dtype", "shape", "bytes", "offset", "checksum"]]
    for t in report["tensors"]:
        if t.get("absent"):
            table.append([t["name"], "-", "-", "absent", "-", "-", "-"])
        else:
            table.append(
                [
                    t["name"],
                    str(t["layer"]),
                    t["dtype"],
                    "x".join(map(str, t["shape"])) or "scalar",
                    str(t["bytes"]),
                    str(t["offset"]),
                    t["checksum_status"],
                ]
            )
    widths = [max(len(r[i]) for r in table) for i in range(len(table[0]))]
    for n, row in enumerate(table):
        lines.append("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines) + "\n"


def run(args: argparse.Namespace, *, out: TextIO | None = None, err: TextIO | None = None) -> int:
    """Inspect ``args.file``; exit status as in the module docstring."""
    out = sys.stdout if out is None else out
    err = sys.stderr if err is None else err
    try:
        with open(args.file, "rb") as handle:
            size = handle.seek(0, 2)
            buf: Any = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) if size else b""
    except OSError as exc:
        print(f"kvferry inspect: error: cannot read {args.file}: {exc.strerror or exc}", file=err)
        return 2
    try:
        report = inspect_buffer(buf, verify=not args.no_verify)
    finally:
        if isinstance(buf, mmap.mmap):
            buf.close()
    if args.json:
        json.dump({"file": args.file, **report}, out, indent=2)
        out.write("\n")
    elif "header" in report:
        out.write(_render(args.file, report))
    if not report["valid"]:
        print(f"kvferry inspect: {args.file}: {report['error']}", file=err)
        return 1
    return 0
