"""KV-cache spec types: what a layer stores per token, and the views it reads.

A leaf module (torch and stdlib only) so that attention backends, models and the
runner's allocator all import the same types without importing each other:
models declare `KVCacheSpec`s, the allocator (`mrv2.runner.kv_cache`) cuts one
`LayerKVCache` per spec, attention reads and writes through it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

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
    `raw` is the byte allocation every layer's views are cut from, and `placement` says
    where each part lies in it (`placement_in`): kernels that write the cache inside a
    compiled graph take those, since torch.compile cannot trace writes to graph inputs that
    alias one another, as the layers' views do.
    """

    parts: dict[str, torch.Tensor]
    joint: torch.Tensor | None = None
    raw: torch.Tensor | None = None
    placement: dict[str, list[int]] = field(default_factory=dict)

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.parts[name]


def placement_in(raw: torch.Tensor, view: torch.Tensor) -> list[int]:
    """Where a [num_blocks, block_size, heads, dim] view (dim contiguous) lies in the byte tensor `raw`:
    [byte offset, its 4 sizes, its first 3 strides in elements]."""
    if view.dim() != 4 or view.stride(3) != 1:
        raise ValueError(f"a cache view must be 4-d with a contiguous last dim, got {tuple(view.shape)} "
                         f"strides {view.stride()}")
    offset = view.data_ptr() - raw.data_ptr()
    if not 0 <= offset <= raw.numel() - view.element_size():
        raise ValueError("the view does not lie in this allocation")
    return [offset, *view.shape, *view.stride()[:3]]


@dataclass(frozen=True)
class KVPartRegion:
    """Where one part (K, V, MLA latent or rope key) of one layer lies in the raw allocation.

    Token t of block b occupies `token_bytes` contiguous bytes at
    base + offset + b * block_stride + t * token_stride.
    """

    layer: int
    part: str
    offset: int
    block_stride: int
    token_stride: int
    token_bytes: int


@dataclass(frozen=True)
class KVRegions:
    """The KV cache as a transfer engine registers it: one region [base, base + size), aligned to
    `alignment` bytes, and every layer's parts inside it (see `KVPartRegion`)."""

    base: int
    size: int
    alignment: int
    num_blocks: int
    block_size: int
    parts: tuple[KVPartRegion, ...]

    def block_bytes(self, block: int) -> list[tuple[int, int]]:
        """(address, length) spans holding block `block` of every layer and part."""
        spans = []
        for p in self.parts:
            start = self.base + p.offset + block * p.block_stride
            if p.token_stride == p.token_bytes:  # the block's tokens are contiguous
                spans.append((start, self.block_size * p.token_bytes))
            else:
                spans.extend((start + t * p.token_stride, p.token_bytes) for t in range(self.block_size))
        return spans
