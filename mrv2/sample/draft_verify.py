"""Exact verification of draft tokens by sampling at every position.

A step with k drafts for a request has logits at its last 1 + k positions; the
sampler draws a token at each (greedy or the stateless seeded Gumbel draw of that
position). Draft i + 1 is accepted while it equals the token drawn at the position
before it; the request emits the accepted drafts and the first token that differs
(or the one after the last draft). For drafts that are one token, not a
distribution (n-gram lookup, a fixed proposer, any greedy drafter), this is the
rejection sampler: accepting d with probability p(d) and otherwise drawing from p
renormalized without d is what drawing t ~ p and comparing does. And since a
position's draw depends only on (seed, position), the output equals the output
without drafts, token for token. Drafters that propose a distribution need the
probabilistic rejection sampler instead.
"""

from __future__ import annotations

import torch

from mrv2.sample.rejection_sampler import rejection_sample


def verify_drafts(sampled: torch.Tensor, input_ids: torch.Tensor, logits_indices: torch.Tensor,
                  logits_start: torch.Tensor, num_drafts: torch.Tensor, max_drafts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens [B, 1 + max_drafts], num_emitted [B]) from one sampled token per logits row.

    Logits rows of batch row b are logits_start[b] .. + num_drafts[b]; the draft a row
    verifies is the input token after that row's position. Every shape is host-known.
    """
    cols, rows, drafts = _rows_and_drafts(input_ids, logits_indices, logits_start, num_drafts, max_drafts)
    return _compare(sampled[rows], drafts, cols, num_drafts, max_drafts)


def _compare(tokens: torch.Tensor, drafts: torch.Tensor, cols: torch.Tensor, num_drafts: torch.Tensor,
             max_drafts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Drafts accepted while each equals the token drawn before it: (tokens, num_emitted)."""
    match = (tokens[:, :max_drafts] == drafts) & (cols[None, :max_drafts] < num_drafts[:, None])
    return tokens, 1 + match.int().cumprod(dim=1).sum(dim=1)


def _rows_and_drafts(input_ids: torch.Tensor, logits_indices: torch.Tensor, logits_start: torch.Tensor,
                     num_drafts: torch.Tensor, max_drafts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(cols [1 + k], each row's logits rows [B, 1 + k] (the last repeated past its drafts), the drafts
    they verify [B, k]: the input token after each of a row's first k logits rows)."""
    cols = torch.arange(max_drafts + 1, device=input_ids.device)
    rows = logits_start[:, None] + torch.minimum(cols[None, :], num_drafts[:, None])
    next_input = logits_indices[rows[:, :max_drafts]] + 1
    return cols, rows, input_ids[next_input.clamp(max=input_ids.shape[0] - 1)]


def verify_drafts_with_probs(sampled: torch.Tensor, target_probs: torch.Tensor, draft_probs: torch.Tensor,
                             input_ids: torch.Tensor, logits_indices: torch.Tensor, logits_start: torch.Tensor,
                             num_drafts: torch.Tensor, max_drafts: int, random_rows: torch.Tensor,
                             seeds: torch.Tensor, first_positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """As `verify_drafts`, but random rows whose drafts were drawn from distributions go through the
    probabilistic rejection sampler (`rejection_sampler.rejection_sample`).

    target_probs [logits rows, V]: the target's filtered distributions; draft_probs [B, >= max_drafts, V]:
    the drafter's, per draft; random_rows [B]: rows sampled at random; first_positions [B]: the token
    position of each row's first draft. Greedy rows and rows without drafts keep `verify_drafts`.
    """
    cols, rows, draft_ids = _rows_and_drafts(input_ids, logits_indices, logits_start, num_drafts, max_drafts)
    tokens, num_emitted = _compare(sampled[rows], draft_ids, cols, num_drafts, max_drafts)
    drawn, drawn_emitted = rejection_sample(target_probs[rows], draft_probs[:, :max_drafts], draft_ids, num_drafts,
                                            seeds, first_positions)
    use = random_rows & (num_drafts > 0)
    return torch.where(use[:, None], drawn, tokens), torch.where(use, drawn_emitted, num_emitted)
