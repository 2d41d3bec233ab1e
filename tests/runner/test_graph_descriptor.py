"""Capture sizes, GraphConfig validation, dispatch to descriptors, and padding rules."""

from __future__ import annotations

import numpy as np
import pytest

from mrv2.runner.graphs import (BatchDescriptor, GraphConfig, GraphDispatcher, GraphMode, default_capture_sizes,
                                pad_query_start_loc, padding)

FULL, PIECEWISE, NONE = GraphMode.FULL, GraphMode.PIECEWISE, GraphMode.NONE


def test_default_capture_sizes():
    assert default_capture_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert default_capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert default_capture_sizes(3) == [1, 2, 3]
    assert default_capture_sizes(1) == [1]
    with pytest.raises(ValueError):
        default_capture_sizes(0)


@pytest.mark.parametrize("kwargs", [
    dict(mode="full"), dict(max_capture_size=0), dict(capture_sizes=()), dict(capture_sizes=[1, 2]),
    dict(capture_sizes=(1, 0)), dict(capture_sizes=(2, 2)), dict(capture_sizes=(1.5,)),
    dict(mode=GraphMode.NONE, compile=True), dict(mode=GraphMode.FULL, full_capture_sizes=(1,)),
    dict(mode=GraphMode.FULL_AND_PIECEWISE, full_capture_sizes=()),
    dict(mode=GraphMode.FULL_AND_PIECEWISE, full_capture_sizes=(2, 2)),
])
def test_invalid_config_raises(kwargs):
    with pytest.raises(ValueError):
        GraphConfig(**kwargs)


def test_config_sizes():
    assert GraphConfig().sizes == default_capture_sizes(64)
    assert GraphConfig(capture_sizes=(8, 1, 4)).sizes == [1, 4, 8]


def test_key_lengths():
    assert GraphConfig().key_lengths(8192, 16) == [256, 1024, 4096, 8192]
    assert GraphConfig().key_lengths(154, 16) == [160]  # whole blocks
    assert GraphConfig(seq_len_buckets=(30, 100, 9999)).key_lengths(256, 16) == [32, 112, 256]
    with pytest.raises(ValueError):
        GraphConfig(seq_len_buckets=(0,))


def test_full_dispatch_by_key_length():
    d = GraphDispatcher(GraphConfig(capture_sizes=(1, 4)), max_num_reqs=8, max_num_tokens=64, key_lengths=(64, 256))
    assert [(x.num_reqs, x.max_seq_len) for x in d.descriptors] == [(4, 256), (4, 64), (1, 256), (1, 64)]
    assert d.dispatch(3, 3, 1, 50) == BatchDescriptor(FULL, 4, 4, 1, 64)
    assert d.dispatch(3, 3, 1, 64) == BatchDescriptor(FULL, 4, 4, 1, 64)
    assert d.dispatch(3, 3, 1, 65) == BatchDescriptor(FULL, 4, 4, 1, 256)
    assert d.dispatch(3, 3, 1, 257).mode is NONE  # longer than every bucket: eager
    p = GraphDispatcher(GraphConfig(mode=PIECEWISE, capture_sizes=(8,)), 8, 64, key_lengths=(64, 256))
    assert p.dispatch(3, 3, 1, 1000) == BatchDescriptor(PIECEWISE, 8, 0, 0)  # attention is not captured
    for bad in ((), (256, 64), (64, 64), (-1,)):
        with pytest.raises(ValueError):
            GraphDispatcher(GraphConfig(), 8, 64, key_lengths=bad)


def test_single_modes():
    assert GraphConfig(mode=NONE).single_modes() == []
    assert GraphConfig(mode=FULL).single_modes() == [GraphConfig(mode=FULL)]
    both = GraphConfig(mode=GraphMode.FULL_AND_PIECEWISE, capture_sizes=(1, 8), compile=True)
    full, pieces = both.single_modes()
    assert (full.mode, full.capture_sizes, full.compile) == (FULL, (1, 8), True)
    assert (pieces.mode, pieces.capture_sizes, pieces.compile) == (PIECEWISE, (1, 8), True)
    # FULL graphs of their own sizes.
    full, pieces = GraphConfig(mode=GraphMode.FULL_AND_PIECEWISE, capture_sizes=(1, 8), full_capture_sizes=(1, 2)
                               ).single_modes()
    assert (full.capture_sizes, pieces.capture_sizes) == ((1, 2), (1, 8))
    assert full.full_capture_sizes is None and pieces.full_capture_sizes is None
    with pytest.raises(ValueError, match="single_modes"):
        GraphDispatcher(both, max_num_reqs=8, max_num_tokens=8)


