"""Sampler: greedy, seeded determinism, distribution, and top-k / top-p / min-p semantics."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mrv2.sample import Sampler, SamplingMetadata, apply_min_p, apply_top_k_top_p
from mrv2.sample.sampler import greedy_argmax

sampler = Sampler()


def _logits(rows: int, vocab: int, seed: int = 0, scale: float = 3.0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * scale


def _md(
    n: int,
    vocab: int,
    temperature: float | list[float] = 1.0,
    seed: int | list[int] = 7,
    positions: list[int] | None = None,
    **filters,
) -> SamplingMetadata:
    temps = temperature if isinstance(temperature, list) else [temperature] * n
    seeds = seed if isinstance(seed, list) else [seed] * n
    positions = list(range(n)) if positions is None else positions
    lists = {k: (v if isinstance(v, list) else [v] * n) for k, v in filters.items()}
    return SamplingMetadata.from_lists(temps, seeds, positions, vocab, **lists)


def _vllm_top_k_top_p(logits: torch.Tensor, k: torch.Tensor | None, p: torch.Tensor | None) -> torch.Tensor:
    """vLLM's sort-and-scatter reference (k already mapped to vocab when disabled)."""
    logits_sort, logits_idx = logits.sort(dim=-1, descending=False)
    if k is not None:
        threshold = logits_sort.gather(1, (logits_sort.size(1) - k.long()).unsqueeze(1))
        logits_sort.masked_fill_(logits_sort < threshold, -math.inf)
    if p is not None:
        probs_sum = logits_sort.softmax(dim=-1).cumsum(dim=-1)
        mask = probs_sum <= 1 - p.unsqueeze(1)
        mask[:, -1] = False
        logits_sort.masked_fill_(mask, -math.inf)
    return logits_sort.scatter(dim=-1, index=logits_idx, src=logits_sort)


def _draws(logits: torch.Tensor, n: int, **kwargs) -> torch.Tensor:
    """n seeded draws (positions 0..n-1) from one row of logits."""
    return sampler(logits.expand(n, -1).contiguous(), _md(n, logits.shape[-1], **kwargs))


def test_all_greedy_is_argmax() -> None:
    logits = _logits(9, 300)
    md = _md(9, 300, temperature=0.0)
    assert md.all_greedy and not md.all_random
    out = sampler(logits, md)
    assert out.dtype == torch.int64 and torch.equal(out, logits.argmax(dim=-1))


def test_mixed_batch_greedy_rows_are_argmax_and_random_rows_match_solo() -> None:
    logits = _logits(6, 400)
    rows = {
        "temperature": [0.0, 1.0, 0.0, 0.8, 1.3, 0.0],
        "seed": [1, 2, 3, 4, 5, 6],
        "positions": [0, 1, 2, 3, 4, 5],
        "top_k": [0, 50, 5, 0, 20, 0],
        "top_p": [1.0, 0.9, 0.5, 1.0, 0.7, 1.0],
        "min_p": [0.0, 0.0, 0.1, 0.05, 0.0, 0.0],
    }
    md = _md(6, 400, **rows)
    assert not md.all_greedy and not md.all_random
    out = sampler(logits, md)
    greedy = [0, 2, 5]
    assert torch.equal(out[greedy], logits[greedy].argmax(dim=-1))
    for i in (1, 3, 4):
        solo = _md(1, 400, **{name: [values[i]] for name, values in rows.items()})
        assert sampler(logits[i : i + 1], solo).item() == out[i].item()


@pytest.mark.parametrize(
    "filters", [{}, {"top_k": 40}, {"top_p": 0.8}, {"min_p": 0.02}, {"top_k": 100, "top_p": 0.9}]
)
def test_seeded_draw_is_independent_of_batch_and_row(filters: dict) -> None:
    vocab = 1000
    logits = _logits(8, vocab, scale=1.0)
    seeds, positions = [11, 22, 33, 44, 55, 66, 77, 88], [5, 0, 9, 100, 3, 7, 1, 2]
    out = sampler(logits, _md(8, vocab, seed=seeds, positions=positions, **filters))
    perm = [3, 7, 0, 5, 1, 6, 2, 4]
    md = _md(8, vocab, seed=[seeds[i] for i in perm], positions=[positions[i] for i in perm], **filters)
    shuffled = sampler(logits[perm], md)
    assert torch.equal(shuffled, out[perm])
    # Same request next to different neighbours, in a different row.
    others = _logits(3, vocab, seed=5)
    mixed = torch.cat([others[:2], logits[4:5], others[2:]])
    temps = [0.0, 0.5, 1.0, 2.0]
    md = _md(4, vocab, temperature=temps, seed=[1, 2, 55, 3], positions=[9, 9, 3, 9], **filters)
    assert sampler(mixed, md)[2].item() == out[4].item()


