"""Log-probabilities of sampled tokens and of each row's top-k alternatives, as vLLM reports them.

They come from the model's raw logits (`log_softmax` before min_tokens, temperature
and the filters: vLLM's default "raw_logprobs"). Per logits row the result holds the
sampled token first, then the `k` most likely tokens in descending order (the
sampled one may appear twice), its logprobs, and the sampled token's rank in the
vocabulary (1 = most likely; ties share the better rank).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LogprobsTensors:
    """token_ids int64 [R, 1 + k], logprobs float32 [R, 1 + k], ranks int64 [R] (the sampled token's)."""

    token_ids: torch.Tensor
    logprobs: torch.Tensor
    ranks: torch.Tensor


def compute_logprobs(raw_logprobs: torch.Tensor, sampled: torch.Tensor, k: int) -> LogprobsTensors:
    """`raw_logprobs` float32 [R, V] (log_softmax of the raw logits), `sampled` int64 [R] -> LogprobsTensors."""
    chosen = raw_logprobs.gather(1, sampled[:, None])
    ranks = (raw_logprobs > chosen).sum(dim=-1) + 1
    if k > 0:
        top = raw_logprobs.topk(k, dim=-1)
        token_ids = torch.cat([sampled[:, None], top.indices], dim=1)
        logprobs = torch.cat([chosen, top.values], dim=1)
    else:
        token_ids, logprobs = sampled[:, None], chosen
    return LogprobsTensors(token_ids, logprobs, ranks)
