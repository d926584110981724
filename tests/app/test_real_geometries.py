"""Real models' KV through the manager on in-memory connectors: replicated heads, MLA, named
layouts. Every receiver's tensors are compared bit for bit with an independent slice of the
source (full-model) cache; the controls show the comparison would catch wrong heads."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kvferry.app.manager import KVTransferManager
from kvferry.core.config import TransferConfig

BLOCK, BLOCKS, LAYERS, DIM = 4, 10, 2, 8
REQUESTS = {"r-a": {"block_ids": [3, 1, 7], "seq_len": 10}, "r-b": {"block_ids": [0, 9], "seq_len": 8}}


def _full_cache(heads: int, seed: int = 0, dim: int = DIM) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The model's KV: per layer ``[blocks, block_size, heads, head_dim]`` (random bf16 bits)."""
    gen = torch.Generator().manual_seed(seed)

    def fresh() -> torch.Tensor:
        return torch.randint(-30000, 30000, (BLOCKS, BLOCK, heads, dim), generator=gen, dtype=torch.int16).view(
            torch.bfloat16
        )

    return [fresh() for _ in range(LAYERS)], [fresh() for _ in range(LAYERS)]


def _engine_heads(tp: int, heads: int, rank: int) -> list[int]:
    """What vLLM gives a rank (written out here, independently of kvferry.core.routing)."""
    if tp <= heads:
        per = heads // tp
        return list(range(rank * per, (rank + 1) * per))
    return [rank * heads // tp]


def _rank_cache(
    full: tuple[list[torch.Tensor], list[torch.Tensor]], tp: int, heads: int, rank: int, layout: str
) -> list[Any]:
    idx = torch.tensor(_engine_heads(tp, heads, rank))
    out: list[Any] = []
    for k, v in zip(*full):
        k, v = k[:, :, idx].contiguous(), v[:, :, idx].contiguous()
        if layout == "flash":
            out.append(torch.stack([k, v]))
        elif layout == "flashinfer_hnd":
            out.append(torch.stack([k.transpose(1, 2), v.transpose(1, 2)], dim=1).contiguous())
        elif layout == "packed":
            out.append(torch.cat([k, v], dim=-1).transpose(1, 2).contiguous())
        elif layout == "vllm_cpu:avx2":  # per (block, head) page: K as [dim][token], then V as [token][dim]
            n, b, h, d = k.shape
            kc = k.permute(0, 2, 3, 1).reshape(n, h, b * d)
            vc = v.permute(0, 2, 1, 3).reshape(n, h, b * d)
            out.append(torch.cat([kc, vc], dim=-1).view(n, h, b, 2 * d))
        else:
            raise AssertionError(layout)
    return out


def _expected(
    full: tuple[list[torch.Tensor], list[torch.Tensor]], head_list: list[int], spec: dict
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    ids, seq = spec["block_ids"], spec["seq_len"]
    idx = torch.tensor(head_list)

    def pick(t: torch.Tensor) -> torch.Tensor:
        return t[ids].reshape(-1, t.shape[2], t.shape[3])[:seq][:, idx]

    return [pick(k) for k in full[0]], [pick(v) for v in full[1]]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16)


def _config(role: str, s: int, t: int, heads: int | None, layout: str | None) -> TransferConfig:
    common: dict[str, Any] = dict(
        connector_config={"type": "memory"},
        from_stage=0,
        to_stage=1,
        from_tp=s,
        to_tp=t,
        num_kv_heads=heads,
        kv_layout=layout,
    )
    if role == "sender":
        return TransferConfig(need_send_cache=True, **common)
    return TransferConfig(need_recv_cache=True, stage_id=1, recv_timeout=2.0, **common)


def _send(conn: Any, full: Any, s: int, t: int, heads: int, layout: str, fake: Any) -> list[Any]:
    outcomes = []
    for rank in range(s):
        m = KVTransferManager(
            _config("sender", s, t, heads, layout),
            tp_rank=rank,
            tp_size=s,
            connector=conn,
            clock=fake,
            sleep=fake.sleep,
        )
        outcomes += m.send_requests(REQUESTS, _rank_cache(full, s, heads, rank, layout), BLOCK, "bfloat16")
    return outcomes


CASES = [  # (heads, from_tp, to_tp): the replicated ones the reference refused, plus two it handled
    (4, 2, 8), (4, 8, 2), (4, 8, 16), (4, 16, 8), (2, 1, 4), (8, 4, 16), (2, 4, 1), (1, 2, 4), (1, 4, 4),
    (8, 2, 4), (8, 4, 2),
]  # fmt: skip


@pytest.mark.parametrize(("heads", "s", "t"), CASES)
def test_every_receiver_gets_exactly_its_heads_bit_exact(kit, memory_connector_factory, fake_time, heads, s, t) -> None:
    full = _full_cache(heads)
    conn = memory_connector_factory(pool_bytes=32 << 20)
    sent = _send(conn, full, s, t, heads, "flash", fake_time)
    assert all(o.ok for o in sent), [o for o in sent if not o.ok]
    put_keys = sorted(k for o in sent for k in o.keys)
    assert sorted(_receive_every_rank(conn, full, s, t, heads, fake_time)) == put_keys  # nothing read twice
    assert kit.pool_is_empty(conn)  # every payload put was consumed


def _receive_every_rank(conn: Any, full: Any, s: int, t: int, heads: int, fake_time: Any) -> list[str]:
    """Every receiver rank of TP ``s -> t`` receives every request from ``conn`` (flash layout):
    its heads bit for bit against an independent slice of the model's cache, and the control
    (another head's slice differs). Returns the keys read."""
    got_keys: list[str] = []
    for rank in range(t):
        m = KVTransferManager(
            _config("receiver", s, t, heads, "flash"),
            tp_rank=rank,
            tp_size=t,
            connector=conn,
            clock=fake_time,
            sleep=fake_time.sleep,
        )
        mine = _engine_heads(t, heads, rank)
        for rid, spec in REQUESTS.items():
            result = m.receive(rid)
            assert result.ok, result.outcome
            got_keys += list(result.outcome.keys)
            keys, values = _expected(full, mine, spec)
            blocks = result.payload["layer_blocks"]
            for layer in range(LAYERS):
                assert torch.equal(_bits(blocks["key_cache"][layer]), _bits(keys[layer])), (rank, layer)
                assert torch.equal(_bits(blocks["value_cache"][layer]), _bits(values[layer])), (rank, layer)
            if heads > 1:  # control: another head's slice of the same cache is different
                other = [(mine[0] + 1) % heads]
                assert not torch.equal(_bits(blocks["key_cache"][0]), _bits(_expected(full, other, spec)[0][0]))
            result.release()
    return got_keys


@pytest.mark.parametrize(("heads", "s", "t"), [(4, 2, 8), (2, 1, 4), (4, 1, 8), (8, 2, 16)])
def test_replicated_heads_through_the_native_one_pass_gather(
    kit, memory_connector_factory, fake_time, monkeypatch, heads, s, t
) -> None:
    """Heads of 128 on one torch thread: the sender's native gather writes each replicated
    head's copies (one per receiver that holds it) from one read of the cache. Every receiver
    still gets exactly its heads, bit for bit; the control: another head differs."""
    from kvferry.adapters import paged_gather

    if not paged_gather.NATIVE_GATHER:
        pytest.skip("the native gather (kvferry.adapters._gather) is not built")
    calls: list[int] = []
    native = paged_gather._native

    class Counting:
        def __getattr__(self, name: str) -> Any:
            return getattr(native, name)

        def gather_split(self, *args: Any) -> Any:
            calls.append(len(args[0]))
            return native.gather_split(*args)

    monkeypatch.setattr(paged_gather, "_native", Counting())
    monkeypatch.setattr(paged_gather, "STREAM_MIN_BYTES", 0)
    from kvferry.app import send as send_module

    planned: list[tuple[int, int]] = []
    slice_heads = send_module.slice_plan_heads

    def counted(plan: Any, offset: int, slices: int) -> Any:
        planned.append((offset, slices))
        return slice_heads(plan, offset, slices)

    monkeypatch.setattr(send_module, "slice_plan_heads", counted)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        full = _full_cache(heads, seed=9, dim=128)
        conn = memory_connector_factory(pool_bytes=64 << 20)
        assert all(o.ok for o in _send(conn, full, s, t, heads, "flash", fake_time))
    finally:
        torch.set_num_threads(threads)
    # every whole-block tensor of a sender rank: one split call writing all its receivers
    assert calls and set(calls) == {t // s}, calls
    # each head slice planned once per request, not once per receiver that holds it
    assert len(planned) == len(REQUESTS) * heads, planned
    assert len(_receive_every_rank(conn, full, s, t, heads, fake_time)) == t * len(REQUESTS)
    assert kit.pool_is_empty(conn)


@pytest.mark.parametrize("layout", ["flashinfer_hnd", "packed", "vllm_cpu:avx2"])
def test_named_layouts_through_the_manager_with_replicated_heads(
    kit, memory_connector_factory, fake_time, layout
) -> None:
    full = _full_cache(4, seed=5)
    conn = memory_connector_factory(pool_bytes=32 << 20)
    assert all(o.ok for o in _send(conn, full, 2, 8, 4, layout, fake_time))
    for rank in range(8):
        m = KVTransferManager(
            _config("receiver", 2, 8, 4, layout),
            tp_rank=rank,
            tp_size=8,
            connector=conn,
            clock=fake_time,
            sleep=fake_time.sleep,
        )
        result = m.receive("r-a")
        assert result.ok, result.outcome
        keys, values = _expected(full, _engine_heads(8, 4, rank), REQUESTS["r-a"])
        blocks = result.payload["layer_blocks"]
        for layer in range(LAYERS):
            assert torch.equal(_bits(blocks["key_cache"][layer]), _bits(keys[layer]))
            assert torch.equal(_bits(blocks["value_cache"][layer]), _bits(values[layer]))
        result.release()


def test_an_unnamed_vllm_cpu_cache_is_refused_not_misread(memory_connector_factory, fake_time) -> None:
    full = _full_cache(2)
    conn = memory_connector_factory()
    sender = KVTransferManager(_config("sender", 1, 1, 2, None), connector=conn, clock=fake_time, sleep=fake_time.sleep)
    [outcome] = sender.send_requests(
        {"r-a": REQUESTS["r-a"]}, _rank_cache(full, 1, 2, 0, "vllm_cpu:avx2"), BLOCK, "bfloat16"
    )
    assert not outcome.ok and "'packed', 'vllm_cpu'" in outcome.detail and "name the layout" in outcome.detail


def test_replicated_fan_in_without_a_head_count_is_not_silently_doubled(memory_connector_factory, fake_time) -> None:
    """Control for the head count: 8 -> 2 at 4 heads routed by the reference's rank map puts
    four shards per receiver, two of them replicas; kvferry's senders put only the first
    replica of each head, so such a receiver times out instead of doubling its heads."""
    full = _full_cache(4)
    conn = memory_connector_factory(pool_bytes=32 << 20)
    assert all(o.ok for o in _send(conn, full, 8, 2, 4, "flash", fake_time))
    m = KVTransferManager(
        _config("receiver", 8, 2, None, "flash"),
        tp_rank=0,
        tp_size=2,
        connector=conn,
        clock=fake_time,
        sleep=fake_time.sleep,
    )
    result = m.receive("r-a", timeout_s=0.05)
    assert not result.ok and result.outcome.kind.value == "timed_out"


LATENT = 12


def _latents(s: int) -> list[list[torch.Tensor]]:
    """Sender rank r's MLA cache: per layer one ``[blocks, block_size, latent]`` tensor. Engines
    hold the same latent on every rank; here each rank's differs (a marker per rank) so the test
    sees which sender each receiver's latent came from."""
    gen = torch.Generator().manual_seed(7)
    base = [
        torch.randint(-30000, 30000, (BLOCKS, BLOCK, LATENT), generator=gen, dtype=torch.int16) for _ in range(LAYERS)
    ]
    return [[(b + r).view(torch.bfloat16) for b in base] for r in range(s)]


@pytest.mark.parametrize(("s", "t"), [(2, 4), (4, 2), (1, 4), (4, 1), (2, 2), (8, 2)])
def test_mla_latent_goes_whole_from_one_sender_per_receiver(kit, memory_connector_factory, fake_time, s, t) -> None:
    caches = _latents(s)
    conn = memory_connector_factory(pool_bytes=32 << 20)
    sent = []
    for rank in range(s):
        m = KVTransferManager(
            _config("sender", s, t, None, "mla"),
            tp_rank=rank,
            tp_size=s,
            connector=conn,
            clock=fake_time,
            sleep=fake_time.sleep,
        )
        sent += m.send_requests(REQUESTS, caches[rank], BLOCK, "bfloat16")
    assert all(o.ok for o in sent)
    assert sum(len(o.keys) for o in sent) == t * len(REQUESTS)  # one payload per receiver, never more
    for rank in range(t):
        source = rank // (t // s) if t >= s else rank * (s // t)  # receivers spread over the senders
        m = KVTransferManager(
            _config("receiver", s, t, None, "mla"),
            tp_rank=rank,
            tp_size=t,
            connector=conn,
            clock=fake_time,
            sleep=fake_time.sleep,
        )
        for rid, spec in REQUESTS.items():
            result = m.receive(rid)
            assert result.ok, result.outcome
            blocks = result.payload["layer_blocks"]
            assert blocks["value_cache"] == [None] * LAYERS  # no value on the wire
            assert result.payload["metadata"]["kv_latent"] is True
            for layer in range(LAYERS):
                want = caches[source][layer][spec["block_ids"]].reshape(-1, LATENT)[: spec["seq_len"]]
                assert torch.equal(_bits(blocks["key_cache"][layer]), _bits(want))
                if s > 1:  # control: another sender's latent differs
                    other = caches[(source + 1) % s][layer][spec["block_ids"]].reshape(-1, LATENT)[: spec["seq_len"]]
                    assert not torch.equal(_bits(blocks["key_cache"][layer]), _bits(other))
            result.release()
    assert kit.pool_is_empty(conn)


def test_a_head_slice_of_an_mla_latent_is_an_error_that_says_why() -> None:
    from kvferry.adapters.paged_cache import plan_extraction
    from kvferry.app.send import slice_plan_heads
    from kvferry.core.errors import RoutingError

    plan = plan_extraction(_latents(1)[0], [1, 2], 8, BLOCK, cache_dtype="bfloat16", layout="mla")
    assert slice_plan_heads(plan, 0, 1) is plan
    with pytest.raises(RoutingError, match="MLA latent by heads: it has no head dimension.*whole latent"):
        slice_plan_heads(plan, 0, 2)
