"""Shared-memory segments and runtime files of the shm connector: names, creation, reaping.

Naming (one function each, used by both sides):

- namespace: config ``namespace``, default ``u{uid}``; letters, digits, ``_`` and ``.`` only.
- segment: ``/dev/shm/kvferry-{namespace}-{owner_pid}-{tag}-{token}`` where ``tag`` is the
  sender's port (or ``x`` without one) and ``token`` 8 random hex digits. Mode 0600; a
  receiver maps only segments owned by its own uid.
- runtime directory: ``{base}/kvferry-{namespace}`` (mode 0700), ``base`` = config
  ``runtime_dir``, else ``$XDG_RUNTIME_DIR``, else ``/tmp``; an existing one must belong to
  this user (a group/world-writable one is made 0700). It holds, per sender, the control
  socket ``ctl-{tag}.sock`` and its owner file ``ctl-{tag}.pid`` (the owner's pid, then the
  segment name).
- control endpoint: ``ipc://{runtime directory}/ctl-{port}.sock``: a receiver derives it from
  (namespace, port) alone.

Reaping: :func:`reap_namespace` removes segments, sockets and owner files of a namespace whose
owner process is gone (no such pid, or a zombie). Both roles run it when they start, so a
crashed writer's segment does not outlive the next start in its namespace.

Watching: a segment in /dev/shm is also handed to Python's resource tracker when it is created
(``multiprocessing.resource_tracker``, type ``shared_memory``) and taken back from it when its
owner discards it (:func:`discard_segment`). The tracker is a process of its own, shared by the
process tree that started it (a spawned or forked child uses its parent's), that ignores SIGINT
and SIGTERM; once every process of the tree has exited, it unlinks what is still registered. So
a segment whose owner is killed without running its cleanup (an engine's shutdown that
force-kills its workers, a SIGKILL) is gone when that tree has ended, without waiting for the
next start in the namespace. A SIGKILL of the whole tree (its process group) kills the tracker
too: then the reaper is what removes it. Unlinking never unmaps: a receiver still reading keeps
its pages.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import re
import secrets
import socket
import stat
import threading
from typing import Any

import attrs
import torch

from kvferry.core.errors import BindError, ConfigError

__all__ = [
    "SHM_DIR",
    "SEGMENT_PREFIX",
    "default_namespace",
    "check_namespace",
    "segment_name",
    "parse_segment_name",
    "runtime_dir",
    "control_endpoint",
    "control_paths",
    "owner_file_of",
    "pid_alive",
    "sender_gone",
    "Segment",
    "create_segment",
    "discard_segment",
    "open_segment",
    "claim_control",
    "remove_quietly",
    "reap_namespace",
]

logger = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
SEGMENT_PREFIX = "kvferry-"
_NAMESPACE_RE = re.compile(r"^[A-Za-z0-9_.]{1,48}$")
_SEGMENT_RE = re.compile(r"^kvferry-(?P<ns>[A-Za-z0-9_.]+)-(?P<pid>\d+)-(?P<tag>\d+|x)-(?P<token>[0-9a-f]+)$")
_PIDFILE_RE = re.compile(r"^ctl-(?P<tag>[0-9a-z]+)\.pid$")
#: An owner file being written (claim_control), by process ``pid``.
_DRAFT_RE = re.compile(r"^ctl-[0-9a-z]+\.pid\.(?P<pid>[0-9]+)\.[0-9]+\.new$")


def default_namespace(uid: int | None = None) -> str:
    """The per-user default namespace ``u{uid}``."""
    return f"u{os.getuid() if uid is None else uid}"


def check_namespace(namespace: Any) -> str:
    if not isinstance(namespace, str) or not _NAMESPACE_RE.match(namespace):
        raise ConfigError(f"shm config 'namespace' must be 1-48 letters, digits, '_' or '.', got {namespace!r}")
    return namespace


def segment_name(namespace: str, pid: int, port: int | None, token: str) -> str:
    """``kvferry-{namespace}-{pid}-{port or x}-{token}`` (a file name in /dev/shm)."""
    return f"{SEGMENT_PREFIX}{namespace}-{pid}-{'x' if port is None else port}-{token}"


def parse_segment_name(name: str) -> tuple[str, int, str, str] | None:
    """``(namespace, owner_pid, tag, token)`` of a segment name, or None if not one of ours."""
    match = _SEGMENT_RE.match(name)
    if match is None:
        return None
    return match["ns"], int(match["pid"]), match["tag"], match["token"]


def runtime_dir(namespace: str, base: str | None = None) -> str:
    """The namespace's runtime directory (not created here)."""
    root = base or os.environ.get("XDG_RUNTIME_DIR") or "/tmp"
    return os.path.join(root, f"kvferry-{namespace}")


