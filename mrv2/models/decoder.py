"""One decoder-only transformer for the Llama family, Mistral, Qwen2 and Qwen3.

The architectures differ only in switches read from the HF config: QKV bias
(Qwen2), per-head q/k RMSNorm (Qwen3), explicit head_dim, tied embeddings and
RoPE scaling. Weights are loaded from HF tensor names into fused QKV and
gate/up projections.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from mrv2.attention.backend import AttentionBackend
from mrv2.distributed.parallel import SINGLE, TensorParallel
from mrv2.kv_spec import KVCacheSpec, LayerKVCache
from mrv2.layers.linear import Linear
from mrv2.layers.mlp import GatedMLP
from mrv2.layers.norm import RMSNorm
from mrv2.layers.rotary import RopeConfig, RotaryEmbedding
from mrv2.models.base import CausalLM, PreNormBlock


@dataclass(frozen=True)
class DecoderConfig:
    """The per-architecture switches of the decoder, resolved from an HF config."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    max_position: int  # positions the rotary cache covers (build_model: max_model_len)
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    hidden_act: str
    qk_norm: bool
    tie_word_embeddings: bool

    @staticmethod
    def from_hf(c: Any) -> "DecoderConfig":
        arch = (getattr(c, "architectures", None) or [""])[0]
        attention_bias = bool(getattr(c, "attention_bias", False))
        is_qwen2 = c.model_type == "qwen2"
        return DecoderConfig(
            vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
            num_layers=c.num_hidden_layers, num_heads=c.num_attention_heads,
            num_kv_heads=getattr(c, "num_key_value_heads", None) or c.num_attention_heads,
            head_dim=getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads,
            rms_norm_eps=c.rms_norm_eps, rope=RopeConfig.from_hf(c), max_position=c.max_position_embeddings,
            qkv_bias=is_qwen2 or attention_bias, o_bias=attention_bias and not is_qwen2,
            mlp_bias=bool(getattr(c, "mlp_bias", False)),
            hidden_act=getattr(c, "hidden_act", "silu"), qk_norm=arch == "Qwen3ForCausalLM",
            tie_word_embeddings=bool(getattr(c, "tie_word_embeddings", False)),
        )


class Attention(nn.Module):
    """Self-attention over the paged KV cache, through the attention backend.

    Under tensor parallelism each rank holds whole GQA groups: its KV heads and their query
    heads (see `TensorParallel.split_heads`; a KV head is replicated where there are fewer
    KV heads than ranks).
    """

    hf_fused = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2)}

    def __init__(self, cfg: DecoderConfig, backend: AttentionBackend, rotary: RotaryEmbedding,
                 dtype: torch.dtype, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        d = cfg.head_dim
        (q_first, self.num_heads), (kv_first, self.num_kv_heads) = tp.split_heads(cfg.num_heads, cfg.num_kv_heads)
        self.head_dim = d
        q_size, kv_size = cfg.num_heads * d, cfg.num_kv_heads * d
        q_part, kv_part = (q_first * d, self.num_heads * d), (kv_first * d, self.num_kv_heads * d)
        self.qkv_proj = Linear(cfg.hidden_size, [q_size, kv_size, kv_size], cfg.qkv_bias, dtype,
                               tp=tp, parallel="column", parts=[q_part, kv_part, kv_part])
        self.o_proj = Linear(q_size, [cfg.hidden_size], cfg.o_bias, dtype, tp=tp, parallel="row", parts=[q_part])
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype) if cfg.qk_norm else None
        self.rotary = rotary
        self.backend = backend
        self.scale = cfg.head_dim ** -0.5
        self.kv_cache: LayerKVCache | None = None

    def project(self, positions: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rotated queries [T, H, D] and keys [T, Hkv, D], values [T, Hkv, D]."""
        t, h, hkv = x.shape[0], self.num_heads, self.num_kv_heads
        qkv = self.qkv_proj(x).view(t, h + 2 * hkv, self.head_dim)
        qk, v = qkv[:, :h + hkv], qkv[:, h + hkv:]
        if self.q_norm is not None:
            qk = torch.cat([self.q_norm(qk[:, :h]), self.k_norm(qk[:, h:])], dim=1)
        q, k = self.rotary(positions, qk).split([h, hkv], dim=1)  # one rotation for queries and keys
        return q, k, v

    def attend(self, inputs: tuple[torch.Tensor, ...], attn_metadata: Any) -> torch.Tensor:
        return self.backend.forward(*inputs, self.kv_cache, attn_metadata, self.scale)

    def warm_up(self) -> None:
        self.backend.warm_up(self.num_heads, self.scale, self.kv_cache)

    def output(self, attn_out: torch.Tensor) -> torch.Tensor:
        return self.o_proj(attn_out.reshape(attn_out.shape[0], -1))


class DecoderForCausalLM(CausalLM):
    """Llama-family decoder: GQA attention + gated MLP in every block."""

    def __init__(self, cfg: DecoderConfig, backend: AttentionBackend, dtype: torch.dtype,
                 tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.config = cfg
        rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position, cfg.rope, dtype)
        self._build([PreNormBlock(cfg.hidden_size, cfg.rms_norm_eps, Attention(cfg, backend, rotary, dtype, tp),
                                  GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias, dtype, cfg.hidden_act,
                                           tp),
                                  dtype) for _ in range(cfg.num_layers)], dtype, tp)

    def kv_cache_specs(self) -> list[KVCacheSpec]:
        attn = self.layers[0].self_attn  # this rank's KV heads
        return [KVCacheSpec.gqa(attn.num_kv_heads, attn.head_dim, attn.head_dim, self.dtype)] * self.config.num_layers

    def estimate_activation_bytes(self, num_tokens: int, num_logits: int) -> int:
        c = self.config
        widths = 3 * c.hidden_size + 2 * (c.num_heads + c.num_kv_heads) * c.head_dim + 3 * c.intermediate_size
        return num_tokens * widths * self.dtype.itemsize + num_logits * c.vocab_size * 4
