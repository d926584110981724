"""Python child processes for the multi-process tests, forked from a server that has imported
torch (and kvferry) already, so a rank starts in milliseconds instead of re-importing torch.

``popen(args, stdin=..., stdout=..., stderr=..., text=..., cwd=..., env=..., bufsize=...)``
stands for ``subprocess.Popen([sys.executable, *args], ...)``; ``args`` is ``SCRIPT ARG...``,
``-c CODE ARG...`` or ``-m MODULE ARG...``. It returns a :class:`WarmProcess` (``pid``,
``stdin``, ``stdout``, ``stderr``, ``returncode``, ``poll``, ``wait``, ``send_signal``, ``kill``,
``terminate``: the part of ``Popen`` the tests use), or a real ``Popen`` where a warm start
would not be the same as a fresh interpreter (see :func:`_cold_reason`), or when the
environment variable ``KVFERRY_TEST_COLD_SPAWN`` is set (every child is then a fresh one).

``pre_exec``: a hook run in the child before the program starts (after its streams, cwd and
environment are set), e.g. entering a network namespace (``hosts/netns_enter.py``). It is a
module-level function, or a ``functools.partial`` of one with JSON-able positional arguments:
the server's child looks the function up by module and name (importing the module from its file
when the server has not), and a fresh interpreter gets it as ``Popen``'s ``preexec_fn``. An
exception in it ends the child with status 1 and the traceback on its stderr (a warm start) or
raises ``SubprocessError`` here (a fresh one).

What makes the fork safe:

- The server is a process of its own (started once per test session, from the session's
  environment, before any test ran), not the test process: it has no threads, no zmq context,
  no torch thread pool, no shm segment and no open connection when it forks. It checks that it
  is single-threaded before every fork and refuses (the caller then starts a fresh interpreter)
  otherwise. It imports modules only; it runs no torch operation and creates no zmq context.
  numpy's BLAS would start a thread pool at import, so it imports numpy with
  ``OPENBLAS_NUM_THREADS=1`` set meanwhile: the children's BLAS is single-threaded (their
  ``os.environ`` is the caller's, unchanged).
- The child gets the caller's stdin/stdout/stderr (passed over a unix socket), its cwd and its
  whole environment (``os.environ``), ``sys.argv``, ``sys.path[0]`` and a fresh ``__main__`` as
  the interpreter would set them; it re-seeds ``random`` and numpy's global generator (a fresh
  interpreter seeds them from the OS; torch's default generator is left at its fixed start
  seed, as in a fresh interpreter); ``OMP_NUM_THREADS`` (read by torch at import) is applied
  with ``torch.set_num_threads``. Then the code runs as the program's main module and the
  interpreter exits normally (threads joined, atexit handlers run, exit status as usual).
- The server reaps its children at once (SIGCHLD) and hands each exit status to its caller
  through a pipe of that child alone, so ``wait(timeout)`` and ``poll()`` behave like Popen's.
  The children stay in the test process's process group, under the test process's tree.

Run as a script this file is the server: ``python warm_spawn.py FD`` (FD: its end of the socket).
"""

from __future__ import annotations

import functools
import importlib.util
import io
import json
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable
from typing import IO, Any

#: Modules the server imports before it forks (what the tests' ranks import), and packages whose
#: modules it imports too (see :func:`preload`).
PRELOAD = ("numpy", "msgpack", "attrs", "zmq", "torch", "torch.distributed")
PRELOAD_PACKAGES = ("kvferry.core", "kvferry.adapters", "kvferry.app")
#: Environment variables read while the interpreter or a preloaded library starts: a child
#: that asks for other values than the server's gets a fresh interpreter instead.
STARTUP_PREFIXES = ("PYTHON", "LD_", "MKL_", "KMP_", "GOMP_", "OPENBLAS_", "TORCH_", "CUDA_", "MALLOC_")
#: Applied in the child (torch reads it at import; the server did not have it).
THREADS_VAR = "OMP_NUM_THREADS"
COLD_VAR = "KVFERRY_TEST_COLD_SPAWN"
#: JSON ``{name: value or null}``: variables a preloading process puts back (see warm_preload).
RESTORE_VAR = "KVFERRY_TEST_RESTORE_ENV"
#: Deadline for the server to start (it imports torch) and for one fork request (seconds).
START_S = 120.0
REQUEST_S = 60.0
_STATUS = struct.Struct("i")
#: The environment the test session started with (this module is imported by the root conftest).
SESSION_ENV = dict(os.environ)


