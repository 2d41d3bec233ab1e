"""Staged writes: ragged host diffs applied to device state in one index_copy per tensor."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mrv2.staged_writes import StagedRowWriter, StagedScalarWriter


def _random_ragged_writes(rng: np.random.Generator, rows: int, width: int, n: int):
    """`n` random (row, start, values) writes, pairwise non-overlapping (their order is then irrelevant)."""
    taken = np.zeros((rows, width), dtype=bool)
    writes = []
    while len(writes) < n:
        row = int(rng.integers(rows))
        start = int(rng.integers(width))
        length = int(rng.integers(1, width - start + 1))
        if taken[row, start:start + length].any():
            continue
        taken[row, start:start + length] = True
        writes.append((row, start, rng.integers(-10**12, 10**12, size=length)))
    return writes


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_ragged_writes_match_a_naive_loop(dtype):
    rng = np.random.default_rng(0)
    rows, width = 7, 13
    target = torch.full((rows, width), -1, dtype=dtype)
    expected = target.clone()
    writer = StagedRowWriter(target)
    for row, start, values in _random_ragged_writes(rng, rows, width, 25):
        if dtype == torch.int32:
            values = values % 2**31
        writer.stage(row, start, values.tolist() if row % 2 else values)  # lists and arrays both accepted
        for j, v in enumerate(values):
            expected[row, start + j] = int(v)
    assert torch.equal(target, torch.full_like(target, -1)), "stage() must not touch the target"
    writer.apply()
    assert torch.equal(target, expected)


def test_several_stages_one_apply_and_then_cleared():
    target = torch.zeros(4, 8, dtype=torch.int64)
    writer = StagedRowWriter(target)
    writer.stage(0, 0, [1, 2, 3])
    writer.stage(0, 3, [4, 5])  # same row, next columns (as BlockTables.append does)
    writer.stage(2, 5, [9, 9, 9])  # ends exactly at the width
    writer.stage(3, 7, [7])
    writer.stage(1, 4, [])  # empty writes are dropped
    writer.apply()
    expected = torch.zeros(4, 8, dtype=torch.int64)
    expected[0, :5] = torch.tensor([1, 2, 3, 4, 5])
    expected[2, 5:] = 9
    expected[3, 7] = 7
    assert torch.equal(target, expected)
    # A second apply has nothing left to write.
    target.fill_(-3)
    writer.apply()
    assert (target == -3).all()
    # Later applies overwrite earlier ones.
    writer.stage(0, 1, [11])
    writer.apply()
    assert target[0, 1] == 11 and (target.view(-1)[torch.arange(32) != 1] == -3).all()


def test_overflow_raises_and_stages_nothing():
    target = torch.zeros(3, 5, dtype=torch.int64)
    writer = StagedRowWriter(target)
    with pytest.raises(IndexError):
        writer.stage(1, 3, [1, 2, 3])
    with pytest.raises(IndexError):
        writer.stage(0, 5, [1])
    with pytest.raises(IndexError):
        writer.stage(0, -1, [1, 2])
    writer.stage(2, 0, [1, 2, 3, 4, 5])  # exactly the width is fine
    writer.apply()
    assert target[:2].abs().sum() == 0
    assert target[2].tolist() == [1, 2, 3, 4, 5]


def test_row_writer_needs_contiguous_2d():
    with pytest.raises(ValueError):
        StagedRowWriter(torch.zeros(4, dtype=torch.int64))
    with pytest.raises(ValueError):
        StagedRowWriter(torch.zeros(4, 6, dtype=torch.int64).t())


def test_scalar_writer():
    f = torch.full((6,), -1.0)
    i = torch.zeros(6, dtype=torch.int64)
    fw, iw = StagedScalarWriter(f), StagedScalarWriter(i)
    fw.stage(4, 0.25)
    fw.stage(1, 2)
    iw.stage(5, 2**62 - 1)  # seeds: int64 values must survive exactly
    iw.stage(0, -7)
    assert (f == -1).all() and (i == 0).all(), "stage() must not touch the target"
    fw.apply()
    iw.apply()
    assert f.tolist() == [-1.0, 2.0, -1.0, -1.0, 0.25, -1.0]
    assert i.tolist() == [-7, 0, 0, 0, 0, 2**62 - 1]
    f.zero_()
    fw.apply()  # cleared after apply
    assert (f == 0).all()
