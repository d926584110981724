"""KVFerryConnector's scheduler side in vLLM's real scheduler and KV cache manager over a hybrid
``KVCacheConfig`` (group 0 full attention, group 1 a sliding window of 48 tokens, block size 16;
no model: hybrid_sched_proc.py writes the steps' outputs). The jobs carry each group's block
ids, a sliding-window group sends exactly the pages vLLM's manager keeps for the prompt's last
token (what the decode's manager keeps for the all-but-last tokens it loads), vLLM calls
``request_finished_all_groups`` and frees every block once the request is reported sent, a
failed load is handled per request under either failure policy, and specs kvferry does not move
are refused at start. Over a config of a full-attention group and a Mamba group (mode ``none``,
block size the model's length): the prefill computes all but the prompt's last token and sends
the state block vLLM's manager holds, and the decode loads ``n - 1`` tokens, its state into the
block its manager gave, and computes the last token."""

from __future__ import annotations

import pytest
from harness import run_json

from kvferry.app.vllm.groups import (
    MAMBA,
    NULL_BLOCK,
    SLIDING_WINDOW,
    GroupSpec,
    freed_at_finish,
    kept_first_page,
    prompt_pages,
    state_page,
)

pytestmark = [pytest.mark.timeout(600)]

BS, WINDOW = 16, 48
MAX_LEN = 1024  # hybrid_sched_proc.py's model length: the Mamba group's block size


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return run_json("hybrid_sched_proc.py", tmp_path_factory.mktemp("hybrid") / "out.json")


def test_vllm_keeps_its_hybrid_manager_on_with_kvferry(run: dict) -> None:
    assert run["supports_hma"] is True and run["hma_enabled"] is True


def _check_prefill(case: dict) -> None:
    n = case["n"]
    pages = prompt_pages(n, BS)
    first = kept_first_page(n - 1, BS, WINDOW)  # the window of the prompt's last token
    finish_first = kept_first_page(n, BS, WINDOW)
    (g0, f0, full), (g1, f1, window) = case["groups"]
    # the full group sends every page of the prompt, in the blocks vLLM gave it
    assert (g0, f0, full) == (0, 0, case["at_save"][0][:pages]) and case["block_ids"] == full
    # the sliding-window group sends the pages its manager held at the save from the first the
    # last token's window reads
    assert (g1, f1) == (1, first)
    assert list(enumerate(window, f1)) == [(p, b) for p, b in enumerate(case["at_save"][1][:pages]) if p >= first]
    assert NULL_BLOCK not in window
    # vLLM called the hybrid finish once, with every group's blocks, having freed the window's
    # pages below the next token's: the sent ones from there on are what it holds then; the one
    # page below (when there is one) is why the save held its step
    [(kind, rid, finished_ids)] = case["calls"]
    assert kind == "all_groups" and rid == f"p{n}"
    held = [(p, b) for p, b in enumerate(finished_ids[1]) if b != case["null_block_id"]]
    assert finished_ids[1][:finish_first] == [NULL_BLOCK] * finish_first
    assert list(enumerate(window, f1))[finish_first - first :] == held
    spec = GroupSpec(1, SLIDING_WINDOW, BS, WINDOW)
    assert case["hold_step"] == freed_at_finish(spec, n) == (finish_first > first)
    assert finished_ids[0] == full
    # held until the worker reports the request sent: the full pages and the window's; then all freed
    free0, held_free, after = case["free"]
    assert held_free == free0 - len(full) - len(held) and after == free0
    assert case["pending_push"] is True and case["after_push"] is False


def test_a_prefill_sends_each_groups_pages_and_the_window_vllm_keeps(run: dict) -> None:
    firsts, holds = set(), set()
    for case in run["prefill"]:
        _check_prefill(case)
        firsts.add(case["groups"][1][1])
        holds.add(case["hold_step"])
    assert firsts == {0, 1, 3, 5}  # the cases cover windows that start on page 0 and later
    assert holds == {False, True}  # and a window whose first page vLLM frees at the finish (63)


def test_a_chunked_prefill_sends_the_window_of_its_last_chunk(run: dict) -> None:
    case = run["prefill_chunked"]
    assert case["steps"] == 3  # 130 tokens in chunks of 48
    # at the save, vLLM had already dropped pages of earlier chunks (nulls lead the table)
    assert case["at_save"][1][:3] == [NULL_BLOCK] * 3
    _check_prefill(case)


