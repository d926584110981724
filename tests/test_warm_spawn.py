"""The warm-start launcher of the multi-process tests: a child forked from the server is the
program a fresh interpreter would run (argv, path, cwd, environment, main module, exit status,
streams), and anything that would not be the same starts a fresh interpreter instead."""

from __future__ import annotations

import functools
import json
import os
import signal
import subprocess
import sys

import pytest
import warm_spawn

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(autouse=True)
def warm_allowed(monkeypatch: pytest.MonkeyPatch) -> None:
    """These tests are about the warm start: also in a session run with fresh interpreters."""
    monkeypatch.delenv(warm_spawn.COLD_VAR, raising=False)


PROBE = """
import json, os, random, sys, threading
import numpy as np
def annotated(x: int) -> None: pass
print(json.dumps({
    "argv": sys.argv, "path0": sys.path[0], "cwd": os.getcwd(), "pid": os.getpid(), "ppid": os.getppid(),
    "env": os.environ.get("KVF_PROBE"), "name": __name__, "file": globals().get("__file__"),
    "random": random.random(), "np": float(np.random.random()), "threads": threading.active_count(),
    "annotation_is_a_type": annotated.__annotations__["x"] is int,
}), flush=True)
line = sys.stdin.readline()
print(json.dumps({"echo": line.strip()}), flush=True)
sys.exit(int(sys.argv[1]) if len(sys.argv) > 1 else 0)
"""


def run_probe(args: list[str], **kw: object) -> tuple[object, list[dict], int]:
    proc = warm_spawn.popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, **kw)
    first = json.loads(proc.stdout.readline())
    proc.stdin.write("hello\n")
    proc.stdin.flush()
    second = json.loads(proc.stdout.readline())
    rc = proc.wait(timeout=60)
    proc.stdin.close()
    proc.stdout.close()
    return proc, [first, second], rc


def test_a_c_program_starts_warm_with_argv_cwd_environment_and_exit_status(tmp_path) -> None:
    env = {**os.environ, "KVF_PROBE": "yes"}
    proc, (info, echo), rc = run_probe(["-c", PROBE, "3"], cwd=tmp_path, env=env)
    assert isinstance(proc, warm_spawn.WarmProcess)
    assert rc == 3 and proc.poll() == 3 and proc.returncode == 3
    assert info["argv"] == ["-c", "3"] and info["path0"] == "" and info["cwd"] == str(tmp_path)
    assert info["env"] == "yes" and info["name"] == "__main__" and info["file"] is None
    assert info["threads"] == 1 and info["annotation_is_a_type"]  # not this file's __future__ import
    server = warm_spawn._get_server()
    assert server is not None and info["ppid"] == server.proc.pid  # under the test process's tree
    assert echo == {"echo": "hello"}
    assert "KVF_PROBE" not in os.environ


def test_a_script_runs_as_main_with_its_directory_on_the_path(tmp_path) -> None:
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    proc, (info, _), rc = run_probe([str(script)], cwd=tmp_path)
    assert isinstance(proc, warm_spawn.WarmProcess) and rc == 0
    assert info["argv"] == [str(script)] and info["path0"] == str(tmp_path)
    assert info["file"] == str(script) and info["name"] == "__main__"


def test_children_get_their_own_random_seeds() -> None:
    draws = [run_probe(["-c", PROBE])[1][0] for _ in range(2)]
    assert draws[0]["pid"] != draws[1]["pid"]
    assert draws[0]["random"] != draws[1]["random"] and draws[0]["np"] != draws[1]["np"]


def test_an_uncaught_exception_exits_1_with_the_traceback_on_stderr(tmp_path) -> None:
    log = tmp_path / "err.log"
    with open(log, "wb") as err:
        proc = warm_spawn.popen(["-c", "raise ValueError('kvf-probe-error')"], stderr=err)
        assert proc.wait(timeout=60) == 1
    text = log.read_text()
    assert "ValueError: kvf-probe-error" in text and "Traceback" in text


