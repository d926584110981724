"""The connector contract (SPEC 5), run against every entry of ``CONNECTOR_FACTORIES``."""

from __future__ import annotations

import json
import threading
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest
import torch

from kvferry.core.errors import PoolFullError
from kvferry.core.ports import BatchedReleases, BlockingGet, Connector, GetMany, PoolBuffer, Reservable

MiB = 1 << 20


class FakeClock:
    """A monotonic clock the test moves by hand (seconds). Thread-safe."""

    def __init__(self, start: float = 1000.0) -> None:
        self._now = start
        self._lock = threading.Lock()

    def monotonic(self) -> float:
        with self._lock:
            return self._now

    def advance(self, seconds: float) -> None:
        with self._lock:
            self._now += seconds


def as_bytes(data: Any) -> bytes:
    """The payload bytes of any received-data form (pool buffer, tensor, bytes-like, frames)."""
    if hasattr(data, "release") and hasattr(data, "tensor"):
        return as_bytes(data.tensor)
    if isinstance(data, torch.Tensor):
        return data.cpu().contiguous().view(torch.uint8).numpy().tobytes()
    if isinstance(data, (list, tuple)):
        return b"".join(as_bytes(part) for part in data)
    return bytes(memoryview(data).cast("B"))


def release(data: Any) -> None:
    """Release received data if it lives in a pool (no-op otherwise)."""
    if hasattr(data, "release") and hasattr(data, "tensor"):
        data.release()


def fetch(receiver: Any, key: str, metadata: Any = None, timeout_s: float = 5.0) -> bytes | None:
    """Blocking get when offered, else one get; returns bytes and releases any pool buffer."""
    if hasattr(receiver, "get_blocking"):
        got = receiver.get_blocking("0", "1", key, metadata, timeout_s=timeout_s)
    else:
        got = receiver.get(from_stage="0", to_stage="1", get_key=key, metadata=metadata)
    if got is None:
        return None
    data, size = got
    try:
        payload = as_bytes(data)
        assert size == len(payload)
        return payload
    finally:
        release(data)


def payload(n: int, seed: int = 0) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


def test_meets_the_protocols(pair) -> None:
    assert isinstance(pair.sender, Connector) and isinstance(pair.receiver, Connector)
    assert isinstance(pair.receiver, BlockingGet)
    assert isinstance(pair.sender, Reservable)


@pytest.mark.parametrize("kind", ["bytes", "bytearray", "memoryview", "tensor", "frames", "empty"])
def test_round_trip_of_every_payload_kind(pair, kind) -> None:
    raw = payload(100_003, seed=1)
    data = {
        "bytes": raw,
        "bytearray": bytearray(raw),
        "memoryview": memoryview(raw),
        "tensor": torch.frombuffer(bytearray(raw), dtype=torch.uint8),
        "frames": [raw[:10], memoryview(raw)[10:5000], b"", torch.frombuffer(bytearray(raw[5000:]), dtype=torch.uint8)],
        "empty": b"",
    }[kind]
    expected = b"" if kind == "empty" else raw
    ok, size, meta = pair.sender.put(from_stage="0", to_stage="1", put_key="req_0_0_0_0", data=data)
    assert ok and size == len(expected)
    assert meta is None or isinstance(meta, dict)
    assert fetch(pair.receiver, "req_0_0_0_0", meta) == expected
    assert fetch(pair.receiver, "req_0_0_0_0", meta, timeout_s=0.05) is None  # consumed


def test_bad_data_is_refused_and_not_stored(pair) -> None:
    """Data that is not a payload is local misuse: a ConfigError, or a failed put with reason
    "error" (both are what the manager handles); never another exception, never stored."""
    from kvferry.core.errors import ConfigError

    strided = memoryview(np.arange(100, dtype=np.uint8)[::2])
    for bad in ("text", 42, strided, [b"ok", object()]):
        try:
            ok, size, info = pair.sender.put("0", "1", "bad", bad)
        except ConfigError:
            continue
        assert (ok, size, info["reason"]) == (False, 0, "error") and info["detail"]
    assert pair.receiver.get("0", "1", "bad") is None
    assert pair.sender.put("0", "1", "good", b"fine")[0]  # and the connector still works


