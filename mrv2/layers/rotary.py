"""Rotary position embeddings that own their cos/sin cache.

The cache is built once for every position up to `max_position` and gathered by
`positions` inside the forward, so no caller ever prepares cos/sin per step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


@dataclass(frozen=True)
class RopeConfig:
    """Rotary parameters as HF configs spell them (`rope_parameters` / `rope_scaling`)."""

    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int | None = None

    @staticmethod
    def from_hf(hf_config: Any) -> "RopeConfig":
        params = dict(getattr(hf_config, "rope_parameters", None) or {})
        params.update(getattr(hf_config, "rope_scaling", None) or {})
        theta = params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
        rope_type = params.get("rope_type", params.get("type", "default")) or "default"
        if rope_type not in ("default", "linear", "llama3"):
            raise ValueError(f"rope_type {rope_type!r} is not supported (supported: default, linear, llama3)")
        return RopeConfig(
            theta=float(theta), rope_type=rope_type, factor=float(params.get("factor", 1.0)),
            low_freq_factor=float(params.get("low_freq_factor", 1.0)),
            high_freq_factor=float(params.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=params.get("original_max_position_embeddings"),
        )

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
        return inv_freq


class RotaryEmbedding(nn.Module):
    """Neox-style (rotate-half) RoPE over the first `rotary_dim` dims of each head."""

    def __init__(self, rotary_dim: int, max_position: int, rope: RopeConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.rotary_dim = rotary_dim
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), rope.inv_freq(rotary_dim))
        cache = torch.cat([freqs.cos(), freqs.sin()], dim=-1).to(dtype)
        self.register_buffer("cos_sin_cache", cache, persistent=False)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Rotate x [tokens, heads, head_dim] (queries and keys may share one call)."""
        cos, sin = self.cos_sin_cache.index_select(0, positions).unsqueeze(1).chunk(2, dim=-1)
        half = self.rotary_dim // 2
        x1, x2 = x[..., :half], x[..., half:self.rotary_dim]
        rotated = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
        if self.rotary_dim == x.shape[-1]:
            return rotated
        return torch.cat([rotated, x[..., self.rotary_dim:]], dim=-1)
