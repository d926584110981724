"""Hosts made of Linux network namespaces: several network stacks on one machine (root only).

``kvferry bench --hosts`` and the multi-host tests (``tests/hosts``) use it; so can an
operator rehearsing a deployment (docs/deploying.md has the same steps as ``ip`` commands).

A :class:`Net` owns every namespace it makes (their names start with its unique ``prefix``,
``kvf-<pid>-<n>``). A host is a namespace with loopback up; a wire is a veth pair whose two
ends are created straight inside the two namespaces (so no device name ever appears in the
root namespace, and two runs on one machine never clash); a switched segment is a bridge in a
namespace of its own with one veth port per host. Each end of a wire can be shaped with a
token-bucket filter (``tc qdisc ... tbf``, egress of both ends) and cut (``ip link set DEV
down``) and restored.

Processes run inside a host through ``ip netns exec``. :meth:`Net.close` (idempotent, called
on every path by the fixtures) SIGKILLs every process still inside each namespace, waits for
them, then deletes the namespaces (which deletes their veth ends). :meth:`Net.leftovers` lists
what would have been left behind: namespaces with the prefix, root-namespace links with the
prefix, processes whose network namespace is one of ours (by inode).

Addresses: only those inside the namespaces made here (``10.99.<subnet>.0/24``). Every
command has a timeout; a failing one raises :class:`NetError` with its stderr.
"""

from __future__ import annotations

import itertools
import os
import signal
import subprocess
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["NetError", "Net", "Host", "Wire", "Segment", "ns_inode", "processes_in", "unavailable_reason"]

#: Deadline of one ``ip``/``tc`` command (seconds).
CMD_S = 20.0
#: How long teardown waits for SIGKILLed processes to disappear (seconds).
KILL_WAIT_S = 10.0
_COUNTER = itertools.count()
_LOCK = threading.Lock()


class NetError(RuntimeError):
    """An ``ip``/``tc`` command failed (the message has the command and its stderr)."""


