"""The interface of a draft head: a small model that proposes tokens from the target's features.

Eagle, Eagle-3 and DeepSeek's multi-token prediction (MTP) read, at position i,
the token at i + 1 and the target's features at i, and predict the token at i + 2.
The first draft pass takes the target's features; every later pass takes the
features the head itself returned for the previous draft. A head has its own KV
cache layers, cut from the target's blocks (same block ids, same slots).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Protocol

import torch
from torch import nn

from mrv2.kv_spec import KVCacheSpec


class DraftHead(Protocol):
    """What the drafter needs from a head (see the module docstring)."""

    # Width of the target features the first pass takes (hidden size, or 3x for Eagle-3).
    feature_size: int
    # Width of the features the head returns for its next pass (its hidden size; 0: none).
    next_feature_size: int
    # Target layers whose inputs (hidden + residual) are concatenated into the features;
    # () means the target's final, normed hidden states.
    aux_layer_ids: tuple[int, ...]

    def bind_target(self, target: nn.Module) -> None:
        """Share what the head's checkpoint lacks (token embedding, LM head) with the target model."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load the head from its published checkpoint names; raise on unknown or missing ones."""

    def pack_linear_weights(self, rows_hint: int) -> int:
        """Prepack the head's own dense linear weights for oneDNN, as the target's; how many were."""

    def kv_cache_specs(self) -> list[KVCacheSpec]: ...

    def attention_layers(self) -> list[nn.Module]: ...

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, features: torch.Tensor,
                attn_metadata: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden states for `compute_logits`, features for the next draft pass), both [tokens, ...]."""

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits over the *target's* vocabulary [rows, target vocab] (-inf where the head has no token)."""
