"""Zero-copy receives (the typed API's default; ``zero_copy=True`` spelled out below): views of
the pool, explicit and garbage-collected release, hold safety, and the copying receive
(``zero_copy=False``, what the compat layer uses).

In-process tests use the memory connector (its releases run inline, or on the release thread
when the garbage collector triggers them); the shm tests run a sender and a receiver in this
process over a private namespace.
"""

from __future__ import annotations

import gc
import itertools
import os
import shutil
import tempfile
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from waits import eventually

from kvferry.adapters.connectors.pool_buffer import PooledBuffer, tie_region, tie_release, wait_for_gc_releases
from kvferry.app.manager import KVTransferManager
from kvferry.app.receive import ReceiveResult
from kvferry.app.registry import create_connector
from kvferry.core.errors import ConfigError
from kvferry.core.outcomes import ReceiveKind, ReceiveOutcome

settings.register_profile(
    "kvferry-zero-copy", max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
PROFILE = settings.get_profile("kvferry-zero-copy")
_SPACES = itertools.count()


def tensors_of(result: ReceiveResult) -> list[torch.Tensor]:
    blocks = result.payload["layer_blocks"]
    return list(blocks["key_cache"]) + list(blocks["value_cache"])


def inside(t: torch.Tensor, storage: torch.Tensor) -> bool:
    start = storage.data_ptr()
    return start <= t.data_ptr() < start + storage.numel()


def settled() -> None:
    """Every release the garbage collector queued so far has run."""
    gc.collect()
    assert wait_for_gc_releases(10.0), "the release thread did not catch up within 10 s"


# ----------------------------------------------------------------------------- in-process


@given(
    topology=st.sampled_from([(1, 1), (1, 2), (2, 4), (4, 2), (2, 1)]),
    layout=st.sampled_from(["kv_dim0", "packed", "tuple"]),
)
@PROFILE
def test_zero_copy_delivers_the_same_bits_as_copying_and_returns_every_region(kit, topology, layout) -> None:
    from_tp, to_tp = topology
    model = kit.PagedModel(heads=8, dtype=torch.bfloat16)
    conn = create_connector({"type": "memory", "pool_bytes": 8 << 20, "readers": 2})
    try:
        requests = {"a": {"block_ids": [3, 1, 5], "seq_len": 10}, "b": {"block_ids": [0, 7], "seq_len": 5}}
        assert all(o.ok for o in kit.send_all(model, conn, from_tp, to_tp, requests, layout))
        storage = conn.pool.storage
        for rank in range(to_tp):
            receiver = KVTransferManager(
                kit.receiver_config(from_tp, to_tp), tp_rank=rank, tp_size=to_tp, connector=conn
            )
            for rid, spec in requests.items():
                expected = model.expected(spec["block_ids"], spec["seq_len"], rank, to_tp)
                copied = receiver.receive(rid, zero_copy=False)
                with receiver.receive(rid, zero_copy=True) as viewed:
                    assert copied.ok and viewed.ok, (copied.outcome, viewed.outcome)
                    kit.assert_kv_equal(copied.payload, *expected)
                    kit.assert_kv_equal(viewed.payload, *expected)
                    assert copied.buffers == () and not any(inside(t, storage) for t in tensors_of(copied))
                    in_pool = [inside(t, storage) for t in tensors_of(viewed)]
                    if from_tp <= to_tp:  # nothing merged: every tensor is a view of the pool
                        assert all(in_pool) and len(viewed.buffers) == 1 and viewed.held
                    else:  # fan-in: torch.cat made fresh tensors, and no buffer is held for them
                        assert not any(in_pool) and viewed.buffers == () and not viewed.held
                assert not viewed.held
        assert kit.pool_is_empty(conn)
    finally:
        conn.close()


def test_release_is_idempotent_and_the_region_is_reused_only_after_it(kit, memory_connector, make_receiver) -> None:
    model = kit.PagedModel()
    kit.send_all(model, memory_connector, 1, 1, {"a": {"block_ids": [1, 2], "seq_len": 8}})
    result = make_receiver(memory_connector).receive("a", zero_copy=True)
    keys = result.payload["layer_blocks"]["key_cache"]
    before = [k.clone() for k in keys]
    junk = torch.full(((8 << 20) - 4096,), 0x7F, dtype=torch.uint8)  # needs the region still held
    ok, _, info = memory_connector.put(from_stage="0", to_stage="1", put_key="junk", data=junk)
    assert not ok and info["reason"] == "pool_full"
    assert all(kit.bits_equal(a, b) for a, b in zip(keys, before))
    result.release()
    result.release()
    assert not result.held and kit.pool_is_empty(memory_connector)
    assert memory_connector.put(from_stage="0", to_stage="1", put_key="junk", data=junk)[0]


def test_dropping_the_result_and_every_tensor_releases(kit, memory_connector, make_receiver) -> None:
    model = kit.PagedModel()
    kit.send_all(
        model, memory_connector, 1, 1, {"a": {"block_ids": [1, 2], "seq_len": 8}, "b": {"block_ids": [3], "seq_len": 4}}
    )
    receiver = make_receiver(memory_connector)
    result = receiver.receive("a", zero_copy=True)
    survivor = result.payload["layer_blocks"]["value_cache"][-1][2:]  # a view of a view
    del result
    gc.collect()
    assert memory_connector.health()["live_regions"] == 2  # one tensor still reads its bytes
    assert survivor.numel() > 0
    del survivor
    settled()
    assert memory_connector.health()["live_regions"] == 1
    again = receiver.receive("b", zero_copy=True)
    assert again.held
    del again  # result and tensors together
    settled()
    assert kit.pool_is_empty(memory_connector)


def test_a_memory_reader_holding_past_hold_s_is_never_revoked(kit, make_receiver, fake_time) -> None:
    conn = create_connector(
        {"type": "memory", "pool_bytes": 1 << 20, "hold_s": 1.0, "lease_s": 5.0, "clock": fake_time}
    )
    try:
        model = kit.PagedModel(num_blocks=64, block_size=16)
        kit.send_all(model, conn, 1, 1, {"a": {"block_ids": list(range(20)), "seq_len": 320}}, fake=fake_time)
        result = make_receiver(conn).receive("a", zero_copy=True)
        assert result.ok and result.nbytes > (1 << 20) - 900_000
        fake_time.advance(100.0)  # far past hold_s and the lease
        ok, _, info = conn.put(from_stage="0", to_stage="1", put_key="x", data=bytes(900_000))
        assert not ok and info["reason"] == "pool_full"  # fits only in the region still read
        health = conn.health()
        assert health["overdue"] == 1 and health["held_overdue"] == 1 and health.get("expired_unreleased", 0) == 0
        kit.assert_kv_equal(result.payload, *model.expected(list(range(20)), 320))
        result.release()
        assert kit.pool_is_empty(conn)
    finally:
        conn.close()


def test_tensors_moved_to_another_device_hold_nothing(kit, memory_connector, make_receiver) -> None:
    model = kit.PagedModel()
    kit.send_all(model, memory_connector, 1, 1, {"a": {"block_ids": [1, 2], "seq_len": 8}})
    result = make_receiver(memory_connector).receive("a", target_device="meta", zero_copy=True)
    assert result.ok and {t.device.type for t in tensors_of(result)} == {"meta"}
    assert result.buffers == () and kit.pool_is_empty(memory_connector)


@pytest.mark.parametrize("copy_unpooled", [False, True])
def test_unpooled_data_is_copied_only_when_asked(kit, memory_connector_factory, make_receiver, copy_unpooled) -> None:
    conn = memory_connector_factory(storage="objects")  # gets return bytes, not pool buffers
    model = kit.PagedModel()
    kit.send_all(model, conn, 1, 1, {"a": {"block_ids": [1, 2], "seq_len": 8}})
    receiver = make_receiver(conn)
    path = receiver.receive_path()
    path.copy_unpooled = copy_unpooled
    result = receiver.receive("a", zero_copy=True)
    assert result.ok and result.buffers == ()
    kit.assert_kv_equal(result.payload, *model.expected([1, 2], 8))
    fresh = [t.untyped_storage().nbytes() == t.numel() * t.element_size() for t in tensors_of(result)]
    assert all(fresh) if copy_unpooled else not any(fresh)


def test_zero_copy_is_the_default_and_copying_is_asked_for(kit, memory_connector, make_receiver) -> None:
    model = kit.PagedModel()
    kit.send_all(
        model, memory_connector, 1, 1, {"a": {"block_ids": [1, 2], "seq_len": 8}, "b": {"block_ids": [3], "seq_len": 4}}
    )
    receiver = make_receiver(memory_connector)
    viewed = receiver.receive("a")
    assert viewed.ok and viewed.held
    assert all(inside(t, memory_connector.pool.storage) for t in tensors_of(viewed))
    viewed.release()
    copied = receiver.receive("b", zero_copy=False)
    assert copied.ok and copied.buffers == () and not copied.held
    assert not any(inside(t, memory_connector.pool.storage) for t in tensors_of(copied))
    assert kit.pool_is_empty(memory_connector)


def test_failed_zero_copy_receives_hold_nothing(kit, memory_connector, make_receiver) -> None:
    memory_connector.put(from_stage="0", to_stage="1", put_key="omni_0_to_1_kv_cache_g", data=b"\x00" * 64)
    result = make_receiver(memory_connector).receive("g", zero_copy=True)
    assert result.outcome.kind is ReceiveKind.DECODE_FAILED and result.buffers == ()
    assert kit.pool_is_empty(memory_connector)


def test_the_manager_reuses_its_receive_path_until_a_hook_changes(kit, memory_connector, make_receiver) -> None:
    receiver = make_receiver(memory_connector)
    first = receiver.receive_path()
    assert receiver.receive_path() is first
    receiver.set_hooks(kv_payload_slicer=lambda payload: payload)
    assert receiver.receive_path() is not first
    again = receiver.receive_path()
    assert receiver.receive_path() is again
    with pytest.raises(ConfigError, match="kv_payload_slicer must be callable"):
        receiver.set_hooks(kv_payload_slicer="not callable")
    with pytest.raises(ConfigError, match="unknown hook 'slicer'"):
        receiver.set_hooks(slicer=None)
    assert receiver.receive_path() is again  # nothing was set


def test_a_pool_buffer_that_is_not_tied_is_wrapped(kit, make_receiver) -> None:
    """A connector whose pool buffers do not follow their views (another package's) still gets
    zero-copy: the receive ties the release to the tensors itself."""
    inner = create_connector({"type": "memory", "pool_bytes": 8 << 20})

    class Plain:
        def __init__(self, buffer: Any) -> None:
            self.inner, self.tensor, self.releases = buffer, buffer.tensor, 0

        def release(self) -> None:
            self.releases += 1
            self.inner.release()

    class Wrapping(kit.BlockingSpyConnector):
        handed: list = []

        def get_blocking(self, *args: Any, **kwargs: Any) -> Any:
            got = super().get_blocking(*args, **kwargs)
            if got is None:
                return None
            plain = Plain(got[0])
            self.handed.append(plain)
            return plain, got[1]

    try:
        model = kit.PagedModel()
        kit.send_all(model, inner, 1, 1, {"a": {"block_ids": [1, 2], "seq_len": 8}})
        result = make_receiver(Wrapping(inner)).receive("a", zero_copy=True)
        assert result.ok and len(result.buffers) == 1
        assert all(inside(t, inner.pool.storage) for t in tensors_of(result))
        (plain,) = Wrapping.handed
        assert plain.releases == 0
        del result
        settled()
        assert plain.releases == 1 and kit.pool_is_empty(inner)
    finally:
        inner.close()


def test_tied_release_follows_the_last_view() -> None:
    calls: list[str] = []
    base = torch.arange(64, dtype=torch.uint8)
    tensor, finalizer = tie_release(base, lambda: calls.append("released"))
    assert tensor.data_ptr() == base.data_ptr() and finalizer.alive
    view = tensor[8:16].view(torch.int32)
    del tensor
    gc.collect()
    assert calls == [] and view.tolist() == base[8:16].view(torch.int32).tolist()
    del view
    settled()
    assert calls == ["released"]
    buffer = PooledBuffer.tied(
        base, on_release=lambda: calls.append("sync"), on_release_soon=lambda: calls.append("soon")
    )
    buffer.release_soon()
    buffer.release()
    del buffer
    gc.collect()
    assert calls == ["released", "soon"]
    with pytest.raises(ValueError):
        tie_release(base[::2], lambda: None)


def test_a_region_tied_by_address_reads_its_bytes_and_holds_its_mapping() -> None:
    calls: list[str] = []
    base = torch.arange(64, dtype=torch.uint8)
    expected = base[8:24].tolist()
    tensor, finalizer = tie_region(base, base.data_ptr() + 8, 16, lambda: calls.append("released"))
    assert tensor.data_ptr() == base.data_ptr() + 8 and tensor.tolist() == expected
    del base  # the owner keeps it: the bytes stay readable
    gc.collect()
    assert tensor.tolist() == expected and calls == [] and finalizer.alive
    del tensor
    settled()
    assert calls == ["released"]
    keep = torch.full((32,), 7, dtype=torch.uint8)
    buffer = PooledBuffer.tied_region(keep, keep.data_ptr(), 32, on_release=lambda: calls.append("sync"))
    assert buffer.tied_to_views and buffer.nbytes == 32 and int(buffer.tensor.sum()) == 7 * 32
    buffer.release()
    assert calls == ["released", "sync"] and buffer.released


def test_a_result_built_without_buffers_releases_nothing() -> None:
    result = ReceiveResult(ReceiveOutcome.received("r"), {"request_id": "r"})
    result.release()
    assert not result.held and result.buffers == ()


# ------------------------------------------------------------------------------------ shm


@pytest.fixture
def shm_pair():
    """A shm sender and receiver of this process in a private namespace (nothing left after)."""
    base = tempfile.mkdtemp(prefix="kvfz-", dir="/tmp")
    common = {"type": "shm", "namespace": f"z{os.getpid()}n{next(_SPACES)}", "runtime_dir": base}
    sender = create_connector({**common, "role": "sender", "port": 50151, "pool_bytes": 4 << 20})
    receiver = create_connector({**common, "role": "receiver", "sender_port": 50151})
    yield sender, receiver
    receiver.close()
    sender.close()
    shutil.rmtree(base, ignore_errors=True)


def test_shm_zero_copy_tensors_live_in_the_segment_until_released(kit, shm_pair, make_receiver) -> None:
    sender, receiver_conn = shm_pair
    model = kit.PagedModel()
    kit.send_all(model, sender, 1, 1, {"a": {"block_ids": [1, 2], "seq_len": 8}})
    result = make_receiver(receiver_conn).receive("a", zero_copy=True)
    assert result.ok
    start, end = receiver_conn.mapped_range(sender.health()["segment"])
    assert all(start <= t.data_ptr() < end for t in tensors_of(result))
    kit.assert_kv_equal(result.payload, *model.expected([1, 2], 8))
    assert sender.health()["used_bytes"] > 0
    result.release(wait=True)  # returns once the sender took the region back
    assert sender.health()["used_bytes"] == 0


def test_shm_copying_receive_releases_without_waiting(kit, shm_pair, make_receiver) -> None:
    sender, receiver_conn = shm_pair
    model = kit.PagedModel()
    kit.send_all(model, sender, 1, 1, {"a": {"block_ids": [1, 2], "seq_len": 8}})
    result = make_receiver(receiver_conn).receive("a", zero_copy=False)
    assert result.ok and result.buffers == ()
    assert receiver_conn.flush_releases(5.0) and sender.health()["used_bytes"] == 0
    kit.assert_kv_equal(result.payload, *model.expected([1, 2], 8))


def test_shm_grant_the_receiver_cannot_map_ends_the_receive_at_once(kit, make_receiver, caplog) -> None:
    """A receiving stage whose shm directory is not its sender's (the usual cause: a container
    that does not share /dev/shm) gets an ``error`` outcome naming ``shm_dir`` and the fix from
    its first grant, not a timeout at its deadline (the grant drained the key: asking again
    finds nothing); the sender gets the region back. A receiver on the sender's directory
    receives the same sender's next request bit-exact."""
    base = tempfile.mkdtemp(prefix="kvfz-", dir="/tmp")
    elsewhere = tempfile.mkdtemp(prefix="kvfz-shm-", dir="/tmp")
    common = {"type": "shm", "namespace": f"z{os.getpid()}n{next(_SPACES)}", "runtime_dir": base}
    sender = create_connector({**common, "role": "sender", "port": 50151, "pool_bytes": 4 << 20})
    far = create_connector({**common, "role": "receiver", "sender_port": 50151, "shm_dir": elsewhere})
    near = create_connector({**common, "role": "receiver", "sender_port": 50151})
    try:
        model = kit.PagedModel()
        kit.send_all(model, sender, 1, 1, {"a": {"block_ids": [1, 2], "seq_len": 8}})
        kit.send_all(model, sender, 1, 1, {"b": {"block_ids": [3], "seq_len": 5}})
        result = make_receiver(far).receive("a", timeout_s=30)
        assert result.outcome.kind is ReceiveKind.ERROR, result.outcome
        assert "cannot read" in result.outcome.detail and "shm_dir" in result.outcome.detail
        assert far.health()["bad_grants"] == 1
        assert not [r for r in caplog.records if r.exc_info]  # an outcome, not an unexpected fault
        good = make_receiver(near).receive("b", timeout_s=30)
        assert good.ok, good.outcome
        kit.assert_kv_equal(good.payload, *model.expected([3], 5))
        good.release(wait=True)
        eventually(lambda: sender.health()["used_bytes"] == 0, "both regions back at the sender")
    finally:
        near.close()
        far.close()
        sender.close()
        shutil.rmtree(base, ignore_errors=True)
        shutil.rmtree(elsewhere, ignore_errors=True)


# ------------------------------------------------------------------------------- zmq streams


class _FlipAfterEncoding:
    """A sender connector whose reservations get one tensor byte flipped after the payload was
    encoded (its checksums written) and before it is published: corruption at the sender."""

    def __init__(self, inner: Any, at: int) -> None:
        self._inner, self._at = inner, at

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def reserve(self, from_stage: Any, to_stage: Any, put_key: str, nbytes: int) -> Any:
        return _Flipped(self._inner.reserve(from_stage, to_stage, put_key, nbytes), nbytes - self._at)


class _Flipped:
    def __init__(self, inner: Any, at: int) -> None:
        self._inner, self._at = inner, at

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def commit(self) -> Any:
        self._inner.buffer[self._at] ^= 0xFF
        return self._inner.commit()


@pytest.mark.parametrize("corrupt", [False, True], ids=["intact", "flipped_at_the_sender"])
def test_a_streamed_zmq_receive_checks_tensors_as_they_arrive_and_reads_none_again(kit, monkeypatch, corrupt) -> None:
    """Over a zmq stream (a payload of many chunks) the receiver computes each tensor's checksum
    as its chunks land, so with checksums on, the decode reads no tensor again to verify it.
    The control: a byte flipped at the sender after encoding makes the checksum computed on
    arrival differ from the header's; the decode then reads that tensor and the receive fails
    ``decode_failed`` naming it (never delivered)."""
    import kvferry.adapters.torch_decode as torch_decode

    reads: list[str] = []  # the tensors the decode read to verify them, either way
    compute, verify = torch_decode.compute_checksum, torch_decode.verify_checksum
    monkeypatch.setattr(torch_decode, "compute_checksum", lambda a, data: reads.append("deferred") or compute(a, data))
    monkeypatch.setattr(torch_decode, "verify_checksum", lambda h, d, data: reads.append(d.name) or verify(h, d, data))
    sender_conn = create_connector(
        {"type": "zmq", "role": "sender", "port": 0, "pool_bytes": 16 << 20, "chunk_bytes": 64 << 10}
    )
    receiver_conn = create_connector(
        {"type": "zmq", "role": "receiver", "sender_host": "127.0.0.1", "sender_port": sender_conn.port}
    )
    try:
        model = kit.PagedModel(num_layers=3, num_blocks=48, block_size=16, heads=4, head_dim=64, dtype=torch.bfloat16)
        spec = {"block_ids": list(range(1, 48, 2)), "seq_len": 370}
        put_through = _FlipAfterEncoding(sender_conn, 1000) if corrupt else sender_conn
        sender = KVTransferManager(kit.sender_config(), connector=put_through, checksums="crc32c")
        (sent,) = sender.send_requests({"a": spec}, model.rank_cache(), model.block_size, model.dtype)
        assert sent.ok and sent.nbytes > 8 * (64 << 10)  # many chunks
        receiver = KVTransferManager(kit.receiver_config(), connector=receiver_conn)
        result = receiver.receive("a", zero_copy=True)
        assert receiver_conn.health()["receiver"]["streams"] == 1
        if corrupt:
            assert result.outcome.kind is ReceiveKind.DECODE_FAILED, result.outcome
            assert "value_cache_2" in result.outcome.detail and "mismatch" in result.outcome.detail
            assert reads  # the decode read the tensor whose arrival checksum differed
        else:
            assert result.ok, result.outcome
            kit.assert_kv_equal(result.payload, *model.expected(spec["block_ids"], spec["seq_len"]))
            assert reads == []  # every tensor was checked as it arrived
            result.release()
    finally:
        receiver_conn.close()
        sender_conn.close()