def test_different_positions_and_seeds_give_different_draws() -> None:
    flat = torch.zeros(1, 1000)
    by_position = _draws(flat, 200)
    assert len(set(by_position.tolist())) > 150
    md = _md(200, 1000, seed=list(range(200)), positions=[0] * 200)
    by_seed = sampler(flat.expand(200, -1).contiguous(), md)
    assert len(set(by_seed.tolist())) > 150
    assert not torch.equal(by_seed, by_position)


def _chi2(samples: torch.Tensor, probs: torch.Tensor) -> float:
    counts = torch.bincount(samples, minlength=probs.numel()).double()
    expected = probs.double() * samples.numel()
    keep = expected > 0
    assert counts[~keep].sum() == 0, "sampled a zero-probability token"
    return (((counts - expected) ** 2)[keep] / expected[keep]).sum().item()


@pytest.mark.parametrize("temperature", [1.0, 0.6, 2.0])
def test_empirical_distribution_matches_softmax(temperature: float) -> None:
    logits = torch.tensor([[0.5, -1.0, 2.0, 0.0, 1.2]])
    draws = _draws(logits, 20000, temperature=temperature)
    probs = (logits[0] / temperature).softmax(-1)
    assert _chi2(draws, probs) < 18.5  # 4 dof; p ~ 1e-3, deterministic because seeded


def test_filtered_distribution_is_renormalized_softmax() -> None:
    logits = torch.tensor([[0.5, -1.0, 2.0, 0.0, 1.2, -2.0]])
    probs = logits[0].softmax(-1)  # descending: token 2 (.53), 4 (.24), 0 (.12), 3 (.07), ...
    order = probs.argsort(descending=True)
    # top-k 3
    kept = torch.zeros(6, dtype=torch.bool)
    kept[order[:3]] = True
    expected = torch.where(kept, probs, 0.0)
    assert _chi2(_draws(logits, 20000, top_k=3), expected / expected.sum()) < 16.3  # 2 dof; p ~ 3e-4
    # top-p: the two leading tokens hold < 0.8, three hold >= 0.8
    assert probs[order[:2]].sum() < 0.8 <= probs[order[:3]].sum()
    assert _chi2(_draws(logits, 20000, top_p=0.8), expected / expected.sum()) < 16.3


def test_top_k_only_picks_among_top_k() -> None:
    logits = _logits(1, 500, scale=0.5)
    draws = _draws(logits, 3000, top_k=7)
    top = set(logits[0].topk(7).indices.tolist())
    assert set(draws.tolist()) == top


def test_top_p_stays_in_nucleus_and_tiny_top_p_is_greedy() -> None:
    logits = _logits(1, 500, scale=1.5)
    probs = logits[0].softmax(-1)
    sorted_probs, order = probs.sort(descending=True)
    size = int((sorted_probs.cumsum(0) < 0.6).sum()) + 1
    draws = _draws(logits, 3000, top_p=0.6)
    assert set(draws.tolist()) <= set(order[:size].tolist())
    assert len(set(draws.tolist())) > size // 2
    assert set(_draws(logits, 200, top_p=1e-6).tolist()) == {int(logits.argmax())}


def test_min_p_excludes_tokens_below_threshold() -> None:
    logits = _logits(1, 300, scale=1.5)
    probs = logits[0].softmax(-1)
    allowed = set((probs >= 0.2 * probs.max()).nonzero().flatten().tolist())
    draws = _draws(logits, 3000, min_p=0.2)
    assert set(draws.tolist()) <= allowed and len(set(draws.tolist())) > len(allowed) // 2


def test_small_temperature_approaches_greedy() -> None:
    logits = _logits(16, 1000)
    md = _md(16, 1000, temperature=1e-3, seed=list(range(16)))
    assert md.all_random
    assert torch.equal(sampler(logits, md), logits.argmax(dim=-1))


@pytest.mark.parametrize("use_max_top_k", [False, True])
def test_top_k_top_p_matches_vllm(use_max_top_k: bool) -> None:
    vocab = 2000
    logits = _logits(8, vocab, seed=3)
    logits[:, ::17] = -math.inf  # as left by min-p
    logits[6, 1:] = -math.inf  # a single candidate
    top_k = torch.tensor([0, 1, 5, 50, 0, 300, 1999, 2000], dtype=torch.int32)
    top_p = torch.tensor([0.9, 1.0, 0.5, 0.95, 1.0, 0.3, 1e-6, 0.7])
    max_top_k = 300 if use_max_top_k else None
    if use_max_top_k:  # rows using top-p must have a top-k within the bound
        top_k = torch.tensor([100, 1, 5, 50, 0, 300, 200, 250], dtype=torch.int32)
    ref_k = torch.where((top_k <= 0) | (top_k >= vocab), vocab, top_k)
    expected = _vllm_top_k_top_p(logits.clone(), ref_k, top_p)
    assert torch.equal(apply_top_k_top_p(logits.clone(), top_k, top_p, max_top_k), expected)
    expected_k = _vllm_top_k_top_p(logits.clone(), ref_k, None)
    assert torch.equal(apply_top_k_top_p(logits.clone(), top_k, None, max_top_k), expected_k)


