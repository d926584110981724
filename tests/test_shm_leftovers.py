"""The engine suites' sweep of what killed engine processes leave in /dev/shm (shm_leftovers):
only new files with the engines' prefixes, and only those no live process holds open or maps.
Here in a temporary directory, with a real second process holding two of the files."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from shm_leftovers import held_paths, remove_orphans

_HOLDER = """
import mmap, os, sys
held = open(sys.argv[1], "rb")                       # open: an fd in /proc/<pid>/fd
fd = os.open(sys.argv[2], os.O_RDWR)
mapped = mmap.mmap(fd, 4096)                         # mapped, its fd closed: only in maps
os.close(fd)
print("ready", flush=True)
sys.stdin.readline()
"""


def test_only_new_engine_files_no_live_process_holds_are_removed(tmp_path: Path) -> None:
    old = tmp_path / "psm_old"
    old.write_bytes(b"x")
    before = {p.name for p in tmp_path.iterdir()}
    for name, size in (("psm_free", 3000), ("psm_open", 10), ("sem.mp-mapped", 4096), ("kvferry-seg", 7)):
        (tmp_path / name).write_bytes(b"\0" * size)
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, str(tmp_path / "psm_open"), str(tmp_path / "sem.mp-mapped")],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "ready"
        held = held_paths()
        assert str(tmp_path / "psm_open") in held and str(tmp_path / "sem.mp-mapped") in held
        assert str(tmp_path / "psm_free") not in held
        sweep = remove_orphans(tmp_path, before)
        assert sweep.removed == ("psm_free",) and sweep.removed_bytes == 3000
        assert sweep.kept == ("psm_open", "sem.mp-mapped")
        left = {p.name for p in tmp_path.iterdir()}
        assert left == {"psm_old", "psm_open", "sem.mp-mapped", "kvferry-seg"}
    finally:
        holder.communicate("go\n", timeout=30)
    # the holder gone, what it held is an orphan too; what was there before and kvferry's stay
    sweep = remove_orphans(tmp_path, before)
    assert sweep.removed == ("psm_open", "sem.mp-mapped") and sweep.kept == ()
    assert {p.name for p in tmp_path.iterdir()} == {"psm_old", "kvferry-seg"}
