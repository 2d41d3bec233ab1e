"""Per-step sampling inputs: per-row tensors plus host flags that let the sampler skip work."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch

from mrv2.sample.bad_words import BadWordsMetadata
from mrv2.sample.logit_bias import LogitBiasMetadata
from mrv2.sample.min_tokens import MinTokensMetadata
from mrv2.sample.penalties import PenaltiesMetadata
from mrv2.sampling_params import is_greedy


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
    replaces the full sort with `torch.topk`. `min_tokens` is None when no row has a
    minimum to enforce (see `mrv2.sample.min_tokens`); `penalties`, `logit_bias` and
    `allowed_tokens` likewise when no row uses them (see their modules).
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
    min_tokens: MinTokensMetadata | None = None
    penalties: PenaltiesMetadata | None = None
    logit_bias: LogitBiasMetadata | None = None
    allowed_tokens: torch.Tensor | None = None  # bool [B, V]
    bad_words: BadWordsMetadata | None = None
    grammar_bitmask: torch.Tensor | None = None  # int32 [B, ceil(V / 32)]: structured output's allowed tokens

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
        return cls(
            temperature=torch.tensor(temperature, dtype=torch.float32, device=device),
            top_k=torch.tensor(top_k, dtype=torch.int32, device=device),
            top_p=torch.tensor(top_p, dtype=torch.float32, device=device),
            min_p=torch.tensor(min_p, dtype=torch.float32, device=device),
            seeds=torch.tensor(seeds, dtype=torch.int64, device=device),
            positions=torch.tensor(positions, dtype=torch.int64, device=device),
            **host_flags(np.asarray(temperature, dtype=np.float32), np.asarray(top_k, dtype=np.int64),
                         np.asarray(top_p, dtype=np.float32), np.asarray(min_p, dtype=np.float32), vocab_size),
        )


@dataclass(frozen=True)
class SamplingFlags:
    """A batch's host flags, fixed when its step is launched (see SamplingMetadata)."""

    all_greedy: bool
    all_random: bool
    no_top_k: bool
    no_top_p: bool
    no_min_p: bool
    max_top_k: int | None
    any_min_tokens: bool = False
    num_logprobs: int | None = None  # the most alternatives a row asks for; None: no row wants logprobs
    any_penalties: bool = False
    any_logit_bias: bool = False
    any_allowed_tokens: bool = False
    any_bad_words: bool = False
    history_len: int = 0  # an upper bound on the tokens before any row's sampled position (penalties, bad words)


def host_flags(temperature: np.ndarray, top_k: np.ndarray, top_p: np.ndarray, min_p: np.ndarray,
               vocab_size: int) -> dict[str, Any]:
    """SamplingMetadata's host flags from host copies of the batch's parameters, one entry per row.

    The one place they are derived (`SamplingMetadata.from_lists` and the runner's
    `SamplingStates.metadata` both call it): all_greedy, all_random, no_top_k, no_top_p,
    no_min_p and max_top_k.
    """
    greedy = is_greedy(temperature)
    uses_k = (top_k > 0) & (top_k < vocab_size)
    uses_p = top_p < 1.0
    bounds = np.where(uses_k, top_k, vocab_size)[uses_k | uses_p]
    return dict(all_greedy=bool(greedy.all()), all_random=not greedy.any(), no_top_k=not uses_k.any(),
                no_top_p=not uses_p.any(), no_min_p=bool((min_p <= 0.0).all()),
                max_top_k=int(bounds.max()) if bounds.size else None)