# ------------------------------------------------------------------------------ callers
class WarmProcess:
    """A child forked by the server: the part of ``subprocess.Popen`` the tests use."""

    def __init__(
        self,
        args: list[str],
        pid: int,
        status_fd: int,
        stdin: IO[Any] | None,
        stdout: IO[Any] | None,
        stderr: IO[Any] | None,
    ) -> None:
        self.args = args
        self.pid = pid
        self.stdin, self.stdout, self.stderr = stdin, stdout, stderr
        self.returncode: int | None = None
        self._status_fd = status_fd

    def _take_status(self, timeout_s: float | None) -> bool:
        if self.returncode is not None:
            return True
        if self._status_fd < 0:
            raise RuntimeError(f"the warm-start server went away before child {self.pid} ended")
        readable, _, _ = select.select([self._status_fd], [], [], timeout_s)
        if not readable:
            return False
        data = os.read(self._status_fd, _STATUS.size)
        os.close(self._status_fd)
        self._status_fd = -1
        if len(data) != _STATUS.size:
            raise RuntimeError(f"the warm-start server went away before child {self.pid} ended")
        (self.returncode,) = _STATUS.unpack(data)
        return True

    def poll(self) -> int | None:
        self._take_status(0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._take_status(timeout):
            raise subprocess.TimeoutExpired(self.args, timeout)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:  # no exit status yet: the pid is still this child's, or just reaped
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass  # it ended and the server reaped it before its status reached us (as Popen)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def __enter__(self) -> WarmProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        for stream in (self.stdin, self.stdout, self.stderr):
            if stream is not None:
                try:
                    stream.close()
                except OSError:
                    pass
        self.wait()

    def __del__(self) -> None:
        if getattr(self, "_status_fd", -1) >= 0:
            os.close(self._status_fd)
            self._status_fd = -1


class _Server:
    """The session's warm-start server (a child of the test process). It starts at once and
    imports in the background; :meth:`ready` waits for it."""

    def __init__(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._log = tempfile.TemporaryFile()
        self.env = dict(SESSION_ENV)
        self.proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), str(theirs.fileno())],
            pass_fds=[theirs.fileno()],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=self._log,
            env=self.env,
            cwd=os.path.dirname(os.path.abspath(__file__)),
        )
        theirs.close()
        self.sock = ours
        self._ready = False

    def ready(self) -> None:
        if self._ready:
            return
        self.sock.settimeout(START_S)
        try:
            hello = json.loads(self.sock.recv(1 << 16) or b"{}")
        except (OSError, ValueError):
            hello = {}
        if not hello.get("ready"):
            self.close()
            raise RuntimeError(f"warm-start server did not start: {self.log_tail()}")
        self.sock.settimeout(REQUEST_S)
        self._ready = True

    def log_tail(self) -> str:
        self._log.seek(0)
        return self._log.read().decode(errors="replace")[-2000:]

    def fork(self, request: dict[str, Any], fds: list[int]) -> dict[str, Any]:
        socket.send_fds(self.sock, [json.dumps(request).encode()], fds)
        reply = self.sock.recv(1 << 16)
        if not reply:
            raise RuntimeError(f"warm-start server exited: {self.log_tail()}")
        return json.loads(reply)

    def close(self) -> None:
        self.sock.close()  # the server exits on EOF
        try:
            self.proc.wait(timeout=REQUEST_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=REQUEST_S)
        self._log.close()


_lock = threading.Lock()
_server: _Server | None = None
_server_failed: str | None = None


