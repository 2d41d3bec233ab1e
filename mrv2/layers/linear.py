"""Linear layers whose weights may be loaded as several stacked shards (fused QKV, gate/up)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Linear(nn.Module):
    """y = x W^T (+ b). `shard_sizes` names the row blocks of a fused weight."""

    def __init__(self, in_features: int, shard_sizes: list[int], bias: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.shard_sizes = shard_sizes
        out_features = sum(shard_sizes)
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def load_shard(self, param: nn.Parameter, shard: int, value: torch.Tensor) -> None:
        start = sum(self.shard_sizes[:shard])
        rows = param.data[start:start + self.shard_sizes[shard]]
        if rows.shape != value.shape:
            raise ValueError(f"shard {shard} of a {tuple(param.shape)} weight expects {tuple(rows.shape)}, "
                             f"got {tuple(value.shape)}")
        rows.copy_(value)