def run_cmd(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    try:
        done = subprocess.run(list(argv), capture_output=True, text=True, timeout=CMD_S)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise NetError(f"{' '.join(argv)}: {exc}") from exc
    if check and done.returncode != 0:
        raise NetError(f"{' '.join(argv)} exited with {done.returncode}: {done.stderr.strip()}")
    return done


def unavailable_reason() -> str | None:
    """Why namespaces cannot be made here (None when they can): not root, no ``ip``, or the
    kernel refused a probe namespace."""
    if os.geteuid() != 0:
        return "network namespaces need root (run the suite as root, as CI does)"
    name = f"kvf-{os.getpid()}-probe{next(_COUNTER)}"
    try:
        run_cmd("ip", "netns", "add", name)
    except NetError as exc:
        return f"cannot create a network namespace: {exc}"
    finally:
        run_cmd("ip", "netns", "del", name, check=False)
    try:
        run_cmd("tc", "-V")
    except NetError as exc:
        return f"tc (iproute2) is not usable: {exc}"
    return None


def ns_inode(name: str) -> int:
    """Inode of a namespace's bind mount: what ``/proc/PID/ns/net`` of its processes shows."""
    return os.stat(f"/run/netns/{name}").st_ino


def processes_in(inodes: set[int]) -> list[int]:
    """Pids of live processes whose network namespace is one of ``inodes``."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            if os.stat(f"/proc/{entry}/ns/net").st_ino in inodes:
                out.append(int(entry))
        except OSError:  # gone meanwhile, or a kernel thread
            continue
    return out


@dataclass(eq=False)
class Host:
    """One namespace: ``name`` (the namespace), ``label`` (the test's name for it), and the
    addresses given to it (``addresses[device] = ip``)."""

    net: Net
    label: str
    name: str
    addresses: dict[str, str] = field(default_factory=dict)

    @property
    def address(self) -> str:
        """The host's only address (ValueError when it has none or several)."""
        if len(self.addresses) != 1:
            raise ValueError(f"host {self.label} has addresses {self.addresses}; name the device")
        return next(iter(self.addresses.values()))

    def argv(self, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside this host."""
        return ["ip", "netns", "exec", self.name, *map(str, argv)]

    def popen(self, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen:
        """Start a process inside this host (``subprocess.Popen`` keywords pass through)."""
        return subprocess.Popen(self.argv(argv), **kwargs)

    def run(self, argv: Sequence[str], timeout_s: float = CMD_S, **kwargs: Any) -> subprocess.CompletedProcess[str]:
        """Run a command inside this host to its end (``timeout_s`` bounds it)."""
        return subprocess.run(self.argv(argv), capture_output=True, text=True, timeout=timeout_s, **kwargs)

    def listening(self) -> set[tuple[str, int]]:
        """``(address, port)`` of every TCP socket listening inside this host (IPv4 and IPv6,
        from the host's own ``/proc/net/tcp*``); ``0.0.0.0`` / ``::`` are wildcards."""
        done = self.run(["cat", "/proc/net/tcp", "/proc/net/tcp6"])
        out = set()
        for line in done.stdout.splitlines():
            parts = line.split()
            if len(parts) < 4 or parts[3] != "0A" or ":" not in parts[1]:  # 0A: TCP_LISTEN
                continue
            addr_hex, port_hex = parts[1].split(":")
            out.add((_proc_address(addr_hex), int(port_hex, 16)))
        return out

    def pids(self) -> list[int]:
        """Pids of every process inside this host."""
        done = run_cmd("ip", "netns", "pids", self.name, check=False)
        return [int(p) for p in done.stdout.split() if p.strip().isdigit()]

    def kill_all(self, wait_s: float = KILL_WAIT_S) -> list[int]:
        """SIGKILL every process inside this host and wait until none is left; the pids killed.
        (A process started with ``Popen`` must still be reaped by its parent: ``wait()``.)"""
        killed: list[int] = []
        deadline = time.monotonic() + wait_s
        pause = threading.Event()
        while True:
            live = [p for p in self.pids() if _alive(p)]
            if not live:
                return killed
            for pid in live:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                if pid not in killed:
                    killed.append(pid)
            if time.monotonic() >= deadline:
                raise NetError(f"processes {live} in {self.name} survived SIGKILL for {wait_s} s")
            pause.wait(0.01)


def _proc_address(hex_text: str) -> str:
    """An address as ``/proc/net/tcp`` writes it (host byte order words) -> text."""
    import ipaddress

    raw = bytes.fromhex(hex_text)
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    return str(ipaddress.ip_address(words))


def _alive(pid: int) -> bool:
    """True for a running process (a zombie counts as gone: it holds no socket)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


@dataclass(eq=False)
class Wire:
    """A veth pair: ``ends = ((host, device), (host, device))``."""

    ends: tuple[tuple[Host, str], tuple[Host, str]]
    rate: str | None = None

    def shape(self, rate: str | None, burst: str | None = None) -> None:
        """A tbf of ``rate`` (tc syntax: ``"1gbit"``) on the egress of both ends; None removes
        it. ``burst`` defaults to 4 ms at the rate (at least 64 KiB)."""
        for host, dev in self.ends:
            run_cmd("tc", "-n", host.name, "qdisc", "del", "dev", dev, "root", check=False)
            if rate is not None:
                run_cmd(
                    "tc",
                    "-n",
                    host.name,
                    "qdisc",
                    "add",
                    "dev",
                    dev,
                    "root",
                    "tbf",
                    "rate",
                    rate,
                    "burst",
                    burst or f"{max(64 << 10, tbf_bytes_per_s(rate) // 250)}b",
                    "latency",
                    "100ms",
                )
        self.rate = rate

    def cut(self) -> None:
        """Take both ends down: nothing crosses until :meth:`restore`. Sockets stay open (no
        RST, no FIN): for TCP the peer is silent, as when a cable is pulled."""
        for host, dev in self.ends:
            run_cmd("ip", "-n", host.name, "link", "set", dev, "down")

    def restore(self) -> None:
        """Bring both ends up again (addresses and routes of the devices come back with them).
        Idempotent."""
        for host, dev in self.ends:
            run_cmd("ip", "-n", host.name, "link", "set", dev, "up")
        for host, dev in self.ends:
            _wait_carrier(host, dev)

    def qdisc(self) -> list[str]:
        return [run_cmd("tc", "-n", h.name, "qdisc", "show", "dev", d).stdout.strip() for h, d in self.ends]


def tbf_bytes_per_s(rate: str) -> int:
    """``"1gbit"`` -> bytes per second (tc's units: bit, kbit, mbit, gbit; decimal)."""
    units = {"gbit": 1e9, "mbit": 1e6, "kbit": 1e3, "bit": 1.0}
    text = rate.strip().lower()
    for suffix, scale in units.items():
        if text.endswith(suffix):
            return int(float(text[: -len(suffix)]) * scale / 8)
    raise ValueError(f"rate {rate!r}: use a number with bit, kbit, mbit or gbit")


def _wait_carrier(host: Host, dev: str, timeout_s: float = CMD_S) -> None:
    """Wait until ``dev`` reports carrier (IPv4 addresses need no duplicate detection)."""
    deadline = time.monotonic() + timeout_s
    pause = threading.Event()
    while True:
        link = run_cmd("ip", "-n", host.name, "-o", "link", "show", "dev", dev).stdout
        if "LOWER_UP" in link:
            return
        if time.monotonic() >= deadline:
            raise NetError(f"{host.name}/{dev} has no carrier after {timeout_s} s: {link.strip()}")
        pause.wait(0.01)


@dataclass(eq=False)
class Segment:
    """A switched segment: a bridge in its own namespace, one port (a :class:`Wire`) per host."""

    switch: Host
    subnet: str
    ports: dict[str, Wire] = field(default_factory=dict)  # host label -> wire to the switch


class Net:
    """The namespaces of one test (or module). Use as a context manager, or call
    :meth:`close` on every path."""

    def __init__(self, tag: str = "") -> None:
        with _LOCK:
            self.prefix = f"kvf-{os.getpid()}-{next(_COUNTER)}{tag}"
        self.hosts: dict[str, Host] = {}
        self.wires: list[Wire] = []
        self._inodes: set[int] = set()
        self._subnets = itertools.count(1)
        self._closed = False

    # -------------------------------------------------------------------------- building
    def host(self, label: str) -> Host:
        """A new host (namespace ``{prefix}-{label}``) with loopback up."""
        if label in self.hosts:
            raise ValueError(f"host {label!r} exists")
        name = f"{self.prefix}-{label}"
        run_cmd("ip", "netns", "add", name)
        host = self.hosts[label] = Host(self, label, name)
        self._inodes.add(ns_inode(name))
        run_cmd("ip", "-n", name, "link", "set", "lo", "up")
        return host

    def _subnet(self) -> str:
        """``10.99.N`` for the next wire or segment of this net (N in 1..250)."""
        n = next(self._subnets)
        if n > 250:
            raise NetError("more than 250 subnets in one Net")
        return f"10.99.{n}"

    def _veth(self, a: Host, dev_a: str, b: Host, dev_b: str) -> Wire:
        run_cmd(
            "ip", "link", "add", "name", dev_a, "netns", a.name, "type", "veth", "peer", "name", dev_b, "netns", b.name
        )
        wire = Wire(((a, dev_a), (b, dev_b)))
        self.wires.append(wire)
        return wire

    def wire(self, a: Host, b: Host, rate: str | None = None) -> Wire:
        """A point-to-point link ``a <-> b`` in a fresh /24: ``a`` gets ``.1``, ``b`` ``.2``
        (device ``to-<other label>`` on each side, at most 15 characters)."""
        subnet = self._subnet()
        dev_a, dev_b = f"to-{b.label}"[:15], f"to-{a.label}"[:15]
        wire = self._veth(a, dev_a, b, dev_b)
        for host, dev, ip in ((a, dev_a, f"{subnet}.1"), (b, dev_b, f"{subnet}.2")):
            run_cmd("ip", "-n", host.name, "addr", "add", f"{ip}/24", "dev", dev)
            run_cmd("ip", "-n", host.name, "link", "set", dev, "up")
            host.addresses[dev] = ip
        for host, dev in wire.ends:
            _wait_carrier(host, dev)
        if rate is not None:
            wire.shape(rate)
        return wire

    def segment(self, hosts: Sequence[Host], rate: str | None = None, label: str = "sw") -> Segment:
        """A bridge (in a new namespace ``label``) with every host of ``hosts`` on it, in one
        fresh /24: host i gets ``.(10+i)`` on device ``eth-<label>``."""
        switch = self.host(label)
        subnet = self._subnet()
        run_cmd("ip", "-n", switch.name, "link", "add", "br0", "type", "bridge")
        run_cmd("ip", "-n", switch.name, "link", "set", "br0", "up")
        seg = Segment(switch, subnet)
        for i, host in enumerate(hosts):
            dev, port = f"eth-{label}"[:15], f"p-{host.label}"[:15]
            wire = self._veth(host, dev, switch, port)
            run_cmd("ip", "-n", switch.name, "link", "set", port, "master", "br0")
            run_cmd("ip", "-n", switch.name, "link", "set", port, "up")
            ip = f"{subnet}.{10 + i}"
            run_cmd("ip", "-n", host.name, "addr", "add", f"{ip}/24", "dev", dev)
            run_cmd("ip", "-n", host.name, "link", "set", dev, "up")
            host.addresses[dev] = ip
            seg.ports[host.label] = wire
        for wire in seg.ports.values():
            for host, dev in wire.ends:
                _wait_carrier(host, dev)
            if rate is not None:
                wire.shape(rate)
        return seg

    # -------------------------------------------------------------------------- teardown
    def close(self) -> None:
        """Kill every process inside our namespaces, then delete the namespaces. Idempotent;
        raises NetError (after trying everything) if something could not be removed."""
        if self._closed:
            return
        self._closed = True
        errors: list[str] = []
        for host in self.hosts.values():
            try:
                host.kill_all()
            except NetError as exc:
                errors.append(str(exc))
        for host in self.hosts.values():
            done = run_cmd("ip", "netns", "del", host.name, check=False)
            if done.returncode != 0 and "No such file" not in done.stderr:
                errors.append(f"ip netns del {host.name}: {done.stderr.strip()}")
        left = self.leftovers()
        if errors or left:
            raise NetError(f"teardown of {self.prefix}: {errors} left {left}")

    def leftovers(self) -> dict[str, list[Any]]:
        """What of this net still exists: namespaces, root-namespace links and processes."""
        names = run_cmd("ip", "netns", "list", check=False).stdout.split("\n")
        spaces = [n.split()[0] for n in names if n.strip() and n.split()[0].startswith(self.prefix)]
        links = [
            line for line in run_cmd("ip", "-o", "link", "show", check=False).stdout.splitlines() if self.prefix in line
        ]
        return {
            k: v for k, v in (("namespaces", spaces), ("links", links), ("processes", processes_in(self._inodes))) if v
        }

    def __enter__(self) -> Net:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
