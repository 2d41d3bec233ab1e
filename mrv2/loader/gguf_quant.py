"""The quantized weights of a GGUF file, kept quantized, beside its converted HF checkpoint.

`convert_gguf_to_hf` writes dequantized fp32 weights (the exact reference). This module
also keeps each Q4_0, Q4_1 and Q8_0 tensor's codes and block scales, under its HF
name, in `QUANT_FILE` of the same folder:

    <name>.codes   Q4: uint8 [N, K/2], element 2i in the low nibble, 2i+1 in the high;
                   Q8_0: int8 [N, K]
    <name>.scales  float16 [N, K/32] (the blocks' d)
    <name>.mins    float16 [N, K/32] (Q4_1's m)

with each name's GGUF type in the file's metadata. Dequantized: Q4_0 d * (q - 8),
Q4_1 d * q + m, Q8_0 d * q, exactly what `gguf.quants.dequantize` computes. Other
GGUF types are not listed: they load from the fp32 weights.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from mrv2.layers.quantization import GGUF_BLOCK, QuantizedWeight
from mrv2.loader.cache import QUANT_FILE

# GGUF type name -> bytes per block of 32 weights
_BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}


def decode_blocks(qtype: str, raw: np.ndarray, rows: int, cols: int) -> dict[str, np.ndarray]:
    """Codes and scales of a GGUF tensor's raw blocks (uint8, `rows` x `cols` weights)."""
    blocks = np.asarray(raw, dtype=np.uint8).reshape(rows, cols // GGUF_BLOCK, _BLOCK_BYTES[qtype])
    out = {"scales": blocks[..., 0:2].copy().view(np.float16)[..., 0]}
    if qtype == "Q8_0":
        out["codes"] = blocks[..., 2:].copy().view(np.int8).reshape(rows, cols)
        return out
    if qtype == "Q4_1":
        out["mins"] = blocks[..., 2:4].copy().view(np.float16)[..., 0]
    qs = blocks[..., -16:]  # byte j: element j (low nibble) and element j + 16 (high nibble)
    q = np.concatenate([qs & 0xF, qs >> 4], axis=-1).reshape(rows, cols)
    out["codes"] = (q[:, 0::2] | (q[:, 1::2] << 4)).astype(np.uint8)
    return out


def write_quantized_weights(tensors: list[tuple[str, tuple[int, ...], Any]], out: Path,
                            row_permutation: Callable[[str, np.ndarray], np.ndarray]) -> None:
    """Write `QUANT_FILE` for the quantized ones of `tensors` ((hf name, shape, GGUF tensor))."""
    from safetensors.numpy import save_file

    arrays: dict[str, np.ndarray] = {}
    types: dict[str, str] = {}
    for name, shape, tensor in tensors:
        qtype = tensor.tensor_type.name
        if qtype not in _BLOCK_BYTES or len(shape) != 2 or shape[1] % GGUF_BLOCK:
            continue
        parts = decode_blocks(qtype, tensor.data, *shape)
        for part, array in parts.items():
            arrays[f"{name}.{part}"] = np.ascontiguousarray(row_permutation(name, array))
        types[name] = qtype
    save_file(arrays, str(out), metadata=types)


def stored_weight(qtype: str, parts: Mapping[str, torch.Tensor]) -> QuantizedWeight:
    """A `QuantizedWeight` from its stored parts (`decode_blocks`' layout: Q4 codes nibble-packed)."""
    codes = parts["codes"]
    if qtype != "Q8_0":
        codes = torch.stack([codes & 0xF, codes >> 4], dim=-1).flatten(-2)
    return QuantizedWeight(qtype, codes, parts["scales"], parts.get("mins"))


def iter_quantized_weights(folder: Path) -> Iterator[tuple[str, QuantizedWeight]]:
    """Yield `(hf name, QuantizedWeight)` for every tensor of the folder's `QUANT_FILE`."""
    from safetensors import safe_open

    with safe_open(folder / QUANT_FILE, framework="pt") as f:
        keys = set(f.keys())
        for name, qtype in (f.metadata() or {}).items():
            parts = {p: f.get_tensor(f"{name}.{p}") for p in ("codes", "scales", "mins") if f"{name}.{p}" in keys}
            yield name, stored_weight(qtype, parts)


def quantized_names(folder: Path) -> set[str]:
    """HF names the folder holds quantized (empty when it has no `QUANT_FILE`)."""
    if not (folder / QUANT_FILE).is_file():
        return set()
    from safetensors import safe_open

    with safe_open(folder / QUANT_FILE, framework="pt") as f:
        return set((f.metadata() or {}))


def iter_weights_keeping_quantized(folder: Path) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
    """The folder's weights, those in `QUANT_FILE` as `QuantizedWeight`s, the rest from its safetensors."""
    from mrv2.loader.safetensors_weights import iter_safetensors_weights

    names = quantized_names(folder)
    if names:
        yield from iter_quantized_weights(folder)
    yield from iter_safetensors_weights(folder, skip=names)
