"""Token embedding that may hold a GGUF-quantized table (which a tied LM head then shares)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mrv2.layers.quantization import QuantizedWeight


class VocabEmbedding(nn.Embedding):
    """nn.Embedding; with `quantized` set and no dense table, rows are dequantized as they are looked up."""

    def __init__(self, num_embeddings: int, embedding_dim: int, dtype: torch.dtype) -> None:
        super().__init__(num_embeddings, embedding_dim, dtype=dtype)
        self.weight.requires_grad_(False)
        self.dtype = dtype  # lookups' dtype, also once the dense table is dropped
        self.quantized: QuantizedWeight | None = None

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.weight is None:
            return self.quantized.dequantize(self.dtype, rows=input_ids)
        return F.embedding(input_ids, self.weight)

    def load_quantized(self, name: str, value: QuantizedWeight) -> bool:
        if name != "weight" or tuple(value.shape) != tuple(self.weight.shape):
            return False
        self.quantized = value
        return True

    def finalize_quantization(self, keep_dense: bool) -> None:
        """Dequantize into the dense table, or drop it (lookups then dequantize their rows)."""
        if self.quantized is None:
            return
        if keep_dense:
            self.weight.data.copy_(self.quantized.dequantize(torch.float32))
        else:
            self.weight = None