def test_get_many_answers_each_key_as_get_would(pair) -> None:
    """GetMany (optional): per key in order, the payload or None, consumed as by get."""
    if not isinstance(pair.receiver, GetMany):
        pytest.skip(f"{type(pair.receiver).__name__} does not offer get_many")
    metas = [pair.sender.put("0", "1", f"many_{i}", payload(1000 + i, seed=i))[2] for i in range(3)]
    got = pair.receiver.get_many("0", "1", ["many_0", "absent", "many_2", "many_1"], metas[0])
    assert [None if g is None else as_bytes(g[0]) for g in got] == [
        payload(1000, seed=0),
        None,
        payload(1002, seed=2),
        payload(1001, seed=1),
    ]
    batched = pair.receiver.batched_releases() if isinstance(pair.receiver, BatchedReleases) else None
    if batched is not None:
        with batched:
            for g in got:
                if g is not None:
                    release(g[0])
    else:
        for g in got:
            if g is not None:
                release(g[0])
    assert pair.receiver.get_many("0", "1", ["many_0"], metas[0]) == [None]  # consumed


def test_get_without_metadata_uses_the_default_sender(pair) -> None:
    assert pair.sender.put("0", "1", "k1", b"abc")[0]
    got = pair.receiver.get(from_stage="0", to_stage="1", get_key="k1", metadata=None)
    assert got is not None and as_bytes(got[0]) == b"abc" and got[1] == 3
    release(got[0])


def test_not_found_is_none(pair) -> None:
    assert pair.receiver.get("0", "1", "missing") is None
    assert pair.receiver.get("0", "1", "missing", None) is None


def test_consume_once_by_default(pair) -> None:
    ok, _, meta = pair.sender.put("0", "1", "once", b"x" * 10)
    assert ok
    first = pair.receiver.get("0", "1", "once", meta)
    assert first is not None
    assert pair.receiver.get("0", "1", "once", meta) is None  # duplicate reader: not found
    release(first[0])
    assert pair.receiver.get("0", "1", "once", meta) is None


def test_n_readers(make_pair) -> None:
    pair = make_pair(readers=3)
    ok, _, meta = pair.sender.put("0", "1", "multi", payload(999, 3))
    assert ok
    got = [pair.receiver.get("0", "1", "multi", meta) for _ in range(3)]
    assert all(g is not None and as_bytes(g[0]) == payload(999, 3) for g in got)
    assert pair.receiver.get("0", "1", "multi", meta) is None
    for g in got:
        release(g[0])


def test_unread_payload_expires_after_its_lease(make_pair) -> None:
    clock = FakeClock()
    pair = make_pair(lease_s=10.0, clock=clock)
    assert pair.sender.put("0", "1", "old", b"1" * 100)[0]
    assert pair.sender.put("0", "1", "young", b"2" * 100)[0]
    clock.advance(9.0)
    assert fetch(pair.receiver, "young") == b"2" * 100
    clock.advance(1.0)
    assert pair.receiver.get("0", "1", "old") is None
    health = pair.sender.health()
    assert health["used_bytes"] == 0 if "used_bytes" in health else True


def test_pool_full_reports_reason_and_recovers_after_release(make_pair) -> None:
    pair = make_pair(pool_bytes=1 * MiB)
    ok, _, meta = pair.sender.put("0", "1", "a", payload(600 * 1024))
    assert ok
    ok, size, info = pair.sender.put("0", "1", "b", payload(600 * 1024, 1))
    assert (ok, size) == (False, 0) and info["reason"] == "pool_full" and info["detail"]
    ok, size, info = pair.sender.put("0", "1", "huge", payload(2 * MiB))
    assert (ok, size, info["reason"]) == (False, 0, "too_large")
    got = pair.receiver.get("0", "1", "a", meta)
    assert got is not None
    release(got[0])
    release(got[0])  # idempotent
    ok, _, meta_b = pair.sender.put("0", "1", "b", payload(600 * 1024, 1))
    assert ok, meta_b
    assert fetch(pair.receiver, "b", meta_b) == payload(600 * 1024, 1)


def test_pool_buffer_is_not_reused_before_release(make_pair) -> None:
    pair = make_pair(pool_bytes=1 * MiB)
    first = payload(400 * 1024, 7)
    ok, _, meta = pair.sender.put("0", "1", "held", first)
    got = pair.receiver.get("0", "1", "held", meta)
    assert ok and got is not None
    data, _ = got
    for i in range(20):  # churn through the rest of the pool many times
        ok, _, m = pair.sender.put("0", "1", f"churn{i}", payload(300 * 1024, i))
        assert ok, m
        assert fetch(pair.receiver, f"churn{i}", m) == payload(300 * 1024, i)
    assert as_bytes(data) == first
    if isinstance(data, PoolBuffer):
        data.release()
        data.release()


