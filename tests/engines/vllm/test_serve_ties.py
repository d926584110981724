"""Which completions the serve tests accept as the plain server's (serve_harness.not_plain): its
answer alone, its answer in its own batch, or one that parts from the answer alone at a tie of
bf16 logits. Pure: no server is started."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st
from serve_harness import TIE_NATS, departs_at_a_tie, not_plain, tie_gap

STEP = 1 / 16  # bf16 log-probabilities near the top step by this much
TOP = [{5: -1.0, 6: -1.0 - STEP, 7: -1.0 - 2 * STEP, 8: -3.0}, {1: -0.5, 2: -0.5 - STEP}]
REF = [5, 1]


def test_a_tie_is_equal_or_one_bf16_step_below_the_reference() -> None:
    assert tie_gap(REF, REF, TOP) == 0.0 and departs_at_a_tie(REF, REF, TOP)
    assert tie_gap([6, 9], REF, TOP) == STEP and departs_at_a_tie([6, 9], REF, TOP)  # parts at token 0
    assert tie_gap([5, 2], REF, TOP) == STEP and departs_at_a_tie([5, 2], REF, TOP)  # at token 1
    assert not departs_at_a_tie([7, 1], REF, TOP)  # two steps below
    assert not departs_at_a_tie([8, 1], REF, TOP)  # far below
    assert tie_gap([9, 1], REF, TOP) is None and not departs_at_a_tie([9, 1], REF, TOP)  # not in the top
    assert tie_gap([5], REF, TOP) is None and not departs_at_a_tie([5], REF, TOP)  # cut short
    assert STEP <= TIE_NATS < 2 * STEP


def test_not_plain_names_what_is_wrong_and_counts_the_ties() -> None:
    plain = {"reference": {(1,): REF, (2,): REF}, "batched": {(2,): [8, 3]}, "top": {(1,): TOP, (2,): TOP}}
    wrong, ties = not_plain(plain, [([1], REF), ([2], [8, 3]), ([1], [6, 4])])
    assert (wrong, ties) == ([], [1])  # alone, its batch, a tie
    wrong, ties = not_plain(plain, [([1], [8, 1]), ([2], [7, 3])])
    assert ties == [] and len(wrong) == 2
    assert wrong[0].startswith("1 tokens: [8, 1] against [5, 1]") and "top at 0" in wrong[0]


@given(st.lists(st.integers(0, 9), min_size=2, max_size=2))
def test_whatever_is_accepted_follows_the_reference_up_to_a_top_token(got: list[int]) -> None:
    if departs_at_a_tie(got, REF, TOP):
        at = next((i for i in range(2) if got[i] != REF[i]), None)
        assert at is None or (got[:at] == REF[:at] and TOP[at][REF[at]] - TOP[at][got[at]] <= TIE_NATS)
