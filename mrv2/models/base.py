"""The skeleton every mrv2 causal LM shares: pre-norm blocks between embeddings and LM head.

A model provides its attention and feed-forward modules and its KV-cache spec; the
embedding, residual stream, final norm, LM head and weight loading are here once.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from mrv2.layers.norm import RMSNorm
from mrv2.models.weights import load_hf_weights
from mrv2.runner.kv_cache import KVCacheSpec


class PreNormBlock(nn.Module):
    """x + attn(norm(x)), then + mlp(norm(.)), with the residual add fused into the norms."""

    def __init__(self, hidden_size: int, eps: float, self_attn: nn.Module, mlp: nn.Module,
                 dtype: torch.dtype) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(hidden_size, eps, dtype)
        self.self_attn = self_attn
        self.post_attention_layernorm = RMSNorm(hidden_size, eps, dtype)
        self.mlp = mlp

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None,
                attn_metadata: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(positions, x, attn_metadata)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class CausalLM(nn.Module):
    """Embeddings -> PreNormBlocks -> final norm -> LM head (tied or not).

    Subclasses set `config` (with vocab_size, hidden_size, rms_norm_eps,
    tie_word_embeddings) and call `_build` with their blocks, then implement
    `kv_cache_specs` and `estimate_activation_bytes`.
    """

    config: Any

    def _build(self, blocks: list[PreNormBlock], dtype: torch.dtype) -> None:
        c = self.config
        self.dtype = dtype
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size, dtype=dtype)
        self.embed_tokens.weight.requires_grad_(False)
        self.layers = nn.ModuleList(blocks)
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype)
        if c.tie_word_embeddings:
            self.lm_head_weight = self.embed_tokens.weight
        else:
            self.lm_head_weight = nn.Parameter(torch.empty(c.vocab_size, c.hidden_size, dtype=dtype),
                                               requires_grad=False)

    def kv_cache_specs(self) -> list[KVCacheSpec]:
        raise NotImplementedError

    def estimate_activation_bytes(self, num_tokens: int, num_logits: int) -> int:
        """Live activations of one step, from shapes (for platforms without peak statistics)."""
        raise NotImplementedError

    def attention_layers(self) -> list[nn.Module]:
        """The modules the runner binds KV-cache views to (`.kv_cache`), one per cache spec."""
        return [layer.self_attn for layer in self.layers]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn_metadata: Any) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        residual = None
        for layer in self.layers:
            x, residual = layer(positions, x, residual, attn_metadata)
        x, _ = self.norm(x, residual)
        return x

    def compute_logits(self, hidden: torch.Tensor, chunk_rows: int | None = None) -> torch.Tensor:
        """fp32 logits [rows, vocab]; `chunk_rows` splits the LM head by vocabulary rows (see Platform)."""
        if chunk_rows is None or chunk_rows >= self.lm_head_weight.shape[0]:
            return F.linear(hidden, self.lm_head_weight).float()
        out = hidden.new_empty(hidden.shape[0], self.lm_head_weight.shape[0])
        for start in range(0, out.shape[1], chunk_rows):
            w = self.lm_head_weight[start:start + chunk_rows]
            torch.mm(hidden, w.t(), out=out[:, start:start + w.shape[0]])
        return out.float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load HF-named tensors; raise if any parameter is left unset or a name is unknown."""
        load_hf_weights(self, weights, tied_lm_head=self.config.tie_word_embeddings)
