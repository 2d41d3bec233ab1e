"""The CPU platform's AVX512-VNNI block GEMM (`mrv2/platforms/cpu_kernels/gguf_gemm_vnni.cpp`), for bf16
activations on CPUs with AVX512-BF16 and VNNI but no AMX (Zen 4): integer products of the GGUF codes (in the
bf16 GEMM's tile layout) with the activations quantized to int8 per 32-value block give the product of those
quantized activations with the dequantized weights, within the quantization's own bound of the exact product;
bf16 out is the float32 sums rounded once; a gated product is SwiGLU of its two halves of columns."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mrv2.layers.quantization import BlockGemv, GemmTiles
from mrv2.platforms.cpu import CpuPlatform
from quant_helpers import check_int8_product, held_in_fp16, quantized

PLATFORM = CpuPlatform()
VNNI = 4  # CpuPlatform.gemm_isa's number for it
pytestmark = [pytest.mark.usefixtures("split_threads"),
              pytest.mark.skipif(PLATFORM.kernels_missing() is not None or not {
                  "avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx512_vnni"} <= PLATFORM.flags,
                  reason="the VNNI block GEMM needs AVX512-BF16, AVX512-VNNI and its kernels built")]


def _gemm(weight, gemv_rows: int = 2) -> BlockGemv:
    gemm = BlockGemv(weight, PLATFORM.gemv_isa(), VNNI, gemv_rows=gemv_rows)
    assert gemm.tiles is not None and gemm.tiles.engine == "vnni" and gemm.tiles.dtype == torch.bfloat16
    return gemm


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q4_K", "Q6_K", "Q8_0"])
# Passes of up to 12 rows, split evenly: every pass size, two of 8 (16), 9 and 8 (17), 11 x 5 and 9 (64).
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 16, 17, 25, 64, 100])
def test_gemm_is_the_int8_activations_product_within_their_rounding(qtype, rows):
    weight, _ = quantized(qtype, 48, 256, seed=rows)  # three 16-column tiles (a pair and a single) of eight blocks
    x = (torch.randn(rows, 256) * torch.logspace(-2, 1, 256)).bfloat16()  # blocks of different magnitudes
    sums = _gemm(weight).tiles(x, torch.float32)
    assert sums.dtype == torch.float32 and sums.shape == (rows, 48)
    check_int8_product(held_in_fp16(weight), x, sums)
    assert torch.equal(_gemm(weight).tiles(x), sums.bfloat16())  # bf16 out: the sums rounded once


def test_the_default_models_shapes_and_zero_blocks():
    for qtype, n, k in (("Q4_1", 960, 576), ("Q4_1", 576, 1536), ("Q8_0", 1024, 576)):
        weight, _ = quantized(qtype, n, k, seed=n)
        x = torch.randn(64, k, dtype=torch.bfloat16)
        x[3] = 0  # a row of zeros: zero scales, zero codes
        x[5, :32] = 0
        got = _gemm(weight).tiles(x, torch.float32)
        assert torch.equal(got[3], torch.zeros(n))
        check_int8_product(weight, x, got)


def test_batches_up_to_the_gemv_rows_keep_the_gemv():
    weight, _ = quantized("Q4_1", 32, 64, seed=1)
    both, gemv = _gemm(weight, gemv_rows=2), BlockGemv(weight, PLATFORM.gemv_isa())
    small, large = torch.randn(2, 64, dtype=torch.bfloat16), torch.randn(3, 64, dtype=torch.bfloat16)
    assert torch.equal(both(small), gemv(small))
    assert torch.equal(both(large), both.tiles(large)) and not torch.equal(both(large), gemv(large))


@pytest.mark.parametrize("qtype", ["Q4_1", "Q6_K", "Q8_0"])
@pytest.mark.parametrize("rows", [3, 12, 17, 64])
def test_gated_product_is_swiglu_of_the_products_halves(qtype, rows):
    # Four column tiles: gates in the first two, the values they gate in the last two (as gate_up_proj stacks them).
    weight, _ = quantized(qtype, 64, 96, seed=rows)
    tiles = _gemm(weight).tiles
    x = torch.randn(rows, 96, dtype=torch.bfloat16) * 2
    sums = tiles(x, torch.float32)
    gate, up = sums.chunk(2, dim=-1)
    want = F.silu(gate) * up
    got = tiles(x, torch.float32, gated=True)
    assert got.shape == (rows, 32)
    assert ((got - want).abs() <= want.abs() * 2 ** -20 + want.abs().max() * 2 ** -24).all()
    rounded = F.silu(gate.bfloat16().float()) * up.bfloat16().float()  # bf16 out: from the bf16 halves
    step = rounded.abs() * 2 ** -7 + rounded.abs().max() * 2 ** -16
    assert ((tiles(x, gated=True).float() - rounded).abs() <= step).all()


def test_compiled_code_calls_the_kernel():
    weight, _ = quantized("Q4_1", 64, 256, seed=5)
    gemm = _gemm(weight)
    x = torch.randn(16, 256, dtype=torch.bfloat16)
    compiled = torch.compile(lambda t: gemm(t) * 2, fullgraph=True, dynamic=False)
    assert torch.equal(compiled(x), gemm(x) * 2)


def test_bad_operands_name_the_problem():
    # The operands' checks are the bf16 GEMM's (`gemm_tiles.inc`, tested in test_block_gemm.py): here, that these
    # ops make them.
    weight, _ = quantized("Q4_1", 32, 64)
    tiles = _gemm(weight).tiles
    q4, q8 = torch.ops.mrv2_gguf.q4_gemm_vnni, torch.ops.mrv2_gguf.q8_gemm_vnni
    with pytest.raises(RuntimeError, match="x must be a contiguous bfloat16"):
        q4(torch.randn(16, 64), tiles.codes, tiles.scales, tiles.mins)
    with pytest.raises(RuntimeError, match="mins must be shaped and typed like scales"):
        q4(torch.randn(16, 64).bfloat16(), tiles.codes, tiles.scales, tiles.mins[:1])
    with pytest.raises(RuntimeError, match="codes must be"):
        q8(torch.randn(16, 64).bfloat16(), tiles.codes, tiles.scales)
    with pytest.raises(RuntimeError, match="out_dtype must be bfloat16 or float32"):
        q4(torch.randn(16, 64).bfloat16(), tiles.codes, tiles.scales, tiles.mins, torch.float16)
    odd, _ = quantized("Q4_1", 48, 64)
    with pytest.raises(RuntimeError, match="even number of 16-column tiles"):
        _gemm(odd).tiles(torch.randn(16, 64, dtype=torch.bfloat16), gated=True)
    assert tiles(torch.randn(0, 64, dtype=torch.bfloat16)).shape == (0, 32)
    assert GemmTiles.takes(VNNI, torch.bfloat16) and not GemmTiles.takes(VNNI, torch.float32)
