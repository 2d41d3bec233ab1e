"""compute_logprobs: the sampled token first with its rank, then the top-k, from raw log-probabilities."""

from __future__ import annotations

import pytest
import torch

from mrv2.sample.logprobs import compute_logprobs


@pytest.mark.parametrize("k", [0, 1, 5])
def test_sampled_token_first_then_top_k_with_ranks(k):
    torch.manual_seed(0)
    logits = torch.randn(6, 50)
    raw = logits.log_softmax(dim=-1)
    sampled = torch.tensor([0, 7, 49, 3, 3, 20])
    out = compute_logprobs(raw, sampled, k)
    assert out.token_ids.shape == out.logprobs.shape == (6, 1 + k)
    assert torch.equal(out.token_ids[:, 0], sampled)
    assert torch.equal(out.logprobs[:, 0], raw[torch.arange(6), sampled])
    order = raw.argsort(dim=-1, descending=True)
    expected_rank = (order == sampled[:, None]).int().argmax(dim=-1) + 1
    assert torch.equal(out.ranks, expected_rank)
    assert torch.equal(out.token_ids[:, 1:], order[:, :k])
    assert torch.equal(out.logprobs[:, 1:], raw.gather(1, order[:, :k]))


def test_ties_share_the_better_rank():
    raw = torch.tensor([[-1.0, -1.0, -2.0]])
    assert compute_logprobs(raw, torch.tensor([1]), 2).ranks.tolist() == [1]
    assert compute_logprobs(raw, torch.tensor([2]), 0).ranks.tolist() == [3]