def prestart() -> None:
    """Start the server now (it imports torch while the first tests run); a no-op once it runs
    and where children are to start cold."""
    global _server, _server_failed
    with _lock:
        if _server is None and _server_failed is None and not os.environ.get(COLD_VAR):
            try:
                _server = _Server()
            except OSError as exc:
                _server_failed = str(exc)


def _get_server() -> _Server | None:
    """The running server (started and waited for here if need be); None if it cannot start."""
    global _server, _server_failed
    if _server is None and _server_failed is None:
        try:
            _server = _Server()
        except OSError as exc:
            _server_failed = str(exc)
    if _server is not None:
        try:
            _server.ready()
        except RuntimeError as exc:
            _server, _server_failed = None, str(exc)
    return _server


def shutdown() -> None:
    """Stop the server (the root conftest calls this at the end of the session)."""
    global _server
    with _lock:
        if _server is not None:
            _server.close()
            _server = None


def _cold_reason(args: list[str], env: dict[str, str], server_env: dict[str, str]) -> str | None:
    if os.environ.get(COLD_VAR):
        return f"{COLD_VAR} is set"
    if (
        not args
        or (args[0].startswith("-") and args[0] not in ("-c", "-m"))
        or (args[0] in ("-c", "-m") and len(args) < 2)
    ):
        return f"interpreter options {args[:1]}"
    for name in set(env) | set(server_env):
        if name.startswith(STARTUP_PREFIXES) and env.get(name) != server_env.get(name):
            return f"{name} differs from the session's"
    return None


def _fd_of(stream: Any, default: int) -> tuple[int, list[int]]:
    """(fd to hand over, fds to close here afterwards) for one of Popen's stream arguments."""
    if stream is None:
        return default, []
    if stream == subprocess.DEVNULL:
        fd = os.open(os.devnull, os.O_RDWR)
        return fd, [fd]
    if isinstance(stream, int):
        return stream, []
    return stream.fileno(), []


def _hook_request(hook: Callable[[], None]) -> dict[str, Any]:
    """How the server's child finds ``hook`` (see the module docstring); ValueError if it cannot."""
    func, args = (hook.func, list(hook.args)) if isinstance(hook, functools.partial) else (hook, [])
    if isinstance(hook, functools.partial) and hook.keywords:
        raise ValueError(f"pre_exec {hook!r}: keyword arguments are not passed to the child; use positional ones")
    name = getattr(func, "__qualname__", "")
    module = sys.modules.get(getattr(func, "__module__", "") or "")
    if not name or "." in name or module is None or getattr(module, name, None) is not func:
        raise ValueError(f"pre_exec {hook!r}: must be a module-level function (or a functools.partial of one)")
    try:
        json.dumps(args)
    except TypeError as exc:
        raise ValueError(f"pre_exec {hook!r}: its arguments must be JSON values: {exc}") from None
    return {"module": module.__name__, "file": getattr(module, "__file__", None), "name": name, "args": args}


def _run_hook(spec: dict[str, Any]) -> None:
    """In the forked child: call the hook ``spec`` names (see :func:`_hook_request`)."""
    module = sys.modules.get(spec["module"])
    if module is None or (spec["file"] and getattr(module, "__file__", None) != spec["file"]):
        if not spec["file"]:
            module = importlib.import_module(spec["module"])
        else:
            loader_spec = importlib.util.spec_from_file_location(spec["module"], spec["file"])
            if loader_spec is None or loader_spec.loader is None:
                raise ImportError(f"pre_exec: cannot load {spec['module']} from {spec['file']}")
            module = importlib.util.module_from_spec(loader_spec)
            sys.modules[spec["module"]] = module
            loader_spec.loader.exec_module(module)
    getattr(module, spec["name"])(*spec["args"])


