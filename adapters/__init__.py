"""kvferry.adapters: torch, ZMQ, shared memory and torch.distributed behind the core's ports."""

__all__: list[str] = []