def test_full_descriptors_largest_first_and_smallest_fit():
    d = GraphDispatcher(GraphConfig(capture_sizes=(1, 2, 4, 8)), max_num_reqs=16, max_num_tokens=256)
    assert d.descriptors == [BatchDescriptor(FULL, n, n, 1) for n in (8, 4, 2, 1)]
    assert d.dispatch(1, 1, 1) == BatchDescriptor(FULL, 1, 1, 1)
    assert d.dispatch(3, 3, 1) == BatchDescriptor(FULL, 4, 4, 1)
    assert d.dispatch(8, 8, 1) == BatchDescriptor(FULL, 8, 8, 1)
    assert d.dispatch(5, 5, 1) in d.descriptors


def test_full_only_for_uniform_decode():
    d = GraphDispatcher(GraphConfig(capture_sizes=(1, 2, 4, 8)), max_num_reqs=16, max_num_tokens=256)
    assert d.dispatch(9, 9, 1) == BatchDescriptor(NONE, 9, 9, 1)  # above the largest size
    assert d.dispatch(7, 3, 0) == BatchDescriptor(NONE, 7, 3, 0)  # mixed
    assert d.dispatch(6, 3, 2) == BatchDescriptor(NONE, 6, 3, 2)  # uniform, but not the decode length


def test_full_with_speculative_decode_len():
    d = GraphDispatcher(GraphConfig(capture_sizes=(1, 2, 4)), max_num_reqs=16, max_num_tokens=256,
                        decode_query_len=3)
    assert d.descriptors == [BatchDescriptor(FULL, 3 * n, n, 3) for n in (4, 2, 1)]
    assert d.dispatch(9, 3, 3) == BatchDescriptor(FULL, 12, 4, 3)
    assert d.dispatch(3, 3, 1).mode is NONE


def test_sizes_clamped_to_runner_limits():
    d = GraphDispatcher(GraphConfig(), max_num_reqs=20, max_num_tokens=256)
    assert [x.num_reqs for x in d.descriptors] == [20, 16, 8, 4, 2, 1]
    assert d.dispatch(17, 17, 1) == BatchDescriptor(FULL, 20, 20, 1)
    p = GraphDispatcher(GraphConfig(mode=PIECEWISE, capture_sizes=(8, 64)), max_num_reqs=4, max_num_tokens=30)
    assert [x.num_tokens for x in p.descriptors] == [30, 8]


def test_piecewise_keys_by_tokens_for_any_batch():
    d = GraphDispatcher(GraphConfig(mode=PIECEWISE, capture_sizes=(4, 8, 16)), max_num_reqs=8, max_num_tokens=64)
    assert d.descriptors == [BatchDescriptor(PIECEWISE, t, 0, 0) for t in (16, 8, 4)]
    assert d.dispatch(7, 3, 0) == BatchDescriptor(PIECEWISE, 8, 0, 0)
    assert d.dispatch(3, 3, 1) == BatchDescriptor(PIECEWISE, 4, 0, 0)
    assert d.dispatch(17, 2, 0) == BatchDescriptor(NONE, 17, 2, 0)


def test_mode_none_is_always_eager():
    d = GraphDispatcher(GraphConfig(mode=NONE), max_num_reqs=8, max_num_tokens=64)
    assert d.descriptors == []
    assert d.dispatch(1, 1, 1) == BatchDescriptor(NONE, 1, 1, 1)


def test_dispatch_rejects_impossible_sizes():
    d = GraphDispatcher(GraphConfig(), max_num_reqs=8, max_num_tokens=64)
    with pytest.raises(ValueError):
        d.dispatch(2, 3, 0)
    with pytest.raises(ValueError):
        d.dispatch(0, 0, 0)


def test_padding_per_mode():
    assert padding(3, 3, BatchDescriptor(FULL, 4, 4, 1)) == (4, 4)
    assert padding(7, 3, BatchDescriptor(PIECEWISE, 8, 0, 0)) == (8, 3)
    assert padding(9, 9, BatchDescriptor(NONE, 9, 9, 1)) == (9, 9)


def test_pad_query_start_loc():
    qsl = np.array([0, 1, 2, 3, 99], dtype=np.int32)  # entries past num_reqs are stale
    out = pad_query_start_loc(qsl, 3, 8, 8)
    assert out.tolist() == list(range(9)) and out.dtype == np.int32
    spec = pad_query_start_loc(np.array([0, 3, 6]), 2, 4, 12)
    assert spec.tolist() == [0, 3, 6, 9, 12]
    uneven = pad_query_start_loc(np.array([0, 5]), 1, 4, 12)
    assert uneven[-1] == 12 and np.all(np.diff(uneven) >= 0)
    assert pad_query_start_loc(np.array([0, 2, 5]), 2, 2, 5).tolist() == [0, 2, 5]
    with pytest.raises(ValueError):
        pad_query_start_loc(np.array([0, 2, 5]), 2, 2, 6)  # padded tokens but no request to hold them
    with pytest.raises(ValueError):
        pad_query_start_loc(np.array([0, 2, 5]), 2, 4, 4)
