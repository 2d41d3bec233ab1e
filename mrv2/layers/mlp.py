"""Gated feed-forward (SwiGLU and kin) with a fused gate/up projection."""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from mrv2.distributed.parallel import SINGLE, TensorParallel
from mrv2.layers.linear import Linear

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu, "gelu": F.gelu, "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}


class GatedMLP(nn.Module):
    """down(act(x W_gate) * (x W_up)); HF's gate_proj/up_proj load as shards of `gate_up_proj`.

    Under tensor parallelism gate/up split the intermediate features and down sums the ranks' parts."""

    hf_fused = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool, dtype: torch.dtype,
                 act: str = "silu", tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        if act not in ACTIVATIONS:
            raise ValueError(f"hidden_act {act!r} is not supported (supported: {', '.join(ACTIVATIONS)})")
        self.act = ACTIVATIONS[act]
        self.gate_up_proj = Linear(hidden_size, [intermediate_size] * 2, bias, dtype, tp=tp, parallel="column")
        self.down_proj = Linear(intermediate_size, [hidden_size], bias, dtype, tp=tp, parallel="row")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # SwiGLU in the gate/up kernel where it has one for this batch: no [tokens, 2 x intermediate] round trip.
        fused = self.gate_up_proj.silu_and_mul(x) if self.act is F.silu else None
        if fused is not None:
            return self.down_proj(fused)
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(self.act(gate) * up)
