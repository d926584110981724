"""Prefill and decode with different block sizes (real vLLM CPU on both sides): the decode
re-blocks the prefill's pages into its own, bit for bit per token.

Each case starts a decode and a prefill of one model with other ``block_size`` settings. The
reference is the decode instance computing each prompt itself; the per-token check reads both
instances' pages through the page order of the kernel vLLM picked and compares the tokens'
K/V hashes (the prefill's pages and the decode's differ as bytes: other block sizes); the
control hands the decode one prompt's KV for another prompt of the same length, which must
change its tokens (the loaded KV is what it attends to).
"""

from __future__ import annotations

from typing import Any

import pytest
from harness import (
    Instance,
    assert_loaded_without_failures,
    assert_other_kv_changes_tokens,
    free_base_port,
    make_model,
    prompts,
    start_together,
    vllm_python,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

LENGTHS = [45, 130, 257]  # inside one block, across blocks of either size, past two 128-token blocks
TOKENS = 12


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Any:
    py = vllm_python()
    root = tmp_path_factory.mktemp("vllm_blocks")
    return py, root, make_model(py, root / "model", 1)


def _pair(model: Any, prefill_bs: int, decode_bs: int) -> tuple[Instance, Instance]:
    py, root, path = model
    extra = {"base_port": free_base_port(), "load_timeout_s": 20}
    base = {"model": str(path), "extra": extra}
    d, p = start_together(
        lambda: Instance(
            py,
            {**base, "kv_role": "kv_consumer", "block_size": decode_bs},
            cpu="0",
            log=root / f"decode_{decode_bs}.log",
        ),
        lambda: Instance(
            py,
            {**base, "kv_role": "kv_producer", "block_size": prefill_bs},
            cpu="1",
            log=root / f"prefill_{prefill_bs}.log",
        ),
    )
    startup = {f"decode_{decode_bs}_s": round(d.startup_s, 1), f"prefill_{prefill_bs}_s": round(p.startup_s, 1)}
    print("startup:", startup)
    return d, p


@pytest.mark.parametrize(("prefill_bs", "decode_bs"), [(32, 64), (128, 32)])
def test_decode_of_another_block_size_gets_the_prefills_tokens(model: Any, prefill_bs: int, decode_bs: int) -> None:
    d, p = _pair(model, prefill_bs, decode_bs)
    try:
        ps = prompts(LENGTHS, seed=31)
        reference = [r["tokens"] for r in d.generate(ps, max_tokens=TOKENS)]
        before = d.metrics()
        per_token = []
        for prompt in ps:
            [par] = [r["kv_transfer_params"] for r in p.generate([prompt], [{"do_remote_decode": True}], max_tokens=1)]
            assert par["remote_block_size"] == prefill_bs
            n = len(prompt) - 1  # the decode computes the last prompt token itself
            # the prefill's pages now, before another request of the prefill may reuse its freed blocks
            p.send({"op": "tokens", "num_tokens": n, "transfer_id": par["transfer_id"]})
            [theirs] = p.reply(120)["ranks"]
            out = d.generate([prompt], [par], max_tokens=TOKENS)
            per_token.append(out[0]["tokens"])
            d.send({"op": "tokens", "num_tokens": n})
            [mine] = d.reply(120)["ranks"]
            assert (mine["block_size"], theirs["block_size"]) == (decode_bs, prefill_bs)
            assert mine["last_load"] == [[True, mine["last_load"][0][1]]]  # the load itself succeeded
            assert mine["hashes"] == theirs["hashes"], f"prompt of {len(prompt)} tokens: K/V differ per token"
        assert per_token == reference
        assert_loaded_without_failures(d, before, len(ps))
        # control: prompt B decoded over prompt A's KV (same length) follows A's KV, not B's prompt
        assert_other_kv_changes_tokens(p, d, ps[1], 32, TOKENS, before)
    finally:
        p.close()
        d.close()
