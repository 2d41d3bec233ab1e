"""DeepSeek-V2 and V3: multi-head latent attention (MLA) and mixture-of-experts layers.

The attention module owns its rotary embedding (plain or YaRN, on the decoupled rope
dims, in the layout transformers uses for the version) and hands the backend only the
latent, the rotated rope key and the query parts; the KV cache stores
kv_lora_rank + qk_rope_head_dim values per token and layer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from mrv2.attention.torch_mla import TorchMLAAttention
from mrv2.layers.linear import Linear
from mrv2.layers.moe import FusedMoE, MoEConfig
from mrv2.layers.norm import RMSNorm
from mrv2.layers.rotary import RopeConfig, RotaryEmbedding, hf_rotary_style, yarn_softmax_scale
from mrv2.models.decoder import MLP
from mrv2.models.weights import load_hf_weights
from mrv2.runner.kv_cache import KVCacheSpec, KVPart, LayerKVCache


@dataclass(frozen=True)
class DeepseekConfig:
    """DeepSeek-V2/V3 fields as transformers defines them."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    rotary_style: str
    max_position: int
    attention_bias: bool
    mlp_bias: bool
    tie_word_embeddings: bool
    first_k_dense_replace: int
    moe_layer_freq: int
    moe: MoEConfig | None

    @staticmethod
    def from_hf(c: Any) -> "DeepseekConfig":
        n_experts = getattr(c, "n_routed_experts", None)
        return DeepseekConfig(
            vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
            num_layers=c.num_hidden_layers, num_heads=c.num_attention_heads, q_lora_rank=c.q_lora_rank,
            kv_lora_rank=c.kv_lora_rank, qk_nope_head_dim=c.qk_nope_head_dim, qk_rope_head_dim=c.qk_rope_head_dim,
            v_head_dim=c.v_head_dim, rms_norm_eps=c.rms_norm_eps, rope=RopeConfig.from_hf(c),
            rotary_style=hf_rotary_style(c), max_position=c.max_position_embeddings,
            attention_bias=bool(getattr(c, "attention_bias", False)), mlp_bias=bool(getattr(c, "mlp_bias", False)),
            tie_word_embeddings=bool(getattr(c, "tie_word_embeddings", False)),
            first_k_dense_replace=getattr(c, "first_k_dense_replace", 0) or 0,
            moe_layer_freq=getattr(c, "moe_layer_freq", 1) or 1,
            moe=MoEConfig.from_hf(c) if n_experts else None,
        )

    def is_moe_layer(self, i: int) -> bool:
        return self.moe is not None and i >= self.first_k_dense_replace and i % self.moe_layer_freq == 0


class MLAAttention(nn.Module):
    """Multi-head latent attention; the backend sees latents, never full per-head keys in the cache."""

    def __init__(self, cfg: DeepseekConfig, backend: TorchMLAAttention, dtype: torch.dtype) -> None:
        super().__init__()
        self.cfg = cfg
        h, qk_dim = cfg.num_heads, cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
        if cfg.q_lora_rank is None:
            self.q_proj = Linear(cfg.hidden_size, [h * qk_dim], False, dtype)
        else:
            self.q_a_proj = Linear(cfg.hidden_size, [cfg.q_lora_rank], cfg.attention_bias, dtype)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps, dtype)
            self.q_b_proj = Linear(cfg.q_lora_rank, [h * qk_dim], False, dtype)
        self.kv_a_proj_with_mqa = Linear(cfg.hidden_size, [cfg.kv_lora_rank + cfg.qk_rope_head_dim],
                                         cfg.attention_bias, dtype)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, cfg.rms_norm_eps, dtype)
        self.kv_b_proj = Linear(cfg.kv_lora_rank, [h * (cfg.qk_nope_head_dim + cfg.v_head_dim)], False, dtype)
        self.o_proj = Linear(h * cfg.v_head_dim, [cfg.hidden_size], cfg.attention_bias, dtype)
        self.rotary = RotaryEmbedding(cfg.qk_rope_head_dim, cfg.max_position, cfg.rope, dtype, cfg.rotary_style)
        self.scale = yarn_softmax_scale(cfg.rope, qk_dim)
        self.backend = backend
        self.kv_cache: LayerKVCache | None = None

    def forward(self, positions: torch.Tensor, x: torch.Tensor, attn_metadata: Any) -> torch.Tensor:
        cfg, t, h = self.cfg, x.shape[0], self.cfg.num_heads
        if cfg.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q_nope, q_pe = q.view(t, h, -1).split([cfg.qk_nope_head_dim, cfg.qk_rope_head_dim], dim=-1)
        latent, k_pe = self.kv_a_proj_with_mqa(x).split([cfg.kv_lora_rank, cfg.qk_rope_head_dim], dim=-1)
        latent = self.kv_a_layernorm(latent.contiguous())
        pe = self.rotary(positions, torch.cat([q_pe, k_pe[:, None]], dim=1))  # one rotation for q and k
        q_pe, k_pe = pe[:, :h], pe[:, h]
        w_kv_b = self.kv_b_proj.weight.view(h, cfg.qk_nope_head_dim + cfg.v_head_dim, cfg.kv_lora_rank)
        out = self.backend.forward_mla(q_nope, q_pe, latent, k_pe, w_kv_b, self.kv_cache, attn_metadata, self.scale)
        return self.o_proj(out.reshape(t, -1))


