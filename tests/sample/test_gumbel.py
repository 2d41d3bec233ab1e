"""Seeded Gumbel noise: uniformity of the hash, determinism, and the Gumbel-max identity."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch

from mrv2.sample import gumbel
from mrv2.sample.gumbel import (
    _mix32_,
    _to_uniform,
    _vocab_hash,
    gumbel_noise,
    gumbel_sample,
    row_keys,
    uniform,
)


def _seeds_positions(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randint(-(2**63), 2**63 - 1, (n,), generator=g), torch.randint(0, 1 << 20, (n,), generator=g)


def test_uniform_is_strictly_inside_unit_interval_and_uniform() -> None:
    seeds, positions = _seeds_positions(64)
    u = uniform(seeds, positions, 4096).double()
    assert u.dtype == torch.float64 and u.shape == (64, 4096)
    assert u.min() > 0.0 and u.max() < 1.0
    n = u.numel()
    assert abs(u.mean().item() - 0.5) < 4 * math.sqrt(1 / 12 / n)
    assert abs(u.var().item() - 1 / 12) < 1e-3
    counts = torch.histc(u, bins=16, min=0.0, max=1.0)
    expected = n / 16
    chi2 = ((counts - expected) ** 2 / expected).sum().item()
    assert chi2 < 45.0  # 15 dof; p ~ 1e-4
    # Neighbouring rows and neighbouring vocab entries are uncorrelated.
    for a, b in ((u[:-1], u[1:]), (u[:, :-1], u[:, 1:])):
        assert abs(torch.corrcoef(torch.stack([a.flatten(), b.flatten()]))[0, 1].item()) < 0.01


def test_hash_bits_are_balanced() -> None:
    seeds, positions = _seeds_positions(32)
    x = torch.bitwise_xor(row_keys(seeds, positions)[:, None], _vocab_hash(8192, seeds.device)[None, :])
    bits = _mix32_(x, torch.empty_like(x)).long() & 0xFFFFFFFF
    for bit in range(8, 32):  # the 24 bits that make u
        frac = ((bits >> bit) & 1).double().mean().item()
        assert abs(frac - 0.5) < 0.005, bit


def test_uniform_extremes() -> None:
    s = torch.tensor([-(1 << 23), -(1 << 23) + 1, -1, 0, (1 << 23) - 2, (1 << 23) - 1], dtype=torch.int32)
    u = _to_uniform(s << 8, torch.full((), 0.5), torch.empty(6))
    assert u[0].item() == 2.0**-25 and u[1].item() == 3 * 2.0**-25
    assert 1.0 - 2.0**-23 <= u[-1].item() <= 1.0 - 2.0**-24
    assert (u > 0).all() and (u < 1).all() and (u.diff() > 0).all()


def test_gumbel_noise_moments() -> None:
    seeds, positions = _seeds_positions(64)
    g = gumbel_noise(seeds, positions, 4096).double()
    assert torch.isfinite(g).all()
    assert abs(g.mean().item() - 0.5772156649) < 0.01  # Euler-Mascheroni
    assert abs(g.var().item() - math.pi**2 / 6) < 0.03


def test_noise_depends_only_on_seed_position_and_index() -> None:
    seeds, positions = _seeds_positions(8)
    full = gumbel_noise(seeds, positions, 1000)
    perm = torch.tensor([5, 2, 7, 0, 1, 6, 3, 4])
    assert torch.equal(gumbel_noise(seeds[perm], positions[perm], 1000), full[perm])
    assert torch.equal(gumbel_noise(seeds[3:4], positions[3:4], 1000), full[3:4])
    # Noise at index v does not depend on the vocab size.
    assert torch.equal(gumbel_noise(seeds, positions, 300), full[:, :300])
    assert torch.equal(row_keys(seeds, positions), row_keys(seeds, positions))


def test_noise_changes_with_position_and_seed() -> None:
    seeds = torch.zeros(256, dtype=torch.int64)
    positions = torch.arange(256)
    u = uniform(seeds, positions, 64)
    assert len({tuple(row) for row in u.tolist()}) == 256
    other = uniform(seeds + 1, positions, 64)
    assert not torch.isclose(u, other).any(dim=-1).all()


def test_gumbel_sample_is_argmax_of_noisy_logits() -> None:
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(16, 500, generator=g) * 3
    seeds, positions = _seeds_positions(16)
    temperature = torch.rand(16, generator=g) + 0.2
    noise = gumbel_noise(seeds, positions, 500)
    expected = (logits / temperature[:, None] + noise).argmax(dim=-1)
    assert torch.equal(gumbel_sample(logits, seeds, positions, temperature), expected)
    scaled = logits / temperature[:, None]
    assert torch.equal(gumbel_sample(scaled, seeds, positions), expected)
    out = gumbel_sample(scaled, seeds, positions)
    assert out.dtype == torch.int64 and out.device == logits.device


@pytest.mark.parametrize("chunk", [None, 1, 1000, 1 << 30])
def test_chunking_does_not_change_draws(chunk: int | None) -> None:
    logits = torch.randn(7, 300, generator=torch.Generator().manual_seed(2))
    seeds, positions = _seeds_positions(7)
    expected = (logits + gumbel_noise(seeds, positions, 300)).argmax(dim=-1)
    assert torch.equal(gumbel_sample(logits, seeds, positions, chunk_elems=chunk), expected)


def test_neg_inf_logits_never_win() -> None:
    logits = torch.full((4, 100), float("-inf"))
    logits[:, 37] = -1e4
    seeds, positions = _seeds_positions(4)
    assert gumbel_sample(logits, seeds, positions).tolist() == [37] * 4


_BANNED = (r"\bcuda\b", r"\bnpu\b", r"\.item\(", r"\.tolist\(", r"\.cpu\(", r"\.numpy\(", "Generator")


def test_sample_package_is_device_agnostic_and_sync_free() -> None:
    root = Path(gumbel.__file__).parent
    for path in root.glob("*.py"):
        text = path.read_text()
        for banned in _BANNED:
            assert not re.search(banned, text), f"{path.name} matches {banned}"
