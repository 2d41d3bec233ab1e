"""Fixed-tile matmuls: the values of F.linear, and a row's result bitwise independent of the other rows."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mrv2.layers.batch_invariant import ROW_TILE, tiled_grouped_linear, tiled_linear


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(576, 576), (1536, 576), (576, 1536)])
def test_a_row_does_not_depend_on_the_batch(dtype, shape):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(*shape, generator=g).to(dtype)
    x = torch.randn(80, shape[1], generator=g).to(dtype)
    ref = tiled_linear(x[:1], w)[0]
    torch.testing.assert_close(ref.float(), F.linear(x[:1], w)[0].float(), rtol=2e-2, atol=2e-2)
    for rows in (2, 3, ROW_TILE - 1, ROW_TILE, ROW_TILE + 1, 33, 80):
        assert torch.equal(tiled_linear(x[:rows], w)[0], ref)
    for pos in range(1, ROW_TILE + 3):  # at any position of a tile, beside any other rows
        others = torch.randn(ROW_TILE + 3, shape[1], generator=g).to(dtype)
        others[pos] = x[0]
        assert torch.equal(tiled_linear(others, w)[pos], ref)


def test_bias_shapes_and_empty_input():
    w, b = torch.randn(7, 5), torch.randn(7)
    x = torch.randn(3, 4, 5)  # leading dims kept
    torch.testing.assert_close(tiled_linear(x, w, b), F.linear(x, w, b))
    assert tiled_linear(torch.empty(0, 5), w).shape == (0, 7)


def test_grouped_rows_by_expert():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(4, 24, 16, generator=g)  # 4 experts, [out, in]
    x = torch.randn(30, 16, generator=g)
    ends = torch.tensor([5, 5, 21, 30])  # expert 1 gets no rows
    out = tiled_grouped_linear(x, w, ends)
    want = torch.cat([F.linear(x[a:b], w[e]) for e, (a, b) in enumerate(zip([0, 5, 5, 21], [5, 5, 21, 30]))])
    torch.testing.assert_close(out, want)
    # Expert 2's first row, with the other experts' rows changed or gone: bitwise the same.
    alone = tiled_grouped_linear(x[5:6], w, torch.tensor([0, 0, 1, 1]))
    assert torch.equal(alone[0], out[5])
