"""GGUF block formats kept quantized: codes and scales decode exactly as `gguf` dequantizes, and
the int4-kernel matmul equals the dequantized weight's matmul within bf16 rounding."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mrv2.config import QuantPolicy
from mrv2.layers.linear import Linear
from mrv2.layers.quantization import Int4Matmul, QuantizedWeight
from quant_helpers import quantized

TYPES = ["Q4_0", "Q4_1", "Q4_K", "Q6_K", "Q8_0"]
INT4_TYPES = ["Q4_0", "Q4_1", "Q4_K", "Q8_0"]  # torch's int4 kernel takes 32-weight groups or larger: not Q6_K's


@pytest.mark.parametrize("qtype", TYPES)
def test_decoded_blocks_dequantize_exactly_as_gguf(qtype):
    weight, ref = quantized(qtype, 48, 256 if qtype.endswith("_K") else 96)
    assert torch.equal(weight.dequantize(torch.float32), torch.from_numpy(ref))
    rows = torch.tensor([5, 0, 47])
    assert torch.equal(weight.dequantize(torch.float32, rows=rows), torch.from_numpy(ref)[rows])


@pytest.mark.parametrize("qtype", INT4_TYPES)
@pytest.mark.parametrize("rows", [1, 3, 64])
def test_int4_matmul_equals_the_dequantized_weight(qtype, rows):
    weight, ref = quantized(qtype, 64, 512, seed=1)
    x = torch.randn(rows, 512, dtype=torch.bfloat16)
    got = Int4Matmul(weight, torch.bfloat16)(x).float()
    want = x.float() @ torch.from_numpy(ref).t()
    # bf16 inputs, scales and outputs: within a few bf16 ulps of the output's scale.
    tol = 2 ** -6 * want.abs().max()
    assert (got - want).abs().max() <= tol


def test_linear_runs_int4_for_small_batches_and_its_dense_copy_above():
    parts = [quantized("Q4_1", 32, 64, seed=s) for s in (2, 3)]
    ref = torch.from_numpy(np.concatenate([r for _, r in parts]))
    for keep_dense in (True, False):
        lin = Linear(64, [32, 32], bias=False, dtype=torch.bfloat16)
        for i, (w, _) in enumerate(parts):
            lin.load_shard(lin.weight, i, w)
        lin.finalize_quantization(QuantPolicy(int4_max_rows=4, dense_budget=1 << 30), keep_dense)
        assert lin.int4 is not None and (lin.weight is not None) == keep_dense
        for rows in (1, 4, 9):
            x = torch.randn(rows, 64, dtype=torch.bfloat16)
            want = x.float() @ ref.t()
            assert (lin(x).float() - want).abs().max() <= 2 ** -6 * want.abs().max()
        if keep_dense:  # the dense copy is the exact dequantization, in the layer's dtype
            assert torch.equal(lin.weight, ref.to(torch.bfloat16))


def test_linear_dequantizes_what_the_int4_kernel_cannot_take():
    w, ref = quantized("Q8_0", 24, 64)  # 24 rows: not a multiple of the kernel's 16-row tiles
    lin = Linear(64, [24], bias=True, dtype=torch.float32)
    assert lin.load_quantized("weight", w)
    lin.finalize_quantization(QuantPolicy(int4_max_rows=8), keep_dense=False)
    assert lin.int4 is None and torch.equal(lin.weight, torch.from_numpy(ref))


def test_q6_k_narrows_by_whole_blocks_with_both_their_scales():
    # A tensor-parallel rank's columns of a Q6_K weight: whole 32-weight blocks, each with its two 16-weight scales.
    weight, ref = quantized("Q6_K", 16, 512, seed=2)
    part = weight.narrow(1, 96, 160)
    assert part.scales.shape == (16, 10)
    assert torch.equal(part.dequantize(torch.float32), torch.from_numpy(ref)[:, 96:256])
    with pytest.raises(ValueError, match="32-weight blocks"):
        weight.narrow(1, 16, 32)


def test_q6_k_without_the_block_kernels_is_dequantized():
    weight, ref = quantized("Q6_K", 32, 256)
    with pytest.raises(ValueError, match="int4 kernel cannot take a Q6_K"):
        Int4Matmul(weight, torch.bfloat16)
    lin = Linear(256, [32], bias=False, dtype=torch.float32)
    assert lin.load_quantized("weight", weight)
    lin.finalize_quantization(QuantPolicy(int4_max_rows=8), keep_dense=False)  # torch's int4 kernel only
    assert lin.int4 is None and torch.equal(lin.weight, torch.from_numpy(ref))


def test_bad_quantized_weights_are_refused():
    w, _ = quantized("Q4_0", 16, 64)
    with pytest.raises(ValueError, match="unsupported quantized type"):
        QuantizedWeight("Q5_K", w.codes, w.scales)
    with pytest.raises(ValueError, match="scales of shape"):
        QuantizedWeight("Q4_0", w.codes, w.scales[:, :1])
    with pytest.raises(ValueError, match=r"scales of shape \(16, 4\)"):  # Q6_K: two scales a 32-weight block
        QuantizedWeight("Q6_K", w.codes.to(torch.int8), w.scales)
    for qtype in ("Q4_1", "Q4_K"):
        with pytest.raises(ValueError, match="needs mins"):
            QuantizedWeight(qtype, w.codes, w.scales)
    with pytest.raises(ValueError, match="different types"):
        QuantizedWeight.cat([w, quantized("Q8_0", 16, 64)[0]])
