"""DeepSeek-V2 and V3: multi-head latent attention (MLA) and mixture-of-experts layers.

All attention modules share one rotary embedding (plain or YaRN, on the decoupled rope
dims, in the layout transformers uses for the version; its cache covers the positions
the model is built for) and hand the backend only the
latent, the rotated rope key and the query parts; the KV cache stores
kv_lora_rank + qk_rope_head_dim values per token and layer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

import torch
from torch import nn

from mrv2.distributed.parallel import SINGLE, TensorParallel
from mrv2.attention.torch_mla import TorchMLAAttention
from mrv2.kv_spec import KVCacheSpec, KVPart, LayerKVCache
from mrv2.layers.linear import Linear
from mrv2.layers.mlp import GatedMLP
from mrv2.layers.moe import FusedMoE, MoEConfig
from mrv2.layers.norm import RMSNorm
from mrv2.layers.rotary import RopeConfig, RotaryEmbedding, hf_rotary_style, yarn_softmax_scale
from mrv2.models.base import CausalLM, PreNormBlock


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
    max_position: int  # positions the rotary cache covers (build_model: max_model_len)
    attention_bias: bool
    mlp_bias: bool
    hidden_act: str
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
            hidden_act=getattr(c, "hidden_act", "silu"),
            tie_word_embeddings=bool(getattr(c, "tie_word_embeddings", False)),
            first_k_dense_replace=getattr(c, "first_k_dense_replace", 0) or 0,
            moe_layer_freq=getattr(c, "moe_layer_freq", 1) or 1,
            moe=MoEConfig.from_hf(c) if n_experts else None,
        )

    def is_moe_layer(self, i: int) -> bool:
        return self.moe is not None and i >= self.first_k_dense_replace and i % self.moe_layer_freq == 0


class MLAAttention(nn.Module):
    """Multi-head latent attention; the backend sees latents, never full per-head keys in the cache.

    Under tensor parallelism each rank holds num_heads / tp heads (their query, kv_b and output
    slices); the latent projections and the latent cache are whole on every rank.
    """

    def __init__(self, cfg: DeepseekConfig, backend: TorchMLAAttention, rotary: RotaryEmbedding,
                 dtype: torch.dtype, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.cfg = cfg
        h, qk_dim = cfg.num_heads, cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
        first, self.num_heads = tp.split(h, "attention heads")
        heads = dict(tp=tp, parallel="column")
        if cfg.q_lora_rank is None:
            self.q_proj = Linear(cfg.hidden_size, [h * qk_dim], False, dtype,
                                 parts=[(first * qk_dim, self.num_heads * qk_dim)], **heads)
        else:
            self.q_a_proj = Linear(cfg.hidden_size, [cfg.q_lora_rank], cfg.attention_bias, dtype)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps, dtype)
            self.q_b_proj = Linear(cfg.q_lora_rank, [h * qk_dim], False, dtype,
                                   parts=[(first * qk_dim, self.num_heads * qk_dim)], **heads)
        self.kv_a_proj_with_mqa = Linear(cfg.hidden_size, [cfg.kv_lora_rank + cfg.qk_rope_head_dim],
                                         cfg.attention_bias, dtype)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, cfg.rms_norm_eps, dtype)
        kv_b_dim = cfg.qk_nope_head_dim + cfg.v_head_dim
        self.kv_b_proj = Linear(cfg.kv_lora_rank, [h * kv_b_dim], False, dtype,
                                packable=False, parts=[(first * kv_b_dim, self.num_heads * kv_b_dim)],
                                **heads)  # `attend` reads its weight
        self.o_proj = Linear(h * cfg.v_head_dim, [cfg.hidden_size], cfg.attention_bias, dtype, tp=tp, parallel="row")
        self.rotary = rotary
        self.scale = yarn_softmax_scale(cfg.rope, qk_dim)
        self.backend = backend
        self.kv_cache: LayerKVCache | None = None

    def project(self, positions: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Query parts q_nope [T, H, nope] and rotated q_pe [T, H, rope]; latent [T, kv_lora]; rotated k_pe [T, rope]."""
        cfg, t, h = self.cfg, x.shape[0], self.num_heads
        if cfg.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q_nope, q_pe = q.view(t, h, -1).split([cfg.qk_nope_head_dim, cfg.qk_rope_head_dim], dim=-1)
        latent, k_pe = self.kv_a_proj_with_mqa(x).split([cfg.kv_lora_rank, cfg.qk_rope_head_dim], dim=-1)
        latent = self.kv_a_layernorm(latent.contiguous())
        pe = self.rotary(positions, torch.cat([q_pe, k_pe[:, None]], dim=1))  # one rotation for q and k
        q_pe, k_pe = pe[:, :h], pe[:, h]
        return q_nope, q_pe, latent, k_pe

    def attend(self, inputs: tuple[torch.Tensor, ...], attn_metadata: Any) -> torch.Tensor:
        cfg = self.cfg
        w_kv_b = self.kv_b_proj.weight.view(self.num_heads, cfg.qk_nope_head_dim + cfg.v_head_dim, cfg.kv_lora_rank)
        return self.backend.forward_mla(*inputs, w_kv_b, self.kv_cache, attn_metadata, self.scale)

    def output(self, attn_out: torch.Tensor) -> torch.Tensor:
        return self.o_proj(attn_out.reshape(attn_out.shape[0], -1))

    def warm_up(self) -> None:
        self.backend.warm_up(self.num_heads, self.scale, self.kv_cache)


class DeepseekForCausalLM(CausalLM):
    """DeepSeek-V2 / V3 causal LM: MLA in every block, dense MLP or MoE after it."""

    def __init__(self, cfg: DeepseekConfig, backend: TorchMLAAttention, dtype: torch.dtype,
                 tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.config = cfg
        rotary = RotaryEmbedding(cfg.qk_rope_head_dim, cfg.max_position, cfg.rope, dtype, cfg.rotary_style)
        self._build([PreNormBlock(cfg.hidden_size, cfg.rms_norm_eps, MLAAttention(cfg, backend, rotary, dtype, tp),
                                  FusedMoE(cfg.moe, dtype, tp) if cfg.is_moe_layer(i) else
                                  GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias, dtype, cfg.hidden_act,
                                           tp),
                                  dtype) for i in range(cfg.num_layers)], dtype, tp)

    def kv_cache_specs(self) -> list[KVCacheSpec]:
        c = self.config
        spec = KVCacheSpec((KVPart("latent", 1, c.kv_lora_rank), KVPart("rope", 1, c.qk_rope_head_dim)), self.dtype)
        return [spec] * c.num_layers

    def estimate_activation_bytes(self, num_tokens: int, num_logits: int) -> int:
        c = self.config
        heads = c.num_heads * (c.qk_nope_head_dim + c.qk_rope_head_dim + 2 * c.v_head_dim)
        ffn = max(c.intermediate_size, (c.moe.moe_intermediate_size * c.moe.num_experts_per_tok) if c.moe else 0)
        widths = 3 * c.hidden_size + heads + 3 * ffn
        return num_tokens * widths * self.dtype.itemsize + num_logits * c.vocab_size * 4

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """As CausalLM's, skipping DeepSeek-V3's multi-token-prediction layers."""
        n = self.config.num_layers
        super().load_weights((name, t) for name, t in weights if not _is_mtp_layer(name, n))


def _is_mtp_layer(name: str, num_layers: int) -> bool:
    # DeepSeek-V3 checkpoints append next-token-prediction layers after the last decoder layer.
    parts = name.split(".")
    return len(parts) > 2 and parts[1] == "layers" and parts[2].isdigit() and int(parts[2]) >= num_layers
