"""Files the engines' processes leave in /dev/shm when a test kills them (SIGKILL: no cleanup of
theirs runs): torch's shared-memory manager (``psm_*``), multiprocessing's named semaphores
(``sem.mp-*``), vLLM CPU's TP broadcast buffers (``vllm_dist_*``): five runs of the engine
suites on one machine had left 58 of them, 4.3 GB of memory. The engine suites' session
removes the ones that appeared during the session and that no live process still holds open
or maps (:func:`remove_orphans`); kvferry's own segments are not among the names (its reaper
and the resource tracker remove those, and a kvferry file left behind is a bug to see, not to
sweep)."""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

import attrs

#: Name prefixes of the engines' files that a killed process leaves behind.
ENGINE_PREFIXES = ("psm_", "sem.mp-", "vllm_dist_")


def held_paths(proc: str = "/proc") -> set[str]:
    """Every path some live process has open (``/proc/*/fd``) or mapped (``/proc/*/maps``);
    a process that exits meanwhile, or one this user may not look at, is skipped."""
    held: set[str] = set()
    for pid in os.listdir(proc):
        if not pid.isdigit():
            continue
        base = os.path.join(proc, pid)
        try:
            for fd in os.listdir(os.path.join(base, "fd")):
                try:
                    held.add(os.readlink(os.path.join(base, "fd", fd)).removesuffix(" (deleted)"))
                except OSError:
                    continue
            with open(os.path.join(base, "maps")) as maps:
                for line in maps:
                    parts = line.split(None, 5)
                    if len(parts) == 6:
                        held.add(parts[5].strip().removesuffix(" (deleted)"))
        except OSError:
            continue
    return held


@attrs.frozen
class Sweep:
    """What :func:`remove_orphans` did: the names it removed (and their bytes), the names it
    kept because a live process holds them."""

    removed: tuple[str, ...]
    removed_bytes: int
    kept: tuple[str, ...]


def remove_orphans(directory: str | Path, before: Iterable[str], prefixes: tuple[str, ...] = ENGINE_PREFIXES) -> Sweep:
    """Remove the files of ``directory`` named with one of ``prefixes`` that were not there
    ``before`` and that no live process holds (:func:`held_paths`)."""
    directory = str(directory)
    old = set(before)
    new = sorted(n for n in os.listdir(directory) if n not in old and n.startswith(prefixes))
    held = held_paths() if new else set()
    removed: list[str] = []
    kept: list[str] = []
    nbytes = 0
    for name in new:
        path = os.path.join(directory, name)
        if path in held:
            kept.append(name)
            continue
        try:
            size = os.stat(path).st_size
            os.unlink(path)
        except FileNotFoundError:  # its owner removed it meanwhile
            continue
        removed.append(name)
        nbytes += size
    return Sweep(tuple(removed), nbytes, tuple(kept))
