"""The demo's progress display: a bar on a terminal, otherwise a plain line every few seconds.

A bar redraws in place with carriage returns, which only a terminal renders; in a log or a
pipe every redraw would pile up on one line, so there the display writes one complete line
(``progress: 12/64 requests received, 3.1 s``) at most every ``interval_s`` seconds, and one
when the last request arrives.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TextIO

import attrs

__all__ = ["Progress"]


@attrs.define(eq=False)
class Progress:
    """Call :meth:`update` when a request completes and :meth:`tick` now and then (so a line
    appears while nothing completes). ``tty`` defaults to ``stream.isatty()``."""

    stream: TextIO
    tty: bool | None = None
    interval_s: float = 5.0
    clock: Callable[[], float] = time.monotonic
    width: int = 40
    _start: float = attrs.field(init=False, default=0.0)
    _last_line: float = attrs.field(init=False, default=0.0)
    _done: int = attrs.field(init=False, default=0)
    _total: int = attrs.field(init=False, default=0)
    _finished: bool = attrs.field(init=False, default=False)

    def __attrs_post_init__(self) -> None:
        if self.tty is None:
            isatty = getattr(self.stream, "isatty", None)
            self.tty = bool(isatty()) if callable(isatty) else False
        self._start = self._last_line = self.clock()

    def update(self, done: int, total: int) -> None:
        self._done, self._total = done, total
        self._show(force=done >= total)

    def tick(self) -> None:
        if self._total:
            self._show(force=False)

    def _show(self, force: bool) -> None:
        if self._finished:
            return
        now = self.clock()
        n, total = self._done, self._total
        if self.tty:
            filled = self.width * n // max(total, 1)
            self.stream.write(f"\r  [{'#' * filled}{'.' * (self.width - filled)}] {n}/{total} requests")
            if n >= total:
                self.stream.write("\n")
        elif force or now - self._last_line >= self.interval_s:
            self.stream.write(f"  progress: {n}/{total} requests received, {now - self._start:.1f} s\n")
            self._last_line = now
        else:
            return
        self._finished = n >= total
        self.stream.flush()
