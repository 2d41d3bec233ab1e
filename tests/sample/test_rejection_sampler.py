"""The probabilistic rejection sampler: emitted tokens follow the target's distribution (chi-square),
whatever the drafter proposes; acceptance follows min(1, p/q); draws depend on (seed, position) only."""

from __future__ import annotations

import torch

from mrv2.sample.rejection_sampler import rejection_sample

CHI2_999 = {4: 18.47, 7: 24.32}  # chi-square critical values at p = 0.001 for 4 and 7 degrees of freedom


def _chi2(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


def test_emitted_tokens_follow_the_target_distribution():
    g = torch.Generator().manual_seed(0)
    v, k, n = 8, 2, 40000
    p = torch.softmax(torch.randn(k + 1, v, generator=g) * 1.5, dim=-1)  # the target at each position
    q = torch.softmax(torch.randn(k, v, generator=g) * 1.5, dim=-1)  # a drafter that disagrees
    drafts = torch.multinomial(q.repeat(n, 1), 1, generator=g).view(n, k)
    tokens, emitted = rejection_sample(p.expand(n, -1, -1), q.expand(n, -1, -1), drafts,
                                       torch.full((n,), k), torch.arange(n), torch.full((n,), 40))
    # Position 0 is always emitted and follows p[0]; position 1, where emitted, follows p[1].
    assert _chi2(torch.bincount(tokens[:, 0], minlength=v).double(), p[0].double()) < CHI2_999[v - 1]
    second = tokens[emitted >= 2, 1]
    assert _chi2(torch.bincount(second, minlength=v).double(), p[1].double()) < CHI2_999[v - 1]
    # The first draft is accepted with probability sum_x min(p(x), q(x)).
    rate = (emitted >= 2).double().mean()
    assert abs(rate - torch.minimum(p[0], q[0]).sum()) < 0.01


def test_limits_and_shapes():
    g = torch.Generator().manual_seed(1)
    v = 5
    p = torch.softmax(torch.randn(3, 3, v, generator=g), dim=-1)
    drafts = torch.randint(0, v, (3, 2), generator=g)
    # A drafter identical to the target: every draft holds, then a bonus token.
    tokens, emitted = rejection_sample(p, p[:, :2], drafts, torch.tensor([2, 1, 0]), torch.arange(3),
                                       torch.zeros(3, dtype=torch.long))
    assert emitted.tolist() == [3, 2, 1]
    assert tokens[0, :2].tolist() == drafts[0].tolist() and tokens[1, 0] == drafts[1, 0]
    # A draft the target gives no mass is always rejected and replaced by a token the target can draw.
    zero = p.clone()
    zero[:, 0, 0] = 0
    zero = zero / zero.sum(-1, keepdim=True)
    tokens, emitted = rejection_sample(zero, torch.full((3, 2, v), 1 / v), torch.zeros(3, 2, dtype=torch.long),
                                       torch.tensor([2, 2, 2]), torch.arange(3), torch.full((3,), 9))
    assert emitted.tolist() == [1, 1, 1] and (tokens[:, 0] != 0).all()


def test_a_row_draws_the_same_whatever_else_is_in_the_batch():
    p = torch.softmax(torch.randn(16, 4, 50), dim=-1)
    q = torch.softmax(torch.randn(16, 3, 50), dim=-1)
    drafts = torch.multinomial(q.view(-1, 50), 1).view(16, 3)
    seeds, positions = torch.arange(100, 116), torch.arange(16) * 3
    tokens, emitted = rejection_sample(p, q, drafts, torch.full((16,), 3), seeds, positions)
    again = rejection_sample(p, q, drafts, torch.full((16,), 3), seeds, positions)
    assert torch.equal(tokens, again[0]) and torch.equal(emitted, again[1])
    alone = rejection_sample(p[5:6], q[5:6], drafts[5:6], torch.tensor([3]), seeds[5:6], positions[5:6])
    n = int(emitted[5])
    assert int(alone[1][0]) == n and torch.equal(alone[0][0, :n], tokens[5, :n])
