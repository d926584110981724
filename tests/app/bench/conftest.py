"""One tiny ``kvferry bench --runs 2`` through the command line, shared by the bench tests.

The peer timeout is generous: on a loaded machine a fresh worker process importing torch can
take tens of seconds before its first answer (the bound on every wait, not a pace)."""

from __future__ import annotations

import contextlib
import io
import json
import pathlib
import sys
from typing import Any

import pytest

from kvferry.app.bench.proc import set_launcher
from kvferry.app.cli import main


def _warm_launcher(argv: list[str], *, close_fds: bool = True, **popen: Any) -> Any:
    """``subprocess.Popen(argv, ...)`` for ``argv = [python, -m, module]``, forked warm."""
    import warm_spawn

    assert argv[0] == sys.executable and close_fds
    return warm_spawn.popen(argv[1:], **popen)


TINY = [
    "--layers",
    "2",
    "--tokens",
    "256",
    "--heads",
    "4",
    "--head-dim",
    "128",
    "--reps",
    "2",
    "--warmup",
    "1",
    "--requests",
    "2",
    "--readiness-reps",
    "3",
    "--timeout",
    "90",
    "--runs",
    "2",
    "--quiet",
]


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[int, str, dict, pathlib.Path]:
    """(exit status, printed table, the JSON report, the PNG's path) of two whole tiny runs."""
    out_dir = tmp_path_factory.mktemp("bench")
    buffer = io.StringIO()
    # the peers fork from the warm-start server (they would each spend seconds importing torch)
    previous = set_launcher(_warm_launcher)
    try:
        with contextlib.redirect_stdout(buffer):
            code = main(["bench", *TINY, "--json", str(out_dir / "b.json"), "--plot", str(out_dir / "b.png")])
    finally:
        set_launcher(previous)
    return code, buffer.getvalue(), json.loads((out_dir / "b.json").read_text()), out_dir / "b.png"