def test_cleanup_drops_every_key_of_the_request(pair) -> None:
    for key in ("reqA_0_0_0_0", "reqA_0_0_0_1", "reqB_0_0_0_0"):
        assert pair.sender.put("0", "1", key, key.encode())[0]
    pair.sender.cleanup("reqA")
    pair.sender.cleanup("reqA")  # idempotent
    pair.receiver.cleanup("nothing-here")
    assert pair.receiver.get("0", "1", "reqA_0_0_0_0") is None
    assert pair.receiver.get("0", "1", "reqA_0_0_0_1") is None
    assert fetch(pair.receiver, "reqB_0_0_0_0") == b"reqB_0_0_0_0"


def test_latest_put_of_a_key_wins_and_keys_can_be_reused(pair) -> None:
    assert pair.sender.put("0", "1", "k", b"first")[0]
    assert pair.sender.put("0", "1", "k", b"second")[0]
    assert fetch(pair.receiver, "k") == b"second"
    assert pair.sender.put("0", "1", "k", b"third")[0]
    assert fetch(pair.receiver, "k") == b"third"


def test_health_is_json(pair) -> None:
    for side in (pair.sender, pair.receiver):
        health = side.health()
        assert health["ok"] is True and isinstance(health["type"], str)
        json.dumps(health)


def test_close_is_idempotent_and_a_context_manager(pair) -> None:
    with pair.sender as sender:
        assert sender.put("0", "1", "k", b"v")[0]
    ok, size, info = pair.sender.put("0", "1", "k2", b"v")
    assert (ok, size, info["reason"]) == (False, 0, "closed")
    pair.sender.close()
    with pair.receiver:
        pass
    pair.receiver.close()
    assert pair.receiver.get("0", "1", "k") is None
    assert pair.receiver.health()["ok"] is False


def test_reservation_commit_and_abort(make_pair) -> None:
    pair = make_pair(pool_bytes=1 * MiB)
    res = pair.sender.reserve("0", "1", "direct", 1000)
    assert res.buffer.dtype == torch.uint8 and res.buffer.shape == (1000,)
    res.buffer.copy_(torch.arange(1000, dtype=torch.int64).to(torch.uint8))
    ok, size, _ = res.commit()
    assert ok and size == 1000
    assert res.commit()[0]  # idempotent
    res.abort()  # no effect after commit
    assert fetch(pair.receiver, "direct") == bytes(i % 256 for i in range(1000))
    big = pair.sender.reserve("0", "1", "big", 900 * 1024)
    with pytest.raises(PoolFullError, match="pool_full"):
        pair.sender.reserve("0", "1", "more", 900 * 1024)
    with pytest.raises(PoolFullError, match="too_large"):
        pair.sender.reserve("0", "1", "more", 2 * MiB)
    big.abort()
    big.abort()
    assert not big.commit()[0]
    pair.sender.reserve("0", "1", "more", 900 * 1024).abort()  # space came back


def test_blocking_get_times_out_by_its_deadline(pair) -> None:
    start = time.monotonic()
    assert pair.receiver.get_blocking("0", "1", "never", None, timeout_s=0.3) is None
    elapsed = time.monotonic() - start
    assert 0.29 <= elapsed < 2.0


def test_blocking_get_wakes_on_arrival(pair) -> None:
    waiting = threading.Event()
    result: dict[str, object] = {}

    def reader() -> None:
        waiting.set()
        start = time.monotonic()
        got = pair.receiver.get_blocking("0", "1", "late", None, timeout_s=20.0)
        result["elapsed"] = time.monotonic() - start
        result["data"] = None if got is None else as_bytes(got[0])
        if got is not None:
            release(got[0])

    thread = threading.Thread(target=reader)
    thread.start()
    assert waiting.wait(5.0)
    put_at = time.monotonic()
    assert pair.sender.put("0", "1", "late", b"arrived")[0]
    thread.join(10.0)
    assert not thread.is_alive()
    assert result["data"] == b"arrived"
    assert time.monotonic() - put_at < 2.0  # woken by the arrival, not by the 20 s deadline


def test_blocking_get_returns_none_when_closed_while_waiting(pair) -> None:
    waiting = threading.Event()
    out: list[object] = []

    def reader() -> None:
        waiting.set()
        out.append(pair.receiver.get_blocking("0", "1", "k", None, timeout_s=20.0))

    thread = threading.Thread(target=reader)
    thread.start()
    assert waiting.wait(5.0)
    closed_at = time.monotonic()
    pair.receiver.close()
    thread.join(10.0)
    assert out == [None] and time.monotonic() - closed_at < 5.0  # woken, not the 20 s deadline


