"""The CPU platform's block GEMM (`mrv2/platforms/cpu_kernels/gguf_gemm.cpp`), on AMX and with AVX512-BF16 dot
products: GGUF weights dequantized a tile at a time give the dense bf16 copy's product, eagerly and compiled;
small batches keep the GEMV. A gated product gives SwiGLU of its two halves of columns."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mrv2.config import QuantPolicy
from mrv2.layers.mlp import GatedMLP
from mrv2.layers.quantization import BlockGemv, GemmTiles, quantized_matmul
from mrv2.platforms.cpu import GEMM_ISAS, CpuPlatform
from quant_helpers import held_in_fp16, quantized

PLATFORM = CpuPlatform()
RUNS = {
    2: PLATFORM.gemm_isa() == 2,
    1: PLATFORM.gemm_isa() >= 1,  # every CPU with AMX has AVX512-BF16
}
pytestmark = pytest.mark.usefixtures("split_threads")


@pytest.fixture(params=sorted(RUNS), ids=lambda isa: GEMM_ISAS[isa])
def gemm_isa(request) -> int:
    """Each of the bf16 GEMM's instruction sets that this CPU runs (the others skip; the float32 one, AVX2, has
    tests of its own: test_block_gemm_avx2.py)."""
    if not RUNS[request.param]:
        pytest.skip(f"the block GEMM on {GEMM_ISAS[request.param]} needs a CPU that has it")
    return request.param


def _dense_product(x: torch.Tensor, weight) -> torch.Tensor:
    """x @ W^T with the weight as a dense bf16 copy of what the kernels hold (scales in fp16) holds it, summed
    exactly and rounded to bf16 once."""
    return (x.double() @ held_in_fp16(weight).dequantize(torch.bfloat16).double().t()).to(torch.bfloat16)


def _within_an_ulp(got: torch.Tensor, want: torch.Tensor) -> None:
    """bf16 results of the same products summed in another order: at most one bf16 step apart."""
    assert got.dtype == torch.bfloat16 and got.shape == want.shape
    step = want.float().abs() * 2 ** -7 + want.float().abs().max() * 2 ** -16
    assert ((got.float() - want.float()).abs() <= step).all()


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q4_K", "Q6_K", "Q8_0"])
# AMX: one row tile, padded tiles, pairs and a single; dot products: every block of 1 to 12 rows.
@pytest.mark.parametrize("rows", [1, 3, 5, 12, 16, 17, 23, 40, 64, 100])
def test_gemm_equals_the_dense_bf16_weights_product(qtype, rows, gemm_isa):
    # Three column tiles (a pair and a single) of three feature tiles each (Q4_K: of eight, a super-block; Q6_K:
    # of three, each under two scales a column).
    k = 256 if qtype == "Q4_K" else 96
    weight, _ = quantized(qtype, 48, k, seed=rows)
    gemm = BlockGemv(weight, PLATFORM.gemv_isa(), gemm_isa, gemv_rows=4)
    assert gemm.tiles is not None and gemm.tiles.engine == GemmTiles.ENGINES[gemm_isa]
    x = torch.randn(rows, k, dtype=torch.bfloat16)
    _within_an_ulp(gemm.tiles(x), _dense_product(x, weight))


@pytest.mark.parametrize("qtype", ["Q4_1", "Q8_0"])
def test_float32_out_is_the_sums_the_bf16_out_rounds(qtype, gemm_isa):
    # The LM head asks for float32 logits: the sums as they are, not rounded to bf16 and widened.
    weight, _ = quantized(qtype, 48, 96, seed=3)
    gemm = BlockGemv(weight, PLATFORM.gemv_isa(), gemm_isa, gemv_rows=4)
    x = torch.randn(40, 96, dtype=torch.bfloat16)
    sums = gemm(x, torch.float32)
    assert sums.dtype == torch.float32 and torch.equal(sums.bfloat16(), gemm(x))
    exact = x.double() @ weight.dequantize(torch.bfloat16).double().t()
    assert (sums.double() - exact).abs().max() <= exact.abs().max() * 2 ** -20
    with pytest.raises(RuntimeError, match="out_dtype must be bfloat16 or float32"):
        gemm.tiles(x, torch.float16)


def test_the_default_models_layer_shapes(gemm_isa):
    for n, k in ((960, 576), (576, 1536)):
        weight, _ = quantized("Q4_1", n, k, seed=n)
        x = torch.randn(64, k, dtype=torch.bfloat16)
        _within_an_ulp(BlockGemv(weight, PLATFORM.gemv_isa(), gemm_isa, gemv_rows=4)(x), _dense_product(x, weight))


def test_batches_up_to_the_gemv_rows_keep_the_gemv(gemm_isa):
    weight, _ = quantized("Q4_1", 32, 64, seed=1)
    both = BlockGemv(weight, PLATFORM.gemv_isa(), gemm_isa, gemv_rows=4)
    gemv = BlockGemv(weight, PLATFORM.gemv_isa())
    small, large = torch.randn(4, 64, dtype=torch.bfloat16), torch.randn(5, 64, dtype=torch.bfloat16)
    assert torch.equal(both(small), gemv(small))
    assert torch.equal(both(large), both.tiles(large)) and not torch.equal(both(large), gemv(large))
    fp32 = torch.randn(8, 64)  # the GEMM takes bf16 activations only: fp32 stays on the GEMV
    assert torch.equal(both(fp32), gemv(fp32))


def test_policy_places_the_tile_layout_for_bf16_only(gemm_isa):
    weight, _ = quantized("Q8_0", 32, 64)
    policy = QuantPolicy(int4_max_rows=4, gemv_isa=PLATFORM.gemv_isa(), gemm_isa=gemm_isa)
    assert quantized_matmul(weight, torch.bfloat16, policy).tiles is not None
    assert quantized_matmul(weight, torch.float32, policy).tiles is None
    odd, _ = quantized("Q8_0", 24, 64)  # 24 columns: not whole 16-column tiles, the GEMV serves every batch
    assert not GemmTiles.supports(odd) and quantized_matmul(odd, torch.bfloat16, policy).tiles is None


def test_compiled_code_calls_the_kernel(gemm_isa):
    weight, _ = quantized("Q4_1", 64, 256, seed=5)
    gemm = BlockGemv(weight, PLATFORM.gemv_isa(), gemm_isa, gemv_rows=4)
    x = torch.randn(16, 256, dtype=torch.bfloat16)
    compiled = torch.compile(lambda t: gemm(t) * 2, fullgraph=True, dynamic=False)
    assert torch.equal(compiled(x), gemm(x) * 2)


def _swiglu(product: torch.Tensor) -> torch.Tensor:
    """silu(first half) * second half of a product's columns, in float32 from its halves as they are."""
    gate, up = product.float().chunk(2, dim=-1)
    return F.silu(gate) * up


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q6_K", "Q8_0"])
@pytest.mark.parametrize("rows", [5, 12, 16, 17, 40, 64, 100])
def test_gated_product_is_swiglu_of_the_products_halves(qtype, rows, gemm_isa):
    # Four column tiles: gates in the first two, the values they gate in the last two (as gate_up_proj stacks them).
    weight, _ = quantized(qtype, 64, 96, seed=rows)
    gemm = BlockGemv(weight, PLATFORM.gemv_isa(), gemm_isa, gemv_rows=4)
    x = torch.randn(rows, 96, dtype=torch.bfloat16) * 2
    fused = gemm.silu_and_mul(x)
    assert fused.shape == (rows, 32)
    _within_an_ulp(fused, _swiglu(gemm(x)).bfloat16())  # from the bf16 halves, rounded once
    sums = gemm.tiles(x, torch.float32, gated=True)  # float32: from the sums as they are
    want = _swiglu(gemm(x, torch.float32))
    assert ((sums - want).abs() <= want.abs() * 2 ** -20 + want.abs().max() * 2 ** -24).all()


