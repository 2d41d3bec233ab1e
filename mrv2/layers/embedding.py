"""Token embedding that may hold a GGUF-quantized table (which a tied LM head then shares).

Under tensor parallelism each rank holds a contiguous slice of the vocabulary's rows; a
lookup embeds the ids in its slice, zeros the rest and sums over the ranks.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn

from mrv2.distributed.parallel import SINGLE, TensorParallel
from mrv2.layers.linear import TPSlice
from mrv2.layers.quantization import QuantizedWeight


class VocabEmbedding(nn.Embedding):
    """nn.Embedding; with `quantized` set and no dense table, rows are dequantized as they are looked up.

    Under `tp` the table holds this rank's vocabulary rows [`vocab_start`, `vocab_start` + rows).
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, dtype: torch.dtype,
                 tp: TensorParallel = SINGLE) -> None:
        self.vocab_start, rows = tp.split(num_embeddings, "vocabulary rows")
        super().__init__(rows, embedding_dim, dtype=dtype)
        self.weight.requires_grad_(False)
        self.tp = tp
        self.dtype = dtype  # lookups' dtype, also once the dense table is dropped
        self.quantized: QuantizedWeight | None = None

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return self._lookup(input_ids)
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.num_embeddings)
        x = self._lookup(local.masked_fill(outside, 0)).masked_fill_(outside[:, None], 0)
        return self.tp.all_reduce(x)

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        if self.weight is None:
            return self.quantized.dequantize(self.dtype, rows=ids)
        return F.embedding(ids, self.weight)

    def tp_slice(self, name: str, shard: int | None) -> TPSlice | None:
        """This rank's vocabulary rows of the checkpoint's table."""
        return (0, self.vocab_start, self.num_embeddings) if self.tp.size > 1 else None

    def load_quantized(self, name: str, value: QuantizedWeight) -> bool:
        if name != "weight" or tuple(value.shape) != tuple(self.weight.shape):
            return False
        self.quantized = value
        return True

    def finalize_quantization(self, keep_dense: bool) -> None:
        """Dequantize into the dense table, or drop it (lookups then dequantize their rows)."""
        if self.quantized is None:
            return
        q = self.quantized
        if keep_dense:
            self.weight.data.copy_(q.dequantize(torch.float32))
        else:
            self.weight = None
            # Scales in fp32 for lookups: compiled code then mixes no fp16 into the model's bf16 (a few MiB).
            self.quantized = replace(q, scales=q.scales.float(), mins=None if q.mins is None else q.mins.float())
