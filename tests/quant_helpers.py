"""GGUF blocks for tests of the quantized path."""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from mrv2.layers.quantization import QuantizedWeight
from mrv2.loader.gguf_quant import decode_blocks, stored_weight


def random_q4_k(n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """Raw Q4_K blocks ([n, k / 256 * 144] uint8): random codes and 6-bit scales, small positive d and dmin.

    `gguf` cannot quantize to Q4_K, but any bytes are valid blocks (finite halves aside).
    """
    blocks = rng.integers(0, 256, (n, k // 256, 144), dtype=np.uint8)
    blocks[..., 0:2] = rng.uniform(0.001, 0.01, (n, k // 256, 1)).astype(np.float16).view(np.uint8)
    blocks[..., 2:4] = rng.uniform(0.001, 0.02, (n, k // 256, 1)).astype(np.float16).view(np.uint8)
    return blocks.reshape(n, -1)


def quantized(qtype: str, n: int, k: int, seed: int = 0) -> tuple[QuantizedWeight, np.ndarray]:
    """A random [n, k] weight quantized by `gguf` (Q4_K: random blocks) and its reference dequantization."""
    rng = np.random.default_rng(seed)
    if qtype == "Q4_K":
        raw = random_q4_k(n, k, rng)
    else:
        raw = quantize(rng.standard_normal((n, k)).astype(np.float32), GGMLQuantizationType[qtype])
    ref = dequantize(raw, GGMLQuantizationType[qtype]).reshape(n, k)
    parts = {p: torch.from_numpy(a) for p, a in decode_blocks(qtype, raw, n, k).items()}
    return stored_weight(qtype, parts), ref
