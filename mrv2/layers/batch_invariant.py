"""Matmuls whose result for a row does not depend on how many rows share the call.

GEMM libraries pick kernels, blockings and thread splits by the number of rows. On a
2 vCPU Sapphire Rapids, a row of `F.linear` over the default model's weights came out
different for 1-12 rows than for 16 or more in fp32 (MKL), and for 33 or more than
for fewer in bf16 (oneDNN), so a request's logits shifted with the batch it ran in.
Calling the library only with one shape, rows cut into tiles of `ROW_TILE` and the
last tile zero-padded, leaves a row's result a function of its own values: the same
kernel, blocking and reduction order for every tile, whatever the batch (tested: a
row's position in its tile, the other rows' values and the number of tiles change no
bit). This is vLLM's batch-invariant mode's idea (fixed tiles, no split reductions)
with the library's own kernels. It costs up to `ROW_TILE - 1` padded rows per call.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

ROW_TILE = 16


def pad_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    """`x` [n, ...] with zero rows appended up to `rows` rows (itself when it has them already)."""
    pad = rows - x.shape[0]
    return x if pad <= 0 else torch.cat([x, x.new_zeros(pad, *x.shape[1:])])


def tiled_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 tile: int = ROW_TILE) -> torch.Tensor:
    """x [..., in] @ weight [out, in]^T (+ bias) through calls of exactly `tile` rows each."""
    rows = x.reshape(-1, x.shape[-1])
    n = rows.shape[0]
    if n == 0:
        return F.linear(x, weight, bias)
    out = torch.cat([F.linear(t, weight, bias) for t in pad_rows(rows, -(-n // tile) * tile).split(tile)])
    return out[:n].view(*x.shape[:-1], weight.shape[0])


def tiled_grouped_linear(x: torch.Tensor, weights: torch.Tensor, ends: torch.Tensor,
                         tile: int = ROW_TILE) -> torch.Tensor:
    """Rows [ends[e-1], ends[e]) of `x` times weights[e] [out, in]^T, each group through `tiled_linear`.

    The group ends are read on the host, as torch's own grouped_mm fallback does.
    """
    out = x.new_empty(x.shape[0], weights.shape[1])
    start = 0
    for e, end in enumerate(ends.tolist()):
        if end > start:
            out[start:end] = tiled_linear(x[start:end], weights[e], None, tile)
        start = end
    return out
