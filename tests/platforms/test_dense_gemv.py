"""The CPU platform's dense fp32 GEMV (`mrv2/platforms/cpu_kernels/dense_gemv.cpp`): each instruction set
this machine runs gives F.linear's products within fp32 rounding, for any shape, eagerly and compiled."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mrv2.config import DenseGemvPolicy
from mrv2.layers.batch_invariant import pad_rows
from mrv2.layers.linear import Linear
from mrv2.layers.packed import padded_rows
from mrv2.platforms.cpu import DENSE_GEMV_ISAS, CpuPlatform

MACHINE = CpuPlatform()
# Every instruction set this CPU runs (AVX-512 machines run the AVX2 code as well).
ISAS = [isa for isa, flag in ((1, "avx2"), (2, "avx512f")) if MACHINE.gemv_isa() and flag in MACHINE.flags]

pytestmark = [pytest.mark.skipif(not ISAS, reason="the dense GEMV needs AVX2, FMA and F16C"),
              pytest.mark.usefixtures("split_threads", "cpu_kernels")]


def _reference(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x.double(), w.double(), None if bias is None else bias.double())


def _close(got: torch.Tensor, want: torch.Tensor, k: int) -> None:
    """fp32 sums of k products: within a few ulps of the products' scale times sqrt(k)."""
    assert got.dtype == torch.float32 and got.shape == want.shape
    tol = 4 * 2 ** -24 * max(k, 1) ** 0.5 * 4 * (want.abs().max().item() + 1)
    assert (got.double() - want).abs().max().item() <= tol


@pytest.mark.parametrize("isa", ISAS, ids=lambda i: DENSE_GEMV_ISAS[i])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 9, 16, 17])  # passes of 3 (AVX2) or 4 rows, and remainders
@pytest.mark.parametrize("k,n", [(576, 960), (1536, 576), (17, 37), (8, 4), (1, 5), (100, 3)])  # K and N tails
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("row_stream", [False, True], ids=["groups", "row_stream"])  # one row: either layout
def test_dense_gemv_equals_f_linear(isa, rows, k, n, bias, row_stream):
    torch.manual_seed(rows * 1000 + k + n)
    x, w = torch.randn(rows, k), torch.randn(n, k)
    b = torch.randn(n) if bias else None
    _close(torch.ops.mrv2.dense_gemv(x, w, b, isa, row_stream), _reference(x, w, b), k)


@pytest.mark.parametrize("isa", ISAS, ids=lambda i: DENSE_GEMV_ISAS[i])
@pytest.mark.parametrize("k", [576, 1536, 33, 47, 16, 3])  # whole 32-feature steps, a vector and a masked tail
def test_row_stream_reads_every_feature_once(isa, k):
    """The single-row layout's tails: integer-valued operands make every product and sum exact in fp32, so a
    feature read twice or skipped shows as an exact difference."""
    torch.manual_seed(k)
    x, w = torch.randint(-3, 4, (1, k)).float(), torch.randint(-3, 4, (37, k)).float()
    b = torch.randint(-3, 4, (37,)).float()
    assert torch.equal(torch.ops.mrv2.dense_gemv(x, w, b, isa, True), x @ w.T + b)


@pytest.mark.parametrize("isa", ISAS, ids=lambda i: DENSE_GEMV_ISAS[i])
def test_a_rows_result_does_not_depend_on_the_rows_computed_with_it(isa):
    torch.manual_seed(1)
    x, w = torch.randn(11, 200), torch.randn(70, 200)
    whole = torch.ops.mrv2.dense_gemv(x, w, None, isa)
    for i in range(11):
        assert torch.equal(whole[i:i + 1], torch.ops.mrv2.dense_gemv(x[i:i + 1], w, None, isa))


def test_strided_activations_and_empty_operands():
    isa = ISAS[-1]
    torch.manual_seed(2)
    w = torch.randn(48, 64)
    rows = torch.randn(6, 64)[::2]  # strided rows, as slices of a batch are
    columns = torch.randn(64, 3).t()  # columns not contiguous: copied first
    for x in (rows, columns):
        _close(torch.ops.mrv2.dense_gemv(x, w, None, isa), _reference(x, w, None), 64)
    assert torch.ops.mrv2.dense_gemv(torch.randn(0, 64), w, None, isa).shape == (0, 48)
    assert torch.ops.mrv2.dense_gemv(torch.randn(2, 64), w[:0], None, isa).shape == (2, 0)


