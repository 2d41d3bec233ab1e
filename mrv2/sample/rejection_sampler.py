"""The probabilistic rejection sampler, for drafters that propose a distribution.

Draft i of a request (drawn from the drafter's distribution q_i) is accepted with
probability min(1, p_i(d) / q_i(d)), where p_i is the target's distribution at that
position; at the first rejection the token is drawn from the residual
normalize(max(p_i - q_i, 0)) and the request emits nothing after it; when every draft
holds, a bonus token is drawn from the target's distribution after the last draft.
Each emitted token is then distributed exactly as the target's (Leviathan et al.,
2023; vLLM's RejectionSampler). Drafts that are single tokens (n-gram lookup, greedy
drafters) need no distributions: `draft_verify` covers them by drawing at every
position. Everything is batched on the device with host-known shapes. Randomness is
stateless, like the sampler's (`gumbel`): every draw depends on (request seed, token
position) only, so a seeded request repeats whatever else is in the batch.
"""

from __future__ import annotations

import torch

from mrv2.sample.gumbel import gumbel_noise, uniform
from mrv2.sampling_params import GREEDY_EPS, is_greedy

_ACCEPT_SALT = 0x5BD1E995  # keys the acceptance uniforms apart from the same position's categorical noise


def _draw(weights: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """One token per row of unnormalized `weights` [N, V] (Gumbel-max on log weights; zero weight never wins)."""
    return (weights.log() + gumbel_noise(seeds, positions, weights.shape[-1])).argmax(dim=-1)


def rejection_sample(target_probs: torch.Tensor, draft_probs: torch.Tensor, draft_ids: torch.Tensor,
                     num_drafts: torch.Tensor, seeds: torch.Tensor,
                     positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens [B, k + 1], num_emitted [B]).

    target_probs [B, k + 1, V]: the target's distributions at each draft position and after the last;
    draft_probs [B, k, V] and draft_ids [B, k]: the drafter's distributions and its draws; row b
    verifies its first num_drafts[b] drafts, the first at token position positions[b], with
    seed seeds[b]. Row b emits tokens[b, :num_emitted[b]].
    """
    b, k = draft_ids.shape
    v = target_probs.shape[-1]
    cols = torch.arange(k, device=draft_ids.device)
    # Seed and token position of every draft's draws, flattened [B * k].
    draft_seeds = seeds.long()[:, None].expand(-1, k).flatten()
    draft_pos = (positions.long()[:, None] + cols).flatten()
    p = target_probs[:, :k].gather(-1, draft_ids[..., None])[..., 0]
    q = draft_probs.gather(-1, draft_ids[..., None])[..., 0]
    u = uniform(draft_seeds ^ _ACCEPT_SALT, draft_pos, 1).view(b, k).to(p.dtype)
    accept = (u * q < p) & (cols < num_drafts[:, None])  # u < p / q without dividing by a zero q
    num_accepted = accept.int().cumprod(dim=1).sum(dim=1)
    residual = (target_probs[:, :k] - draft_probs).clamp_(min=0)
    # Where p <= q everywhere the residual is empty, but then no draft is ever rejected there.
    empty = residual.sum(dim=-1, keepdim=True) <= 0
    residual = torch.where(empty, target_probs[:, :k], residual)
    # [B, k]: the token a rejection at each position draws.
    recovered = _draw(residual.flatten(0, 1), draft_seeds, draft_pos).view(b, k)
    after = num_drafts.long()
    bonus = _draw(target_probs.gather(1, after[:, None, None].expand(-1, 1, v))[:, 0], seeds.long(),
                  positions.long() + after)  # the token after the last verified draft
    tokens = torch.cat([draft_ids, bonus[:, None]], dim=1).clone()
    at = num_accepted.long()
    rejected = at < num_drafts
    last = torch.where(rejected, recovered.gather(1, at.clamp(max=k - 1)[:, None])[:, 0], bonus)
    tokens.scatter_(1, at[:, None], last[:, None])
    return tokens, num_accepted + 1


_DRAFT_SALT = 0x2545F491  # keys a drafter's draws apart from the target's at the same position


def draw_drafts(logits: torch.Tensor, temperature: torch.Tensor, seeds: torch.Tensor,
                positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A drafter's tokens for the probabilistic rejection sampler: (ids [B], q [B, V]).

    Random rows draw from q = softmax(logits / temperature), seeded by (seed, position) apart
    from the target's draws; greedy rows take the argmax (their q is never read).
    """
    q = (logits / temperature.clamp(min=GREEDY_EPS)[:, None]).softmax(dim=-1)
    drawn = _draw(q, seeds.long() ^ _DRAFT_SALT, positions.long())
    return torch.where(is_greedy(temperature), logits.argmax(dim=-1), drawn), q