def test_a_decode_loads_into_each_groups_blocks_and_vllm_waits_for_it(run: dict) -> None:
    for name in ("ok", "sync_as_async", "short"):
        case = run["decode"][name]
        n = case["n"]
        # a hybrid load is all but the last token: the pages of n - 1 tokens in each group
        assert case["groups"] == [[g, 0, ids[: prompt_pages(n - 1, BS)]] for g, ids in enumerate(case["manager"])]
        # the decode's own manager leaves the pages before its window null: they are not written
        first = kept_first_page(n - 1, BS, WINDOW)
        assert case["manager"][1][:first] == [NULL_BLOCK] * first and NULL_BLOCK not in case["manager"][1][first:]
        assert NULL_BLOCK not in case["manager"][0]
        assert case["waiting_for_kv"] is True and case["scheduled"] == {}
        assert case["sync"] is False  # load_mode "sync" is taken as async with several groups
        assert case["loaded_groups"] == [0, 1]
        # loaded: vLLM computes the prompt's last token only, and asks for no other load
        assert case["next_scheduled"] == {f"d{n}": 1} and case["next_loads"] == 0
        assert case["free"][1] == case["free"][0]


def test_a_failed_load_is_per_request_under_either_policy(run: dict) -> None:
    recompute, fail = run["decode"]["failed_recompute"], run["decode"]["failed_fail"]
    # recompute: the whole prompt is computed here, nothing loaded again
    assert recompute["next_scheduled"] == {"d100": 100} and recompute["next_loads"] == 0
    assert recompute["finish_reasons"] == ["length"]
    # fail: the request ends with an error and its blocks are freed
    assert fail["finished"] is True and fail["status_after"] == "FINISHED_ERROR"
    assert fail["free"][1] == fail["free"][0]


def test_a_mamba_prefill_computes_all_but_the_last_token_and_sends_its_state_block(run: dict) -> None:
    cases = [*run["mamba"]["prefill"], run["mamba"]["prefill_chunked"]]
    assert [c["n"] for c in cases] == [20, 100, 130, 130] and cases[-1]["steps"] == 3  # 129 in chunks of 48
    for case in cases:
        n = case["n"]
        # the prompt cut on arrival (on_new_request): the state sent is the one after n - 1
        assert case["prompt"] == case["job_tokens"] == n - 1 and case["result_tokens"] == [n - 1]
        (g0, f0, full), (g1, f1, state) = case["groups"]
        assert (g0, f0, full) == (0, 0, case["at_save"][0][: prompt_pages(n - 1, BS)]) and case["block_ids"] == full
        # the Mamba group holds one block of the model's length; the save sends that one
        assert len(case["at_save"][1]) == 1 and state_page(n - 1, MAX_LEN) == 0
        assert (g1, f1, state) == (1, 0, case["at_save"][1]) and state != [NULL_BLOCK]
        assert case["hold_step"] is False and case["finished_after_save"] is True  # max_tokens 1
        [(kind, _rid, finished_ids)] = case["calls"]
        assert kind == "all_groups" and finished_ids == [full, state]
        # held (the pages and the state block) until the worker reports the request sent
        free0, held_free, after = case["free"]
        assert held_free == free0 - len(full) - 1 and after == free0


def test_a_mamba_decode_loads_n_minus_one_tokens_and_its_state_block(run: dict) -> None:
    case = run["mamba"]["decode"]
    n = case["n"]
    manager = case["manager"]
    assert len(manager[1]) == 1 and NULL_BLOCK not in manager[1]
    assert case["groups"] == [[0, 0, manager[0][: prompt_pages(n - 1, BS)]], [1, 0, manager[1]]]
    assert case["upto_tokens"] == n - 1 and case["error"] is None
    assert case["waiting_for_kv"] is True and case["loaded_groups"] == [0, 1]
    # loaded: vLLM counts n - 1 computed and runs the prompt's last token from the state
    assert case["computed_at_load"] == n - 1 and case["next_scheduled"] == {f"d{n}": 1}
    assert case["computed_after_load"] == n
    assert case["next_loads"] == 0 and case["free"][1] == case["free"][0]
    failed = run["mamba"]["decode_failed"]  # control: a failed load computes the whole prompt
    assert failed["next_scheduled"] == {f"d{n}": n} and failed["computed_at_load"] == 0
    assert GroupSpec(1, MAMBA, MAX_LEN, mode="none").state


def test_specs_kvferry_does_not_move_are_refused_at_start(run: dict) -> None:
    refused = run["refused"]
    for key in ("mamba", "scheduler_mamba"):  # a Mamba group in mode "align" (prefix caching)
        msg = refused[key]
        assert msg.startswith("ConfigError:"), (key, msg)
        assert "MambaSpec" in msg and "mamba_cache_mode 'align'" in msg and "KV cache group 1" in msg
        assert "model.layers.1.mixer" in msg
    for key, spec in (("chunked_local", "ChunkedLocal"),):
        msg = refused[key]
        assert msg.startswith("ConfigError:"), (key, msg)
        assert spec in msg and "KV cache group 1" in msg and "model.layers.1.self_attn.attn" in msg
        assert "FullAttentionSpec" in msg and "SlidingWindowSpec" in msg and "MambaSpec" in msg
    assert "block sizes [16, 32]" in refused["block_sizes"]
    assert refused["layer_groups"] == "[0, 1, 0, 1]"
    msg = refused["page_shapes"]
    assert msg.startswith("ConfigError:") and "model.layers.3.self_attn.attn" in msg and "group 1" in msg
