"""Connector implementations: ``memory``, ``shm``, ``zmq`` and the optional ``mooncake``.

Each is created by name through :func:`kvferry.app.registry.create_connector` (the one list of
built-in names is its ``BUILTIN_CONNECTORS``); modules are
imported only when their connector is asked for, so an optional package missing here costs
nothing until it is used (then creation fails loudly with what to install).
"""

__all__: list[str] = []