def test_bad_operands_name_the_problem():
    x, w = torch.randn(1, 32), torch.randn(8, 32)
    with pytest.raises(RuntimeError, match="isa must be"):
        torch.ops.mrv2.dense_gemv(x, w, None, 3)
    with pytest.raises(RuntimeError, match="x must be a float32"):
        torch.ops.mrv2.dense_gemv(x.bfloat16(), w, None, ISAS[0])
    with pytest.raises(RuntimeError, match="weight must be a contiguous float32"):
        torch.ops.mrv2.dense_gemv(x, torch.randn(32, 8).t(), None, ISAS[0])
    with pytest.raises(RuntimeError, match="K = x's columns"):
        torch.ops.mrv2.dense_gemv(torch.randn(1, 16), w, None, ISAS[0])
    with pytest.raises(RuntimeError, match="bias must be"):
        torch.ops.mrv2.dense_gemv(x, w, torch.randn(7), ISAS[0])


def test_linear_runs_small_batches_on_it_and_larger_ones_through_torch():
    policy = DenseGemvPolicy(ISAS[-1], max_rows=4)
    torch.manual_seed(3)
    layer = Linear(96, [80, 48], True, torch.float32)
    layer.weight.data.normal_()
    layer.bias.data.normal_()
    w, b = layer.weight.detach(), layer.bias.detach()
    assert layer.use_dense_gemv(policy) and layer.gemv == policy
    small, large = torch.randn(2, 2, 96), torch.randn(5, 96)  # leading dims: 4 rows in all
    assert torch.equal(layer(small), torch.ops.mrv2.dense_gemv(small.reshape(4, 96), w, b, policy.isa).view(2, 2, 128))
    assert torch.equal(layer(large), F.linear(large, w, b))


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="this torch has no oneDNN")
@pytest.mark.parametrize("rows", [5, 37])  # a row bucket of its own, and one padded to 48 rows
def test_larger_batches_run_through_onednn_on_the_same_plain_weight_where_the_policy_says(rows):
    """AMD CPUs' policy: above the GEMV's rows, oneDNN on the plain weight (no packed copy), eagerly and in
    compiled graphs (through `mrv2::onednn_linear`, which Inductor calls as it is)."""
    policy = DenseGemvPolicy(ISAS[-1], max_rows=4, onednn_above=True)
    torch.manual_seed(5)
    layer = Linear(96, [80], True, torch.float32)
    layer.weight.data.normal_()
    layer.bias.data.normal_()
    assert layer.use_dense_gemv(policy)
    x = torch.randn(rows, 96)
    bucket = pad_rows(x, padded_rows(rows))  # oneDNN's kernels per row count are bounded (`layers/packed.py`)
    want = torch.ops.mkldnn._linear_pointwise(bucket, layer.weight, layer.bias, "none", [], "")[:rows]
    got = layer(x)
    _close(got, _reference(x, layer.weight, layer.bias), 96)
    assert torch.equal(got, want)
    compiled = torch.compile(lambda t: torch.relu(layer(t)), dynamic=False)
    torch.testing.assert_close(compiled(x), torch.relu(got), rtol=0, atol=0)


def test_only_plain_float32_weights_take_it():
    policy = DenseGemvPolicy(ISAS[-1], max_rows=16)
    assert not Linear(32, [16], False, torch.bfloat16).use_dense_gemv(policy)
    tiled = Linear(32, [16], False, torch.float32)
    tiled.row_tile = 8  # batch-invariant mode: fixed tiles through torch
    assert not tiled.use_dense_gemv(policy)
    packed = Linear(32, [16], False, torch.float32)
    if packed.pack(64):  # oneDNN's layout replaces the plain weight
        assert not packed.use_dense_gemv(policy)


def test_compiled_code_calls_each_layers_weight_through_one_graph():
    from torch._dynamo.testing import CompileCounterWithBackend

    policy = DenseGemvPolicy(ISAS[-1], max_rows=16)
    torch.manual_seed(4)
    layers = []
    for _ in range(2):
        layer = Linear(96, [80], True, torch.float32)
        layer.weight.data.normal_()
        layer.bias.data.normal_()
        assert layer.use_dense_gemv(policy)
        layers.append(layer)

    def block(layer: Linear, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(layer(x * 2))

    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(block, backend=counter, dynamic=False)
    x = torch.randn(1, 96)
    for layer in layers:  # a graph that baked one layer's weight in would give the other's result
        assert torch.equal(compiled(layer, x), block(layer, x))
    assert counter.frame_count == 1