def popen(
    args: list[str],
    *,
    stdin: Any = None,
    stdout: Any = None,
    stderr: Any = None,
    text: bool = False,
    cwd: str | os.PathLike[str] | None = None,
    env: dict[str, str] | None = None,
    bufsize: int = -1,
    pre_exec: Callable[[], None] | None = None,
) -> Any:
    """``subprocess.Popen([sys.executable, *args], ...)``, started warm where that is the same;
    ``pre_exec`` runs in the child before the program (see the module docstring)."""
    args = [str(a) for a in args]
    full_env = dict(os.environ if env is None else env)
    hook = None if pre_exec is None else _hook_request(pre_exec)
    with _lock:
        server = None if os.environ.get(COLD_VAR) else _get_server()
        reason = "no warm-start server" if server is None else _cold_reason(args, full_env, server.env)
        if server is None or reason is not None:
            return subprocess.Popen(
                [sys.executable, *args],
                stdin=stdin,
                stdout=stdout,
                stderr=stderr,
                text=text,
                cwd=cwd,
                env=env,
                bufsize=bufsize,
                preexec_fn=pre_exec,
            )
        here: list[int] = []  # our ends of the pipes
        there: list[int] = []  # the child's ends (closed here once the server has them)
        try:
            if stdin == subprocess.PIPE:
                r, w = os.pipe()
                here_in, child_in = w, r
                there.append(r)
                here.append(w)
            else:
                here_in, (child_in, extra) = None, _fd_of(stdin, 0)
                there.extend(extra)
            if stdout == subprocess.PIPE:
                r, w = os.pipe()
                here_out, child_out = r, w
                there.append(w)
                here.append(r)
            else:
                here_out, (child_out, extra) = None, _fd_of(stdout, 1)
                there.extend(extra)
            if stderr == subprocess.PIPE:
                r, w = os.pipe()
                here_err, child_err = r, w
                there.append(w)
                here.append(r)
            elif stderr == subprocess.STDOUT:
                here_err, child_err = None, child_out
            else:
                here_err, (child_err, extra) = None, _fd_of(stderr, 2)
                there.extend(extra)
            status_r, status_w = os.pipe()
            there.append(status_w)
            request = {
                "args": args,
                "cwd": os.path.abspath(cwd if cwd is not None else os.getcwd()),
                "env": full_env,
                "pre_exec": hook,
            }
            reply = server.fork(request, [child_in, child_out, child_err, status_w])
        except BaseException:
            for fd in here:
                os.close(fd)
            raise
        finally:
            for fd in there:
                os.close(fd)
        if "pid" not in reply:  # the server refused (e.g. it was not single-threaded): start cold
            os.close(status_r)
            for fd in here:
                os.close(fd)
            return subprocess.Popen(
                [sys.executable, *args],
                stdin=stdin,
                stdout=stdout,
                stderr=stderr,
                text=text,
                cwd=cwd,
                env=env,
                bufsize=bufsize,
                preexec_fn=pre_exec,
            )
    return WarmProcess(
        [sys.executable, *args],
        reply["pid"],
        status_r,
        _wrap(here_in, "wb", bufsize, text),
        _wrap(here_out, "rb", bufsize, text),
        _wrap(here_err, "rb", bufsize, text),
    )


def _wrap(fd: int | None, mode: str, bufsize: int, text: bool) -> IO[Any] | None:
    """The stream object Popen would make of ``fd``."""
    if fd is None:
        return None
    line_buffering = bufsize == 1 and text  # as Popen: the binary layer then has the default size
    if bufsize == 1:
        bufsize = -1
    stream: IO[Any] = open(fd, mode, bufsize)
    if text:
        if mode == "wb":
            stream = io.TextIOWrapper(stream, write_through=True, line_buffering=line_buffering)
        else:
            stream = io.TextIOWrapper(stream)
    return stream


# ------------------------------------------------------------------------------- server
def _single_threaded() -> bool:
    return threading.active_count() == 1 and len(os.listdir("/proc/self/task")) == 1


