"""The fork server's pre-exec hook of the multi-host tests: put the child into a host's network
namespace (``setns``, what ``ip netns exec`` does) before the worker runs, so its sockets live in
that host's network stack and ``ip netns pids`` lists it.

As ``ip netns exec`` does, the child also gets a mount namespace of its own (a slave of the
host's: nothing it mounts propagates back) with a fresh ``/sys``, so that programs that read
the network devices from ``/sys/class/net`` (UCX, under the nixl connector) see the host's
devices (its veth) instead of the machine's."""

from __future__ import annotations

import ctypes
import os

CLONE_NEWNET = 0x40000000
CLONE_NEWNS = 0x00020000
MS_REC, MS_SLAVE = 0x4000, 0x80000
MNT_DETACH = 2
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
    _check(_LIBC.unshare(CLONE_NEWNS), "unshare the mount namespace")
    _check(_LIBC.mount(None, b"/", None, MS_REC | MS_SLAVE, None), "make / a slave mount")
    _check(_LIBC.umount2(b"/sys", MNT_DETACH), "unmount /sys")
    _check(_LIBC.mount(b"sysfs", b"/sys", b"sysfs", 0, None), f"mount the sysfs of {name}")


def _check(rc: int, what: str) -> None:
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")
