"""The CPU platform's GGUF block GEMV (`mrv2/platforms/cpu_kernels`): each instruction set this
machine runs gives the dequantized weight's matmul within bf16 rounding, eagerly and compiled."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mrv2.config import QuantPolicy
from mrv2.layers.linear import Linear
from mrv2.layers.quantization import (BlockGemv, Int4Matmul, QuantizedWeight, StackedMatmul, block_gemv_supports,
                                      block_gemvs, quantized_matmul)
from mrv2.platforms.cpu import GEMV_ISAS, CpuPlatform
from quant_helpers import held_in_fp16, quantized

MACHINE_ISA = CpuPlatform().gemv_isa()
# Every instruction set this CPU runs (AVX512-VNNI machines run the AVX2 code as well).
ISAS = [isa for isa in GEMV_ISAS if isa <= MACHINE_ISA]

pytestmark = [pytest.mark.skipif(not ISAS, reason="the block GEMV needs AVX2, FMA and F16C"),
              pytest.mark.usefixtures("split_threads", "cpu_kernels")]


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    """bf16 results within a few bf16 ulps of the output's scale; fp32 ones within int16 codes' step
    (activations are quantized to int16 per block: errors measured up to 8e-5 of the largest output)."""
    tol = 2 ** -6 if got.dtype == torch.bfloat16 else 2 ** -12
    assert (got.float() - want).abs().max() <= tol * want.abs().max()


def _held(weight: QuantizedWeight) -> torch.Tensor:
    return held_in_fp16(weight).dequantize(torch.float32)


@pytest.mark.parametrize("isa", ISAS, ids=lambda i: GEMV_ISAS[i])
@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q4_K", "Q6_K", "Q8_0"])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 7, 9, 20])  # passes of 4 (AVX2) or 8 rows, and remainders
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_block_gemv_equals_the_dequantized_weight(isa, qtype, rows, dtype):
    # 40 output rows (not a multiple of any tile) and 12 blocks a row (Q4_K: 16): the second 8-wide load of a
    # row's scales reads 4 of the next row's (or the tail's), which must count nothing; Q6_K's 24 scales a row
    # are read 16 at a time, 8 past the row.
    k = 512 if qtype == "Q4_K" else 384
    weight, ref = quantized(qtype, 40, k, seed=rows)
    x = torch.randn(rows, k, dtype=dtype)
    got = BlockGemv(weight, isa)(x)
    assert got.dtype == dtype and got.shape == (rows, 40)
    _close(got, x.double() @ _held(weight).double().t())


def test_k_quant_scales_are_held_within_fp16_rounding():
    # Q4_K's d * sc and dmin * m and Q6_K's d * sc are exact in fp32, not in fp16: held to 2^-11 of each (GGUF's
    # fp16 scales of the other types exactly), so a held Q4_K weight d * q + m (q <= 15) is GGUF's within 2^-11
    # of 16 (|d| + |m|), a held Q6_K weight d * q (|q| <= 32) within 2^-11 of 32 |d|.
    weight, ref = quantized("Q4_K", 32, 512)
    ref = torch.from_numpy(ref)
    assert not torch.equal(_held(weight), ref)
    per_block = (weight.scales.abs() + weight.mins.abs()).repeat_interleave(32, dim=1) * 16
    assert ((_held(weight) - ref).abs() <= 2 ** -11 * per_block).all()
    weight, ref = quantized("Q6_K", 32, 512)
    ref = torch.from_numpy(ref)
    assert not torch.equal(_held(weight), ref)
    assert ((_held(weight) - ref).abs() <= 2 ** -11 * 32 * weight.scales.abs().repeat_interleave(16, dim=1)).all()
    for qtype in ("Q4_0", "Q4_1", "Q8_0"):
        weight, ref = quantized(qtype, 32, 512)
        assert torch.equal(_held(weight), torch.from_numpy(ref))


@pytest.mark.parametrize("isa", ISAS, ids=lambda i: GEMV_ISAS[i])
@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q6_K", "Q8_0"])
@pytest.mark.parametrize("blocks", [1, 3, 18, 23, 48])
def test_one_row_over_any_number_of_blocks(isa, qtype, blocks):
    # The single-row AVX-512 kernels take 4 blocks (Q4) or 2 (Q8) a step and convert scales 16 at a
    # time (Q6_K: 8 blocks' two each): a row of 1 or 3 blocks, 18 (16 and 2: the default model's K = 576;
    # Q6_K 8, 8 and 2), 23 (16, 4 and 3) and 48 (K = 1536).
    weight, _ = quantized(qtype, 37, 32 * blocks, seed=blocks)
    x = torch.randn(1, 32 * blocks)
    got = BlockGemv(weight, isa)(x, torch.float32)
    _close(got, x.double() @ _held(weight).double().t())


@pytest.mark.parametrize("isa", ISAS, ids=lambda i: GEMV_ISAS[i])
@pytest.mark.parametrize("qtype", ["Q4_1", "Q8_0"])
@pytest.mark.parametrize("rows", [1, 9])
def test_block_gemv_writes_float32_for_bf16_activations_unrounded(isa, qtype, rows):
    # The LM head's logits: the same fp32 sums, not rounded to bf16 on their way to the sampler.
    weight, ref = quantized(qtype, 40, 384, seed=rows)
    x = torch.randn(rows, 384).bfloat16()
    gemv = BlockGemv(weight, isa)
    wide = gemv(x, torch.float32)
    assert wide.dtype == torch.float32 and wide.shape == (rows, 40)
    assert torch.equal(wide.bfloat16(), gemv(x))
    assert not torch.equal(wide, wide.bfloat16().float())  # kept fp32 bits
    _close(wide, x.double() @ torch.from_numpy(ref).double().t())
    with pytest.raises(RuntimeError, match="out_dtype must be"):
        gemv(x, torch.float16)


@pytest.mark.parametrize("isa", ISAS, ids=lambda i: GEMV_ISAS[i])
@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q6_K", "Q8_0"])
def test_a_rows_result_does_not_depend_on_the_rows_computed_with_it(isa, qtype):
    # Rows go through the kernel in groups (and the rest of a tile one by one): each output must be
    # bitwise what the row gives alone, wherever it falls.
    weight, _ = quantized(qtype, 37, 384, seed=5)
    x = torch.randn(1, 384).bfloat16()
    together = BlockGemv(weight, isa)(x, torch.float32)
    for i in range(37):
        alone = QuantizedWeight(qtype, weight.codes[i:i + 1], weight.scales[i:i + 1],
                                None if weight.mins is None else weight.mins[i:i + 1])
        assert torch.equal(BlockGemv(alone, isa)(x, torch.float32)[0, 0], together[0, i]), i


def test_every_instruction_set_computes_the_same_integer_dot_products():
    if len(ISAS) < 2:
        pytest.skip("this CPU runs one instruction set of the block GEMV")
    weight, _ = quantized("Q4_1", 64, 1536, seed=3)
    x = torch.randn(9, 1536, generator=torch.Generator().manual_seed(3))  # 8 rows and 1: both AVX-512 kernels
    outs = [BlockGemv(weight, isa)(x) for isa in ISAS]
    # Only the order of the fp32 sums of block products differs: their rounding scales with the largest
    # outputs (measured up to 4e-7 of them), not with each output.
    assert (outs[0] - outs[1]).abs().max() <= 2 ** -18 * outs[0].abs().max()


@pytest.mark.parametrize("isa", ISAS, ids=lambda i: GEMV_ISAS[i])
@pytest.mark.parametrize("code", [0, 7, 8, 15])
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_extreme_codes_and_activations_stay_exact(isa, code, sign):
    # Every weight code the same and x at its largest int16 code everywhere: the largest
    # products the integer sums hold (the single-row AVX-512 Q4 kernel multiplies x's codes by
    # their bytes: 32767 and -32767 are high bytes 127 and -128, low bytes 255 and 1).
    n, k = 16, 256
    weight = QuantizedWeight("Q4_1", torch.full((n, k), code, dtype=torch.uint8),
                             torch.full((n, k // 32), 0.5, dtype=torch.float16), torch.full((n, k // 32), -1.0, dtype=torch.float16))
    x = torch.full((1, k), sign * 3.0)
    want = torch.full((1, n), sign * 3.0 * k * (0.5 * code - 1.0))
    torch.testing.assert_close(BlockGemv(weight, isa)(x), want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("isa", ISAS, ids=lambda i: GEMV_ISAS[i])
@pytest.mark.parametrize("rows", [1, 3])  # the single-row AVX-512 kernel, and the others
def test_each_q6_k_sub_block_takes_its_own_scale(isa, rows):
    # Codes at their extremes (-32, 31) under scales that differ in sign and size from one 16-weight sub-block to
    # the next: a kernel that applied a block's first scale to both halves, or swapped them, is far off.
    n, k = 16, 128
    codes = torch.where(torch.arange(k) % 3 == 0, -32, 31).to(torch.int8).expand(n, k).contiguous()
    scales = torch.tensor([0.5, -2.0, 0.125, 4.0, -1.0, 0.25, 2.0, -0.5]).repeat(n, 1)
    weight = QuantizedWeight("Q6_K", codes, scales)
    x = torch.linspace(-3.0, 3.0, k).repeat(rows, 1)
    want = x.double() @ weight.dequantize(torch.float32).double().t()
    _close(BlockGemv(weight, isa)(x, torch.float32), want)


def test_leading_dims_and_a_large_vocabulary_head():
    weight, ref = quantized("Q8_0", 4096, 64, seed=4)
    x = torch.randn(2, 1, 64, dtype=torch.bfloat16)
    got = BlockGemv(weight, MACHINE_ISA)(x)
    assert got.shape == (2, 1, 4096)
    _close(got, x.float() @ torch.from_numpy(ref).t())


def test_compiled_code_calls_the_kernel():
    weight, _ = quantized("Q4_1", 64, 256, seed=5)
    gemv = BlockGemv(weight, MACHINE_ISA)
    x = torch.randn(2, 256, dtype=torch.bfloat16)
    compiled = torch.compile(lambda t: gemv(t) * 2, fullgraph=True, dynamic=False)
    assert torch.equal(compiled(x), gemv(x) * 2)


def test_bad_operands_name_the_problem():
    weight, _ = quantized("Q4_1", 32, 64)
    gemv = BlockGemv(weight, MACHINE_ISA)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        torch.ops.mrv2_gguf.q4_gemv(torch.randn(1, 48), gemv.codes, gemv.scales, gemv.mins, MACHINE_ISA)
    with pytest.raises(RuntimeError, match="scales must be"):
        torch.ops.mrv2_gguf.q4_gemv(torch.randn(1, 64), gemv.codes, gemv.scales[:-1].contiguous(), gemv.mins,
                                    MACHINE_ISA)
    with pytest.raises(RuntimeError, match="isa must be"):
        torch.ops.mrv2_gguf.q8_gemv(torch.randn(1, 64), gemv.codes, gemv.scales, 3)
    q6k = BlockGemv(quantized("Q6_K", 32, 64)[0], MACHINE_ISA)
    with pytest.raises(RuntimeError, match="sub_blocks"):
        torch.ops.mrv2_gguf.q8_gemv(torch.randn(1, 64), q6k.codes, q6k.scales, MACHINE_ISA, None, 3)
    with pytest.raises(RuntimeError, match="a scale per 32 in_features"):  # Q6_K's scales read as one a block
        torch.ops.mrv2_gguf.q8_gemv(torch.randn(1, 64), q6k.codes, q6k.scales, MACHINE_ISA)


def test_weights_the_block_gemv_cannot_hold_take_torchs_int4_kernel():
    policy = QuantPolicy(int4_max_rows=4, gemv_isa=MACHINE_ISA)
    q41, _ = quantized("Q4_1", 32, 64)
    assert isinstance(quantized_matmul(q41, torch.bfloat16, policy), BlockGemv)
    # Q4_K's sub-block scales (d * sc), exact in fp32, are rounded to fp16 where they are normal numbers there;
    # below fp16's normal range that rounding would lose bits, so such a weight takes the int4 kernel.
    q4k, _ = quantized("Q4_K", 32, 256)
    assert isinstance(quantized_matmul(q4k, torch.bfloat16, policy), BlockGemv)
    tiny = QuantizedWeight("Q4_K", q4k.codes, q4k.scales * 2 ** -20, q4k.mins)
    assert not block_gemv_supports(tiny)
    assert isinstance(quantized_matmul(tiny, torch.bfloat16, policy), Int4Matmul)
    infinite = q41.scales.clone()
    infinite[3, 1] = float("inf")
    assert not block_gemv_supports(QuantizedWeight("Q4_1", q41.codes, infinite, q41.mins))
    odd = QuantizedWeight("Q4_1", q41.codes[:24], q41.scales[:24], q41.mins[:24])  # 24 rows: not int4's tiles
    assert isinstance(quantized_matmul(odd, torch.bfloat16, policy), BlockGemv)
    assert quantized_matmul(odd, torch.bfloat16, QuantPolicy(int4_max_rows=4)) is None
    # Q6_K's 16-weight sub-blocks: the block kernels, or (torch's int4 kernel's groups are 32 or more) dequantized.
    q6k, _ = quantized("Q6_K", 32, 256)
    assert isinstance(quantized_matmul(q6k, torch.bfloat16, policy), BlockGemv)
    assert quantized_matmul(q6k, torch.bfloat16, QuantPolicy(int4_max_rows=4)) is None
    assert quantized_matmul(q41, torch.bfloat16, QuantPolicy()) is None


@pytest.mark.parametrize("rows", [1, 5])
def test_a_fused_layer_of_shards_of_different_types_keeps_each_run_quantized(rows):
    # Q4_K_M's fused QKV: Q4_K queries and keys, Q6_K values. Each run of one type on its own block kernel, the
    # outputs side by side; with no kernel for one run (torch's int4 kernel cannot take Q6_K) all is dequantized.
    shards = [quantized("Q4_K", 64, 256, seed=1), quantized("Q4_K", 32, 256, seed=2),
              quantized("Q6_K", 32, 256, seed=3)]
    held = torch.cat([_held(w) for w, _ in shards])
    lin = Linear(256, [64, 32, 32], bias=False, dtype=torch.bfloat16)
    for i, (w, _) in enumerate(shards):
        lin.load_shard(lin.weight, i, w)
    lin.finalize_quantization(QuantPolicy(int4_max_rows=4, gemv_isa=MACHINE_ISA), keep_dense=False)
    assert isinstance(lin.int4, StackedMatmul) and [g.out_features for g in block_gemvs(lin.int4)] == [96, 32]
    x = torch.randn(rows, 256, dtype=torch.bfloat16)
    got = lin(x)
    assert got.shape == (rows, 128)
    _close(got, x.double() @ held.double().t())

    lin = Linear(256, [64, 32, 32], bias=False, dtype=torch.float32)
    for i, (w, _) in enumerate(shards):
        lin.load_shard(lin.weight, i, w)
    lin.finalize_quantization(QuantPolicy(int4_max_rows=4), keep_dense=False)
    assert lin.int4 is None
    assert torch.equal(lin.weight, torch.from_numpy(np.concatenate([ref for _, ref in shards])))
