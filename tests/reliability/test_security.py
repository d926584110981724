"""Security properties (SPEC 3.1, 3.2, 5): where kvferry listens, what it will deserialize,
what a header may claim, and who can touch shared memory.

CURVE authentication of the zmq connector (an unauthenticated or unknown client gets nothing,
the sender counts no request) is tested in ``tests/adapters/connectors/test_zmq.py``
(``test_curve_admits_only_configured_clients``, ``test_curve_without_allow_list_...``); here
it is exercised once more end to end, through managers built from an engine's config.
The import-level "no pickle, no eval" scan lives in ``tests/test_layers.py``; this file adds
the call-level scan and a live check that a pickle bomb is only ever data.
"""

from __future__ import annotations

import ast
import os
import pathlib
import pickle
import stat
import struct
from typing import Any

import msgpack
import pytest
import torch
from fault_kit import SHM_DIR, free_base_port
from stage_kit import Geometry, omni_config, sender_cache

from kvferry.adapters.collectives import MAX_OBJECT_BYTES, decode_object
from kvferry.adapters.connectors.shm.control import decode as shm_decode
from kvferry.adapters.connectors.shm.segment import open_segment, runtime_dir
from kvferry.adapters.connectors.zmq.config import generate_curve_config
from kvferry.adapters.connectors.zmq.connector import ZmqConnector
from kvferry.adapters.connectors.zmq.protocol import Rejection, decode_reply, decode_request
from kvferry.adapters.side_codec import unpack_request_kv
from kvferry.adapters.torch_frames import decode_payload, encode_bytes
from kvferry.app.registry import create_connector
from kvferry.app.wiring import build_manager
from kvferry.core.errors import BindError, ConfigError, ConnectorUnavailable, PayloadError
from kvferry.core.header import DecodeLimits
from kvferry.core.outcomes import ReceiveKind

ROOT = pathlib.Path(__file__).resolve().parents[2]
GEOM = Geometry()


# --------------------------------------------------------------------------- listening sockets
def _own_socket_inodes() -> set[int]:
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(int(target[8:-1]))
    return inodes


def _listening() -> set[tuple[str, int]]:
    """``(hex address, port)`` of TCP sockets in LISTEN state that belong to this process."""
    mine = _own_socket_inodes()
    out = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        if not os.path.exists(table):
            continue
        with open(table) as f:
            for line in list(f)[1:]:
                fields = line.split()
                address, port = fields[1].split(":")
                if fields[3] == "0A" and int(fields[9]) in mine:  # 0A: LISTEN
                    out.add((address, int(port, 16)))
    return out


pytestmark = pytest.mark.skipif(not os.path.exists("/proc/net/tcp"), reason="needs Linux /proc")


def test_a_manager_built_sender_listens_only_on_loopback_by_default() -> None:
    base = free_base_port()
    before = _listening()
    sender = build_manager(omni_config("sender", {"type": "zmq"}, base_port=base), env={})
    try:
        new = _listening() - before
        assert new == {("0100007F", base + 100)}, new  # 127.0.0.1:<derived port>, nothing else
    finally:
        sender.close()
    assert _listening() - before == set()


def test_a_configured_interface_is_the_only_one_bound() -> None:
    base = free_base_port()
    before = _listening()
    connector = {"type": "zmq", "host": "127.0.0.2", "advertise_host": "127.0.0.2"}
    sender = build_manager(omni_config("sender", connector, base_port=base), env={})
    try:
        assert _listening() - before == {("0200007F", base + 100)}  # 127.0.0.2 only, not 0.0.0.0
    finally:
        sender.close()
    with pytest.raises(ConfigError, match="advertise_host"):
        ZmqConnector({"role": "sender", "port": 0, "host": "0.0.0.0"})  # a wildcard must be explicit


def test_receivers_and_shm_senders_listen_on_no_tcp_port(shm_space: Any) -> None:
    before = _listening()
    receiver = ZmqConnector({"role": "receiver", "request_timeout_s": 0.2})
    shm_sender = create_connector(shm_space.config("sender", port=50999))
    try:
        assert receiver.get("0", "1", "k", {"source_host": "127.0.0.1", "source_port": 9}) is None
        assert shm_sender.endpoint.startswith("ipc://")
        assert _listening() - before == set()
    finally:
        receiver.close()
        shm_sender.close()


