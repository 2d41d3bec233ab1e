"""Rotary position embeddings that own their cos/sin cache.

The cache is built once for every position up to `max_position` and gathered by
`positions` inside the forward, so no caller ever prepares cos/sin per step.
Frequencies and the YaRN cos/sin multiplier follow transformers' `modeling_rope_utils`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
# neox: rotate-half over [x[:d/2], x[d/2:]] (Llama; DeepSeek-V3 with rope_interleave=False).
# interleaved: pairs (x0,x1),(x2,x3).. rotated, output stays interleaved (DeepSeek-V2 `apply_rotary_emb`).
# interleaved_to_neox: same pairs, output laid out as cat(even, odd) (DeepSeek-V3 `apply_rotary_pos_emb_interleave`).
ROTARY_STYLES = ("neox", "interleaved", "interleaved_to_neox")


def _yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


@dataclass(frozen=True)
class RopeConfig:
    """Rotary parameters as HF configs spell them (`rope_parameters` / `rope_scaling`).

    Optional YaRN fields keep HF's `None` so its fallbacks (`beta_fast or 32`, `mscale and mscale_all_dim`,
    attention_factor inferred from mscales) apply exactly as in transformers.
    """

    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int | None = None
    attention_factor: float | None = None
    beta_fast: float | None = None
    beta_slow: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True

    @staticmethod
    def from_hf(hf_config: Any) -> "RopeConfig":
        params = dict(getattr(hf_config, "rope_parameters", None) or {})
        params.update(getattr(hf_config, "rope_scaling", None) or {})  # legacy configs; an alias of the above in 5.x
        theta = params.get("rope_theta", getattr(hf_config, "rope_theta", None) or 10000.0)
        rope_type = params.get("rope_type", params.get("type", "default")) or "default"
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(f"rope_type {rope_type!r} is not supported (supported: {', '.join(SUPPORTED_ROPE_TYPES)})")
        max_pos = getattr(hf_config, "max_position_embeddings", None)
        orig = params.get("original_max_position_embeddings")
        if rope_type in ("llama3", "yarn"):  # HF's standardize_rope_params: a top-level value (Phi3) wins
            orig = getattr(hf_config, "original_max_position_embeddings", None) or orig or max_pos
        factor = params.get("factor")
        if factor is None:  # YaRN derives it from the context extension (DeepSeek-V3 note in HF)
            factor = max_pos / orig if rope_type == "yarn" else 1.0

        def opt(key: str) -> float | None:
            return None if params.get(key) is None else float(params[key])

        return RopeConfig(
            theta=float(theta), rope_type=rope_type, factor=float(factor),
            low_freq_factor=float(params.get("low_freq_factor", 1.0)),
            high_freq_factor=float(params.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=orig, attention_factor=opt("attention_factor"),
            beta_fast=opt("beta_fast"), beta_slow=opt("beta_slow"), mscale=opt("mscale"),
            mscale_all_dim=opt("mscale_all_dim"), truncate=bool(params.get("truncate", True)),
        )

    def attention_scaling(self) -> float:
        """The multiplier HF folds into cos/sin (YaRN's attention_factor; 1.0 for the other types)."""
        if self.rope_type != "yarn":
            return 1.0
        if self.attention_factor is not None:
            return self.attention_factor
        if self.mscale and self.mscale_all_dim:
            return float(_yarn_get_mscale(self.factor, self.mscale) / _yarn_get_mscale(self.factor, self.mscale_all_dim))
        return _yarn_get_mscale(self.factor)

    def inv_freq(self, rotary_dim: int) -> torch.Tensor:
        inv_freq = 1.0 / (self.theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim))
        if self.rope_type == "linear":
            return inv_freq / self.factor
        if self.rope_type == "llama3":
            old_len = self.original_max_position_embeddings
            low_wavelen = old_len / self.low_freq_factor
            high_wavelen = old_len / self.high_freq_factor
            wavelen = 2 * math.pi / inv_freq
            scaled = torch.where(wavelen > low_wavelen, inv_freq / self.factor, inv_freq)
            smooth = (old_len / wavelen - self.low_freq_factor) / (self.high_freq_factor - self.low_freq_factor)
            smoothed = (1 - smooth) * scaled / self.factor + smooth * scaled
            is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
            return torch.where(is_medium, smoothed, scaled)
        if self.rope_type == "yarn":
            return self._yarn_inv_freq(rotary_dim)
        return inv_freq

    def _yarn_inv_freq(self, dim: int) -> torch.Tensor:
        # Same operations in the same order as HF `_compute_yarn_parameters`, so the result is bit-identical.
        base, orig = self.theta, self.original_max_position_embeddings
        beta_fast, beta_slow = self.beta_fast or 32, self.beta_slow or 1

        def correction_dim(num_rotations: float) -> float:
            return (dim * math.log(orig / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

        low, high = correction_dim(beta_fast), correction_dim(beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001  # HF: prevent singularity
        ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
        pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
        extrapolation = 1 - ramp
        return (1.0 / (self.factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


def yarn_softmax_scale(rope: RopeConfig, head_dim: int) -> float:
    """DeepSeek's softmax scale (HF `yarn_apply_mscale`): head_dim**-0.5 * mscale(factor, mscale_all_dim)**2.

    `head_dim` is the full q/k head dim (DeepSeek: qk_nope_head_dim + qk_rope_head_dim).
    """
    scale = head_dim ** -0.5
    if rope.rope_type != "default" and rope.mscale_all_dim:
        mscale = _yarn_get_mscale(rope.factor, rope.mscale_all_dim)
        scale = scale * mscale * mscale
    return scale


def hf_rotary_style(hf_config: Any) -> str:
    """The rotary layout transformers uses for this config's q/k (see ROTARY_STYLES)."""
    model_type = getattr(hf_config, "model_type", "")
    if model_type == "deepseek_v2":
        return "interleaved"
    if model_type == "deepseek_v3":
        return "interleaved_to_neox" if getattr(hf_config, "rope_interleave", True) else "neox"
    return "neox"


class RotaryEmbedding(nn.Module):
    """RoPE over the first `rotary_dim` dims of each head, in one of ROTARY_STYLES (default neox).

    "interleaved" mirrors DeepSeek-V2's complex-number path, which rotates in fp32 whatever the input dtype, so its
    cache stays fp32 and results are cast back; the other styles rotate in the cache dtype, as HF does.
    """

    def __init__(self, rotary_dim: int, max_position: int, rope: RopeConfig, dtype: torch.dtype,
                 style: str = "neox") -> None:
        super().__init__()
        if style not in ROTARY_STYLES:
            raise ValueError(f"rotary style {style!r} is not one of {ROTARY_STYLES}")
        self.rotary_dim, self.style = rotary_dim, style
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), rope.inv_freq(rotary_dim))
        scaling = rope.attention_scaling()
        cache = torch.cat([freqs.cos() * scaling, freqs.sin() * scaling], dim=-1)
        self.register_buffer("cos_sin_cache", cache if style == "interleaved" else cache.to(dtype), persistent=False)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Rotate x [tokens, heads, head_dim] (queries and keys may share one call)."""
        cos, sin = self.cos_sin_cache.index_select(0, positions).unsqueeze(1).chunk(2, dim=-1)
        d = self.rotary_dim
        if self.style == "neox":
            x1, x2 = x[..., :d // 2], x[..., d // 2:d]
        else:
            x1, x2 = x[..., 0:d:2], x[..., 1:d:2]
            if self.style == "interleaved":
                x1, x2 = x1.float(), x2.float()
        o1, o2 = x1 * cos - x2 * sin, x2 * cos + x1 * sin
        if self.style == "interleaved":
            rotated = torch.stack([o1, o2], dim=-1).flatten(-2).to(x.dtype)
        else:
            rotated = torch.cat([o1, o2], dim=-1)
        if d == x.shape[-1]:
            return rotated
        return torch.cat([rotated, x[..., d:]], dim=-1)