def test_concurrent_puts_and_gets(make_pair) -> None:
    pair = make_pair(pool_bytes=32 * MiB)
    keys = [f"r{t}_0_0_{i}_0" for t in range(4) for i in range(25)]

    def put(key: str) -> bool:
        data = payload(20_000 + len(key), seed=zlib.crc32(key.encode()))
        return pair.sender.put("0", "1", key, [data[:100], data[100:]])[0]

    def get(key: str) -> bool:
        data = fetch(pair.receiver, key, timeout_s=20.0)
        return data == payload(20_000 + len(key), seed=zlib.crc32(key.encode()))

    # 4 writer threads and 4 reader threads, each with its own share of the keys; readers
    # start first and block until their keys arrive.
    with ThreadPoolExecutor(4) as readers, ThreadPoolExecutor(4) as writers:
        gets = [readers.submit(lambda ks=keys[t::4]: all(get(k) for k in ks)) for t in range(4)]
        puts = [writers.submit(lambda ks=keys[t::4]: all(put(k) for k in ks)) for t in range(4)]
        assert all(f.result(timeout=60) for f in puts)
        assert all(f.result(timeout=60) for f in gets)
    health = pair.sender.health()
    assert health.get("used_bytes", 0) == 0


@pytest.mark.slow
def test_large_payload_256_mib(make_pair) -> None:
    n = 256 * MiB
    pair = make_pair(pool_bytes=n + MiB)
    data = torch.empty(n, dtype=torch.uint8)
    data[::4096] = torch.arange(n // 4096, dtype=torch.int64).to(torch.uint8)
    data[-1] = 77
    ok, size, meta = pair.sender.put("0", "1", "big", data)
    assert ok and size == n
    got = pair.receiver.get_blocking("0", "1", "big", meta, timeout_s=30.0)
    assert got is not None and got[1] == n
    received, _ = got
    tensor = (
        received.tensor
        if isinstance(received, PoolBuffer)
        else torch.frombuffer(bytearray(as_bytes(received)), dtype=torch.uint8)
    )
    assert torch.equal(tensor, data)
    release(received)


# ------------------------------------------------------------------------------ registry


def test_registry_unknown_name_lists_the_available_ones() -> None:
    from kvferry.app.registry import ConnectorRegistry
    from kvferry.core.errors import ConfigError

    registry = ConnectorRegistry()
    with pytest.raises(ConfigError, match="available: memory, mooncake, nixl, shm, zmq"):
        registry.create({"type": "carrier-pigeon"})
    with pytest.raises(ConfigError, match="type"):
        registry.create({"pool_bytes": 1})


def test_registry_remembers_constructor_failures() -> None:
    from kvferry.app.registry import ConnectorRegistry
    from kvferry.core.errors import ConnectorUnavailable

    calls = []

    def broken(config: dict) -> Any:
        calls.append(config)
        raise OSError("device missing")

    registry = ConnectorRegistry({"broken": broken, "absent": "kvferry_no_such_module:Thing"})
    for _ in range(3):
        with pytest.raises(ConnectorUnavailable, match="device missing") as info:
            registry.create({"type": "broken", "x": 1})
        assert isinstance(info.value.__cause__, OSError)
    assert len(calls) == 1  # tried once; later calls get the remembered failure at once
    with pytest.raises(ConnectorUnavailable, match="ModuleNotFoundError"):
        registry.create({"type": "absent"})
    assert len(registry.failures()) == 2
    registry.forget_failures("broken")
    with pytest.raises(ConnectorUnavailable):
        registry.create({"type": "broken", "x": 1})
    assert len(calls) == 2


def test_registry_registers_targets_lazily() -> None:
    from kvferry.app.registry import ConnectorRegistry
    from kvferry.core.errors import ConfigError, ConnectorUnavailable

    registry = ConnectorRegistry({})
    registry.register("mem", "kvferry.adapters.connectors.memory.connector:MemoryConnector")
    with pytest.raises(ConfigError):
        registry.register("mem", "x:y", replace=False)
    with pytest.raises(ConfigError):
        registry.register("bad", "no-colon")
    with registry.create({"type": "mem", "pool_bytes": 4096}) as connector:
        assert isinstance(connector, Connector) and connector.health()["pool_bytes"] == 4096
    registry.register("not-a-connector", lambda config: object())
    with pytest.raises(ConnectorUnavailable, match="Connector contract"):
        registry.create({"type": "not-a-connector"})
