"""The ``kvferry`` command line.

Sub-commands live in their own modules and register themselves here through ``COMMANDS``:
each entry maps a name to ``"module:function"`` where the function takes the argparse
sub-parser to fill and returns the callable that runs the command (``args -> exit status``).
Modules are imported lazily so ``kvferry --help`` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable, Sequence

__all__ = ["main", "COMMANDS"]

#: name -> (help line, "module:function" that configures the sub-parser and returns the runner)
COMMANDS: dict[str, tuple[str, str]] = {
    "demo": (
        "run a real sender -> receiver pipeline on this machine and verify it bit for bit",
        "kvferry.app.demo.command:configure",
    ),
    "plan": ("print every rank's keys, ports and head slices", "kvferry.app.plan.command:configure"),
    "bench": (
        "measure kvferry against the machine's limits and a naive baseline",
        "kvferry.app.bench.command:configure",
    ),
    "inspect": ("decode a payload file and print its header and tensor table", "kvferry.app.inspect.command:configure"),
}


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, Callable[[argparse.Namespace], int]]]:
    parser = argparse.ArgumentParser(
        prog="kvferry",
        description="Move a request's KV cache between inference stages with different TP sizes.",
    )
    from kvferry.app import __version__

    parser.add_argument("--version", action="version", version=f"kvferry {__version__}")
    subs = parser.add_subparsers(dest="command", metavar="COMMAND")
    runners: dict[str, Callable[[argparse.Namespace], int]] = {}
    for name, (help_line, target) in COMMANDS.items():
        sub = subs.add_parser(name, help=help_line, description=help_line)
        module_name, func_name = target.split(":")
        try:
            configure = getattr(importlib.import_module(module_name), func_name)
        except ImportError:
            continue
        runners[name] = configure(sub)
    return parser, runners


def main(argv: Sequence[str] | None = None) -> int:
    parser, runners = build_parser()
    args = parser.parse_args(argv)
    if not args.command:
        parser.print_help()
        return 0
    runner = runners.get(args.command)
    if runner is None:
        print(f"kvferry: error: command {args.command!r} is not available", file=sys.stderr)
        return 2
    return int(runner(args) or 0)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
