"""Structured output's token bitmask: a logit whose bit is 0 becomes -inf (before every other filter).

The host fills one row of int32 words per logits row (bit j of word w allows token 32 w + j;
rows of unconstrained requests are all ones); here it is unpacked on the logits' device.
"""

from __future__ import annotations

import torch

_NEG_INF = float("-inf")


def apply_grammar_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Mask, in place, the tokens each row's bitmask [rows, ceil(V / 32)] int32 disallows."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    allowed = ((bitmask[:, :, None] >> shifts) & 1).bool().flatten(1)[:, :logits.shape[1]]
    return logits.masked_fill_(~allowed, _NEG_INF)
