"""prompt_logprobs: which of a step's tokens score the prompt, and the scores on the device.

A prefill chunk of a request that asked for prompt logprobs computes, at each of its
positions p below the prompt's last, the logprob of prompt token p + 1 (and the top
alternatives) from the logits at p; the chunk that holds the prompt's last position
scores up to it (that position predicts the first output token, which is sampled).
The targets are read from the slot's token history on the device. A request
prefilled again after a preemption scores the same positions again, with the same
values, so the engine stores them by position.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from mrv2.sample.logprobs import LogprobsTensors, compute_logprobs


@dataclass(frozen=True)
class PromptLogprobsPlan:
    """Host plan: per request (id, first scored position, count), and per scored token its flattened
    batch index, slot and target position (the prompt token it scores)."""

    requests: list[tuple[str, int, int]]
    token_index: np.ndarray
    slots: np.ndarray
    target_pos: np.ndarray
    k: int


def plan_prompt_logprobs(req_ids: list[str], idx_cpu: np.ndarray, num_scheduled: np.ndarray,
                         num_computed: np.ndarray, query_start_loc: np.ndarray, prompt_len: np.ndarray,
                         wanted: np.ndarray) -> PromptLogprobsPlan | None:
    """Host work at launch; `num_computed`, `prompt_len`, `wanted` (-1: none) are per batch row."""
    rows = np.nonzero(wanted >= 0)[0]
    start = num_computed[rows]
    count = np.minimum(start + num_scheduled[rows], prompt_len[rows] - 1) - start
    keep = count > 0  # only while they prefill their prompt
    rows, start, count = rows[keep], start[keep], count[keep]
    if not rows.size:
        return None
    # Scored token t of row r: batch index qsl[r] + t, target position start[r] + 1 + t.
    offset = np.arange(int(count.sum())) - np.repeat(np.cumsum(count) - count, count)
    return PromptLogprobsPlan(
        [(req_ids[r], int(s) + 1, int(c)) for r, s, c in zip(rows.tolist(), start.tolist(), count.tolist())],
        np.repeat(query_start_loc[rows], count) + offset, np.repeat(idx_cpu[rows], count),
        np.repeat(start + 1, count) + offset, int(wanted[rows].max()))


def score_prompt(plan: PromptLogprobsPlan, hidden: torch.Tensor, token_ids: torch.Tensor, compute_logits,
                 device: torch.device) -> LogprobsTensors:
    """Device work: logprobs of the planned prompt tokens from the step's hidden states."""
    index = torch.from_numpy(plan.token_index).to(device)
    targets = token_ids[torch.from_numpy(plan.slots).to(device), torch.from_numpy(plan.target_pos).to(device)]
    raw = compute_logits(hidden[index]).log_softmax(dim=-1)
    return compute_logprobs(raw, targets, plan.k)
