"""The n-gram proposer: the tokens after the latest earlier occurrence of the longest recurring suffix."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from mrv2.spec_decode.metrics import SpecDecodingStats
from mrv2.spec_decode.ngram import NgramProposer


def test_longest_suffix_then_latest_occurrence():
    p = NgramProposer(k=3, min_n=1, max_n=3)
    # Suffix [7, 8, 9] occurs at 0 and 5: the latest (5) gives 10, 11, 12.
    assert p.propose([7, 8, 9, 1, 2, 7, 8, 9, 10, 11, 12, 13, 7, 8, 9]) == [10, 11, 12]
    # Only the 1-gram [5] recurs: what followed its latest earlier occurrence.
    assert p.propose([5, 1, 5, 2, 4, 5]) == [2, 4, 5]
    assert p.propose([1, 2, 3]) == []  # nothing recurs
    assert p.propose([4]) == [] and p.propose([]) == []
    assert NgramProposer(k=3, min_n=2, max_n=3).propose([5, 1, 5, 2, 4, 5]) == []  # a 1-gram is too short
    assert p.propose([1, 2, 1, 2]) == [1, 2]  # the occurrence may overlap the suffix; drafts stop at the end


def _reference(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        suffix = tokens[len(tokens) - n:]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start:start + n] == suffix:
                return tokens[start + n:start + n + k]
    return []


@settings(max_examples=300, deadline=None, derandomize=True)
@given(tokens=st.lists(st.integers(0, 4), max_size=40), k=st.integers(1, 5), min_n=st.integers(1, 3),
       extra=st.integers(0, 3))
def test_equals_a_plain_loop(tokens, k, min_n, extra):
    assert NgramProposer(k, min_n, min_n + extra).propose(tokens) == _reference(tokens, k, min_n, min_n + extra)


@settings(max_examples=200, deadline=None, derandomize=True)
@given(histories=st.lists(st.lists(st.integers(0, 4), max_size=30), max_size=6), k=st.integers(1, 5),
       min_n=st.integers(1, 3), extra=st.integers(0, 3))
def test_the_batch_equals_each_request_alone(histories, k, min_n, extra):
    p = NgramProposer(k, min_n, min_n + extra)
    assert p.propose_batch(histories) == [_reference(h, k, min_n, min_n + extra) for h in histories]


def test_stats():
    s = SpecDecodingStats()
    s.observe(3, 2)
    s.observe(3, 0)
    s.observe(2, 2)
    assert s.num_drafts == 3 and s.num_draft_tokens == 8 and s.num_accepted_tokens == 4
    assert s.acceptance_rate == 0.5 and abs(s.mean_acceptance_length - (1 + 4 / 3)) < 1e-12
    assert s.accepted_per_position == [2, 2, 0] and s.position_rates() == [2 / 3, 2 / 3, 0.0]
