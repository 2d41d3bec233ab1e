"""The CPU platform's AMX block GEMM (`mrv2/platforms/cpu_kernels/gguf_amx.cpp`): GGUF weights dequantized a
tile at a time give the dense bf16 copy's product, eagerly and compiled; small batches keep the GEMV."""

from __future__ import annotations

import pytest
import torch

from mrv2.config import QuantPolicy
from mrv2.layers.quantization import AmxTiles, BlockGemv, quantized_matmul
from mrv2.platforms.cpu import CpuPlatform
from mrv2.platforms.cpu_kernels import load_cpu_kernels
from quant_helpers import quantized

PLATFORM = CpuPlatform()
AMX = PLATFORM.has_amx() and load_cpu_kernels() is None and torch.ops.mrv2_gguf.amx_ready()

pytestmark = pytest.mark.skipif(not AMX, reason="the AMX block GEMM needs a CPU with AMX-BF16 tiles")


def _dense_product(x: torch.Tensor, weight) -> torch.Tensor:
    """x @ W^T with the weight as a dense bf16 copy holds it, summed exactly and rounded to bf16 once."""
    return (x.double() @ weight.dequantize(torch.bfloat16).double().t()).to(torch.bfloat16)


def _within_an_ulp(got: torch.Tensor, want: torch.Tensor) -> None:
    """bf16 results of the same products summed in another order: at most one bf16 step apart."""
    assert got.dtype == torch.bfloat16 and got.shape == want.shape
    step = want.float().abs() * 2 ** -7 + want.float().abs().max() * 2 ** -16
    assert ((got.float() - want.float()).abs() <= step).all()


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0"])
@pytest.mark.parametrize("rows", [5, 16, 17, 40, 64, 100])  # one row tile, padded tiles, pairs and a single
def test_amx_gemm_equals_the_dense_bf16_weights_product(qtype, rows):
    # Three column tiles (a pair and a single) of three feature tiles each.
    weight, _ = quantized(qtype, 48, 96, seed=rows)
    gemm = BlockGemv(weight, PLATFORM.gemv_isa(), amx=True, gemv_rows=4)
    assert gemm.amx is not None
    x = torch.randn(rows, 96, dtype=torch.bfloat16)
    _within_an_ulp(gemm(x), _dense_product(x, weight))


@pytest.mark.parametrize("qtype", ["Q4_1", "Q8_0"])
def test_float32_out_is_the_sums_the_bf16_out_rounds(qtype):
    # The LM head asks for float32 logits: the sums as they are, not rounded to bf16 and widened.
    weight, _ = quantized(qtype, 48, 96, seed=3)
    gemm = BlockGemv(weight, PLATFORM.gemv_isa(), amx=True, gemv_rows=4)
    x = torch.randn(40, 96, dtype=torch.bfloat16)
    sums = gemm(x, torch.float32)
    assert sums.dtype == torch.float32 and torch.equal(sums.bfloat16(), gemm(x))
    exact = x.double() @ weight.dequantize(torch.bfloat16).double().t()
    assert (sums.double() - exact).abs().max() <= exact.abs().max() * 2 ** -20
    with pytest.raises(RuntimeError, match="out_dtype must be bfloat16 or float32"):
        gemm.amx(x, torch.float16)


def test_the_default_models_layer_shapes():
    for n, k in ((960, 576), (576, 1536)):
        weight, _ = quantized("Q4_1", n, k, seed=n)
        x = torch.randn(64, k, dtype=torch.bfloat16)
        _within_an_ulp(BlockGemv(weight, PLATFORM.gemv_isa(), amx=True, gemv_rows=4)(x), _dense_product(x, weight))


def test_batches_up_to_the_gemv_rows_keep_the_gemv():
    weight, _ = quantized("Q4_1", 32, 64, seed=1)
    both = BlockGemv(weight, PLATFORM.gemv_isa(), amx=True, gemv_rows=4)
    gemv = BlockGemv(weight, PLATFORM.gemv_isa())
    small, large = torch.randn(4, 64, dtype=torch.bfloat16), torch.randn(5, 64, dtype=torch.bfloat16)
    assert torch.equal(both(small), gemv(small))
    assert torch.equal(both(large), both.amx(large)) and not torch.equal(both(large), gemv(large))
    fp32 = torch.randn(8, 64)  # the AMX GEMM takes bf16 activations only: fp32 stays on the GEMV
    assert torch.equal(both(fp32), gemv(fp32))


def test_policy_places_the_amx_layout_for_bf16_only():
    weight, _ = quantized("Q8_0", 32, 64)
    policy = QuantPolicy(int4_max_rows=4, gemv_isa=PLATFORM.gemv_isa(), amx=True)
    assert quantized_matmul(weight, torch.bfloat16, policy).amx is not None
    assert quantized_matmul(weight, torch.float32, policy).amx is None
    odd, _ = quantized("Q8_0", 24, 64)  # 24 columns: not whole 16-column tiles, the GEMV serves every batch
    assert not AmxTiles.supports(odd) and quantized_matmul(odd, torch.bfloat16, policy).amx is None


def test_compiled_code_calls_the_kernel():
    weight, _ = quantized("Q4_1", 64, 256, seed=5)
    gemm = BlockGemv(weight, PLATFORM.gemv_isa(), amx=True, gemv_rows=4)
    x = torch.randn(16, 256, dtype=torch.bfloat16)
    compiled = torch.compile(lambda t: gemm(t) * 2, fullgraph=True, dynamic=False)
    assert torch.equal(compiled(x), gemm(x) * 2)


def test_bad_operands_name_the_problem():
    weight, _ = quantized("Q4_1", 32, 64)
    tiles = BlockGemv(weight, PLATFORM.gemv_isa(), amx=True).amx
    with pytest.raises(RuntimeError, match="bfloat16"):
        torch.ops.mrv2_gguf.q4_gemm_amx(torch.randn(16, 64), tiles.codes, tiles.scales, tiles.mins)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        torch.ops.mrv2_gguf.q4_gemm_amx(torch.randn(16, 48).bfloat16(), tiles.codes, tiles.scales, tiles.mins)
    with pytest.raises(RuntimeError, match="scales must be"):
        torch.ops.mrv2_gguf.q4_gemm_amx(torch.randn(16, 64).bfloat16(), tiles.codes, tiles.scales[:1], tiles.mins)
    with pytest.raises(RuntimeError, match="codes must be"):
        torch.ops.mrv2_gguf.q8_gemm_amx(torch.randn(16, 64).bfloat16(), tiles.codes, tiles.scales)
