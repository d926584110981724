"""shm between real processes: bit-exact exchange, and crashes that leave nothing behind.

Child processes run small scripts (``python -c``) and talk to the test through stdout lines;
no sleeps: every wait is a blocking read or a blocking get with a deadline.
"""

from __future__ import annotations

import hashlib
import itertools
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time

import pytest
import warm_spawn
from jsonlines import Channel
from waits import eventually

from kvferry.adapters.connectors.shm.segment import SHM_DIR, reap_namespace, runtime_dir
from kvferry.app.registry import create_connector
from kvferry.core.errors import SenderUnavailable

pytestmark = [pytest.mark.timeout(120), pytest.mark.slow]

PORT = 50200
#: Deadline of one line from a child (seconds; a shared machine).
READ_S = 60.0
_COUNTER = itertools.count()

PAYLOAD = """
import numpy as np
def payload(i):
    return np.random.default_rng(i).integers(0, 256, 1000 + 4099 * i, dtype=np.uint8).tobytes()
"""

SENDER = (
    PAYLOAD
    + """
import json, sys
from kvferry.app.registry import create_connector
ns, base, port, count = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
conn = create_connector({"type": "shm", "role": "sender", "namespace": ns, "runtime_dir": base,
                         "port": port, "pool_bytes": 64 << 20})
print(json.dumps({"ready": conn.health()["segment"]}), flush=True)
for i in range(count):
    data = payload(i)
    ok, size, meta = conn.put("0", "1", f"req{i}_0_0_0_0", [data[:100], data[100:]])
    assert ok and size == len(data), meta
print(json.dumps({"sent": count}), flush=True)
sys.stdin.readline()  # stay alive (serving) until the test says so, or until killed
conn.close()
print(json.dumps({"closed": True}), flush=True)
"""
)

RECEIVER = """
import hashlib, json, sys
from kvferry.app.registry import create_connector
ns, base, port, count, hold = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5] == "hold"
conn = create_connector({"type": "shm", "role": "receiver", "namespace": ns, "runtime_dir": base,
                         "sender_port": port})
digests, held = {}, []
for i in range(count):
    got = conn.get_blocking("0", "1", f"req{i}_0_0_0_0", timeout_s=60.0)
    assert got is not None, i
    buffer, size = got
    digests[i] = [hashlib.sha256(buffer.tensor.numpy().tobytes()).hexdigest(), size]
    held.append(buffer) if hold else buffer.release()
print(json.dumps({"digests": digests}), flush=True)
sys.stdin.readline()
conn.close()
"""


def spawn(script: str, *args: object, stderr: int | None = None) -> subprocess.Popen:
    """A child running ``script``; its JSON lines are read through ``proc.channel``."""
    proc = warm_spawn.popen(
        ["-c", script, *map(str, args)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=stderr,
        text=True,
    )
    proc.channel = Channel(proc, f"child {proc.pid}")  # type: ignore[union-attr]
    return proc


def line(proc: subprocess.Popen) -> dict:
    """The child's next JSON line (AssertionError if it says nothing in time or exits first)."""
    return proc.channel.read(READ_S)  # type: ignore[attr-defined]


def expected_digest(i: int) -> list:
    namespace: dict = {}
    exec(PAYLOAD, namespace)  # the same generator the children use
    data = namespace["payload"](i)
    return [hashlib.sha256(data).hexdigest(), len(data)]


@pytest.fixture
def space():
    base = tempfile.mkdtemp(prefix="kvfi-", dir="/tmp")
    namespace = f"i{os.getpid()}n{next(_COUNTER)}"
    procs: list[subprocess.Popen] = []
    yield namespace, base, procs
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=30)
        proc.channel.close(30)  # type: ignore[attr-defined]
    reap_namespace(namespace, base)
    leftovers = [n for n in os.listdir(SHM_DIR) if n.startswith(f"kvferry-{namespace}-")]
    files = os.listdir(base)
    shutil.rmtree(base, ignore_errors=True)
    assert leftovers == [] and files == []


def segments(namespace: str) -> list[str]:
    return [n for n in os.listdir(SHM_DIR) if n.startswith(f"kvferry-{namespace}-")]