class DeepseekLayer(nn.Module):
    """Pre-norm MLA + (dense MLP or MoE) block."""

    def __init__(self, cfg: DeepseekConfig, index: int, backend: TorchMLAAttention, dtype: torch.dtype) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.self_attn = MLAAttention(cfg, backend, dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.mlp = (FusedMoE(cfg.moe, dtype) if cfg.is_moe_layer(index)
                    else MLP(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias, dtype))

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None,
                attn_metadata: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(positions, x, attn_metadata)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class DeepseekForCausalLM(nn.Module):
    """DeepSeek-V2 / V3 causal LM."""

    def __init__(self, cfg: DeepseekConfig, backend: TorchMLAAttention, dtype: torch.dtype) -> None:
        super().__init__()
        self.config = cfg
        self.dtype = dtype
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
        self.embed_tokens.weight.requires_grad_(False)
        self.layers = nn.ModuleList(DeepseekLayer(cfg, i, backend, dtype) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        if cfg.tie_word_embeddings:
            self.lm_head_weight = self.embed_tokens.weight
        else:
            self.lm_head_weight = nn.Parameter(torch.empty(cfg.vocab_size, cfg.hidden_size, dtype=dtype),
                                               requires_grad=False)

    def kv_cache_specs(self) -> list[KVCacheSpec]:
        c = self.config
        spec = KVCacheSpec((KVPart("latent", 1, c.kv_lora_rank), KVPart("rope", 1, c.qk_rope_head_dim)), self.dtype)
        return [spec] * c.num_layers

    def attention_layers(self) -> list[MLAAttention]:
        return [layer.self_attn for layer in self.layers]

    def estimate_activation_bytes(self, num_tokens: int, num_logits: int) -> int:
        c = self.config
        heads = c.num_heads * (c.qk_nope_head_dim + c.qk_rope_head_dim + 2 * c.v_head_dim)
        ffn = max(c.intermediate_size, (c.moe.moe_intermediate_size * c.moe.num_experts_per_tok) if c.moe else 0)
        widths = 3 * c.hidden_size + heads + 3 * ffn
        return num_tokens * widths * self.dtype.itemsize + num_logits * c.vocab_size * 4

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn_metadata: Any) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        residual = None
        for layer in self.layers:
            x, residual = layer(positions, x, residual, attn_metadata)
        x, _ = self.norm(x, residual)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.lm_head_weight).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load HF-named tensors (experts per expert or stacked); multi-token-prediction layers are skipped."""
        n = self.config.num_layers
        weights = ((name, t) for name, t in weights if not _is_mtp_layer(name, n))
        load_hf_weights(self, weights, tied_lm_head=self.config.tie_word_embeddings)


def _is_mtp_layer(name: str, num_layers: int) -> bool:
    # DeepSeek-V3 checkpoints append next-token-prediction layers after the last decoder layer.
    parts = name.split(".")
    return len(parts) > 2 and parts[1] == "layers" and parts[2].isdigit() and int(parts[2]) >= num_layers
