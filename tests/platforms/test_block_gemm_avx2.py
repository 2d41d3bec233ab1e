"""The CPU platform's AVX2 block GEMM (`mrv2/platforms/cpu_kernels/gguf_gemm_avx2.cpp`), for float32 activations
on CPUs without native bf16: integer products of the GGUF codes with the activations quantized to int8 per
32-value block give the product of those quantized activations with the dequantized weights, within the
quantization's own bound of the exact product; small batches keep the GEMV; bf16 activations never reach it. It
runs on any CPU with AVX2, which these tests need, whichever GEMM the platform picks there."""

from __future__ import annotations

import pytest
import torch

from mrv2.config import QuantPolicy
from mrv2.layers.quantization import BlockGemv, GemmTiles, quantized_matmul
from mrv2.platforms.cpu import CpuPlatform
from quant_helpers import check_int8_product, quantized

PLATFORM = CpuPlatform()
AVX2 = 3  # CpuPlatform.gemm_isa's number for it
pytestmark = [pytest.mark.usefixtures("split_threads"),
              pytest.mark.skipif(PLATFORM.kernels_missing() is not None,
                                 reason="the AVX2 block GEMM needs AVX2, FMA, F16C and its kernels built")]


# Q4_K, Q6_K: their scales as they are, in fp32
@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q4_K", "Q6_K", "Q8_0"])
# Every tail of the kernel's six-row passes, a whole 96-row chunk and a partial one.
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 13, 64, 96, 100, 200])
def test_gemm_is_the_int8_activations_product_within_their_rounding(qtype, rows):
    weight, _ = quantized(qtype, 48, 256, seed=rows)  # six 8-column strips of eight blocks
    gemm = BlockGemv(weight, PLATFORM.gemv_isa(), AVX2, gemv_rows=4)
    assert gemm.tiles is not None and gemm.tiles.engine == "avx2"
    x = torch.randn(rows, 256) * torch.logspace(-2, 1, 256)  # blocks of different magnitudes
    got = gemm.tiles(x)
    assert got.dtype == torch.float32 and got.shape == (rows, 48)
    check_int8_product(weight, x, got)


def test_the_default_models_layer_shapes_and_zero_blocks():
    for qtype, n, k in (("Q4_1", 960, 576), ("Q4_1", 576, 1536), ("Q8_0", 1024, 576)):
        weight, _ = quantized(qtype, n, k, seed=n)
        x = torch.randn(64, k)
        x[3] = 0  # a row of zeros: zero scales, zero codes
        x[5, :32] = 0
        got = BlockGemv(weight, PLATFORM.gemv_isa(), AVX2, gemv_rows=4)(x)
        assert torch.equal(got[3], torch.zeros(n))
        check_int8_product(weight, x, got)


def test_strided_rows_are_read_as_they_lie():
    weight, _ = quantized("Q4_1", 32, 64, seed=2)
    tiles = BlockGemv(weight, PLATFORM.gemv_isa(), AVX2).tiles
    x = torch.randn(20, 64)
    assert torch.equal(tiles(x[::2]), tiles(x[::2].contiguous()))
    assert tiles(torch.randn(0, 64)).shape == (0, 32)


def test_batches_up_to_the_gemv_rows_keep_the_gemv_and_bf16_never_reaches_the_gemm():
    weight, _ = quantized("Q4_1", 32, 64, seed=1)
    both = BlockGemv(weight, PLATFORM.gemv_isa(), AVX2, gemv_rows=4)
    gemv = BlockGemv(weight, PLATFORM.gemv_isa())
    small, large = torch.randn(4, 64), torch.randn(5, 64)
    assert torch.equal(both(small), gemv(small))
    assert torch.equal(both(large), both.tiles(large))
    half = torch.randn(8, 64, dtype=torch.bfloat16)
    assert torch.equal(both(half), gemv(half))
    assert both.silu_and_mul(large) is None  # no gated product: the caller activates the halves


def test_policy_places_the_strips_for_float32_only():
    weight, _ = quantized("Q8_0", 32, 64)
    policy = QuantPolicy(int4_max_rows=4, gemv_isa=PLATFORM.gemv_isa(), gemm_isa=AVX2)
    assert GemmTiles.takes(AVX2, torch.float32) and not GemmTiles.takes(AVX2, torch.bfloat16)
    assert GemmTiles.takes(1, torch.bfloat16) and not GemmTiles.takes(1, torch.float32)
    assert quantized_matmul(weight, torch.float32, policy).tiles is not None
    assert quantized_matmul(weight, torch.bfloat16, policy).tiles is None


def test_compiled_code_calls_the_kernel():
    weight, _ = quantized("Q4_1", 64, 256, seed=5)
    gemm = BlockGemv(weight, PLATFORM.gemv_isa(), AVX2, gemv_rows=4)
    x = torch.randn(16, 256)
    compiled = torch.compile(lambda t: gemm(t) * 2, fullgraph=True, dynamic=False)
    assert torch.equal(compiled(x), gemm(x) * 2)


def test_bad_operands_name_the_problem():
    weight, _ = quantized("Q4_1", 32, 64)
    tiles = BlockGemv(weight, PLATFORM.gemv_isa(), AVX2).tiles
    q4 = torch.ops.mrv2_gguf.q4_gemm_avx2
    x = torch.randn(3, 64)
    with pytest.raises(RuntimeError, match="x must be a float32"):
        q4(x.bfloat16(), tiles.codes, tiles.scales, tiles.mins)
    with pytest.raises(RuntimeError, match="x has 32"):
        q4(x[:, :32].contiguous(), tiles.codes, tiles.scales, tiles.mins)
    with pytest.raises(RuntimeError, match="codes must be contiguous"):
        q4(x, tiles.codes.to(torch.int8), tiles.scales, tiles.mins)
    with pytest.raises(RuntimeError, match="scales must be contiguous float32"):
        q4(x, tiles.codes, tiles.scales.half(), tiles.mins)
    with pytest.raises(RuntimeError, match="mins must be shaped and typed like scales"):
        q4(x, tiles.codes, tiles.scales, tiles.mins[:1])
    with pytest.raises(RuntimeError, match="out_dtype must be float32"):
        q4(x, tiles.codes, tiles.scales, tiles.mins, torch.bfloat16)
    with pytest.raises(RuntimeError, match="no gated product"):
        q4(x, tiles.codes, tiles.scales, tiles.mins, None, True)