def test_swiglu_runs_unfused_where_the_gemm_does_not_run(gemm_isa):
    weight, _ = quantized("Q4_1", 64, 96, seed=2)
    gemm = BlockGemv(weight, PLATFORM.gemv_isa(), gemm_isa, gemv_rows=4)
    assert gemm.silu_and_mul(torch.randn(4, 96, dtype=torch.bfloat16)) is None  # the GEMV's batches
    assert gemm.silu_and_mul(torch.randn(8, 96)) is None  # float32 activations
    odd, _ = quantized("Q4_1", 48, 96)  # three column tiles do not halve
    assert BlockGemv(odd, PLATFORM.gemv_isa(), gemm_isa).silu_and_mul(torch.randn(8, 96, dtype=torch.bfloat16)) is None
    tiles = BlockGemv(odd, PLATFORM.gemv_isa(), gemm_isa).tiles
    with pytest.raises(RuntimeError, match="even number of 16-column tiles"):
        tiles(torch.randn(16, 96, dtype=torch.bfloat16), gated=True)


@pytest.mark.parametrize("rows", [3, 40])
def test_gated_mlp_runs_swiglu_in_the_gate_up_kernel(rows, gemm_isa):
    torch.manual_seed(rows)
    mlp = GatedMLP(96, 48, bias=False, dtype=torch.bfloat16)
    for i in (0, 1):
        mlp.gate_up_proj.load_shard(mlp.gate_up_proj.weight, i, quantized("Q4_1", 48, 96, seed=10 + i)[0])
    mlp.down_proj.weight.data.copy_(torch.randn(96, 48) / 8)
    mlp.gate_up_proj.finalize_quantization(QuantPolicy(int4_max_rows=4, gemv_isa=PLATFORM.gemv_isa(),
                                                       gemm_isa=gemm_isa), keep_dense=False)
    x = torch.randn(rows, 96, dtype=torch.bfloat16)
    fused = mlp.gate_up_proj.silu_and_mul(x)
    assert (fused is None) == (rows <= 4)  # three rows stay on the GEMV, unfused
    want = mlp.down_proj(_swiglu(mlp.gate_up_proj(x)).bfloat16())
    got = mlp(x)
    assert (got.float() - want.float()).abs().max() <= want.float().abs().max() * 2 ** -6
    compiled = torch.compile(mlp, fullgraph=True, dynamic=False)(x)  # the fused kernel traces too
    assert (compiled.float() - want.float()).abs().max() <= want.float().abs().max() * 2 ** -6


def test_bad_operands_name_the_problem(gemm_isa):
    weight, _ = quantized("Q4_1", 32, 64)
    tiles = BlockGemv(weight, PLATFORM.gemv_isa(), gemm_isa).tiles
    q4 = torch.ops.mrv2_gguf.q4_gemm_amx if gemm_isa == 2 else torch.ops.mrv2_gguf.q4_gemm_bf16
    q8 = torch.ops.mrv2_gguf.q8_gemm_amx if gemm_isa == 2 else torch.ops.mrv2_gguf.q8_gemm_bf16
    with pytest.raises(RuntimeError, match="bfloat16"):
        q4(torch.randn(16, 64), tiles.codes, tiles.scales, tiles.mins)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        q4(torch.randn(16, 48).bfloat16(), tiles.codes, tiles.scales, tiles.mins)
    with pytest.raises(RuntimeError, match="scales must be"):
        q4(torch.randn(16, 64).bfloat16(), tiles.codes, tiles.scales[:1], tiles.mins)
    with pytest.raises(RuntimeError, match="codes must be"):
        q8(torch.randn(16, 64).bfloat16(), tiles.codes, tiles.scales)