# ------------------------------------------------------------------------------------- CURVE
def test_curve_end_to_end_through_managers() -> None:
    keys = generate_curve_config()
    base = free_base_port()
    server = {"type": "zmq", "curve": {k: keys[k] for k in ("server_public", "server_secret", "client_public")}}
    client = {"type": "zmq", "curve": {k: keys[k] for k in ("server_public", "client_public", "client_secret")}}
    stranger_keys = generate_curve_config()
    stranger = {
        "type": "zmq",
        "curve": {
            "server_public": keys["server_public"],
            "client_public": stranger_keys["client_public"],
            "client_secret": stranger_keys["client_secret"],
        },
    }
    sender = build_manager(omni_config("sender", server, base_port=base), env={})
    info = {"host": "127.0.0.1", "zmq_port": base + 100}
    cache = sender_cache(GEOM, 1, 0, 1)
    try:
        for rid in ("secret-a", "secret-b"):
            sent = sender.send_requests({rid: {"block_ids": [1, 2], "seq_len": 8}}, cache, GEOM.block_size, GEOM.dtype)
            assert sent[0].ok
        for cfg in (stranger, {"type": "zmq"}):  # unknown key, no CURVE at all: nothing
            with build_manager(omni_config("receiver", cfg, recv_timeout=0.5, base_port=base), env={}) as rx:
                assert rx.receive("secret-a", sender_info=info).outcome.kind is ReceiveKind.TIMED_OUT
        assert sender.health()["sender"]["sender"]["requests"] == 0  # they never got through
        with build_manager(omni_config("receiver", client, base_port=base), env={}) as rx:
            assert rx.receive("secret-b", sender_info=info).ok
    finally:
        sender.close()


# ------------------------------------------------------------------------ no pickle, no eval
_FORBIDDEN_CALLS = {
    "load": ("torch", "numpy", "np", "yaml", "pickle", "marshal", "dill", "shelve"),
    "loads": ("pickle", "marshal", "dill", "cPickle", "_pickle"),
    "Unpickler": ("pickle", "_pickle"),
    "recv_pyobj": "any",
    "send_pyobj": "any",
    "recv_serialized": "any",
    "send_serialized": "any",
    "eval": (None,),
    "exec": (None,),
    "compile": (None,),  # the builtins
}


def _calls(path: pathlib.Path) -> list[tuple[int, str, str | None]]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        if isinstance(func, ast.Name):
            found.append((node.lineno, func.id, None))
        elif isinstance(func, ast.Attribute):
            owner = func.value.id if isinstance(func.value, ast.Name) else None
            found.append((node.lineno, func.attr, owner))
    return found


def test_no_library_call_can_deserialize_code() -> None:
    """Beyond the import scan: no unpickling loader (torch.load, np.load, pyzmq's *_pyobj ...),
    no eval/exec/compile/__import__ anywhere in core, adapters or app."""
    offences = []
    for layer in ("core", "adapters", "app"):
        for path in sorted((ROOT / layer).rglob("*.py")):
            for line, name, owner in _calls(path):
                if name not in _FORBIDDEN_CALLS:
                    continue
                owners = _FORBIDDEN_CALLS[name]
                if owners == "any" or owner in owners:
                    offences.append(f"{path.relative_to(ROOT)}:{line}: {owner + '.' if owner else ''}{name}()")
    assert offences == []


