"""Dense weights prepacked once into oneDNN's blocked layout (torch's own mkldnn ops).

oneDNN's AMX / AVX-512-BF16 kernels read weights in a blocked layout, while `F.linear`
hands them a plain row-major one on every call. Packed once at load, the default
model's bf16 shapes ran 1.3-1.9x faster at 1 to 64 rows and the same at 2048 on a 2 vCPU
Sapphire Rapids, bit-identical to `F.linear`. fp32 packs where oneDNN beats MKL (AMD
CPUs), not bit-identical there (see `Platform.linear_pack_rows`). Inductor cannot lower
these ops, so compiled graphs keep plain weights.

oneDNN builds (JIT-compiles) a primitive per input shape and caches up to 1024 of them,
so a server whose steps have every row count from 1 to 2048 grew by hundreds of MB
(`mrv2 bench soak`). Rows are padded to `padded_rows` buckets (about 50 per weight):
powers of two up to 16 (AMX computes 16-row tiles anyway), multiples of 16 up to 256,
of 64 beyond (at most 6% more work there).
"""

from __future__ import annotations

import torch

from mrv2.layers.batch_invariant import pad_rows


PACKED_DTYPES = (torch.bfloat16, torch.float32)


def packing_available() -> bool:
    """Whether this torch build has oneDNN's linear packing ops."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


def pack_weight(weight: torch.Tensor, rows_hint: int) -> torch.Tensor:
    """An opaque oneDNN tensor holding `weight` [out, in] blocked for batches of about `rows_hint` rows."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), rows_hint)


def padded_rows(rows: int) -> int:
    """The row bucket a call of `rows` rows runs as."""
    if rows <= 16:
        return 1 << max(rows - 1, 0).bit_length()
    step = 16 if rows <= 256 else 64
    return -(-rows // step) * step


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [rows, in] @ W^T (+ bias) with a weight from `pack_weight`."""
    rows = x.shape[0]
    out = torch.ops.mkldnn._linear_pointwise(pad_rows(x, padded_rows(rows)), packed, bias, "none", [], "")
    return out if out.shape[0] == rows else out[:rows]