def test_int_key_sort_matches_float_sort() -> None:
    from mrv2.sample.sampler import _sorted_ascending

    x = _logits(4, 300, seed=6)
    x[:, ::7] = -math.inf
    x[:, 1::11] = 0.0
    x[:, 2::13] = -0.0
    x[0, 5] = math.inf
    assert torch.equal(_sorted_ascending(x), x.sort(dim=-1).values)
    assert torch.equal(_sorted_ascending(x.double()), x.double().sort(dim=-1).values)


def test_min_p_matches_vllm() -> None:
    logits = _logits(6, 1000, seed=4)
    min_p = torch.tensor([0.0, 0.01, 0.05, 0.1, 0.5, 1.0])
    probs = logits.softmax(-1)
    expected = logits.masked_fill(probs < min_p[:, None] * probs.amax(-1, keepdim=True), -math.inf)
    assert torch.equal(apply_min_p(logits.clone(), min_p), expected)


def test_metadata_flags() -> None:
    md = _md(3, 100, temperature=[0.0, 0.7, 1.0], top_k=[0, 100, -1], top_p=[1.0, 1.0, 1.0], min_p=0.0)
    flags = (md.all_greedy, md.all_random, md.no_top_k, md.no_top_p, md.no_min_p)
    assert flags == (False, False, True, True, True)
    assert md.max_top_k is None
    md = _md(3, 100, top_k=[0, 10, 20], top_p=[0.9, 1.0, 1.0])
    assert not md.no_top_k and not md.no_top_p and md.max_top_k == 100
    md = _md(2, 100, top_k=[10, 20])
    assert md.max_top_k == 20 and md.top_k.dtype == torch.int32 and md.seeds.dtype == torch.int64


def test_host_flags_only_skip_work() -> None:
    """Conservative flags (all False) give the same draws as exact ones."""
    logits = _logits(5, 700, seed=9)
    md = _md(5, 700, temperature=[0.0, 1.0, 0.5, 1.0, 2.0], seed=[3, 4, 5, 6, 7], top_k=[0, 0, 30, 0, 0])
    conservative = replace(md, no_top_p=False, no_min_p=False, max_top_k=None)
    assert torch.equal(sampler(logits, md), sampler(logits, conservative))


@pytest.mark.parametrize("filters", [{}, {"top_k": 20, "min_p": 0.01}])
def test_chunked_sampling_draws_the_same_tokens(filters) -> None:
    # The platform's sampling_chunk_elems only changes how rows are batched through the noise.
    logits = _logits(9, 300, seed=4)
    md = _md(9, 300, temperature=[0.0, 0.7, 1.3] * 3, seed=list(range(9)), **filters)
    expected = sampler(logits.clone(), md)
    for chunk in (1, 700, 1 << 20):
        assert torch.equal(Sampler(chunk_elems=chunk)(logits.clone(), md), expected)


@pytest.mark.parametrize("rows,vocab,block", [(1, 49152, 1024), (64, 49152, 1024), (5, 32000, 1024),
                                              (3, 151936, 1024), (4, 700, 1024), (2, 40, 8), (3, 41, 8)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_argmax_is_torch_argmax(rows, vocab, block, dtype):
    g = torch.Generator().manual_seed(vocab + rows)
    logits = torch.randn(rows, vocab, generator=g).to(dtype)
    assert torch.equal(greedy_argmax(logits, block), logits.argmax(dim=-1))


@given(st.integers(1, 4), st.integers(9, 80), st.integers(2, 8), st.data())
@settings(max_examples=200, deadline=None)
def test_greedy_argmax_takes_the_first_of_tied_maxima(rows, vocab, block, data):
    # Few distinct values: ties inside a block, across blocks and with the tail, and all -inf rows.
    values = st.sampled_from([float("-inf"), -1.0, 0.0, 2.0, 3.0])
    logits = torch.tensor([[data.draw(values) for _ in range(vocab)] for _ in range(rows)])
    assert torch.equal(greedy_argmax(logits, block), logits.argmax(dim=-1))
