"""GGUF blocks for tests of the quantized path."""

from __future__ import annotations

import numpy as np


def random_q4_k(n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """Raw Q4_K blocks ([n, k / 256 * 144] uint8): random codes and 6-bit scales, small positive d and dmin.

    `gguf` cannot quantize to Q4_K, but any bytes are valid blocks (finite halves aside).
    """
    blocks = rng.integers(0, 256, (n, k // 256, 144), dtype=np.uint8)
    blocks[..., 0:2] = rng.uniform(0.001, 0.01, (n, k // 256, 1)).astype(np.float16).view(np.uint8)
    blocks[..., 2:4] = rng.uniform(0.001, 0.02, (n, k // 256, 1)).astype(np.float16).view(np.uint8)
    return blocks.reshape(n, -1)
