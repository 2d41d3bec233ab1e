"""Per-step sampling inputs: per-row tensors plus host flags that let the sampler skip work."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from mrv2.sampling_params import GREEDY_EPS, is_greedy


@dataclass
class SamplingMetadata:
    """Sampling parameters of one step's batch, one row per sampled token, in batch order.

    temperature float32 [B] (`is_greedy`: greedy), top_k int32 [B] (<= 0 or >= vocab:
    disabled), top_p float32 [B] (1: disabled), min_p float32 [B] (0: disabled), seeds
    int64 [B], positions int64 [B] (the position of the token being sampled, i.e. the
    sequence length before it). The bools are known on the host ahead of time and only
    let the sampler skip work, so they may be conservative (False) but never wrong.
    `max_top_k`, when set, bounds the effective top-k of every row that uses top-k or
    top-p (a top-p row without top-k counts as the vocab size); below the vocab size it
    replaces the full sort with `torch.topk`.
    """

    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    min_p: torch.Tensor
    seeds: torch.Tensor
    positions: torch.Tensor
    all_greedy: bool
    all_random: bool
    no_top_k: bool
    no_top_p: bool
    no_min_p: bool
    max_top_k: int | None = None

    @classmethod
    def from_lists(
        cls,
        temperature: Sequence[float],
        seeds: Sequence[int],
        positions: Sequence[int],
        vocab_size: int,
        top_k: Sequence[int] | None = None,
        top_p: Sequence[float] | None = None,
        min_p: Sequence[float] | None = None,
        device: torch.device | str | None = None,
    ) -> "SamplingMetadata":
        """Build from host lists (one entry per row), deriving every host flag."""
        n = len(temperature)
        top_k = [0] * n if top_k is None else list(top_k)
        top_p = [1.0] * n if top_p is None else list(top_p)
        min_p = [0.0] * n if min_p is None else list(min_p)
        greedy = [is_greedy(t) for t in temperature]
        uses_k = [0 < k < vocab_size for k in top_k]
        uses_p = [p < 1.0 for p in top_p]
        bounds = [k if uk else vocab_size for k, uk, up in zip(top_k, uses_k, uses_p) if uk or up]
        return cls(
            temperature=torch.tensor(temperature, dtype=torch.float32, device=device),
            top_k=torch.tensor(top_k, dtype=torch.int32, device=device),
            top_p=torch.tensor(top_p, dtype=torch.float32, device=device),
            min_p=torch.tensor(min_p, dtype=torch.float32, device=device),
            seeds=torch.tensor(seeds, dtype=torch.int64, device=device),
            positions=torch.tensor(positions, dtype=torch.int64, device=device),
            all_greedy=all(greedy),
            all_random=not any(greedy),
            no_top_k=not any(uses_k),
            no_top_p=not any(uses_p),
            no_min_p=all(m <= 0.0 for m in min_p),
            max_top_k=max(bounds, default=None),
        )
