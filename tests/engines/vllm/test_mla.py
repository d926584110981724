"""MLA caches between real vLLM CPU instances: tiny random DeepSeek-V2 models (engine_proc.py
``make-mla-model``) on vLLM's ``CPU_MLA`` backend, whose layers are ``[num_blocks, 1, 16,
576]`` (one 576-wide latent per token, block size 16: what vLLM's CPU MLA kernel takes).

Prefill TP 1 -> decode TP 1 (one layer): the decode's latents of the loaded tokens equal the
prefill's, byte for byte, and its tokens equal the decode instance's own for the prompt
computed in the same steps (:func:`_same_steps`: CPU_MLA's decode step and its prefill give
other tokens for one position, docs/layouts.md "vLLM's two MLA paths do not agree", and a
loading decode computes the prompt's last token in a decode step). The control hands the
decode one prompt's latents for another prompt of the same length, which must change its
tokens. With three layers the latents are still equal but the tokens part from that reference
after a few steps: vLLM's prefill of ``L - 1`` tokens (the reference's base) and of ``L`` (the
prefill instance's prompt) give the same positions other latents from layer 1 on (measured,
docs/layouts.md), so that model is checked by its latents.

Prefill TP 1 -> decode TP 2 (three layers): each decode rank reads the whole latent from the
one prefill rank (``core.routing.latent_source``), so both ranks' latents equal the prefill's
(TP 1 and TP 2 instances of a random model diverge in tokens, so tokens are not compared
across TP sizes).
"""

from __future__ import annotations

from typing import Any

import pytest
from harness import (
    Instance,
    assert_loaded_without_failures,
    failures,
    free_base_port,
    proc_model,
    prompts,
    start_together,
    vllm_python,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

BS = 16
LENGTHS = [45, 130]  # a partial page after two full ones; after eight
TOKENS = 12
BACKEND = {"attention_backend": "CPU_MLA", "block_size": BS}


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return vllm_python(), tmp_path_factory.mktemp("vllm_mla")


def _model(root: Any, layers: int) -> Any:
    py, base = root
    return py, base, proc_model(py, base / f"model_{layers}", "make-mla-model", 1, layers)


def _start(model: Any, decode_tp: int) -> tuple[Instance, Instance]:
    py, root, path = model
    extra = {"base_port": free_base_port(), "load_timeout_s": 30}
    base = {"model": str(path), "extra": extra, **BACKEND}
    d, p = start_together(
        lambda: Instance(
            py,
            {**base, "kv_role": "kv_consumer", "tp": decode_tp},
            cpu="0|1" if decode_tp == 2 else "0",
            log=root / f"decode_tp{decode_tp}.log",
            timeout_s=600,
        ),
        lambda: Instance(py, {**base, "kv_role": "kv_producer"}, cpu="1", log=root / f"prefill_for_tp{decode_tp}.log"),
    )
    print("startup:", {f"decode_tp{decode_tp}_s": round(d.startup_s, 1), "prefill_tp1_s": round(p.startup_s, 1)})
    return d, p


def _prefill(p: Instance, prompt: list[int], decode_tp: int) -> dict[str, Any]:
    [res] = p.generate([prompt], [{"do_remote_decode": True, "decode_tp_size": decode_tp}], max_tokens=1)
    params = res["kv_transfer_params"]
    assert params["remote_block_size"] == BS
    return params


def _latents(inst: Instance, num_tokens: int, transfer_id: str | None = None) -> list[dict[str, Any]]:
    """Per rank, the per-layer hashes of the first ``num_tokens`` latents (the prefill's of a
    transfer, or the decode's of its last load)."""
    msg: dict[str, Any] = {"op": "latents", "num_tokens": num_tokens}
    if transfer_id is not None:
        msg["transfer_id"] = transfer_id
    inst.send(msg)
    return inst.reply(120)["ranks"]


def _same_steps(d: Instance, lengths: list[int], seed: int) -> tuple[list[list[int]], list[list[int]]]:
    """Prompts and the decode instance's own tokens for them, computed in the steps a decode
    that loads a prompt's KV takes: each prompt is a random base and the token the instance
    generates after it, so the instance computes the base in its prefill and the prompt's last
    token in a decode step, as the loading decode does; its tokens after that one are the
    reference."""
    bases = prompts([n - 1 for n in lengths], seed=seed)
    outs = [r["tokens"] for r in d.generate(bases, max_tokens=TOKENS + 1)]
    return [base + out[:1] for base, out in zip(bases, outs)], [out[1:] for out in outs]


def test_prefill_tp1_to_decode_tp1_is_token_identical(root: Any) -> None:
    d, p = _start(_model(root, 1), 1)
    try:
        ps, reference = _same_steps(d, LENGTHS, seed=41)
        before = d.metrics()
        got = []
        for prompt in ps:
            params = _prefill(p, prompt, 1)
            n = len(prompt) - 1  # the decode computes the last prompt token itself
            # the prefill's latents now, before another request of the prefill may reuse its freed blocks
            [theirs] = _latents(p, n, params["transfer_id"])
            [out] = d.generate([prompt], [params], max_tokens=TOKENS)
            got.append(out["tokens"])
            [mine] = _latents(d, n)
            assert mine["shape"][1:] == theirs["shape"][1:] == [1, BS, 576]
            assert mine["hashes"] == theirs["hashes"], f"prompt of {len(prompt)} tokens: latents differ"
        assert got == reference
        assert_loaded_without_failures(d, before, len(ps))

        # control: prompt B decoded over prompt A's latents (same length) follows A's, not B's own
        [b], [ref_b] = _same_steps(d, [LENGTHS[1]], seed=42)
        [over_a] = [r["tokens"] for r in d.generate([b], [_prefill(p, ps[1], 1)], max_tokens=TOKENS)]
        assert over_a != ref_b
        assert failures(d.metrics()) == failures(before), d.kv_log()
    finally:
        p.close()
        d.close()


def test_prefill_tp1_to_decode_tp2_gives_each_rank_the_whole_latent(root: Any) -> None:
    d, p = _start(_model(root, 3), 2)
    try:
        for prompt in prompts(LENGTHS, seed=43):
            params = _prefill(p, prompt, 2)
            assert params["decode_tp_size"] == 2 and params["remote_tp_size"] == 1
            n = len(prompt) - 1
            [theirs] = _latents(p, n, params["transfer_id"])
            assert len(theirs["hashes"]) == 3
            before = d.metrics()
            d.generate([prompt], [params], max_tokens=2)
            after = d.metrics()
            # both ranks loaded (the engine counts the request once per rank), none failed
            assert after["vllm:kvferry_requests_loaded"] - before.get("vllm:kvferry_requests_loaded", 0) == 2
            assert failures(after) == failures(before), d.kv_log()
            ranks = _latents(d, n)
            assert len(ranks) == 2
            for rank, mine in enumerate(ranks):
                assert mine["hashes"] == theirs["hashes"], (len(prompt), rank)
    finally:
        p.close()
        d.close()
