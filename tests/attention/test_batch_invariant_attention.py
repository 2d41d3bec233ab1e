"""The batch-invariant attention backend: the dense reference's values, and a query row's output bitwise
the same whatever else its step holds (other requests, chunking, decode or prefill)."""

from __future__ import annotations

import pytest
import torch

from test_torch_paged import HEADS, SCENARIOS, D, Case, make_cache, make_case, make_metadata, reference, step_inputs

from mrv2.attention.batch_invariant import BatchInvariantAttention


def _run(case: Case, heads, layout: str = "joint") -> torch.Tensor:
    cache = make_cache(case, heads, layout, "finite")
    backend = BatchInvariantAttention()
    q, k, v = step_inputs(case)
    out = backend.forward(q, k, v, cache, backend.build_metadata(make_metadata(case)), D ** -0.5)
    assert out.shape == (q.shape[0], heads[0], D)
    return out[:sum(n for _, n in case.reqs)]


@pytest.mark.parametrize("scenario", list(SCENARIOS))
@pytest.mark.parametrize("heads", list(HEADS))
@pytest.mark.parametrize("layout", ["joint", "split"])
def test_matches_dense_reference(scenario, heads, layout):
    case = make_case(SCENARIOS[scenario], HEADS[heads], 4)
    out = _run(case, HEADS[heads], layout)
    torch.testing.assert_close(out.double(), reference(case, D ** -0.5), rtol=1e-4, atol=1e-5)


def _subcase(case: Case, rows: list[int], reqs: list[tuple[int, int]]) -> Case:
    """Requests `rows` of `case` with other (computed, new) splits of the same history."""
    q = []
    for r, (computed, n) in zip(rows, reqs):
        c0, n0 = case.reqs[r]
        assert computed + n <= c0 + n0 and computed + n > c0  # the new tokens cover the case's queries' end
        full_q = torch.cat([torch.randn(c0, *case.q[r].shape[1:]), case.q[r]])  # queries before c0: any values
        q.append(full_q[computed:computed + n])
    return Case(reqs=reqs, q=q, k=[case.k[r][:c + n] for r, (c, n) in zip(rows, reqs)],
                v=[case.v[r][:c + n] for r, (c, n) in zip(rows, reqs)], blocks=[case.blocks[r] for r in rows],
                num_blocks=case.num_blocks, max_blocks=case.max_blocks, block_size=case.block_size)


def test_a_row_is_bitwise_the_same_alone_in_a_batch_chunked_or_as_a_decode():
    heads = HEADS["gqa"]
    case = make_case(SCENARIOS["mixed"], heads, 4, seed=5)  # (45, 1), (16, 1), (0, 19), (33, 7), (4, 3)
    batch = _run(case, heads)
    starts = [0]
    for _, n in case.reqs:
        starts.append(starts[-1] + n)
    last = {r: batch[starts[r + 1] - 1] for r in range(len(case.reqs))}  # each request's last query row
    for r in range(len(case.reqs)):
        alone = _run(_subcase(case, [r], [case.reqs[r]]), heads)
        assert torch.equal(alone, batch[starts[r]:starts[r + 1]])
    # Request 3's last token (position 39) as a decode, and inside a longer chunk beside other requests.
    as_decode = _run(_subcase(case, [3], [(39, 1)]), heads)
    chunked = _run(_subcase(case, [0, 3, 2], [(45, 1), (30, 10), (0, 19)]), heads)
    assert torch.equal(as_decode[0], last[3]) and torch.equal(chunked[1 + 9], last[3])
