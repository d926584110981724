"""The fork server's pre-exec hook of the multi-host tests: put the child into a host's network
namespace (``setns``, what ``ip netns exec`` does) before the worker runs, so its sockets live in
that host's network stack and ``ip netns pids`` lists it."""

from __future__ import annotations

import ctypes
import os

CLONE_NEWNET = 0x40000000
#: Loaded here, at import, not in the child: a fresh interpreter runs the hook as ``preexec_fn``,
#: between fork and exec, where loading a library is not safe.
_LIBC = ctypes.CDLL(None, use_errno=True)


def enter(name: str) -> None:
    """Move this process into the network namespace ``/run/netns/NAME``; OSError if it cannot."""
    fd = os.open(f"/run/netns/{name}", os.O_RDONLY)
    try:
        if _LIBC.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns into {name}: {os.strerror(err)}")
    finally:
        os.close(fd)
