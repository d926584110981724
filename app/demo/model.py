"""The demo's pure description: geometry presets, the request list, every rank's config.

Everything here is a deterministic function of :class:`DemoSpec`, so the parent, every
sender rank and every receiver rank agree on the requests without talking to each other.
"""

from __future__ import annotations

import random
from typing import Any

import attrs

from kvferry.core.addressing import kv_port
from kvferry.core.models import model_geometry
from kvferry.core.routing import rank_heads, route_heads

__all__ = ["PRESETS", "DemoSpec", "DemoRequest", "request_plan", "CONNECTOR_CHOICES", "model_preset"]

#: name -> (model, layers, kv heads, head dim, dtype, block size)
PRESETS: dict[str, tuple[str, int, int, int, str, int]] = {
    "qwen2.5-7b": ("Qwen2.5-7B-Instruct", 28, 4, 128, "bfloat16", 16),
    "llama-3.1-8b": ("Llama-3.1-8B", 32, 8, 128, "bfloat16", 16),
    "qwen2.5-0.5b": ("Qwen2.5-0.5B", 24, 2, 64, "bfloat16", 16),
    "tiny": ("tiny test model", 2, 8, 16, "bfloat16", 16),
}


def model_preset(name: str, block_size: int = 16) -> dict[str, Any]:
    """DemoSpec fields for a model of :data:`kvferry.core.models.MODELS` (ConfigError listing
    the known names for another)."""
    m = model_geometry(name)
    if m.is_mla:
        assert m.latent_dim is not None
        return dict(
            model=m.name,
            layers=m.layers,
            kv_heads=1,
            head_dim=m.latent_dim,
            dtype=m.dtype,
            block_size=block_size,
            latent_dim=m.latent_dim,
        )
    assert m.kv_heads is not None and m.head_dim is not None
    return dict(
        model=m.name, layers=m.layers, kv_heads=m.kv_heads, head_dim=m.head_dim, dtype=m.dtype, block_size=block_size
    )


#: CLI connector name -> connector_config dict (without ports, which the manager derives)
CONNECTOR_CHOICES: dict[str, dict[str, Any]] = {
    "shm": {"type": "shm"},
    "zmq-tcp": {"type": "zmq", "transport": "tcp"},
    "zmq-ipc": {"type": "zmq", "transport": "ipc"},
    "memory": {"type": "memory"},
    "mooncake": {"type": "mooncake"},
    "nixl": {"type": "nixl"},
}


@attrs.frozen
class DemoRequest:
    request_id: str
    seq_len: int
    block_ids: tuple[int, ...]


#: A sender's pool when the demo sizes it (DemoSpec.pool_size): requests of the longest kind it
#: holds room for when requests do not overlap, bytes on top for headers, and the bounds.
POOL_REQUESTS = 4
POOL_SLACK = 8 << 20
POOL_FLOOR = 32 << 20
POOL_CAP = 1 << 30