def _serve(sock: socket.socket) -> dict[str, Any] | None:
    """Serve fork requests until EOF (returns None), or return a request in a forked child."""
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.set_wakeup_fd(wake_w)
    status: dict[int, int] = {}  # child pid -> the write end of its status pipe

    def reap() -> None:
        while True:
            try:
                pid, raw = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            fd = status.pop(pid, None)
            if fd is not None:
                os.write(fd, _STATUS.pack(os.waitstatus_to_exitcode(raw)))
                os.close(fd)

    sock.sendall(json.dumps({"ready": True}).encode())
    while True:
        readable, _, _ = select.select([sock, wake_r], [], [])
        if wake_r in readable:
            try:
                while os.read(wake_r, 512):
                    pass
            except BlockingIOError:
                pass
            reap()
        if sock not in readable:
            continue
        msg, fds, _, _ = socket.recv_fds(sock, 1 << 20, 8)
        if not msg:
            for fd in fds:
                os.close(fd)
            break
        request = json.loads(msg)
        if len(fds) != 4 or not _single_threaded():
            for fd in fds:
                os.close(fd)
            sock.sendall(json.dumps({"refused": "not single-threaded" if len(fds) == 4 else "bad request"}).encode())
            continue
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            sock.close()
            for fd in (wake_r, wake_w, *status.values()):
                os.close(fd)
            child_in, child_out, child_err, status_w = fds
            os.close(status_w)
            for target, fd in enumerate((child_in, child_out, child_err)):
                os.dup2(fd, target)
            for fd in {child_in, child_out, child_err} - {0, 1, 2}:
                os.close(fd)
            return request
        for fd in fds[:3]:
            os.close(fd)
        status[pid] = fds[3]
        sock.sendall(json.dumps({"pid": pid}).encode())
    for fd in status.values():
        os.close(fd)
    return None


def _become(request: dict[str, Any]) -> None:
    """In the forked child: take the requested program's process state and run it as main."""
    import builtins
    import random
    import runpy
    import types

    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    random.seed()
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    threads = os.environ.get(THREADS_VAR)
    if threads and threads.isdigit() and int(threads) > 0 and "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(int(threads))
    if request.get("pre_exec"):
        _run_hook(request["pre_exec"])
    args = request["args"]
    if args[0] == "-m":
        sys.argv = [args[1], *args[2:]]  # run_module puts the module's path in argv[0]
        sys.path[0] = os.getcwd()
        runpy.run_module(args[1], run_name="__main__", alter_sys=True)
        return
    if args[0] == "-c":
        sys.argv = ["-c", *args[2:]]
        sys.path[0] = ""
        path, source = "<string>", args[1]
    else:
        sys.argv = list(args)
        path = args[0]
        sys.path[0] = os.path.dirname(os.path.realpath(path))
        with open(path, "rb") as f:
            source = f.read()
    main = types.ModuleType("__main__")
    main.__dict__["__builtins__"] = builtins
    if args[0] != "-c":
        main.__dict__.update({"__file__": os.path.abspath(path), "__cached__": None})
    sys.modules["__main__"] = main
    code = compile(source, path, "exec", dont_inherit=True)  # not this file's __future__ flags
    exec(code, main.__dict__)


def preload() -> None:
    """Import what the ranks import (:data:`PRELOAD`, then every module of :data:`PRELOAD_PACKAGES`
    that imports cleanly; one that does not is left to the child), starting no thread, then
    freeze what is loaded (the children's collections and their exit then skip it)."""
    import gc
    import importlib
    import pkgutil

    blas = os.environ.get("OPENBLAS_NUM_THREADS")
    os.environ["OPENBLAS_NUM_THREADS"] = "1"  # numpy's BLAS would start a thread pool at import
    try:
        for name in PRELOAD:
            importlib.import_module(name)
        for package in PRELOAD_PACKAGES:
            try:
                path = importlib.import_module(package).__path__
            except ImportError:
                continue
            for info in pkgutil.walk_packages(path, package + ".", onerror=lambda _name: None):
                try:
                    importlib.import_module(info.name)
                except Exception:  # an optional dependency missing: the child imports it (or not) itself
                    pass
    finally:
        if blas is None:
            del os.environ["OPENBLAS_NUM_THREADS"]
        else:
            os.environ["OPENBLAS_NUM_THREADS"] = blas
    gc.collect()
    gc.freeze()


def _server_main(fd: int) -> None:
    sock = socket.socket(fileno=fd)
    preload()
    request = _serve(sock)
    if request is None:
        return
    _become(request)


if __name__ == "__main__":
    _server_main(int(sys.argv[1]))
