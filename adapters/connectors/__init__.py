"""Connector implementations: ``memory``, ``shm``, ``zmq`` and the optional ``mooncake``.

Each is created by name through :func:`kvferry.app.registry.create_connector`; modules are
imported only when their connector is asked for, so an optional package missing here costs
nothing until it is used (then creation fails loudly with what to install).
"""

__all__ = ["CONNECTOR_MODULES"]

#: connector name -> implementing module (imported lazily by the registry)
CONNECTOR_MODULES = {
    "memory": "kvferry.adapters.connectors.memory.connector",
    "shm": "kvferry.adapters.connectors.shm.connector",
    "zmq": "kvferry.adapters.connectors.zmq.connector",
    "mooncake": "kvferry.adapters.connectors.mooncake.connector",
}
