"""kvferry.app: the manager, compatibility layer, registry, wiring and command line."""

__version__ = "0.1.0"

__all__ = ["__version__"]
