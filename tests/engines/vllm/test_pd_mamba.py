"""Two real vLLM CPU instances hand a Mamba-hybrid model's KV and state over through kvferry
(shared memory): a tiny random Granite 4 hybrid (``GraniteMoeHybridForCausalLM``, 4 layers,
Mamba2 and attention alternating; engine_proc.py ``make-mamba-model``). vLLM makes a
full-attention group and a Mamba group (mode ``none``, prefix caching off) on both.

The prefill computes all but the prompt's last token and sends the attention pages of those
tokens and each Mamba layer's state block; the decode loads them and computes the last token.
The reference is the decode instance computing each prompt itself, split where the hand-off
splits it: both instances compute prompts in chunks of ``CHUNK`` tokens (vLLM's
``max_num_batched_tokens``) and every prompt's ``n - 1`` is a multiple of it, so the reference
computes the prefill's chunks, keeps each Mamba layer's state in its cache between them as the
hand-off does, and computes the last token alone as the decode does. A prompt computed in one
piece comes out otherwise: vLLM keeps the state in the cache's dtype, bf16, between chunks
(measured on an AVX2-only host: a 100-token prompt's first token differed from one piece's; the
hand-off's log-probabilities were those of one instance chunked at 99 tokens, bit for bit). So
the hand-off must give the reference's every token. The control is a prefill instance with other
weights. Beside the tokens, each Mamba layer's state block is compared in the two engines' own
caches (engine_proc.py ``_watch_states``: sha256 of the prefill's block as it was saved, of the
decode's right after it was written, before vLLM's step overwrites it): the decode's bytes are
the prefill's, for every prompt and layer, and the control's differ.
"""

from __future__ import annotations

from typing import Any

import pytest
from harness import Instance, cache_groups, decode_on, hand_off, prompts, two_models

from kvferry.app.vllm.groups import prompt_pages

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

#: the tokens an instance computes in a step; every prompt's ``n - 1`` is a multiple of it (a
#: prefill computes ``n - 1`` in whole chunks; the reference's last chunk is the last token). The
#: pages of ``n - 1`` tokens: half a page, one and a half, four (attention block size 64), or a
#: third of a page, one page, two and two thirds (96)
CHUNK = 32
LENGTHS = [CHUNK + 1, 3 * CHUNK + 1, 8 * CHUNK + 1]
TOKENS = 12
# one attention block of one layer, a token: 2 KV heads x K and V of 32, bf16. vLLM raises the
# attention group's block size from 32 until a page holds a Mamba page (and pads the Mamba page
# to it): 96 tokens on the AVX-512 hosts this ran on, 64 on an AVX2-only one, whose Mamba state
# block is smaller; so the test reads the block size from the engine (``attention_block_size``)
# and checks the state block's size against vLLM's rule, not against one host's figure
TOKEN_BYTES = 2 * 2 * 32 * 2


def attention_block_size(inst: Instance) -> int:
    """The tokens an attention page holds in ``inst``: raised above 32 (to hold a Mamba state
    block)."""
    groups = cache_groups(inst)
    size = groups["block_sizes"][groups["groups"].index("full")]
    assert size > 32
    return size


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Any:
    env = two_models(tmp_path_factory.mktemp("vllm_mamba"), "make-mamba-model")
    env["engine"] = {"max_num_batched_tokens": CHUNK}
    return env


@pytest.fixture(scope="module")
def decode(env: dict) -> Any:
    with decode_on(env) as inst:  # and model_a's prefill, started at once, for the first hand-off
        yield inst


@pytest.fixture(scope="module")
def reference(decode: Instance) -> list[list[int]]:
    return [r["tokens"] for r in decode.generate(prompts(LENGTHS, seed=7), max_tokens=TOKENS)]


def test_the_decode_runs_an_attention_and_a_mamba_group(env: dict, decode: Instance, reference: list) -> None:
    assert cache_groups(decode)["groups"] == ["mamba:none", "full"]  # vLLM's order: the Mamba group first


