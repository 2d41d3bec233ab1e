"""KV-cache spec types: what a layer stores per token, and the views it reads.

A leaf module (torch and stdlib only) so that attention backends, models and the
runner's allocator all import the same types without importing each other:
models declare `KVCacheSpec`s, the allocator (`mrv2.runner.kv_cache`) cuts one
`LayerKVCache` per spec, attention reads and writes through it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVPart:
    """One per-token component of a layer's cache, e.g. K or V."""

    name: str
    num_heads: int
    head_dim: int

    @property
    def width(self) -> int:
        return self.num_heads * self.head_dim


@dataclass(frozen=True)
class KVCacheSpec:
    """What one attention layer stores per token."""

    parts: tuple[KVPart, ...]
    dtype: torch.dtype

    @staticmethod
    def gqa(num_kv_heads: int, head_dim: int, v_head_dim: int, dtype: torch.dtype) -> "KVCacheSpec":
        return KVCacheSpec((KVPart("k", num_kv_heads, head_dim), KVPart("v", num_kv_heads, v_head_dim)), dtype)

    @property
    def width(self) -> int:
        """Elements per token, all parts together."""
        return sum(p.width for p in self.parts)

    @property
    def bytes_per_token(self) -> int:
        return self.width * self.dtype.itemsize


@dataclass
class LayerKVCache:
    """One layer's cache views, keyed by part name; each is [num_blocks, block_size, heads, dim].

    With the joint layout, `joint` is the whole [num_blocks, block_size, width] tensor the
    parts are column slices of: gathering from it is contiguous, gathering a part is not.
    """

    parts: dict[str, torch.Tensor]
    joint: torch.Tensor | None = None

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.parts[name]
