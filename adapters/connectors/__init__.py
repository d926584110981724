"""Connector implementations (memory, shm, zmq, mooncake). Created by name via the registry."""

__all__: list[str] = []
