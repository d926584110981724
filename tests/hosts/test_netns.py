"""The namespace toolkit itself: hosts really are separate stacks, wires carry and can be cut,
shaping is installed, and teardown leaves nothing behind on any path."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest
from conftest import HostWorker, require_namespaces

from kvferry.app.bench.netns import Net, NetError, processes_in, run_cmd

pytestmark = pytest.mark.timeout(60)

SERVER = (
    "import socket;s=socket.socket();s.bind(({addr!r},7000));s.listen();print('up',flush=True)\n"
    "while True: s.accept()[0].close()"
)
CLIENT = "import socket;socket.create_connection(({addr!r},7000),timeout=1)"


def _root_names() -> tuple[str, str]:
    return run_cmd("ip", "netns", "list").stdout, run_cmd("ip", "-o", "link", "show").stdout


def test_hosts_wires_cuts_and_shaping(net: Net) -> None:
    a, b, c = net.host("a"), net.host("b"), net.host("c")
    wire = net.wire(a, b, rate="100mbit")
    seg = net.segment([a, b, c])
    assert c.address.startswith("10.99.") and set(a.addresses) == {"to-b", "eth-sw"}
    assert all("tbf" in q and "100Mbit" in q for q in wire.qdisc()), wire.qdisc()
    assert not any("tbf" in q for w in seg.ports.values() for q in w.qdisc())  # the segment is unshaped
    server = b.popen([sys.executable, "-c", SERVER.format(addr=b.addresses["to-a"])], stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout.readline().strip() == "up"
        assert (b.addresses["to-a"], 7000) in b.listening()
        assert (b.addresses["to-a"], 7000) not in a.listening()  # a has a stack of its own
        client = [sys.executable, "-c", CLIENT.format(addr=b.addresses["to-a"])]
        assert a.run(client).returncode == 0
        wire.cut()
        assert a.run(client).returncode != 0
        wire.restore()
        assert a.run(client).returncode == 0
    finally:
        server.kill()
        server.wait(timeout=30)
        server.stdout.close()


def test_teardown_leaves_nothing_even_when_the_test_fails(forks: Any, tmp_path: Any) -> None:
    require_namespaces()
    net = Net("z")
    inodes: set[int] = set()
    try:
        with pytest.raises(RuntimeError, match="the test failed"):
            with net:
                a, b = net.host("a"), net.host("b")
                net.wire(a, b)
                net.segment([a, b])
                sleeper = a.popen(["sleep", "300"])  # a process that would outlive the test
                worker = HostWorker(forks, b, ["probe", '{"tcp": []}'], tmp_path / "w.log")  # a forked one
                inodes = set(net._inodes)
                assert sorted(a.pids()) == [sleeper.pid]
                raise RuntimeError("the test failed")
        assert sleeper.wait(timeout=30) == -9  # SIGKILLed by the teardown
        worker.kill_quietly()
        names, links = _root_names()
        assert net.prefix not in names and net.prefix not in links
        assert net.leftovers() == {} and processes_in(inodes) == []
        net.close()  # idempotent
    finally:
        try:
            net.close()
        except NetError:
            pass


def test_a_second_host_of_the_same_name_is_refused(net: Net) -> None:
    net.host("a")
    with pytest.raises(ValueError, match="exists"):
        net.host("a")