MAMBA_LAYERS = 2
WRITTEN_A: dict[tuple[int, int], str] = {}  # (prompt, layer) -> sha256 of the decode's state block, model_a


def _states(groups: dict, side: str, params: list[dict], since: int = 0) -> dict[tuple[int, int], str]:
    """``(prompt index, layer) -> sha256`` of the state blocks ``side`` ("save" or "load")
    recorded since entry ``since``, matched to the prompts by their transfer ids."""
    prompt = {p["transfer_id"]: i for i, p in enumerate(params)}
    out = {}
    for s in groups["states"][since:]:
        if s["side"] == side and s["transfer_id"] in prompt:
            out[(prompt[s["transfer_id"]], s["layer"])] = s["sha256"]
    return out


def test_mamba_hand_off_equals_a_single_instance(env: dict, decode: Instance, reference: list[list[int]]) -> None:
    before = cache_groups(decode)
    loads_before, states_before = len(before["jobs"]), len(before["states"])
    tokens, loaded, prefill, params = hand_off(env, decode, "model_a", LENGTHS, TOKENS)
    # each Mamba layer's state block arrived bit for bit: the decode's cache holds the prefill's
    # bytes, read from both engines' caches (not from kvferry's payload)
    saved = _states(prefill, "save", params)
    written = _states(cache_groups(decode), "load", params, states_before)
    assert len(saved) == len(LENGTHS) * MAMBA_LAYERS
    assert written == saved
    assert len(set(saved.values())) == len(saved)  # every prompt and layer a state of its own
    WRITTEN_A.update(written)
    assert prefill["groups"] == ["mamba:none", "full"]
    # the prefill computed n - 1 tokens (and says so), each save sent one state block
    assert [p["remote_num_tokens"] for p in params] == [n - 1 for n in LENGTHS]
    saves = [j["groups"] for j in prefill["jobs"] if j["kind"] == "save"]
    loads = [j["groups"] for j in cache_groups(decode)["jobs"][loads_before:] if j["kind"] == "load"]
    assert len(saves) == len(loads) == len(LENGTHS)
    block_size = attention_block_size(decode)
    for n, save, load in zip(LENGTHS, saves, loads):
        assert save[0][1] == 0 and len(save[0][2]) == 1 and load[0][1] == 0 and len(load[0][2]) == 1
        assert len(save[1][2]) == len(load[1][2]) == prompt_pages(n - 1, block_size)
    # written on the decode: the 2 attention layers' pages of the n - 1 tokens, each of the 2
    # Mamba layers' state block
    page_bytes = block_size * TOKEN_BYTES
    pages_bytes = sum(2 * prompt_pages(n - 1, block_size) * page_bytes for n in LENGTHS)
    state_bytes, rest = divmod(loaded - pages_bytes, 2 * len(LENGTHS))
    # one state block per Mamba layer and prompt, all of one size: more than a page of 32 tokens
    # (else vLLM would not have raised the block size) and at most a page
    assert rest == 0 and 32 * TOKEN_BYTES < state_bytes <= page_bytes
    # the decode's tokens come from the loaded state and pages over the prompt's last token: the
    # reference's, split at the same token, every one of them
    assert tokens == reference


def test_a_prefill_with_other_weights_changes_the_tokens(
    env: dict, decode: Instance, reference: list[list[int]]
) -> None:
    states_before = len(cache_groups(decode)["states"])
    tokens, loaded, _, params = hand_off(env, decode, "model_b", LENGTHS, TOKENS)
    assert loaded > 0
    # the control: other weights' states were written for the same prompts, and they differ
    written = _states(cache_groups(decode), "load", params, states_before)
    assert len(written) == len(LENGTHS) * MAMBA_LAYERS
    if WRITTEN_A:  # the hand-off test ran first (the module's order)
        assert all(written[k] != WRITTEN_A[k] for k in written)
    # the loaded KV and state were used: the first tokens differ
    assert sum(t[:2] != r[:2] for t, r in zip(tokens, reference)) >= len(LENGTHS) - 1