def test_wait_times_out_and_a_killed_child_reports_the_signal() -> None:
    proc = warm_spawn.popen(["-c", "import sys; sys.stdin.readline()"], stdin=subprocess.PIPE)
    assert isinstance(proc, warm_spawn.WarmProcess)
    with pytest.raises(subprocess.TimeoutExpired):
        proc.wait(timeout=0.05)
    assert proc.poll() is None
    proc.kill()
    assert proc.wait(timeout=60) == -signal.SIGKILL
    proc.kill()  # reaped: a no-op, as for Popen
    proc.stdin.close()


def test_a_module_runs_with_dash_m(tmp_path) -> None:
    (tmp_path / "kvf_probe_mod.py").write_text(PROBE)
    proc, (info, _), rc = run_probe(["-m", "kvf_probe_mod", "0"], cwd=tmp_path)
    assert isinstance(proc, warm_spawn.WarmProcess) and rc == 0
    assert info["argv"] == [str(tmp_path / "kvf_probe_mod.py"), "0"] and info["name"] == "__main__"


def write_pid(path: str) -> None:
    """A pre-exec hook: this process's pid, written where the program then reads it."""
    with open(path, "w") as f:
        f.write(str(os.getpid()))


def refuse(message: str) -> None:
    """A pre-exec hook that fails."""
    raise OSError(message)


@pytest.mark.parametrize("cold", [False, True])
def test_the_pre_exec_hook_runs_in_the_child_before_its_program(cold, tmp_path, monkeypatch) -> None:
    if cold:
        monkeypatch.setenv(warm_spawn.COLD_VAR, "1")
    marker = tmp_path / "hook.pid"
    code = "import os, sys; print(os.getpid(), open(sys.argv[1]).read())"  # no file: the program fails
    hook = functools.partial(write_pid, str(marker))
    proc = warm_spawn.popen(["-c", code, str(marker)], stdout=subprocess.PIPE, text=True, pre_exec=hook)
    out = proc.stdout.read()
    assert proc.wait(timeout=60) == 0
    proc.stdout.close()
    assert isinstance(proc, warm_spawn.WarmProcess) is not cold
    assert out.split() == [str(proc.pid), str(proc.pid)]


def test_a_failing_pre_exec_hook_ends_the_child_before_its_program(tmp_path) -> None:
    log = tmp_path / "err.log"
    with open(log, "wb") as err:
        proc = warm_spawn.popen(
            ["-c", "print('ran')"], stdout=subprocess.PIPE, stderr=err, pre_exec=functools.partial(refuse, "kvf-no")
        )
        assert isinstance(proc, warm_spawn.WarmProcess)
        assert proc.stdout.read() == b"" and proc.wait(timeout=60) == 1
        proc.stdout.close()
    assert "OSError: kvf-no" in log.read_text()
    with pytest.raises(subprocess.SubprocessError):  # a fresh interpreter: Popen raises here
        warm_spawn.popen(
            ["-c", "print('ran')"],
            env={**os.environ, "PYTHONHASHSEED": "7"},
            pre_exec=functools.partial(refuse, "kvf-no"),
        )


def test_a_pre_exec_hook_the_child_cannot_find_is_refused_here() -> None:
    with pytest.raises(ValueError, match="module-level function"):
        warm_spawn.popen(["-c", "pass"], pre_exec=lambda: None)
    with pytest.raises(ValueError, match="JSON"):
        warm_spawn.popen(["-c", "pass"], pre_exec=functools.partial(write_pid, object()))


@pytest.mark.parametrize("env_change", [{"PYTHONHASHSEED": "7"}, {warm_spawn.COLD_VAR: "1"}])
def test_what_a_warm_start_cannot_match_starts_a_fresh_interpreter(env_change, monkeypatch) -> None:
    if warm_spawn.COLD_VAR in env_change:
        monkeypatch.setenv(warm_spawn.COLD_VAR, "1")
        env = None
    else:
        env = {**os.environ, **env_change}
    proc, (info, _), rc = run_probe(["-c", PROBE], env=env)
    assert isinstance(proc, subprocess.Popen) and rc == 0
    assert info["argv"] == ["-c"]


def test_the_server_has_one_thread_and_no_torch_pool_in_use() -> None:
    server = warm_spawn._get_server()
    assert server is not None, warm_spawn._server_failed
    tasks = os.listdir(f"/proc/{server.proc.pid}/task")
    assert len(tasks) == 1
    assert sys.executable == server.proc.args[0]
