"""A hybrid model's KV between two real vLLM CPU instances of different block sizes (shared
memory): the tiny random Llama whose layers alternate full attention and a 48-token sliding
window (two KV cache groups on both), a prefill of 32-token pages and a decode of 64-token pages.
The decode re-blocks each group's pages per token; the prefill, told the decode's block size
(``decode_block_size`` in its extra config), sends the sliding-window group from the token the
decode's window keeps (groups.window_first_page), which for the 100-token prompt is a page below
its own window.

The reference is the decode computing each prompt itself; the control is prompt B decoded over
prompt A's KV (same length), which follows A's KV. A request that tells the prefill its own
block size (32) gets its own window: the decode's load of the 100-token prompt fails
(``layout``) and vLLM recomputes it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from harness import (
    Instance,
    assert_other_kv_changes_tokens,
    cache_groups,
    failures,
    free_base_port,
    proc_model,
    prompts,
    start_together,
    vllm_python,
)

from kvferry.app.vllm.groups import kept_first_page, prompt_pages, window_first_page

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

LENGTHS = [45, 79, 100, 257]
TOKENS = 12
WINDOW, P_BS, D_BS = 48, 32, 64
PAGE_BYTES = 2 * D_BS * 2 * 32 * 2  # one decode block of one layer: 2 KV heads x 64 tokens x K and V of 32, bf16


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Any:
    py = vllm_python()
    root = tmp_path_factory.mktemp("vllm_hybrid_blocks")
    model = proc_model(py, root / "model", "make-hybrid-model", 1, WINDOW)
    base = free_base_port()
    extra = {"base_port": base, "load_timeout_s": 10}
    d, p = start_together(
        lambda: Instance(
            py,
            {"model": str(model), "kv_role": "kv_consumer", "block_size": D_BS, "policy": "recompute", "extra": extra},
            cpu="0",
            log=Path(root) / "decode.log",
        ),
        lambda: Instance(
            py,
            {
                "model": str(model),
                "kv_role": "kv_producer",
                "block_size": P_BS,
                "extra": {**extra, "decode_block_size": D_BS},
            },
            cpu="1",
            log=Path(root) / "prefill.log",
        ),
    )
    print("startup:", {"decode_s": round(d.startup_s, 1), "prefill_s": round(p.startup_s, 1)})
    yield p, d
    p.close()
    d.close()


def test_hybrid_hand_off_across_block_sizes_equals_a_single_instance(pair: Any) -> None:
    p, d = pair
    assert cache_groups(d)["groups"] == cache_groups(p)["groups"] == ["full", f"sliding_window:{WINDOW}"]
    ps = prompts(LENGTHS, seed=7)
    reference = [r["tokens"] for r in d.generate(ps, max_tokens=TOKENS)]
    saves_before, loads_before = len(cache_groups(p)["jobs"]), len(cache_groups(d)["jobs"])
    before = d.metrics()
    out_p = p.generate(ps, [{"do_remote_decode": True} for _ in ps], max_tokens=1)
    params = [r["kv_transfer_params"] for r in out_p]
    assert all(par["remote_block_size"] == P_BS for par in params)
    tokens = [r["tokens"] for r in d.generate(ps, params, max_tokens=TOKENS)]
    after = d.metrics()
    assert failures(after) == failures(before), d.kv_log()
    assert after["vllm:kvferry_requests_loaded"] - before.get("vllm:kvferry_requests_loaded", 0) == len(ps)
    assert tokens == reference
    saves = [j["groups"] for j in cache_groups(p)["jobs"][saves_before:] if j["kind"] == "save"]
    loads = [j["groups"] for j in cache_groups(d)["jobs"][loads_before:] if j["kind"] == "load"]
    assert len(saves) == len(loads) == len(LENGTHS)
    for n, save, load in zip(LENGTHS, saves, loads):
        first = window_first_page(n, P_BS, WINDOW, 0, D_BS)
        assert save[0][1] == 0 and len(save[0][2]) == prompt_pages(n, P_BS)
        assert save[1][1] == first and len(save[1][2]) == prompt_pages(n, P_BS) - first
        kept = kept_first_page(n - 1, D_BS, WINDOW)
        assert load[1][2][:kept] == [0] * kept and 0 not in load[1][2][kept:] and 0 not in load[0][2]
    # the 100-token prompt: the decode keeps from token 0, the prefill's own window from token 32
    assert window_first_page(100, P_BS, WINDOW, 0, D_BS) == 0 < kept_first_page(99, P_BS, WINDOW)
    # written on the decode, in its 64-token pages, of the n - 1 tokens it loads: every page of
    # the 2 full-attention layers, the window's of the 2 others
    full = sum(prompt_pages(n - 1, D_BS) for n in LENGTHS)
    window = sum(prompt_pages(n - 1, D_BS) - kept_first_page(n - 1, D_BS, WINDOW) for n in LENGTHS)
    loaded = after["vllm:kvferry_bytes_loaded"] - before.get("vllm:kvferry_bytes_loaded", 0)
    assert loaded == (2 * full + 2 * window) * PAGE_BYTES
    print("bytes loaded:", loaded, "sent pages:", [[len(g[2]) for g in s] for s in saves])
    # control: prompt B decoded over prompt A's KV (100 tokens) follows A's KV, not B's prompt
    assert_other_kv_changes_tokens(p, d, ps[2], 32, TOKENS, before)


def test_a_request_that_tells_the_prefill_its_own_block_size_is_recomputed(pair: Any) -> None:
    p, d = pair
    [prompt] = prompts([100], seed=7)
    [reference] = [r["tokens"] for r in d.generate([prompt], max_tokens=TOKENS)]
    before = d.metrics()
    [par] = [
        r["kv_transfer_params"]
        for r in p.generate([prompt], [{"do_remote_decode": True, "decode_block_size": P_BS}], max_tokens=1)
    ]
    [tokens] = [r["tokens"] for r in d.generate([prompt], [par], max_tokens=TOKENS)]
    after = d.metrics()
    # the window the prefill sent starts at token 32, the decode's first kept page at 0: a layout failure
    assert failures(after) == failures(before) + 1, d.kv_log()
    assert after.get("vllm:kvferry_failures{layout}", 0) > before.get("vllm:kvferry_failures{layout}", 0), sorted(after)
    assert tokens == reference  # recomputed (kv_load_failure_policy recompute)