def trackers_of(pid: int) -> list[int]:
    """The resource tracker processes that ``pid`` started (its children running one)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                ppid = int(f.read().rsplit(b")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read()
        except (OSError, IndexError, ValueError):
            continue
        if ppid == pid and b"resource_tracker" in cmdline:
            found.append(int(entry))
    return found


def test_sender_and_receiver_processes_exchange_bit_exact(space) -> None:
    namespace, base, procs = space
    count = 12
    # the receiver starts first and blocks until each key is published
    receiver = spawn(RECEIVER, namespace, base, PORT, count, "release")
    sender = spawn(SENDER, namespace, base, PORT, count, stderr=subprocess.PIPE)
    procs += [receiver, sender]
    assert "ready" in line(sender)
    assert line(sender) == {"sent": count}
    digests = line(receiver)["digests"]
    assert digests == {str(i): expected_digest(i) for i in range(count)}
    receiver.stdin.write("\n")
    receiver.stdin.flush()
    assert receiver.wait(timeout=30) == 0
    sender.stdin.write("\n")
    sender.stdin.flush()
    assert line(sender) == {"closed": True}
    assert sender.wait(timeout=30) == 0
    assert segments(namespace) == [] and os.listdir(base) == []
    # the close took the segment back from the resource tracker: at its exit (after the
    # sender's, stderr ends with it) the tracker has nothing left to unlink and says nothing
    # (a registered name it found gone would be "leaked shared_memory objects" and an error)
    assert sender.stderr is not None
    said = sender.stderr.read()
    assert "resource_tracker" not in said, said


def writer_with_three_keys(space) -> tuple[subprocess.Popen, str, int]:
    """A sender process that published three keys: it, its segment and its resource tracker
    (one it started: the test process is not its parent)."""
    namespace, base, procs = space
    sender = spawn(SENDER, namespace, base, PORT, 3)
    procs.append(sender)
    segment = line(sender)["ready"]
    assert line(sender) == {"sent": 3}
    (tracker,) = trackers_of(sender.pid)
    return sender, segment, tracker


def test_killed_writer_s_segment_is_unlinked_by_its_resource_tracker(space) -> None:
    namespace, _, _ = space
    sender, segment, _ = writer_with_three_keys(space)
    os.kill(sender.pid, signal.SIGKILL)  # no cleanup of its own runs
    sender.wait(timeout=30)
    # its tracker sees the last process of its tree end and unlinks what is still registered,
    # with no kvferry start in the namespace (the next test is the control: no tracker, no unlink)
    path = os.path.join(SHM_DIR, segment)
    eventually(lambda: not os.path.exists(path), f"{segment} unlinked by the tracker", 30, pause_s=0.01)


def test_killed_writer_and_its_tracker_leave_nothing_after_the_reaper(space) -> None:
    namespace, base, _ = space
    sender, segment, tracker = writer_with_three_keys(space)
    # the whole tree killed at once (a SIGKILL of its process group): the tracker first
    os.kill(tracker, signal.SIGKILL)
    os.kill(sender.pid, signal.SIGKILL)
    sender.wait(timeout=30)
    assert segments(namespace) == [segment]  # nothing of the tree could clean up after it...
    # ...the next start in the namespace does: here a receiver (reaper at start)
    with create_connector(
        {"type": "shm", "role": "receiver", "namespace": namespace, "runtime_dir": base, "sender_port": PORT}
    ) as receiver:
        assert segments(namespace) == []
        assert not os.path.exists(runtime_dir(namespace, base))
        assert receiver.get("0", "1", "req0_0_0_0_0") is None


PARKING_SENDER = """
import json, sys
from kvferry.app.registry import create_connector
ns, base, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
conn = create_connector({"type": "shm", "role": "sender", "namespace": ns, "runtime_dir": base,
                         "port": port, "pool_bytes": 1 << 20})
assert conn.put("0", "1", "held_0_0_0_0", b"h" * 1000)[0]
print(json.dumps({"ready": True}), flush=True)
for _ in sys.stdin:  # each line: how many gets are parked here now
    print(json.dumps({"parked": conn.health()["parked"]}), flush=True)
