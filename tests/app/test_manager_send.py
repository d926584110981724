"""The send path of :class:`KVTransferManager` on in-memory adapters (SPEC 4, 7).

Every request handed in gets a typed outcome (sent / failed with a reason / skipped); puts are
retried 3 times with 0.1 s doubling backoff (the injected sleep records the delays); a
connector that cannot be created is remembered and never created again on the hot path.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kvferry.adapters.torch_frames import decode_payload
from kvferry.app.compat.manager import OmniKVTransferManager
from kvferry.core.errors import ConnectorUnavailable
from kvferry.core.outcomes import ReceiveKind, SendKind, SendReason

REQ = {"block_ids": [3, 1, 5], "seq_len": 10}


def _raw(connector: Any, key: str) -> Any:
    """Decode the payload stored under ``key`` (consumes it)."""
    got = connector.get(from_stage="0", to_stage="1", get_key=key)
    assert got is not None, f"nothing stored under {key}"
    data, _ = got
    try:
        decoded = decode_payload(data)
        return decoded, [t.clone() for t in decoded.key_cache], [t.clone() for t in decoded.value_cache]
    finally:
        if hasattr(data, "release"):
            data.release()


# --------------------------------------------------------------------------------- layouts
@pytest.mark.parametrize("path", ["reserved", "frames"])
@pytest.mark.parametrize("layout", ["kv_dim0", "kv_dim1", "packed", "tuple"])
def test_spec7_send_every_layout_delivers_bit_exact(
    kit, memory_connector, make_sender, make_receiver, layout, path
) -> None:
    """Each SPEC 4 layout, through the pool (reserve + gather) and through zero-copy frames."""
    model = kit.PagedModel()
    conn = memory_connector if path == "reserved" else kit.SpyConnector(memory_connector)
    sender = make_sender(conn, config=kit.sender_config(kv_layout=kit.LAYOUT_NAMES[layout]))
    [outcome] = sender.send_requests(
        {"r1": {**REQ, "custom_metadata": {"note": "x"}}}, model.rank_cache(layout=layout), model.block_size, "float32"
    )
    assert outcome.kind is SendKind.SENT and outcome.ok
    assert outcome.keys == ("omni_0_to_1_kv_cache_r1",) and outcome.attempts == 1 and outcome.nbytes > 0
    if path == "frames":  # zero-copy frames: header + tensor views, never one joined object
        [(key, data)] = conn.puts
        assert key == "omni_0_to_1_kv_cache_r1" and isinstance(data, list) and len(data) > 1
    result = make_receiver(memory_connector).receive("r1")
    assert result.ok
    kit.assert_kv_equal(result.payload, *model.expected(REQ["block_ids"], REQ["seq_len"]))
    meta = result.payload["metadata"]
    assert meta["note"] == "x" and meta["seq_len"] == 10 and meta["block_size"] == 4
    assert meta["num_layers"] == model.num_layers and meta["dtype"] == "float32"
    assert result.payload["block_ids"] == [3, 1, 5] and result.payload["request_id"] == "r1"


def test_requests_of_every_length_and_a_replaced_cache_arrive_bit_exact(
    kit, memory_connector, make_sender, make_receiver
) -> None:
    """One sender, one cache, requests of several lengths (each a payload template of its own,
    found again by the cache and its token count when a length comes back), then another cache
    (new tensors, half the heads), then the first cache again: every payload holds the blocks
    of the cache it was sent from, in its shapes."""
    first, second = kit.PagedModel(seed=1), kit.PagedModel(seed=2, heads=4)
    sender, receiver = make_sender(memory_connector), make_receiver(memory_connector)
    caches = {id(first): first.rank_cache(), id(second): second.rank_cache()}  # the same tensors each round
    rounds = [(first, 10), (first, 3), (first, 10), (second, 10), (second, 7), (first, 10)]
    for n, (model, seq_len) in enumerate(rounds):
        request = {"block_ids": [3, 1, 5], "seq_len": seq_len}
        [outcome] = sender.send_requests({f"r{n}": request}, caches[id(model)], model.block_size, "float32")
        assert outcome.ok, outcome
        result = receiver.receive(f"r{n}")
        assert result.ok and result.payload["metadata"]["seq_len"] == seq_len
        kit.assert_kv_equal(result.payload, *model.expected(request["block_ids"], seq_len))


def test_spec4_unusable_layers_skipped_others_sent(kit, memory_connector, make_sender, make_receiver) -> None:
    model = kit.PagedModel()
    cache = model.rank_cache()
    cache[1] = torch.zeros(3, 3)  # not a KV layout: skipped with a warning, layer absent
    [outcome] = make_sender(memory_connector).send_requests({"r1": REQ}, cache, 4, "float32")
    assert outcome.ok
    result = make_receiver(memory_connector).receive("r1")
    keys, values = model.expected(REQ["block_ids"], REQ["seq_len"])
    assert result.payload["layer_blocks"]["key_cache"][1] is None
    assert kit.bits_equal(result.payload["layer_blocks"]["key_cache"][0], keys[0])
    assert kit.bits_equal(result.payload["layer_blocks"]["value_cache"][2], values[2])


# -------------------------------------------------------------------------------- outcomes
def told_and_drained(kit, connector: Any, make_receiver: Any, outcome: Any) -> None:
    """The receiving stage was told of the refusal (a marker under the request's key, read as
    a ``refused`` outcome), and then nothing is left in the pool."""
    assert outcome.refusal_keys == ("omni_0_to_1_kv_cache_r1",)
    result = make_receiver(connector).receive("r1")
    assert result.outcome.kind is ReceiveKind.REFUSED and result.payload is None
    assert outcome.reason.value in result.outcome.detail
    assert kit.pool_is_empty(connector)


def test_spec4_request_without_block_ids_fails_no_blocks(kit, memory_connector, make_sender, make_receiver) -> None:
    model = kit.PagedModel()
    [outcome] = make_sender(memory_connector).send_requests(
        {"r1": {"block_ids": [], "seq_len": 4}}, model.rank_cache(), 4, "float32"
    )
    assert outcome.kind is SendKind.FAILED and outcome.reason is SendReason.NO_BLOCKS
    told_and_drained(kit, memory_connector, make_receiver, outcome)


@pytest.mark.parametrize(
    "spec",
    [{"block_ids": [99, 100], "seq_len": 8}, {"block_ids": [1], "seq_len": 0}],
    ids=["blocks-out-of-range", "zero-tokens"],
)
def test_spec4_all_layers_empty_fails_no_payload(kit, memory_connector, make_sender, make_receiver, spec) -> None:
    model = kit.PagedModel()
    [outcome] = make_sender(memory_connector).send_requests({"r1": spec}, model.rank_cache(), 4, "float32")
    assert outcome.kind is SendKind.FAILED and outcome.reason is SendReason.NO_PAYLOAD
    told_and_drained(kit, memory_connector, make_receiver, outcome)


def test_spec4_no_usable_layout_fails_no_payload(memory_connector, make_sender) -> None:
    cache = [torch.zeros(4, 4), (torch.zeros(2, 2, 2),), "not a tensor"]
    [outcome] = make_sender(memory_connector).send_requests({"r1": REQ}, cache, 4, "float32")
    assert outcome.reason is SendReason.NO_PAYLOAD


@pytest.mark.parametrize("path", ["reserved", "frames"])
def test_spec5_full_pool_fails_pool_full_after_retries(
    kit, memory_connector_factory, make_sender, fake_time, path
) -> None:
    """A tiny pool holds one request; the next is ``pool_full`` after 3 attempts, not lost silently."""
    model = kit.PagedModel()
    inner = memory_connector_factory(pool_bytes=12288)  # one request fits
    conn = inner if path == "reserved" else kit.SpyConnector(inner)
    sender = make_sender(conn)
    first, second = sender.send_requests({"a": REQ, "b": REQ}, model.rank_cache(), 4, "float32")
    assert first.ok
    assert second.kind is SendKind.FAILED and second.reason is SendReason.POOL_FULL
    assert second.attempts == 3 and second.failed_keys == ("omni_0_to_1_kv_cache_b",)
    assert fake_time.sleeps == [0.1, 0.2]
    assert sender.counters.get("send.failed.pool_full") == 1 and sender.counters.get("send.sent") == 1


@pytest.mark.parametrize("path", ["reserved", "frames"])
def test_spec5_payload_larger_than_pool_fails_at_once(
    kit, memory_connector_factory, make_sender, fake_time, path
) -> None:
    """A payload that can never fit is not retried (retrying cannot help) and is not ``pool_full``."""
    model = kit.PagedModel()
    inner = memory_connector_factory(pool_bytes=1024)
    conn = inner if path == "reserved" else kit.SpyConnector(inner)
    [outcome] = make_sender(conn).send_requests({"a": REQ}, model.rank_cache(), 4, "float32")
    assert outcome.kind is SendKind.FAILED and outcome.reason is SendReason.PUT_FAILED
    assert "exceeds the pool" in outcome.detail
    assert outcome.attempts == 1 and fake_time.sleeps == []


class CountingFactory:
    def __init__(self, error: BaseException) -> None:
        self.error = error
        self.calls: list[dict] = []

    def __call__(self, config: dict) -> Any:
        self.calls.append(config)
        raise self.error


@pytest.mark.parametrize(
    "error",
    [
        ConnectorUnavailable("connector 'x' could not be created"),
        ImportError("No module named 'optional_pkg'"),
        RuntimeError("constructor blew up"),
    ],
    ids=["unavailable", "import-error", "runtime-error"],
)
def test_spec7_connector_unavailable_is_remembered_and_not_retried(kit, make_sender, error) -> None:
    model = kit.PagedModel()
    factory = CountingFactory(error)
    sender = make_sender(None, connector_factory=factory)
    with pytest.raises(ConnectorUnavailable):
        sender.start()  # a sending stage fails loudly at start
    for _ in range(3):
        outcomes = sender.send_requests({"a": REQ, "b": REQ}, model.rank_cache(), 4, "float32")
        assert [o.reason for o in outcomes] == [SendReason.CONNECTOR_UNAVAILABLE] * 2
    assert len(factory.calls) == 1
    assert isinstance(sender.connector_failure("sender"), ConnectorUnavailable)
    assert sender.counters.get("send.failed.connector_unavailable") == 6
    assert "sender" in sender.health()["failures"]


def test_spec7_missing_connector_config_is_unavailable(kit, make_sender) -> None:
    model = kit.PagedModel()
    sender = make_sender(None, config=kit.sender_config(connector_config=None))
    [outcome] = sender.send_requests({"a": REQ}, model.rank_cache(), 4, "float32")
    assert outcome.reason is SendReason.CONNECTOR_UNAVAILABLE
    assert "connector_config" in str(sender.connector_failure("sender"))


# --------------------------------------------------------------------------------- retries
def test_spec7_put_retried_three_times_with_doubling_backoff(
    kit, memory_connector, make_sender, make_receiver, fake_time
) -> None:
    model = kit.PagedModel()
    spy = kit.SpyConnector(memory_connector)
    spy.put_script = [(False, 0, {"reason": "error", "detail": "transient"})] * 2
    [outcome] = make_sender(spy).send_requests({"r1": REQ}, model.rank_cache(), 4, "float32")
    assert outcome.ok and outcome.attempts == 3
    assert fake_time.sleeps == [0.1, 0.2]
    assert len(spy.puts) == 3
    assert make_receiver(memory_connector).receive("r1").ok


def test_spec7_put_failing_every_attempt_is_a_failed_outcome(kit, memory_connector, make_sender, fake_time) -> None:
    model = kit.PagedModel()
    spy = kit.SpyConnector(memory_connector)
    spy.put_script = [(False, 0, None)] * 3
    sender = make_sender(spy)
    [outcome] = sender.send_requests({"r1": REQ}, model.rank_cache(), 4, "float32")
    assert outcome.kind is SendKind.FAILED and outcome.reason is SendReason.PUT_FAILED
    assert outcome.attempts == 3 and outcome.keys == () and outcome.nbytes == 0
    assert fake_time.sleeps == [0.1, 0.2]
    assert sender.counters.get("send.sent") == 0 and sender.counters.errors == 1


def test_spec7_closed_connector_is_not_retried(kit, memory_connector, make_sender, fake_time) -> None:
    model = kit.PagedModel()
    spy = kit.SpyConnector(memory_connector)
    spy.put_script = [(False, 0, {"reason": "closed", "detail": "gone"})]
    [outcome] = make_sender(spy).send_requests({"r1": REQ}, model.rank_cache(), 4, "float32")
    assert outcome.reason is SendReason.PUT_FAILED and outcome.attempts == 1 and fake_time.sleeps == []


# ------------------------------------------------------------------------- ids and results
def test_spec7_request_id_resolver_names_the_keys(kit, memory_connector, make_sender, make_receiver) -> None:
    model = kit.PagedModel()
    sender = make_sender(memory_connector, 2, 2, rank=1)
    [outcome] = sender.send_requests(
        {"local-7": REQ}, model.rank_cache(1, 2), 4, "float32", request_id_resolver=lambda rid: "global-" + rid
    )
    assert outcome.ok and outcome.request_id == "global-local-7"
    assert outcome.keys == ("global-local-7_0_0_1_1",)
    result = make_receiver(memory_connector, 2, 2, rank=1).receive("global-local-7")
    assert result.ok and result.payload["request_id"] == "global-local-7"
    kit.assert_kv_equal(result.payload, *model.expected(REQ["block_ids"], 10, 1, 2))


def test_spec7_one_outcome_per_request_in_order_and_every_id_processed(kit, memory_connector, make_sender) -> None:
    """A bad request does not stop the others; compat returns every id (so blocks are freed)."""
    model = kit.PagedModel()
    finished = {
        "ok-1": REQ,
        "no-blocks": {"block_ids": [], "seq_len": 3},
        "bad-meta": {**REQ, "custom_metadata": ["not", "a", "mapping"]},
        "ok-2": REQ,
    }
    outcomes = make_sender(memory_connector).send_requests(finished, model.rank_cache(), 4, "float32")
    assert [o.request_id for o in outcomes] == list(finished)
    assert [o.reason for o in outcomes] == [None, SendReason.NO_BLOCKS, SendReason.ERROR, None]
    compat = OmniKVTransferManager(kit.sender_config(), connector=memory_connector, tp_rank=0, tp_size=1)
    assert compat.handle_finished_requests_kv_transfer(finished, model.rank_cache(), 4, "float32") == list(finished)
    assert [o.ok for o in compat.last_send_outcomes] == [True, False, False, True]


def test_spec7_not_sending_config_skips_every_request(kit, memory_connector, make_sender) -> None:
    model = kit.PagedModel()
    sender = make_sender(memory_connector, config=kit.sender_config(need_send_cache=False))
    outcomes = sender.send_requests({"a": REQ, "b": REQ}, model.rank_cache(), 4, "float32")
    assert [o.kind for o in outcomes] == [SendKind.SKIPPED] * 2
    assert [o.reason for o in outcomes] == [SendReason.NOT_SENDING] * 2
    assert sender.counters.get("send.skipped") == 2 and sender.counters.errors == 0
    assert kit.pool_is_empty(memory_connector)


def test_spec7_send_counters_and_bytes(kit, memory_connector, make_sender) -> None:
    model = kit.PagedModel()
    sender = make_sender(memory_connector)
    outcomes = sender.send_requests({"a": REQ, "b": {"block_ids": [], "seq_len": 1}}, model.rank_cache(), 4, "f32")
    snap = sender.counters.snapshot()
    assert snap["send.sent"] == 1 and snap["send.failed"] == 1 and snap["send.failed.no_blocks"] == 1
    assert snap["send.bytes"] == outcomes[0].nbytes > 0 and snap["errors"] == 1


# --------------------------------------------------------------------------------- fan-out
@pytest.mark.parametrize("from_tp,to_tp", [(1, 2), (2, 4), (1, 4)])
def test_spec2_4_fan_out_is_sliced_on_the_sender_and_tagged(kit, memory_connector, make_sender, from_tp, to_tp) -> None:
    model = kit.PagedModel(heads=8)
    k = to_tp // from_tp
    for rank in range(from_tp):
        [outcome] = make_sender(memory_connector, from_tp, to_tp, rank=rank).send_requests(
            {"r1": REQ}, model.rank_cache(rank, from_tp), 4, "float32"
        )
        assert outcome.ok and len(outcome.keys) == k
        for i, key in enumerate(outcome.keys):
            target = rank * k + i
            assert key == f"r1_0_0_{rank}_{target}"
            decoded, keys, values = _raw(memory_connector, key)
            tag = decoded.metadata["tp_head_slice"]
            assert tag == {
                "applied": True,
                "side": "sender",
                "target_rank": target,
                "source_rank": rank,
                "from_tp": from_tp,
                "to_tp": to_tp,
                "offset_in_shard": i,
                "num_slices": k,
            }
            want_k, want_v = model.expected(REQ["block_ids"], 10, target, to_tp)
            assert all(kit.bits_equal(a, b) for a, b in zip(keys, want_k))
            assert all(kit.bits_equal(a, b) for a, b in zip(values, want_v))
    assert kit.pool_is_empty(memory_connector)


def test_fan_out_templates_are_found_by_cache_token_count_and_slot(
    kit, memory_connector, make_sender, monkeypatch
) -> None:
    """A fan-out sender lists a head slice's tensor shapes (for its layout template) once per
    cache, token count and slot; a request of a length seen before finds both slices'
    templates by those and, with the native copy, is not sliced at all (the slice lane serves
    it from the whole plan). Every payload holds its receiver's heads of the cache it was sent
    from, in its shapes, whatever order the lengths and caches come in."""
    from kvferry.adapters import paged_gather
    from kvferry.adapters.paged_cache import ExtractionPlan

    listed: list[int] = []
    sliced: list[int] = []
    real_shapes, real_slice = ExtractionPlan.dtype_shapes, ExtractionPlan.head_slice

    def shapes(plan: ExtractionPlan) -> Any:
        listed.append(1)
        return real_shapes(plan)

    def head_slice(plan: ExtractionPlan, *slot: int) -> Any:
        sliced.append(1)
        return real_slice(plan, *slot)

    monkeypatch.setattr(ExtractionPlan, "dtype_shapes", shapes)
    monkeypatch.setattr(ExtractionPlan, "head_slice", head_slice)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # where the native copy is chosen (paged_gather.NATIVE_MAX_THREADS)
    try:
        _send_rounds(kit, memory_connector, make_sender, listed, sliced, paged_gather.NATIVE_GATHER)
    finally:
        torch.set_num_threads(threads)


def _send_rounds(kit, memory_connector, make_sender, listed: list, sliced: list, native: bool) -> None:
    # heads of 64 values: pieces the native copy takes (smaller ones go through torch, sliced)
    first, second = kit.PagedModel(seed=1, heads=8, head_dim=64), kit.PagedModel(seed=2, heads=4, head_dim=64)
    sender = make_sender(memory_connector, 1, 2)
    caches = {id(first): first.rank_cache(), id(second): second.rank_cache()}
    # (cache, tokens, shapes listed: one per slice when the cache and length are new to the sender)
    rounds = [(first, 10, 2), (first, 3, 2), (first, 10, 0), (first, 3, 0), (second, 10, 2), (first, 10, 2)]
    for n, (model, seq_len, lists) in enumerate(rounds):
        listed.clear()
        sliced.clear()
        request = {"block_ids": [3, 1, 5], "seq_len": seq_len}
        [outcome] = sender.send_requests({f"r{n}": request}, caches[id(model)], model.block_size, "float32")
        assert outcome.ok and len(outcome.keys) == 2, outcome
        assert len(listed) == lists, (n, listed)
        if native:  # as many slices planned as templates listed: none when the lane serves it
            assert len(sliced) == lists, (n, sliced)
        for target, key in enumerate(outcome.keys):
            decoded, got_k, got_v = _raw(memory_connector, key)
            assert decoded.metadata["tp_head_slice"]["offset_in_shard"] == target
            want_k, want_v = model.expected(request["block_ids"], seq_len, target, 2)
            assert [t.shape for t in got_k] == [t.shape for t in want_k]
            assert all(kit.bits_equal(a, b) for a, b in zip(got_k + got_v, want_k + want_v))
    assert kit.pool_is_empty(memory_connector)


class _Reserving:
    """A reservable connector over ``inner`` that logs reserve/commit order and fails the
    reservations whose (1-based) numbers are in ``fail``."""

    def __init__(self, inner: Any, fail: tuple[int, ...] = ()) -> None:
        self.inner, self.fail, self.log = inner, fail, []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def put(self, from_stage: Any, to_stage: Any, put_key: str, data: Any) -> Any:
        return self.inner.put(from_stage, to_stage, put_key, data)

    def reserve(self, from_stage: Any, to_stage: Any, put_key: str, nbytes: int) -> Any:
        from kvferry.core.errors import PoolFullError

        count = sum(1 for op, _ in self.log if op == "reserve") + 1
        self.log.append(("reserve", put_key))
        if count in self.fail:
            raise PoolFullError("pool_full: injected")
        reservation = self.inner.reserve(from_stage, to_stage, put_key, nbytes)
        log = self.log

        class Logged:
            buffer = reservation.buffer

            def commit(self) -> Any:
                log.append(("commit", put_key))
                return reservation.commit()

            def abort(self) -> None:
                log.append(("abort", put_key))
                reservation.abort()

        return Logged()


@pytest.mark.parametrize("fail", [(), (2,)], ids=["together", "second-reserve-fails"])
def test_fan_out_reserves_every_key_before_gathering_and_falls_back_per_key(
    kit, memory_connector, make_sender, fail
) -> None:
    """Fan-out into a reservable connector: every receiver's region is reserved, then all head
    slices are gathered (one pass), then each key is committed; when a reservation fails the
    ones taken are aborted and every key goes by the single path. Bits are exact both ways."""
    model = kit.PagedModel(heads=8)
    conn = _Reserving(memory_connector, fail)
    [outcome] = make_sender(conn, 1, 4).send_requests({"r1": REQ}, model.rank_cache(0, 1), 4, "float32")
    assert outcome.ok and len(outcome.keys) == 4
    keys = [f"r1_0_0_0_{t}" for t in range(4)]
    if not fail:
        assert conn.log == [("reserve", k) for k in keys] + [("commit", k) for k in keys]
    else:
        assert conn.log[:3] == [("reserve", keys[0]), ("reserve", keys[1]), ("abort", keys[0])]
        assert conn.log[3:] == [op for k in keys for op in (("reserve", k), ("commit", k))]
    for target, key in enumerate(keys):
        _, got_k, got_v = _raw(memory_connector, key)
        want_k, want_v = model.expected(REQ["block_ids"], 10, target, 4)
        assert all(kit.bits_equal(a, b) for a, b in zip(got_k + got_v, want_k + want_v))
    assert kit.pool_is_empty(memory_connector)


def test_spec2_2_send_key_hook_replaces_the_keys(kit, memory_connector, make_sender) -> None:
    """One hook key per target rank: each carries its target's heads (in target order)."""
    model = kit.PagedModel()
    calls: list[tuple] = []

    def hook(rid: str, frm: Any, to: Any) -> list[str]:
        calls.append((rid, frm, to))
        return [f"custom/{rid}/a", f"custom/{rid}/b"]

    sender = make_sender(memory_connector, 1, 2, kv_send_key_builder=hook)
    [outcome] = sender.send_requests({"r1": REQ}, model.rank_cache(0, 1), 4, "float32")
    assert calls == [("r1", 0, 1)]
    assert outcome.keys == ("custom/r1/a", "custom/r1/b")
    decoded, keys, _ = _raw(memory_connector, "custom/r1/b")
    assert decoded.metadata["tp_head_slice"]["target_rank"] == 1
    assert kit.bits_equal(keys[0], model.expected(REQ["block_ids"], 10, 1, 2)[0][0])


def test_spec2_2_send_key_hook_with_other_key_count_sends_whole_shards(kit, memory_connector, make_sender) -> None:
    model = kit.PagedModel()
    sender = make_sender(memory_connector, 1, 2, kv_send_key_builder=lambda rid, f, t: [f"only/{rid}"])
    [outcome] = sender.send_requests({"r1": REQ}, model.rank_cache(0, 1), 4, "float32")
    assert outcome.keys == ("only/r1",)
    decoded, keys, _ = _raw(memory_connector, "only/r1")
    assert "tp_head_slice" not in decoded.metadata and keys[0].shape[1] == model.heads


def test_spec7_empty_hook_result_falls_back_to_default_keys(kit, memory_connector, make_sender) -> None:
    model = kit.PagedModel()
    sender = make_sender(memory_connector, 2, 2, kv_send_key_builder=lambda *a: [])
    [outcome] = sender.send_requests({"r1": REQ}, model.rank_cache(0, 2), 4, "float32")
    assert outcome.keys == ("r1_0_0_0_0",)