def control_paths(namespace: str, tag: str, base: str | None = None) -> tuple[str, str]:
    """``(socket path, owner file path)`` of the sender tagged ``tag`` (its port)."""
    directory = runtime_dir(namespace, base)
    return os.path.join(directory, f"ctl-{tag}.sock"), os.path.join(directory, f"ctl-{tag}.pid")


def control_endpoint(namespace: str, port: int, base: str | None = None) -> str:
    """The zmq endpoint of the sender bound with ``port`` in ``namespace``."""
    return "ipc://" + control_paths(namespace, str(port), base)[0]


def owner_file_of(socket_path: str) -> str | None:
    """The owner file beside control socket ``socket_path`` (``ctl-{tag}.sock`` ->
    ``ctl-{tag}.pid``, :func:`control_paths`' pair); None for a path that is not one."""
    return socket_path[: -len(".sock")] + ".pid" if socket_path.endswith(".sock") else None


def pid_alive(pid: int) -> bool:
    """True when ``pid`` names a running (non-zombie) process."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            state = stat.read().rsplit(b")", 1)[1].split()[0]
        return state not in (b"Z", b"X")
    except (OSError, IndexError):
        return True  # no /proc: the kill probe said it exists


def sender_gone(socket_path: str) -> bool:
    """True when the sender behind control socket ``socket_path`` is known to be gone: its
    owner file names a process that is not running AND nothing accepts a connection on the
    socket (a dead pid alone could be a pid of another pid namespace). False while it may live
    or may not have started yet (no owner file, a live owner, a listener)."""
    pidfile = owner_file_of(socket_path)
    owner = None if pidfile is None else _owner_pid(pidfile)
    if owner is None or pid_alive(owner):
        return False
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.settimeout(0.5)
        probe.connect(socket_path)
    except (ConnectionRefusedError, FileNotFoundError):
        return True  # no listener: its owner took it down with it
    except OSError:
        return False
    finally:
        probe.close()
    return False  # someone listens there: a sender of another pid namespace, or a new one


def remove_quietly(path: str) -> bool:
    """Unlink ``path``; True if removed, False if it was already gone."""
    try:
        os.unlink(path)
        return True
    except FileNotFoundError:
        return False


@attrs.define(eq=False)
class Segment:
    """A mapped segment: ``tensor`` is a 1-D uint8 view of all ``nbytes`` of the mapping."""

    name: str
    path: str
    nbytes: int
    mapping: mmap.mmap
    tensor: torch.Tensor
    #: handed to the resource tracker (see the module's doc): taken back by discard_segment
    tracked: bool = False
    #: The mapping's first address in this process (``tensor``'s, read once).
    address: int = attrs.field(init=False)

    @address.default
    def _address(self) -> int:
        return int(self.tensor.data_ptr())

    @property
    def address_range(self) -> tuple[int, int]:
        """``(first, one past last)`` address of the mapping in this process."""
        return self.address, self.address + self.nbytes

    def unmap(self) -> bool:
        """Drop the mapping; False when views of it are still alive (it then goes with them)."""
        self.tensor = torch.empty(0, dtype=torch.uint8)
        try:
            self.mapping.close()
            return True
        except BufferError:
            return False


def _map(fd: int, nbytes: int, populate: bool) -> tuple[mmap.mmap, torch.Tensor]:
    flags = mmap.MAP_SHARED | (getattr(mmap, "MAP_POPULATE", 0) if populate else 0)
    mapping = mmap.mmap(fd, nbytes, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    # through a memoryview the tensor holds: an export of the mapping while any view of the
    # tensor lives, so closing the mapping then fails (BufferError) instead of unmapping memory
    # a view still reads (torch.frombuffer of the mmap itself keeps no export)
    return mapping, torch.frombuffer(memoryview(mapping), dtype=torch.uint8)


def create_segment(namespace: str, port: int | None, nbytes: int, shm_dir: str = SHM_DIR) -> Segment:
    """Create, size (backing pages reserved now: a full /dev/shm fails here, not mid-put),
    pre-fault and map a new 0600 segment owned by this process."""
    name = segment_name(namespace, os.getpid(), port, secrets.token_hex(4))
    path = os.path.join(shm_dir, name)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        os.fchmod(fd, 0o600)
        try:
            os.posix_fallocate(fd, 0, nbytes)
        except OSError as exc:
            if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                raise
            os.ftruncate(fd, nbytes)
        mapping, tensor = _map(fd, nbytes, populate=True)
    except BaseException:
        os.close(fd)
        remove_quietly(path)
        raise
    os.close(fd)
    return Segment(name, path, nbytes, mapping, tensor, tracked=_track(name, shm_dir))


def _tracker_name(name: str) -> str:
    """The name the resource tracker unlinks with ``shm_unlink`` (a POSIX shm name)."""
    return "/" + name


def _track(name: str, shm_dir: str) -> bool:
    """Register segment ``name`` with this process tree's resource tracker (starting it if
    there is none); False for a segment outside /dev/shm (the tracker unlinks by POSIX shm
    name) or when no tracker can run here (a warning: the reaper is then the only way out)."""
    if os.path.realpath(shm_dir) != os.path.realpath(SHM_DIR):
        return False
    try:
        from multiprocessing import resource_tracker

        resource_tracker.register(_tracker_name(name), "shared_memory")
    except Exception as exc:  # any failure to start or reach the tracker
        logger.warning(
            "shm segment %s is not watched by a resource tracker (%s: %s): if this process is killed, "
            "it stays in %s until the next kvferry start in its namespace",
            name,
            type(exc).__name__,
            exc,
            SHM_DIR,
        )
        return False
    return True


def discard_segment(segment: Segment) -> bool:
    """Unlink the owner's ``segment`` and take it back from the resource tracker (in this
    order: a process killed between the two leaves the tracker a name that is gone, never a
    file nobody watches). The mapping stays. True if the file was there."""
    removed = remove_quietly(segment.path)
    if segment.tracked:
        segment.tracked = False
        try:
            from multiprocessing import resource_tracker

            resource_tracker.unregister(_tracker_name(segment.name), "shared_memory")
        except Exception as exc:  # the tracker is gone: nothing of ours is left with it
            logger.debug("resource tracker unreachable while discarding %s: %s", segment.name, exc)
    return removed


def open_segment(name: str, shm_dir: str = SHM_DIR) -> Segment:
    """Map an existing segment by name (receiver side). Raises OSError when it is gone, and
    ValueError for a name that is not a kvferry segment."""
    if parse_segment_name(name) is None:
        raise ValueError(f"not a kvferry segment name: {name!r}")
    path = os.path.join(shm_dir, name)
    fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
    try:
        info = os.fstat(fd)
        if info.st_uid != os.getuid():  # planted by another user: never read it as KV
            raise ValueError(f"segment {name!r} belongs to uid {info.st_uid}, not {os.getuid()}")
        nbytes = info.st_size
        mapping, tensor = _map(fd, nbytes, populate=False)
    finally:
        os.close(fd)
    return Segment(name, path, nbytes, mapping, tensor)


def _private_directory(directory: str) -> None:
    """Create ``directory`` (0700) or make sure the existing one is this user's and private.

    The control sockets live there: a directory another user owns or may write to (a shared
    ``/tmp``) would let them replace a socket and impersonate the sender. Raises BindError.
    """
    os.makedirs(directory, mode=0o700, exist_ok=True)
    info = os.lstat(directory)
    if not stat.S_ISDIR(info.st_mode):
        raise BindError(f"shm runtime directory {directory} is not a directory (a symlink?)")
    if info.st_uid != os.getuid():
        raise BindError(
            f"shm runtime directory {directory} belongs to uid {info.st_uid}, not {os.getuid()}; "
            "set runtime_dir (or XDG_RUNTIME_DIR) to a private directory"
        )
    if stat.S_IMODE(info.st_mode) & 0o077:
        os.chmod(directory, 0o700)


# a peer that closes or reaps removes the namespace's directory once it is empty, which can happen
# between this sender's makedirs and its owner file: each such race costs one attempt
_CLAIM_ATTEMPTS = 20


def claim_control(namespace: str, tag: str, segment: str, base: str | None = None) -> tuple[str, str]:
    """Create the owner file of sender ``tag`` (exclusive); returns ``(socket, owner file)``.

    A stale owner file (dead pid) is replaced; one owned by a live process is a BindError
    naming the port and the pid.
    """
    directory = runtime_dir(namespace, base)
    sock, pidfile = control_paths(namespace, tag, base)
    # the owner file appears with its content (written to a file of our own, then linked: a
    # hard link fails if the name exists, as O_EXCL does): a peer's reaper that looks at the
    # moment it appears reads a live pid, never an empty file it would take for a stale one
    draft = f"{pidfile}.{os.getpid()}.{threading.get_ident()}.new"
    for _ in range(_CLAIM_ATTEMPTS):
        try:
            _private_directory(directory)
            fd = os.open(draft, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
            with os.fdopen(fd, "w") as out:
                out.write(f"{os.getpid()}\n{segment}\n")
            try:
                os.link(draft, pidfile)
            finally:
                remove_quietly(draft)
        except FileExistsError:
            owner = _owner_pid(pidfile)
            if owner is not None and pid_alive(owner):
                raise BindError(f"shm port {tag} in namespace {namespace!r} is held by live process {owner}") from None
            remove_quietly(sock)
            remove_quietly(pidfile)
            continue
        except FileNotFoundError:  # a closing or reaping peer removed the (empty) directory: retry
            continue
        remove_quietly(sock)
        return sock, pidfile
    raise BindError(f"could not claim shm port {tag} in namespace {namespace!r} ({pidfile})")


def _owner_pid(pidfile: str) -> int | None:
    try:
        with open(pidfile, encoding="ascii") as handle:
            first = handle.readline().strip()
        return int(first) if first.isdigit() else None
    except (OSError, ValueError):
        return None


def reap_namespace(namespace: str, base: str | None = None, shm_dir: str = SHM_DIR) -> list[str]:
    """Remove the namespace's segments, sockets and owner files whose owner is dead.

    Returns the paths removed. Never touches anything owned by a live process.
    """
    removed: list[str] = []
    try:
        names = os.listdir(shm_dir)
    except FileNotFoundError:
        names = []
    for name in names:
        parsed = parse_segment_name(name)
        if parsed is None or parsed[0] != namespace or pid_alive(parsed[1]):
            continue
        path = os.path.join(shm_dir, name)
        if remove_quietly(path):
            removed.append(path)
    directory = runtime_dir(namespace, base)
    try:
        entries = os.listdir(directory)
    except FileNotFoundError:
        return removed
    for entry in entries:
        draft = _DRAFT_RE.match(entry)
        if draft is not None and not pid_alive(int(draft["pid"])):  # its writer died mid-claim
            path = os.path.join(directory, entry)
            if remove_quietly(path):
                removed.append(path)
            continue
        match = _PIDFILE_RE.match(entry)
        if match is None:
            continue
        pidfile = os.path.join(directory, entry)
        owner = _owner_pid(pidfile)
        if owner is not None and pid_alive(owner):
            continue
        sock = os.path.join(directory, f"ctl-{match['tag']}.sock")
        removed.extend(p for p in (sock, pidfile) if remove_quietly(p))
    for entry in os.listdir(directory):
        path = os.path.join(directory, entry)
        owner_file = owner_file_of(path)
        if owner_file is not None and not os.path.exists(owner_file):
            if remove_quietly(path):  # a socket whose owner file is gone: its owner is gone
                removed.append(path)
    if removed:
        logger.warning(
            "reaped %d leftover shm files of dead owners in namespace %r: %s", len(removed), namespace, removed
        )
    try:
        os.rmdir(directory)
    except OSError:
        pass  # not empty (live senders) or already gone
    return removed
