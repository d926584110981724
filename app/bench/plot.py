"""The benchmark's PNG: throughput by path (kvferry vs baseline vs the machine's limits).

With matplotlib importable (the ``bench`` extra) it draws the chart; otherwise it writes a
simple horizontal bar chart itself: an RGB raster with a built-in 5x7 pixel font, encoded as
PNG with :mod:`zlib` and :mod:`struct` (no extra dependency).
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Sequence
from typing import Any

import attrs

from kvferry.core.errors import ConfigError

__all__ = ["Bar", "bars_from_report", "write_plot", "render_png", "encode_png", "KIND_COLORS"]

#: Bar colours by kind (RGB).
KIND_COLORS: dict[str, tuple[int, int, int]] = {
    "limit": (140, 140, 140),
    "kvferry": (31, 119, 180),
    "baseline": (214, 39, 40),
}
#: (figure, label, kind) in plot order: copies and transfers (the zero-copy encode, 100x
#: faster than any of them, would flatten every other bar; it is in the table).
_PLOTTED: tuple[tuple[str, str, str], ...] = (
    ("memcpy", "memcpy, 1 thread", "limit"),
    ("extraction", "kvferry extraction", "kvferry"),
    ("baseline_extract", "baseline extraction", "baseline"),
    ("shm_direct_1", "kvferry shm primitives, 1 req", "kvferry"),
    ("shm_e2e_1", "kvferry shm e2e, 1 req", "kvferry"),
    ("shm_e2e_n", "kvferry shm e2e, N req", "kvferry"),
    ("homo_2_2", "kvferry shm TP 2->2", "kvferry"),
    ("hetero_2_4", "kvferry shm TP 2->4", "kvferry"),
    ("replicated_2_8", "kvferry shm TP 2->8 replicated", "kvferry"),
    ("mla_2_4", "kvferry shm TP 2->4 MLA", "kvferry"),
    ("raw_tcp", "raw tcp (kernel stream)", "limit"),
    ("raw_zmq", "raw zmq tcp", "limit"),
    ("zmq_direct_1", "kvferry zmq primitives, 1 req", "kvferry"),
    ("zmq_e2e_1", "kvferry zmq e2e, 1 req", "kvferry"),
    ("zmq_e2e_n", "kvferry zmq e2e, N req", "kvferry"),
    ("mooncake_direct_1", "kvferry mooncake primitives, 1 req", "kvferry"),
    ("mooncake_e2e_1", "kvferry mooncake e2e, 1 req", "kvferry"),
    ("mooncake_e2e_n", "kvferry mooncake e2e, N req", "kvferry"),
    ("mooncake_raw", "raw mooncake write", "limit"),
    ("nixl_direct_1", "kvferry nixl primitives, 1 req", "kvferry"),
    ("nixl_e2e_1", "kvferry nixl e2e, 1 req", "kvferry"),
    ("nixl_pair_get", "kvferry nixl get (paired)", "kvferry"),
    ("nixl_raw_read", "raw NIXL READ (paired)", "limit"),
    ("baseline_e2e", "baseline e2e (zmq tcp)", "baseline"),
)


@attrs.frozen
class Bar:
    """One bar: ``value`` in GB/s (1e9 bytes per second), ``kind`` a key of KIND_COLORS."""

    label: str
    value: float
    kind: str


def bars_from_report(report: dict[str, Any]) -> list[Bar]:
    """Median throughputs of the plotted figures present in ``report["figures"]``."""
    figures = report.get("figures", {})
    bars = []
    for name, label, kind in _PLOTTED:
        gbps = (figures.get(name) or {}).get("gbps") or {}
        if isinstance(gbps.get("median"), (int, float)):
            bars.append(Bar(label, float(gbps["median"]), kind))
    return bars


def write_plot(report: dict[str, Any], path: str) -> str:
    """Write the chart to ``path``; returns ``"matplotlib"`` or ``"builtin"`` (who drew it)."""
    bars = bars_from_report(report)
    nbytes = report.get("settings", {}).get("geometry", {}).get("nbytes", 0)
    title = f"kvferry bench: {nbytes / 1e6:.0f} MB per request, GB/s (medians)"
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        with open(path, "wb") as handle:
            handle.write(render_png(bars, title))
        return "builtin"
    fig, ax = plt.subplots(figsize=(10, 0.45 * max(len(bars), 1) + 1.5))
    labels = [b.label for b in bars][::-1]
    values = [b.value for b in bars][::-1]
    colors = [tuple(c / 255 for c in KIND_COLORS[b.kind]) for b in bars][::-1]
    ax.barh(labels, values, color=colors)
    for y, v in enumerate(values):
        ax.text(v, y, f" {v:.2f}", va="center")
    ax.set_xlabel("GB/s (1e9 bytes/s), median")
    ax.set_title(title)
    handles = [plt.Rectangle((0, 0), 1, 1, color=tuple(c / 255 for c in rgb)) for rgb in KIND_COLORS.values()]
    ax.legend(handles, list(KIND_COLORS), loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return "matplotlib"


# ------------------------------------------------------------------------ built-in raster
_GLYPHS: dict[str, str] = {  # 5 columns x 7 rows, row by row, '#' = ink
    "0": ".###.#...##..###.#.###..##...#.###.",
    "1": "..#...##....#....#....#....#...###.",
    "2": ".###.#...#....#...#...#...#...#####",
    "3": "#####...#...#.....#.....##...#.###.",
    "4": "...#...##..#.#.#..#.#####...#....#.",
    "5": "######....####.....#....##...#.###.",
    "6": "..##..#...#....####.#...##...#.###.",
    "7": "#####....#...#...#...#....#....#...",
    "8": ".###.#...##...#.###.#...##...#.###.",
    "9": ".###.#...##...#.####....#...#..##..",
    "A": ".###.#...##...#######...##...##...#",
    "B": "####.#...##...#####.#...##...#####.",
    "C": ".###.#...##....#....#....#...#.###.",
    "D": "###..#..#.#...##...##...##..#.###..",
    "E": "######....#....####.#....#....#####",
    "F": "######....#....####.#....#....#....",
    "G": ".###.#...##....#.####...##...#.####",
    "H": "#...##...##...#######...##...##...#",
    "I": ".###...#....#....#....#....#...###.",
    "J": "..###...#....#....#....##..#..##...",
    "K": "#...##..#.#.#..##...#.#..#..#.#...#",
    "L": "#....#....#....#....#....#....#####",
    "M": "#...###.###.#.##.#.##...##...##...#",
    "N": "#...##...###..##.#.##..###...##...#",
    "O": ".###.#...##...##...##...##...#.###.",
    "P": "####.#...##...#####.#....#....#....",
    "Q": ".###.#...##...##...##.#.##..#..##.#",
    "R": "####.#...##...#####.#.#..#..#.#...#",
    "S": ".####.....#.....###.....#....#####.",
    "T": "#####..#....#....#....#....#....#..",
    "U": "#...##...##...##...##...##...#.###.",
    "V": "#...##...##...##...##...#.#.#...#..",
    "W": "#...##...##...##.#.##.#.##.#.#.#.#.",
    "X": "#...##...#.#.#...#...#.#.#...##...#",
    "Y": "#...##...#.#.#...#....#....#....#..",
    "Z": "#####....#...#...#...#...#....#####",
    " ": "." * 35,
    ".": "..........................##...##..",
    ",": ".....................##....#...#...",
    "-": "." * 15 + ".###." + "." * 15,
    ":": "......##...##........##...##.......",
    "/": "....#....#...#...#...#...#....#....",
    "(": "...#...#...#....#....#.....#.....#.",
    ")": ".#.....#.....#....#....#...#...#...",
    ">": "#.....#.....#.....#...#...#...#....",
    "=": "..........#####.....#####..........",
    "+": ".......#....#..#####..#....#.......",
    "%": "##...##..#...#...#...#...#..##...##",
    "_": "." * 30 + "#####",
}
_SCALE = 2
_CELL = 6 * _SCALE  # glyph advance (5 columns + 1 space)


def _glyph(ch: str) -> str:
    rows = _GLYPHS.get(ch.upper(), _GLYPHS[" "])
    return rows.ljust(35, ".")[:35]


@attrs.define(eq=False)
class _Canvas:
    width: int
    height: int
    pixels: bytearray = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        self.pixels = bytearray(b"\xff" * (self.width * self.height * 3))

    def rect(self, x: int, y: int, w: int, h: int, rgb: tuple[int, int, int]) -> None:
        x0, y0 = max(0, x), max(0, y)
        x1, y1 = min(self.width, x + w), min(self.height, y + h)
        if x1 <= x0 or y1 <= y0:
            return
        row = bytes(rgb) * (x1 - x0)
        for yy in range(y0, y1):
            start = (yy * self.width + x0) * 3
            self.pixels[start : start + len(row)] = row

    def text(self, x: int, y: int, text: str, rgb: tuple[int, int, int] = (0, 0, 0)) -> None:
        for i, ch in enumerate(text):
            rows = _glyph(ch)
            for r in range(7):
                for c in range(5):
                    if rows[r * 5 + c] == "#":
                        self.rect(x + i * _CELL + c * _SCALE, y + r * _SCALE, _SCALE, _SCALE, rgb)


def encode_png(width: int, height: int, rgb: bytes) -> bytes:
    """An 8-bit RGB PNG of ``width`` x ``height`` pixels from row-major ``rgb`` bytes."""
    if width < 1 or height < 1 or len(rgb) != width * height * 3:
        raise ConfigError(f"need {width}x{height}x3 bytes of pixels, got {len(rgb)}")

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body) & 0xFFFFFFFF)

    stride = width * 3
    raw = b"".join(b"\x00" + rgb[y * stride : (y + 1) * stride] for y in range(height))
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw, 6)) + chunk(b"IEND", b"")


def render_png(bars: Sequence[Bar], title: str) -> bytes:
    """A horizontal bar chart (labels left, GB/s right of each bar, a legend) as PNG bytes."""
    label_chars = max([len(b.label) for b in bars] + [10])
    left = 16 + label_chars * _CELL + 12
    plot_w, row_h, top = 560, 26, 56
    width = left + plot_w + 12 * _CELL + 16
    height = top + row_h * max(len(bars), 1) + 64
    canvas = _Canvas(width, height)
    canvas.text(16, 16, title[: (width - 32) // _CELL])
    peak = max([b.value for b in bars if b.value > 0] + [1e-9])
    for i, bar in enumerate(bars):
        y = top + i * row_h
        canvas.text(16, y + 5, bar.label)
        length = int(plot_w * max(bar.value, 0.0) / peak)
        canvas.rect(left, y + 2, max(length, 1), row_h - 6, KIND_COLORS.get(bar.kind, (0, 0, 0)))
        canvas.text(left + length + 8, y + 5, f"{bar.value:.2f} GB/s")
    canvas.rect(left - 1, top - 4, 1, row_h * max(len(bars), 1) + 4, (0, 0, 0))
    y = height - 36
    x = 16
    for kind, rgb in KIND_COLORS.items():
        canvas.rect(x, y, 18, 14, rgb)
        canvas.text(x + 26, y + 1, kind)
        x += 26 + (len(kind) + 3) * _CELL
    return encode_png(width, height, bytes(canvas.pixels))
