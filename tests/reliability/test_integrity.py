"""Per-tensor checksums (SPEC 3.1 extension): a corrupted payload is rejected, never delivered.

- any byte flipped inside any tensor of a crc32 or crc32c payload raises PayloadError naming
  exactly that tensor and the algorithm (bytes or split frames), and a tampered checksum field
  does too;
- through the manager (sender ``checksums="crc32"``, a link that flips one byte in transit):
  the receive is DECODE_FAILED naming the tensor, no payload is handed out, the pool buffer is
  released, and the next request arrives bit-exact;
- checksums are off by default (docs/reliability.md says why): without them the same flip is
  delivered, which is exactly what the option is for.
"""

from __future__ import annotations

import random
import re
from typing import Any

import pytest
import torch
from fault_kit import free_base_port
from hypothesis import given, settings
from hypothesis import strategies as st
from stage_kit import Geometry, expected_layers, omni_config, received_exactly, request_blocks, sender_cache

from kvferry.adapters.connectors.memory.connector import MemoryConnector
from kvferry.adapters.connectors.zmq.connector import ZmqConnector
from kvferry.adapters.torch_frames import TORCH_DTYPES, decode_payload, encode_bytes
from kvferry.app.manager import KVTransferManager
from kvferry.app.wiring import build_manager
from kvferry.core.errors import PayloadError
from kvferry.core.header import decode_header
from kvferry.core.outcomes import ReceiveKind

GEOM = Geometry()