@attrs.frozen
class DemoSpec:
    """Everything a demo worker needs; plain values so it crosses process boundaries."""

    connector: str = "shm"
    from_tp: int = 2
    to_tp: int = 4
    model: str = "Qwen2.5-7B-Instruct"
    layers: int = 28
    kv_heads: int = 4
    head_dim: int = 128
    dtype: str = "bfloat16"
    block_size: int = 16
    requests: int = 64
    min_tokens: int = 256
    max_tokens: int = 4096
    seed: int = 0
    base_port: int = 50051
    store_ports: tuple[int, int] = (0, 0)
    timeout_s: float = 60.0
    #: Each sender rank's pool (a memory connector's shared one); 0: sized from the requests
    #: (:meth:`pool_size`)
    pool_bytes: int = 0
    namespace: str = "demo"
    done_file: str = ""
    dump_dir: str | None = None
    #: MLA models: the latent width (``kv_lora_rank + qk_rope_head_dim``); 0 for K/V heads.
    latent_dim: int = 0
    #: False (the default): the senders send request ``i`` only once every receiver rank has
    #: verified request ``i - 1``, so each request is transferred the way the benchmark times
    #: its end to end (the receivers waiting, nothing else running). True: requests overlap
    #: (senders ahead, receivers verifying while later requests arrive): a pipeline under load.
    overlap: bool = False

    @property
    def is_mla(self) -> bool:
        return self.latent_dim > 0

    @property
    def routed_heads(self) -> int:
        """The head count routing uses: 1 for an MLA latent (every rank holds it whole)."""
        return 1 if self.is_mla else self.kv_heads

    def sender_heads(self, sender_rank: int) -> tuple[int, int]:
        """The KV heads (start, stop) sender rank ``sender_rank`` holds, as the engine places them
        (a head below the TP size is replicated)."""
        return rank_heads(self.from_tp, self.routed_heads, sender_rank)

    @property
    def num_blocks(self) -> int:
        """Blocks in each sender rank's synthetic cache: room for the longest request, twice."""
        return 2 * -(-self.max_tokens // self.block_size) + 8

    @property
    def advertised_port(self) -> int:
        """Sender rank 0's port (what the orchestrator advertises as sender info)."""
        return kv_port(self.base_port, 0, 0, 0, tp_size=self.from_tp)

    def head_range(self, receiver_rank: int) -> tuple[int, int]:
        """The receiver rank's KV heads in the full model (start, stop)."""
        route_heads(self.from_tp, self.to_tp, self.routed_heads)  # errors name the sizes and heads
        return rank_heads(self.to_tp, self.routed_heads, receiver_rank)

    def kv_bytes(self, tokens: int) -> int:
        """A request's KV bytes at ``tokens`` tokens, every layer and KV head of the model."""
        itemsize = 4 if self.dtype == "float32" else 2
        if self.is_mla:
            return self.layers * tokens * self.latent_dim * itemsize
        return self.layers * 2 * tokens * self.kv_heads * self.head_dim * itemsize

    def pool_size(self) -> int:
        """``pool_bytes``, or when that is 0 the pool a sender rank needs: room for
        :data:`POOL_REQUESTS` of the longest request whole (more than any one rank writes of
        it, a latent sent to two receivers included) or every request when they overlap, plus
        :data:`POOL_SLACK` for headers, between :data:`POOL_FLOOR` and :data:`POOL_CAP`. A
        shm sender reserves its whole pool in /dev/shm at start: a TP 8 demo of small
        requests no longer takes 8 GiB of it. Over the cap only when one request needs more."""
        if self.pool_bytes:
            return self.pool_bytes
        held = self.requests if self.overlap else POOL_REQUESTS
        longest = self.kv_bytes(self.max_tokens)
        return max(longest + POOL_SLACK, min(POOL_CAP, max(POOL_FLOOR, held * longest + POOL_SLACK)))

    def omni_kv_config(self, role: str) -> dict[str, Any]:
        """The ``omni_kv_config`` dict an engine would hand kvferry for this rank's stage."""
        connector = dict(CONNECTOR_CHOICES[self.connector])
        connector["zmq_port"] = self.base_port
        if connector["type"] in ("shm", "zmq", "mooncake", "nixl"):
            connector["pool_bytes"] = self.pool_size()
        if connector["type"] == "shm":
            connector["namespace"] = self.namespace
        common = {
            "connector_config": connector,
            "rank_mapping": {"from_tp": self.from_tp, "to_tp": self.to_tp},
            "recv_timeout": self.timeout_s,
            "kv_layout": "mla" if self.is_mla else "flash",
        }
        if not self.is_mla:
            common["num_kv_heads"] = self.kv_heads
        if role == "sender":
            return {**common, "omni_from_stage": 0, "omni_to_stage": 1, "stage_id": 0, "need_send_cache": True}
        return {**common, "stage_id": 1, "engine_input_source": [0], "need_recv_cache": True}


def request_plan(spec: DemoSpec) -> list[DemoRequest]:
    """The demo's requests: lengths uniform in [min, max] tokens, random distinct blocks.
    ValueError for fewer than 1 request or tokens outside ``1 <= min <= max``."""
    if spec.requests < 1:
        raise ValueError(f"--requests must be at least 1, got {spec.requests}")
    if not 1 <= spec.min_tokens <= spec.max_tokens:
        raise ValueError(f"need 1 <= --min-tokens <= --max-tokens, got {spec.min_tokens} and {spec.max_tokens}")
    rng = random.Random(spec.seed)
    out = []
    for i in range(spec.requests):
        seq_len = rng.randint(spec.min_tokens, spec.max_tokens)
        blocks = rng.sample(range(spec.num_blocks), -(-seq_len // spec.block_size))
        out.append(DemoRequest(f"demo-{spec.seed}-{i:04d}", seq_len, tuple(blocks)))
    return out