"""


def test_a_get_to_a_sender_that_died_ends_at_once_not_at_its_deadline(space) -> None:
    namespace, base, procs = space
    sender = spawn(PARKING_SENDER, namespace, base, PORT)
    procs.append(sender)
    assert line(sender) == {"ready": True}

    def parked() -> int:
        sender.stdin.write("\n")
        sender.stdin.flush()
        return int(line(sender)["parked"])

    config = {"type": "shm", "role": "receiver", "namespace": namespace, "runtime_dir": base, "sender_port": PORT}
    with create_connector(config) as receiver:
        held, _ = receiver.get_blocking("0", "1", "held_0_0_0_0", timeout_s=READ_S)  # read before the death
        assert bytes(held.tensor.numpy()) == b"h" * 1000
        # the control: a live sender that never publishes the key is waited for, to the deadline
        start = time.monotonic()
        assert receiver.get_blocking("0", "1", "never_0_0_0_0", timeout_s=0.6) is None
        assert time.monotonic() - start >= 0.6 and receiver.health().get("miss_sender_gone", 0) == 0
        ended: dict = {}

        def wait_at_sender() -> None:
            try:
                ended["got"] = receiver.get_blocking("0", "1", "never_0_0_0_0", timeout_s=60.0)
            except SenderUnavailable as exc:
                ended["error"] = str(exc)
            ended["at"] = time.monotonic()

        waiter = threading.Thread(target=wait_at_sender)
        waiter.start()
        eventually(lambda: parked() == 1, "the get parked at the sender", READ_S)
        os.kill(sender.pid, signal.SIGKILL)
        killed_at = time.monotonic()
        sender.wait(timeout=30)
        waiter.join(READ_S)
        assert not waiter.is_alive()
        # typed, and within seconds of the death, not at the 60 s deadline
        assert "gone" in ended["error"] and ended["at"] - killed_at < 5.0, ended
        # a get that starts after the death ends at once too; a non-blocking one misses
        start = time.monotonic()
        with pytest.raises(SenderUnavailable, match="gone"):
            receiver.get_blocking("0", "1", "never_0_0_0_0", timeout_s=60.0)
        assert receiver.get("0", "1", "never_0_0_0_0") is None
        assert time.monotonic() - start < 5.0
        assert receiver.health()["miss_sender_gone"] == 3
        # a buffer read before the death is released without error: its region went with the sender
        held.release()
        assert receiver.health()["release_sender_gone"] == 1


def test_killed_reader_does_not_pin_the_pool(space) -> None:
    namespace, base, procs = space

    class Clock:
        now = 0.0

        def monotonic(self) -> float:
            return self.now

    clock = Clock()
    sender = create_connector(
        {
            "type": "shm",
            "role": "sender",
            "namespace": namespace,
            "runtime_dir": base,
            "port": PORT,
            "pool_bytes": 1 << 20,
            "clock": clock,
            "lease_s": 30.0,
            "hold_s": 10.0,
        }
    )
    with sender:
        payload = {}
        exec(PAYLOAD, payload)
        for i in range(3):
            assert sender.put("0", "1", f"req{i}_0_0_0_0", payload["payload"](i))[0]
        reader = spawn(RECEIVER, namespace, base, PORT, 3, "hold")
        procs.append(reader)
        assert line(reader)["digests"] == {str(i): expected_digest(i) for i in range(3)}
        assert sender.health()["used_bytes"] > 0  # the reader holds its three views
        os.kill(reader.pid, signal.SIGKILL)
        reader.wait(timeout=30)
        clock.now += 10.0  # its hold runs out: the sender takes the regions back
        health = sender.health()
        assert health["used_bytes"] == 0 and health["expired_unreleased"] == 3
        # and serves new readers as before
        assert sender.put("0", "1", "req0_0_0_0_0", payload["payload"](0))[0]
        second = spawn(RECEIVER, namespace, base, PORT, 1, "release")
        procs.append(second)
        assert line(second)["digests"] == {"0": expected_digest(0)}
        second.stdin.write("\n")
        second.stdin.flush()
        assert second.wait(timeout=30) == 0
    assert segments(namespace) == []


EXIT_WITHOUT_CLOSE = (
    PAYLOAD
    + """
import json, sys
from kvferry.app.registry import create_connector
ns, base, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
common = {"type": "shm", "namespace": ns, "runtime_dir": base}
sender = create_connector({**common, "role": "sender", "port": port, "pool_bytes": 1 << 20})
receiver = create_connector({**common, "role": "receiver", "sender_port": port})
assert sender.put("0", "1", "k", payload(1))[0]
held = receiver.get_blocking("0", "1", "k", timeout_s=30.0)  # still held at exit
assert held is not None
print(json.dumps({"segment": sender.health()["segment"]}), flush=True)
# no close(): the finalizers run at interpreter exit
"""
)


def test_exit_without_close_leaves_nothing(space) -> None:
    namespace, base, procs = space
    child = spawn(EXIT_WITHOUT_CLOSE, namespace, base, PORT)
    procs.append(child)
    assert line(child)["segment"].startswith(f"kvferry-{namespace}-{child.pid}-")
    assert child.wait(timeout=60) == 0
    assert segments(namespace) == [] and os.listdir(base) == []
