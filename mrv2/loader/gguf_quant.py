"""The quantized weights of a GGUF file, kept quantized, beside its converted HF checkpoint.

`convert_gguf_to_hf` writes dequantized fp32 weights (the exact reference). This module
also keeps each Q4_0, Q4_1, Q4_K, Q6_K and Q8_0 tensor's codes and block scales, under its
HF name, in `QUANT_FILE` of the same folder:

    <name>.codes   Q4: uint8 [N, K/2], element 2i in the low nibble, 2i+1 in the high;
                   Q8_0: int8 [N, K]; Q6_K: int8 [N, K], q - 32
    <name>.scales  [N, K/32]: float16 d (Q4_0, Q4_1, Q8_0); float32 d * sc (Q4_K);
                   [N, K/16]: float32 d * sc (Q6_K)
    <name>.mins    [N, K/32]: float16 m (Q4_1); float32 -dmin * m (Q4_K)

with each name's GGUF type in the file's metadata. Dequantized: Q4_0 d * (q - 8),
Q4_1 and Q4_K scale * q + min, Q8_0 and Q6_K scale * code, exactly what
`gguf.quants.dequantize` computes. Other GGUF types (Q5_K, ...) are not listed: they
load from the fp32 weights.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from mrv2.layers.quantization import INT8_CODES, QuantizedWeight, column_spans
from mrv2.loader.cache import QUANT_FILE

# GGUF type name -> (weights, bytes) per block
_BLOCKS = {"Q4_0": (32, 18), "Q4_1": (32, 20), "Q8_0": (32, 34), "Q4_K": (256, 144), "Q6_K": (256, 210)}


def decode_blocks(qtype: str, raw: np.ndarray, rows: int, cols: int) -> dict[str, np.ndarray]:
    """Codes and scales of a GGUF tensor's raw blocks (uint8, `rows` x `cols` weights)."""
    size, nbytes = _BLOCKS[qtype]
    blocks = np.asarray(raw, dtype=np.uint8).reshape(rows, cols // size, nbytes)
    if qtype == "Q4_K":
        return _decode_q4_k(blocks, rows, cols)
    if qtype == "Q6_K":
        return _decode_q6_k(blocks, rows, cols)
    out = {"scales": blocks[..., 0:2].copy().view(np.float16)[..., 0]}
    if qtype == "Q8_0":
        out["codes"] = blocks[..., 2:].copy().view(np.int8).reshape(rows, cols)
        return out
    if qtype == "Q4_1":
        out["mins"] = blocks[..., 2:4].copy().view(np.float16)[..., 0]
    qs = blocks[..., -16:]  # byte j: element j (low nibble) and element j + 16 (high nibble)
    out["codes"] = _pack_nibbles(np.concatenate([qs & 0xF, qs >> 4], axis=-1).reshape(rows, cols))
    return out


def _decode_q4_k(blocks: np.ndarray, rows: int, cols: int) -> dict[str, np.ndarray]:
    """Q4_K super-blocks: d, dmin (f16), 12 bytes of 6-bit sub-block scales and mins, 128 bytes of codes."""
    d = blocks[..., 0:2].copy().view(np.float16).astype(np.float32)  # [rows, nb, 1]
    dmin = blocks[..., 2:4].copy().view(np.float16).astype(np.float32)
    packed = blocks[..., 4:16].reshape(rows, -1, 3, 4)  # the layout gguf.quants.Q4_K.get_scale_min reads
    a, b, c = packed[..., 0, :], packed[..., 1, :], packed[..., 2, :]
    sc = np.concatenate([a & 0x3F, (c & 0x0F) | ((a >> 2) & 0x30)], axis=-1)  # [rows, nb, 8]
    m = np.concatenate([b & 0x3F, (c >> 4) | ((b >> 2) & 0x30)], axis=-1)
    # 32 bytes per pair of sub-blocks: the first in the low nibbles, the second in the high.
    qs = blocks[..., 16:].reshape(rows, -1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(2, 1)
    return {"codes": _pack_nibbles((qs & 0xF).reshape(rows, cols)),
            "scales": (d * sc.astype(np.float32)).reshape(rows, -1),
            "mins": -(dmin * m.astype(np.float32)).reshape(rows, -1)}


def _decode_q6_k(blocks: np.ndarray, rows: int, cols: int) -> dict[str, np.ndarray]:
    """Q6_K super-blocks: 128 bytes of low nibbles, 64 of high 2-bit pairs, 16 int8 sub-block scales, d (f16);
    the layout gguf.quants.Q6_K.dequantize_blocks reads."""
    ql, qh = blocks[..., :128], blocks[..., 128:192]
    sc = blocks[..., 192:208].copy().view(np.int8).astype(np.float32)  # [rows, nb, 16]
    d = blocks[..., 208:210].copy().view(np.float16).astype(np.float32)  # [rows, nb, 1]
    # 64 bytes of low nibbles per 128 weights (two groups of 32 in the low nibbles, two in the high), 32 bytes
    # of high bits (four groups of 32, two bits each).
    low = (ql.reshape(rows, -1, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(2, 1)) & 0x0F
    high = (qh.reshape(rows, -1, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(4, 1)) & 0x03
    q = low.reshape(rows, -1, 8, 32) | (high.reshape(rows, -1, 8, 32) << 4)
    return {"codes": (q.astype(np.int8) - np.int8(32)).reshape(rows, cols),
            "scales": (d * sc).reshape(rows, -1)}


def _pack_nibbles(q: np.ndarray) -> np.ndarray:
    """Codes 0..15 [N, K] -> uint8 [N, K/2], element 2i in the low nibble."""
    return (q[:, 0::2] | (q[:, 1::2] << 4)).astype(np.uint8)


def write_quantized_weights(tensors: list[tuple[str, tuple[int, ...], Any]], out: Path,
                            row_permutation: Callable[[str, np.ndarray], np.ndarray]) -> None:
    """Write `QUANT_FILE` for the quantized ones of `tensors` ((hf name, shape, GGUF tensor))."""
    from safetensors.numpy import save_file

    arrays: dict[str, np.ndarray] = {}
    types: dict[str, str] = {}
    for name, shape, tensor in tensors:
        qtype = tensor.tensor_type.name
        if qtype not in _BLOCKS or len(shape) != 2 or shape[1] % _BLOCKS[qtype][0]:
            continue
        parts = decode_blocks(qtype, tensor.data, *shape)
        for part, array in parts.items():
            arrays[f"{name}.{part}"] = np.ascontiguousarray(row_permutation(name, array))
        types[name] = qtype
    # No metadata rather than an empty one: safetensors writes an unreadable header for
    # no tensors with empty metadata (a GGUF of F32/F16 tensors only keeps nothing).
    save_file(arrays, str(out), metadata=types or None)


def stored_weight(qtype: str, parts: Mapping[str, torch.Tensor]) -> QuantizedWeight:
    """A `QuantizedWeight` from its stored parts (`decode_blocks`' layout: Q4 codes nibble-packed)."""
    codes = parts["codes"]
    if qtype not in INT8_CODES:
        codes = torch.stack([codes & 0xF, codes >> 4], dim=-1).flatten(-2)
    return QuantizedWeight(qtype, codes, parts["scales"], parts.get("mins"))


class LazyQuantizedWeight:
    """A quantized checkpoint tensor not read yet: its [N, K] shape, and `read` of all of it or of rows
    (dim 0) or whole 32-weight blocks of columns (dim 1), so a tensor-parallel rank reads only its slice.
    Valid until the iterator moves on."""

    def __init__(self, handle, name: str, qtype: str, parts: list[str]) -> None:
        self.qtype = qtype
        self._slices = {p: handle.get_slice(f"{name}.{p}") for p in parts}
        n, stored = self._slices["codes"].get_shape()
        self._per_byte = 1 if qtype in INT8_CODES else 2  # Q4 codes are nibble-packed
        self.shape = torch.Size((n, stored * self._per_byte))

    def read(self, part: tuple[int, int, int] | None = None) -> QuantizedWeight:
        if part is None:
            return stored_weight(self.qtype, {p: s[:] for p, s in self._slices.items()})
        dim, start, length = part
        if dim == 0:
            return stored_weight(self.qtype, {p: s[start:start + length] for p, s in self._slices.items()})
        columns = column_spans(self.qtype, start, length)
        columns["codes"] = slice(start // self._per_byte, (start + length) // self._per_byte)
        return stored_weight(self.qtype, {p: s[:, columns[p]] for p, s in self._slices.items()})


def iter_quantized_weights(folder: Path, lazy: bool = False) -> Iterator[tuple[str, Any]]:
    """Yield `(hf name, QuantizedWeight)` for every tensor of the folder's `QUANT_FILE`
    (`lazy`: as `LazyQuantizedWeight`s)."""
    from safetensors import safe_open

    with safe_open(folder / QUANT_FILE, framework="pt") as f:
        keys = set(f.keys())
        for name, qtype in (f.metadata() or {}).items():
            present = [p for p in ("codes", "scales", "mins") if f"{name}.{p}" in keys]
            if lazy:
                yield name, LazyQuantizedWeight(f, name, qtype, present)
            else:
                yield name, stored_weight(qtype, {p: f.get_tensor(f"{name}.{p}") for p in present})


def quantized_names(folder: Path) -> set[str]:
    """HF names the folder holds quantized (empty when it has no `QUANT_FILE`)."""
    if not (folder / QUANT_FILE).is_file():
        return set()
    from safetensors import safe_open

    with safe_open(folder / QUANT_FILE, framework="pt") as f:
        return set((f.metadata() or {}))


def iter_weights_keeping_quantized(folder: Path, lazy: bool = False) -> Iterator[tuple[str, Any]]:
    """The folder's weights, those in `QUANT_FILE` as `QuantizedWeight`s, the rest from its safetensors
    (`lazy`: as `LazyTensor`s)."""
    from mrv2.loader.safetensors_weights import iter_safetensors_weights

    names = quantized_names(folder)
    if names:
        yield from iter_quantized_weights(folder, lazy)
    yield from iter_safetensors_weights(folder, skip=names, lazy=lazy)
