"""Fixtures of the connector contract suite.

To run the suite against another connector, add ONE entry to ``CONNECTOR_FACTORIES``: a
function ``factory(config) -> ConnectorPair`` where ``config`` holds the contract's keys
(``pool_bytes``, ``readers``, ``lease_s``, ``clock``; more may come) and the pair is
``(sender_side, receiver_side, cleanup)``: the object the test calls ``put``/``reserve`` on,
the object it calls ``get``/``get_blocking`` on (the same object for in-process connectors),
and a callable that closes both and removes whatever the factory created. A factory may call
``pytest.skip("why")`` when an optional package is missing. The receiver side must already
know its default sender (``get(..., metadata=None)`` finds the payloads), e.g. through
``update_sender_info``.
"""

from __future__ import annotations

import itertools
import os
import shutil
import tempfile
from collections.abc import Callable
from typing import Any, NamedTuple

import pytest
import warm_spawn
from mooncake_support import mooncake_missing

from kvferry.app.registry import create_connector

warm_spawn.prestart()  # the gloo ranks fork from it; it imports torch meanwhile


class ConnectorPair(NamedTuple):
    sender: Any
    receiver: Any
    cleanup: Callable[[], None]


def memory_factory(config: dict[str, Any]) -> ConnectorPair:
    connector = create_connector({"type": "memory", **config})
    return ConnectorPair(connector, connector, connector.close)


def memory_objects_factory(config: dict[str, Any]) -> ConnectorPair:
    connector = create_connector({"type": "memory", "storage": "objects", **config})
    return ConnectorPair(connector, connector, connector.close)


_NAMESPACES = itertools.count()


def shm_factory(config: dict[str, Any]) -> ConnectorPair:
    """A sender and a receiver in this process, over a private namespace and runtime dir."""
    runtime_dir = tempfile.mkdtemp(prefix="kvft-", dir="/tmp")
    namespace = f"t{os.getpid()}n{next(_NAMESPACES)}"
    common = {"type": "shm", "namespace": namespace, "runtime_dir": runtime_dir}
    port = 50151
    sender = create_connector({**common, **config, "role": "sender", "port": port})
    try:
        receiver = create_connector({**common, "role": "receiver", "rpc_timeout_s": 5.0})
    except BaseException:
        sender.close()
        raise
    receiver.update_sender_info("127.0.0.1", port)

    def cleanup() -> None:
        receiver.close()
        sender.close()
        shutil.rmtree(runtime_dir, ignore_errors=True)

    return ConnectorPair(sender, receiver, cleanup)


def control_pair(common: dict[str, Any], config: dict[str, Any]) -> ConnectorPair:
    """A sender (control channel on an OS-chosen loopback port) and a receiver that knows it,
    both ``common`` + ``config``: the pair of the connectors with a control channel."""
    sender = create_connector({**common, **config, "role": "sender", "port": 0})
    try:
        receiver = create_connector({**common, **config, "role": "receiver"})
    except BaseException:
        sender.close()
        raise
    receiver.update_sender_info("127.0.0.1", sender.port)

    def cleanup() -> None:
        receiver.close()
        sender.close()

    return ConnectorPair(sender, receiver, cleanup)


def mooncake_factory(config: dict[str, Any]) -> ConnectorPair:
    """A mooncake sender and receiver in this process, over TCP on loopback (OS-chosen ports).

    Skips when the optional package or its system library (libibverbs) is missing."""
    missing = mooncake_missing()
    if missing is not None:
        pytest.skip(missing)
    return control_pair({"type": "mooncake", "host": "127.0.0.1"}, config)


def nixl_factory(config: dict[str, Any]) -> ConnectorPair:
    """A nixl sender and receiver in this process: two NIXL agents (UCX over TCP on loopback),
    control channel on an OS-chosen port. Skips, saying why, without the nixl package."""
    from nixl_support import NIXL_TEST_CONFIG, nixl_missing

    missing = nixl_missing()
    if missing is not None:
        pytest.skip(missing)
    return control_pair({"type": "nixl", **NIXL_TEST_CONFIG}, config)


def zmq_factory(transport: str) -> Callable[[dict[str, Any]], ConnectorPair]:
    """A zmq sender and receiver in this process: ``tcp`` on loopback with an OS-chosen port,
    or ``ipc`` in a private socket directory."""

    def factory(config: dict[str, Any]) -> ConnectorPair:
        ipc_dir = tempfile.mkdtemp(prefix="kvfz-", dir="/tmp")
        common = {"type": "zmq", "transport": transport, "ipc_dir": ipc_dir}
        port = 0 if transport == "tcp" else 50151
        try:
            sender = create_connector({**common, **config, "role": "sender", "port": port})
        except BaseException:
            shutil.rmtree(ipc_dir, ignore_errors=True)
            raise
        try:
            receiver = create_connector({**common, "role": "receiver"})
        except BaseException:
            sender.close()
            shutil.rmtree(ipc_dir, ignore_errors=True)
            raise
        receiver.update_sender_info("127.0.0.1", sender.port)

        def cleanup() -> None:
            receiver.close()
            sender.close()
            shutil.rmtree(ipc_dir, ignore_errors=True)

        return ConnectorPair(sender, receiver, cleanup)

    return factory


#: name -> factory. The zmq (tcp/ipc), mooncake and nixl connectors join by adding their entries.
CONNECTOR_FACTORIES: dict[str, Callable[[dict[str, Any]], ConnectorPair]] = {
    "memory": memory_factory,
    "memory-objects": memory_objects_factory,
    "shm": shm_factory,
    "mooncake": mooncake_factory,
    "nixl": nixl_factory,
    "zmq-tcp": zmq_factory("tcp"),
    "zmq-ipc": zmq_factory("ipc"),
}


@pytest.fixture(params=sorted(CONNECTOR_FACTORIES))
def connector_name(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
def make_pair(connector_name: str) -> Any:
    """``make_pair(**config) -> ConnectorPair``; everything made is cleaned up after the test."""
    made: list[ConnectorPair] = []

    def make(**config: Any) -> ConnectorPair:
        config.setdefault("pool_bytes", 16 << 20)
        pair = CONNECTOR_FACTORIES[connector_name](config)
        made.append(pair)
        return pair

    yield make
    for pair in reversed(made):
        pair.cleanup()


@pytest.fixture
def pair(make_pair: Any) -> ConnectorPair:
    return make_pair()
