"""Linear layers whose weights may be loaded as several stacked shards (fused QKV, gate/up).

A shard may arrive quantized (`QuantizedWeight`, from a GGUF file); once every weight
is loaded, `finalize_quantization` decides how the layer runs it: through the int4
kernel for small batches (with a dense copy for larger ones when the budget allows;
shards of different types each on their own kernel), or dequantized. Dense float32
weights may run small batches on the platform's own GEMV (`use_dense_gemv`), larger
ones through oneDNN or torch, as its policy says.

Under tensor parallelism (`tp`, see `mrv2.distributed.parallel`) a linear holds a slice:
"column" layers hold part of every shard's output rows and need no communication; "row"
layers hold part of the input features and sum the ranks' partial outputs. The parts are
even splits unless the model names them (`parts`: attention heads split by KV groups).
`tp_slice` tells the loader which part of a checkpoint tensor to read.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mrv2.config import DenseGemvPolicy, QuantPolicy
from mrv2.distributed.parallel import SINGLE, TensorParallel
from mrv2.layers.batch_invariant import tiled_linear
from mrv2.layers.packed import PACKED_DTYPES, PackedWeight, onednn_linear
from mrv2.layers.quantization import BlockGemv, QuantizedMatmul, QuantizedWeight, stacked_matmul


TPSlice = tuple[int, int, int]  # (dim, start, length) of a checkpoint tensor one rank reads


class Linear(nn.Module):
    """y = x W^T (+ b). `shard_sizes` names the row blocks of a fused weight (full sizes).

    `packable=False` keeps the weight a plain tensor for layers whose weight is also
    read outside `forward` (MLA's absorbed kv_b_proj). `parallel` ("column" or "row")
    shards the layer over `tp`; `parts` are this rank's (start, length) of every shard's rows
    (column) or of the input features (row), by default an even split.
    """

    def __init__(self, in_features: int, shard_sizes: list[int], bias: bool, dtype: torch.dtype,
                 packable: bool = True, *, tp: TensorParallel = SINGLE, parallel: str | None = None,
                 parts: list[tuple[int, int]] | None = None) -> None:
        super().__init__()
        if parallel not in (None, "column", "row"):
            raise ValueError(f"parallel must be None, 'column' or 'row', got {parallel!r}")
        self.tp = tp
        self.reduce = parallel == "row" and tp.size > 1  # partial outputs to sum over the ranks
        self._reads: list[TPSlice | None] = [None] * len(shard_sizes)
        if parallel == "column" and tp.size > 1:
            parts = parts or [tp.split(size) for size in shard_sizes]
            self._reads = [(0, start, length) for start, length in parts]
            shard_sizes = [length for _, length in parts]
        elif self.reduce:
            start, in_features = (parts or [tp.split(in_features, "input features")])[0]
            self._reads = [(1, start, in_features)]
        self.shard_sizes = shard_sizes
        self.packable = packable
        self.packed: PackedWeight | None = None  # the dense weight in oneDNN's layout (`pack`)
        out_features = sum(shard_sizes)
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype), requires_grad=False) if bias else None
        self._quantized: list[QuantizedWeight | None] = [None] * len(shard_sizes)
        self.int4: QuantizedMatmul | None = None  # the small-batch kernel (int4 or block GEMV)
        self.int4_max_rows = 0
        self.row_tile = 0  # > 0: batch-invariant, through calls of exactly this many rows (dense weight only)
        self.gemv: DenseGemvPolicy | None = None  # small batches on the platform's dense GEMV (`use_dense_gemv`)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.reduce:
            return self._matmul(x, self.bias)
        y = self.tp.all_reduce(self._matmul(x, None))  # the bias once, after the sum
        return y if self.bias is None else y.add_(self.bias)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor | None:
        """silu(gate) * up of a [gate; up] layer in one kernel where its quantized kernel does that for this
        batch (see `BlockGemv.silu_and_mul`); None elsewhere: the caller splits `forward(x)`."""
        if (self.reduce or self.bias is not None or len(self.shard_sizes) != 2 or len(set(self.shard_sizes)) != 1
                or not isinstance(self.int4, BlockGemv) or not self._on_int4(x)):
            return None
        return self.int4.silu_and_mul(x)

    def _on_int4(self, x: torch.Tensor) -> bool:
        dense = self.weight is not None or self.packed is not None
        return self.int4 is not None and (not dense or x.numel() <= self.int4_max_rows * x.shape[-1])

    def _matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.row_tile:
            return tiled_linear(x, self.weight, bias, self.row_tile)
        if self._on_int4(x):
            y = self.int4(x)
            return y if bias is None else y.add_(bias)
        if self.gemv is not None:
            return dense_linear(x, self.weight, bias, self.gemv)
        if self.packed is not None:
            return self.packed(x, bias)
        return F.linear(x, self.weight, bias)

    def tp_slice(self, name: str, shard: int | None) -> TPSlice | None:
        """The part of checkpoint tensor `name` ("weight" or "bias", of `shard`) this rank holds; None: all."""
        read = self._reads[shard or 0]
        if read is None or (name == "bias" and read[0] == 1):  # a row-parallel bias is whole on every rank
            return None
        return read

    def pack(self, rows_hint: int) -> bool:
        """Replace the dense bf16 or fp32 weight by its oneDNN-packed form; False where there is none to pack."""
        if not self.packable or self.weight is None or self.weight.dtype not in PACKED_DTYPES:
            return False
        self.packed = PackedWeight(self.weight, rows_hint)
        self.weight = None
        return True

    def use_dense_gemv(self, policy: DenseGemvPolicy) -> bool:
        """Run batches of up to `policy.max_rows` rows on the platform's dense GEMV; False where the weight
        is not a plain contiguous float32 one (quantized, packed, batch-invariant or another dtype)."""
        if not plain_fp32(self.weight) or self.int4 is not None or self.row_tile:
            return False
        self.gemv = policy
        return True

    def load_shard(self, param: nn.Parameter, shard: int, value: torch.Tensor | QuantizedWeight) -> None:
        start = sum(self.shard_sizes[:shard])
        rows = param.data[start:start + self.shard_sizes[shard]]
        if rows.shape != value.shape:
            raise ValueError(f"shard {shard} of a {tuple(param.shape)} weight expects {tuple(rows.shape)}, "
                             f"got {tuple(value.shape)}")
        if isinstance(value, QuantizedWeight):
            self._quantized[shard] = value  # placed by finalize_quantization
        else:
            rows.copy_(value)

    def load_quantized(self, name: str, value: QuantizedWeight) -> bool:
        if name != "weight" or len(self.shard_sizes) != 1:
            return False
        self.load_shard(self.weight, 0, value)
        return True

    def finalize_quantization(self, policy: QuantPolicy, keep_dense: bool) -> None:
        """Run the loaded quantized shards as int4 (+ a dense copy if `keep_dense`), or dequantize them."""
        parts = self._quantized
        self._quantized = [None] * len(parts)
        if all(p is None for p in parts):
            return
        if all(p is not None for p in parts):
            self.int4 = stacked_matmul(parts, self.weight.dtype, policy)
        if self.int4 is not None:
            self.int4_max_rows = policy.int4_max_rows
            if not keep_dense:
                self.weight = None
                return
        start = 0
        for size, part in zip(self.shard_sizes, parts):
            if part is not None:
                self.weight.data[start:start + size].copy_(part.dequantize(torch.float32))
            start += size

    def quantized_dense_bytes(self) -> int:
        """Bytes a dense copy of the loaded quantized shards takes."""
        return sum(p.shape.numel() * self.weight.element_size() for p in self._quantized if p is not None)


def pack_linears(module: nn.Module, rows_hint: int) -> int:
    """Prepack every packable dense `Linear` inside `module` for oneDNN (see `Linear.pack`); how many were."""
    return sum(m.pack(rows_hint) for m in module.modules() if isinstance(m, Linear))


def plain_fp32(weight: torch.Tensor | None) -> bool:
    """Whether `weight` is one the dense GEMV reads: a contiguous float32 tensor (not packed away)."""
    return weight is not None and weight.dtype == torch.float32 and weight.is_contiguous()


def use_dense_gemv(module: nn.Module, policy: DenseGemvPolicy) -> int:
    """Run small batches of every plain float32 `Linear` inside `module` on the platform's dense GEMV
    (see `Linear.use_dense_gemv`); how many do."""
    return sum(m.use_dense_gemv(policy) for m in module.modules() if isinstance(m, Linear))


def dense_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                 policy: DenseGemvPolicy) -> torch.Tensor:
    """x [..., K] @ weight [N, K]^T (+ bias) in float32: on the platform's dense GEMV (`torch.ops.mrv2`) for
    up to `policy.max_rows` rows, above that through oneDNN (`policy.onednn_above`) or torch."""
    x2 = x.reshape(-1, x.shape[-1])
    if x2.shape[0] <= policy.max_rows:
        y = torch.ops.mrv2.dense_gemv(x2, weight, bias, policy.isa, policy.row_stream)
    elif policy.onednn_above:
        y = onednn_linear(x2, weight, bias)
    else:
        return F.linear(x, weight, bias)
    return y.view(*x.shape[:-1], weight.shape[0])