def _tensor(dtype: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    n = 1
    for d in shape:
        n *= d
    raw = torch.randint(0, 256, (n * TORCH_DTYPES[dtype].itemsize,), dtype=torch.uint8, generator=gen)
    return raw.view(TORCH_DTYPES[dtype]).reshape(shape)


@settings(max_examples=150, deadline=None)
@given(
    layers=st.integers(1, 4),
    dtype=st.sampled_from(sorted(TORCH_DTYPES)),
    tokens=st.integers(1, 5),
    align=st.sampled_from([1, 8, 64]),
    pick=st.randoms(use_true_random=False),
    form=st.sampled_from(["bytes", "frames", "tensor"]),
    algorithm=st.sampled_from(["crc32", "crc32c"]),
)
def test_any_flipped_tensor_byte_is_rejected_naming_that_tensor(
    layers: int, dtype: str, tokens: int, align: int, pick: random.Random, form: str, algorithm: str
) -> None:
    keys = [_tensor(dtype, (tokens, 2, 2), i) for i in range(layers)]
    values = [_tensor(dtype, (tokens, 2, 2), 100 + i) for i in range(layers)]
    raw = encode_bytes("r", keys, values, [0], {}, align=align, checksums=algorithm)
    decoded = decode_header(raw)
    index = pick.randrange(len(decoded.spans))
    start, nbytes = decoded.spans[index]
    victim = decoded.header.tensors[index].name
    data = bytearray(raw)
    data[start + pick.randrange(nbytes)] ^= 1 << pick.randrange(8)
    container: Any = {  # a pool buffer's uint8 tensor is read through its own byte view
        "bytes": lambda: bytes(data),
        "frames": lambda: [bytes(data[: start + 1]), bytes(data[start + 1 :])],
        "tensor": lambda: torch.frombuffer(data, dtype=torch.uint8),
    }[form]()
    with pytest.raises(PayloadError, match=rf"tensor '{victim}'.*{algorithm} mismatch"):
        decode_payload(container)
    assert decode_payload(raw).key_cache[0] is not None  # the untouched payload decodes


@pytest.mark.parametrize("algorithm", ["crc32", "crc32c"])
def test_a_tampered_checksum_field_is_rejected_naming_the_tensor(algorithm: str) -> None:
    keys = [_tensor("bfloat16", (3, 2, 2), i) for i in (1, 2)]
    values = [_tensor("bfloat16", (3, 2, 2), i) for i in (3, 4)]
    raw = encode_bytes("r", keys, values, [0], {}, checksums=algorithm)
    text = raw.decode("latin-1")
    checksums = re.findall(r'"c":"([0-9a-f]{8})"', text)
    assert len(set(checksums)) == 4  # keys 0, 1, then values 0, 1
    tampered = text.replace(f'"c":"{checksums[2]}"', '"c":"00000000"', 1).encode("latin-1")
    with pytest.raises(PayloadError, match=rf"tensor 'value_cache_0'.*{algorithm} mismatch"):
        decode_payload(tampered)


class CorruptingLink:
    """Wraps a receiving connector; flips one bit inside tensor ``victim`` of every payload
    it hands out (in place for pool buffers, in a copy for read-only frames)."""

    def __init__(self, inner: Any, victim: str) -> None:
        self.inner = inner
        self.victim = victim
        self.enabled = True
        self.flipped = 0

    def _corrupt(self, got: Any) -> Any:
        if got is None or not self.enabled:
            return got
        data, size = got
        if hasattr(data, "tensor"):  # a pool buffer: flip in place (the sender's pool memory)
            flat = data.tensor
            offset = self._offset(bytes(flat[:65536].numpy()), flat.numel())
            flat[offset] ^= 0x10
        else:
            joined = bytearray(b"".join(bytes(f) for f in data))
            joined[self._offset(bytes(joined[:65536]), len(joined))] ^= 0x10
            data = [joined]
        self.flipped += 1
        return data, size

    def _offset(self, head: bytes, total: int) -> int:
        decoded = decode_header(head, total_len=total)
        for entry, span in zip(decoded.header.tensors, decoded.spans):
            if entry.name == self.victim:
                return span[0] + span[1] // 2
        raise AssertionError(f"no tensor {self.victim}")

    def put(self, *args: Any, **kwargs: Any) -> Any:
        return self.inner.put(*args, **kwargs)

    def get(self, *args: Any, **kwargs: Any) -> Any:
        return self._corrupt(self.inner.get(*args, **kwargs))

    def get_blocking(self, *args: Any, **kwargs: Any) -> Any:
        return self._corrupt(self.inner.get_blocking(*args, **kwargs))

    def cleanup(self, request_id: str) -> None:
        self.inner.cleanup(request_id)

    def health(self) -> dict[str, Any]:
        return self.inner.health()

    def close(self) -> None:
        self.inner.close()


@pytest.mark.parametrize(("kind", "algorithm"), [("memory", "crc32c"), ("zmq", "crc32")])
def test_a_payload_corrupted_in_transit_is_decode_failed_and_never_delivered(kind: str, algorithm: str) -> None:
    base = free_base_port()
    cache = sender_cache(GEOM, 4, 0, 1)
    rng = random.Random(8)
    shared = MemoryConnector.from_config({"pool_bytes": 1 << 20}) if kind == "memory" else None
    connector = {"type": kind}
    sender = build_manager(
        omni_config("sender", connector, base_port=base), env={}, connector=shared, checksums=algorithm
    )
    inner = shared if shared is not None else ZmqConnector({"role": "receiver"})
    link = CorruptingLink(inner, "value_cache_1")
    receiver = build_manager(omni_config("receiver", connector, base_port=base), env={}, connector=link)
    info = {"host": "127.0.0.1", "zmq_port": base + 100}
    try:
        requests = {}
        for rid in ("corrupted", "clean"):
            blocks = request_blocks(GEOM, rng, 20)
            requests[rid] = blocks
            assert sender.send_requests(
                {rid: {"block_ids": blocks, "seq_len": 20}}, cache, GEOM.block_size, GEOM.dtype
            )[0].ok
        result = receiver.receive("corrupted", sender_info=info)
        assert link.flipped == 1
        assert result.outcome.kind is ReceiveKind.DECODE_FAILED and result.payload is None, result.outcome
        assert "value_cache_1" in result.outcome.detail and f"{algorithm} mismatch" in result.outcome.detail
        if shared is not None:  # the corrupted buffer went back: only "clean" is held
            assert shared.pool.ledger.stats()["entries"] == 1
        link.enabled = False
        clean = receiver.receive("clean", sender_info=info)
        assert clean.ok and received_exactly(
            clean.payload, expected_layers(GEOM, {0: cache}, requests["clean"], 20, 1, 1, 0)
        )
        clean.release()  # a zero-copy result holds its buffer until released
        if shared is not None:
            assert shared.pool.ledger.stats()["used_bytes"] == 0  # every buffer went back
        assert receiver.counters.snapshot()["recv.decode_failed"] == 1
    finally:
        receiver.close()
        sender.close()
        link.close()


def test_checksums_are_off_by_default_so_a_flip_without_them_is_delivered() -> None:
    assert KVTransferManager.__attrs_attrs__.checksums.default is None
    shared = MemoryConnector.from_config({})
    link = CorruptingLink(shared, "key_cache_0")
    cache = sender_cache(GEOM, 4, 0, 1)
    sender = build_manager(omni_config("sender", {"type": "memory"}), env={}, connector=shared)
    receiver = build_manager(omni_config("receiver", {"type": "memory"}), env={}, connector=link)
    try:
        assert sender.send_requests({"plain": {"block_ids": [3, 4], "seq_len": 8}}, cache, GEOM.block_size, GEOM.dtype)[
            0
        ].ok
        result = receiver.receive("plain")
        assert result.ok and link.flipped == 1
        assert not received_exactly(result.payload, expected_layers(GEOM, {0: cache}, [3, 4], 8, 1, 1, 0))
    finally:
        receiver.close()
        sender.close()
        shared.close()
