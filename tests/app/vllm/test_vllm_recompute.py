"""``kv_recompute_threshold``: prompts shorter than it are not handed off. The prefill saves
nothing for them (no pages held) and returns params that tell the decode to compute the prompt;
a decode with the same threshold computes short prompts even when handed kvferry's params."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from test_vllm_pages import _params, _request, _scheduler

from kvferry.app.vllm.params import RECOMPUTE_THRESHOLD, ConnectorSettings, recompute_instead
from kvferry.core.errors import ConfigError


def test_the_threshold_is_a_setting_checked_at_start() -> None:
    assert ConnectorSettings().kv_recompute_threshold == RECOMPUTE_THRESHOLD > 0
    assert ConnectorSettings.from_extra_config({"kv_recompute_threshold": 0}).kv_recompute_threshold == 0
    assert ConnectorSettings.from_extra_config({"kv_recompute_threshold": 100}).kv_recompute_threshold == 100
    for bad in (-1, 1.5, True, "512", None):
        with pytest.raises(ConfigError, match=r"^kv_connector_extra_config\.kv_recompute_threshold: "):
            ConnectorSettings.from_extra_config({"kv_recompute_threshold": bad})


@given(st.integers(0, 1 << 20), st.integers(0, 1 << 20))
def test_the_rule_recomputes_exactly_the_prompts_below_a_positive_threshold(n: int, threshold: int) -> None:
    assert recompute_instead(n, threshold) == (threshold > 0 and n < threshold)
    assert not recompute_instead(n, 0)


def test_a_short_prompt_is_never_saved_and_its_params_make_the_decode_compute_it() -> None:
    prefill = _scheduler(True, kv_recompute_threshold=64)
    short, long = _request("s", 63, {"do_remote_decode": True}), _request("l", 64, {"do_remote_decode": True})
    prefill.track(short)
    prefill.track(long)
    [job] = prefill.build_plan({"s": 63, "l": 64}).saves  # the short one holds no pages
    assert job.req_id == "l"
    keep, params = prefill.request_finished(short)
    assert not keep and params["do_remote_prefill"] is False  # its blocks are freed at once
    assert "kv_recompute_threshold 64" in params["kvferry_not_sent"]
    keep, long_params = prefill.request_finished(long)
    assert keep and long_params["do_remote_prefill"] is True
    decode = _scheduler(False, kv_recompute_threshold=64)
    assert decode.matched_tokens(_request("d", 63, params), 0) == (0, False)
    assert decode.matched_tokens(_request("e", 64, long_params), 0) == (64, True)


def test_a_decode_below_the_threshold_computes_even_when_the_pages_were_sent() -> None:
    """A decode with a threshold the prefill did not apply: it computes, loads nothing (the
    prefill's pages expire at its lease_s)."""
    decode = _scheduler(False, kv_recompute_threshold=100)
    req = _request("d", 70, _params(transfer_id="t", remote_num_tokens=70))
    assert decode.matched_tokens(req, 0) == (0, False)
    assert decode.build_plan({}).loads == ()
    # what counts is what would be loaded: 130 tokens after a 64-token local prefix hit are 66
    hit = _request("h", 130, _params(transfer_id="u", remote_num_tokens=130))
    assert decode.matched_tokens(hit, 64) == (0, False)
    assert decode.matched_tokens(hit, 0) == (130, True)


def test_with_the_threshold_off_every_prompt_is_handed_off() -> None:
    prefill = _scheduler(True, kv_recompute_threshold=0)
    req = _request("a", 1, {"do_remote_decode": True})
    prefill.track(req)
    assert len(prefill.build_plan({"a": 1}).saves) == 1
    decode = _scheduler(False, kv_recompute_threshold=0)
    assert decode.matched_tokens(_request("d", 1, _params(remote_num_tokens=1)), 0) == (1, True)
