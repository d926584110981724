"""Two real vLLM instances hand a hybrid model's KV over through kvferry (shared memory): the tiny
random Llama with layers alternating full attention and a 48-token sliding window
(``layer_types``; vLLM's hybrid KV cache manager makes two KV cache groups, on the CPU build
too, since the connector declares ``SupportsHMA``).

The reference is the decode instance computing each prompt itself; the control is a prefill
instance with other weights. The bytes loaded are the full-attention layers' pages of the prompt
and the sliding-window layers' pages inside the window only.
"""

from __future__ import annotations

from typing import Any

import pytest
from harness import Instance, cache_groups, decode_on, hand_off, prompts, two_models

from kvferry.app.vllm.groups import kept_first_page, prompt_pages

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

# a partial page, the window's edge on a page boundary ((79 - 48 + 1) % 32 == 0), several pages, many
LENGTHS = [45, 79, 100, 257]
TOKENS = 12
WINDOW, BS = 48, 32
PAGE_BYTES = 2 * BS * 2 * 32 * 2  # one block of one layer: 2 KV heads x 32 tokens x K and V of 32, bf16


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return two_models(tmp_path_factory.mktemp("vllm_hybrid"), "make-hybrid-model", WINDOW)


@pytest.fixture(scope="module")
def decode(env: dict) -> Any:
    with decode_on(env) as inst:  # and model_a's prefill, started at once, for the first hand-off
        yield inst


@pytest.fixture(scope="module")
def reference(decode: Instance) -> list[list[int]]:
    return [r["tokens"] for r in decode.generate(prompts(LENGTHS, seed=7), max_tokens=TOKENS)]


def test_the_decode_runs_two_kv_cache_groups(env: dict, decode: Instance, reference: list[list[int]]) -> None:
    assert cache_groups(decode)["groups"] == ["full", "sliding_window:48"]


def test_hybrid_hand_off_equals_a_single_instance_moving_the_window_only(
    env: dict, decode: Instance, reference: list[list[int]]
) -> None:
    loads_before = len(cache_groups(decode)["jobs"])
    tokens, loaded, prefill, _ = hand_off(env, decode, "model_a", LENGTHS, TOKENS)
    assert prefill["groups"] == ["full", "sliding_window:48"]
    assert tokens == reference
    # each save sent group 1 from the first page the window of the prompt's last token reads;
    # each load (all but the last token) left the pages before it as vLLM's null block
    saves = [j["groups"] for j in prefill["jobs"] if j["kind"] == "save"]
    loads = [j["groups"] for j in cache_groups(decode)["jobs"][loads_before:] if j["kind"] == "load"]
    assert len(saves) == len(loads) == len(LENGTHS)
    for n, save, load in zip(LENGTHS, saves, loads):
        first = kept_first_page(n - 1, BS, WINDOW)
        assert save[0][1] == 0 and len(save[0][2]) == prompt_pages(n, BS)
        assert save[1][1] == first and len(save[1][2]) == prompt_pages(n, BS) - first
        assert load[1][2][:first] == [0] * first and 0 not in load[1][2][first:] and 0 not in load[0][2]
    # written on the decode, of the n - 1 tokens it loads: 2 full-attention layers, every page;
    # 2 sliding-window layers, the window's pages only
    full = sum(prompt_pages(n - 1, BS) for n in LENGTHS)
    window = sum(prompt_pages(n - 1, BS) - kept_first_page(n - 1, BS, WINDOW) for n in LENGTHS)
    assert loaded == (2 * full + 2 * window) * PAGE_BYTES
    assert window < full  # the window really is less than the prompt


def test_a_prefill_with_other_weights_changes_the_tokens(
    env: dict, decode: Instance, reference: list[list[int]]
) -> None:
    tokens, loaded, _, _ = hand_off(env, decode, "model_b", LENGTHS, TOKENS)
    assert loaded > 0
    assert sum(t != r for t, r in zip(tokens, reference)) >= len(LENGTHS) - 1  # the loaded KV was used