class _Bomb:
    """Unpickling this creates a file: proof that something unpickled it."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> Any:
        return (open, (self.path, "w"))


def test_a_pickle_bomb_is_only_data_on_every_wire(tmp_path: Any) -> None:
    marker = tmp_path / "executed"
    bomb = pickle.dumps(_Bomb(str(marker)))
    framed = struct.pack(">I", len(bomb)) + bomb  # as a KV header, as a side payload
    side = struct.pack(">i", len(bomb)) + bomb
    for data in (bomb, framed, side):
        with pytest.raises(PayloadError):
            decode_payload(data)
        try:  # a side payload whose length reads as <= 0 is the "sender failed" miss (SPEC 3.2)
            assert unpack_request_kv(data) is None
        except PayloadError:
            pass
    with pytest.raises(PayloadError):
        decode_object(bomb)
    for data in (bomb, msgpack.packb({"v": 1, "op": "get", "id": 1, "key": msgpack.ExtType(1, bomb)})):
        assert isinstance(decode_request(data), Rejection) and isinstance(decode_reply(data), Rejection)
        assert shm_decode(data) is None or "key" not in shm_decode(data) or not isinstance(shm_decode(data)["key"], str)
    assert not marker.exists()


# ---------------------------------------------------------------------------------- limits
def test_decode_limits_have_safe_defaults_and_reach_the_receive_path() -> None:
    limits = DecodeLimits()
    assert limits.max_header_bytes <= 4 << 20 and limits.max_tensors <= 65536
    assert limits.max_layers <= 65536 and limits.max_ndim <= 64
    assert MAX_OBJECT_BYTES <= 8 << 30  # the collectives' object codec refuses bigger claims
    layer = torch.zeros(2, 2, 2, dtype=torch.float16)
    payload = encode_bytes("limited", [layer] * 4, [layer] * 4, list(range(200)), {"pad": "x" * 500})
    tight = build_manager(
        omni_config("receiver", {"type": "memory"}),
        env={},
        start=False,
        decode_limits=DecodeLimits(max_header_bytes=256),
    )
    from kvferry.adapters.connectors.memory.connector import MemoryConnector

    with MemoryConnector.from_config({}) as conn:
        tight.connector = conn
        conn.put("0", "1", "omni_0_to_1_kv_cache_limited", payload)
        result = tight.receive("limited", timeout_s=1.0)
        assert result.outcome.kind is ReceiveKind.DECODE_FAILED and "exceeds the limit 256" in result.outcome.detail
        conn.put("0", "1", "omni_0_to_1_kv_cache_limited", payload)
        tight.decode_limits = DecodeLimits()  # the default admits it
        assert tight.receive("limited", timeout_s=1.0).ok


# ------------------------------------------------------------------------------ shared memory
def test_a_live_segment_is_owner_only_even_under_a_permissive_umask(shm_space: Any) -> None:
    old = os.umask(0)
    try:
        sender = build_manager(
            omni_config(
                "sender",
                {"type": "shm", "namespace": shm_space.namespace, "runtime_dir": shm_space.base},
                base_port=free_base_port(),
            ),
            env={},
        )
    finally:
        os.umask(old)
    try:
        segment = sender.health()["sender"]["segment"]
        mode = stat.S_IMODE(os.stat(os.path.join(SHM_DIR, segment)).st_mode)
        assert mode == 0o600, oct(mode)
        directory = runtime_dir(shm_space.namespace, shm_space.base)
        assert stat.S_IMODE(os.stat(directory).st_mode) == 0o700
        for entry in os.listdir(directory):
            info = os.lstat(os.path.join(directory, entry))
            assert info.st_uid == os.getuid()
            if stat.S_ISREG(info.st_mode):
                assert stat.S_IMODE(info.st_mode) == 0o600, (entry, oct(info.st_mode))
    finally:
        sender.close()


def test_a_shared_runtime_directory_is_made_private_or_refused(shm_space: Any) -> None:
    directory = runtime_dir(shm_space.namespace, shm_space.base)
    os.makedirs(directory)
    os.chmod(directory, 0o777)  # e.g. pre-created in a shared /tmp
    with create_connector(shm_space.config("sender", port=50998)):
        assert stat.S_IMODE(os.stat(directory).st_mode) == 0o700
    if os.geteuid() != 0:
        pytest.skip("needs root to create a directory owned by another user")
    os.makedirs(directory, exist_ok=True)
    decoy = os.path.join(directory, "decoy")
    open(decoy, "w").close()  # not empty: the reaper leaves it in place
    os.chown(directory, 65534, 65534)  # someone else's directory: never used
    try:
        with pytest.raises(ConnectorUnavailable) as info:
            create_connector(shm_space.config("sender", port=50997))
        assert isinstance(info.value.__cause__, BindError) and "belongs to uid 65534" in str(info.value)
        assert os.listdir(directory) == ["decoy"]
    finally:
        os.unlink(decoy)
        os.rmdir(directory)


def test_a_segment_planted_by_another_user_is_never_mapped(shm_space: Any) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root to create a file owned by another user")
    name = f"kvferry-{shm_space.namespace}-1-x-0badf00d"
    path = os.path.join(SHM_DIR, name)
    with open(path, "wb") as f:
        f.write(b"\0" * 4096)
    os.chown(path, 65534, 65534)
    try:
        with pytest.raises(ValueError, match="belongs to uid 65534"):
            open_segment(name)
    finally:
        os.unlink(path)
