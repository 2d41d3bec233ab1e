"""SamplingStates: per-slot parameters staged to the device, and the host flags derived in one place."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mrv2.sample.states import SamplingStates
from mrv2.sampling_params import SamplingParams

CPU = torch.device("cpu")
VOCAB = 100


def make_states(max_num_reqs: int = 4, seed: int = 0) -> SamplingStates:
    return SamplingStates(max_num_reqs, VOCAB, CPU, pin_memory=False, seed=seed)


def _metadata(s: SamplingStates, slots: list[int]):
    idx = np.asarray(slots, dtype=np.int64)
    return s.metadata(s.host_flags(idx), torch.from_numpy(idx), torch.arange(len(slots), dtype=torch.int64))


def test_add_request_stages_params():
    s = make_states()
    s.add_request(1, SamplingParams(temperature=0.0, top_k=-1, top_p=0.5, min_p=0.1, seed=1234))
    s.add_request(2, SamplingParams(temperature=0.7, top_k=20))
    # The host mirrors change at once; the device only at apply_staged_writes().
    assert s.temperature_cpu[2] == pytest.approx(0.7) and s.temperature.abs().sum() == 0
    s.apply_staged_writes()
    assert s.temperature[1] == 0.0 and s.temperature[2] == pytest.approx(0.7)
    assert s.top_k[1] == 0 and s.top_k[2] == 20  # -1 (disabled) is stored as 0
    assert s.top_p[1] == 0.5 and s.min_p[1] == pytest.approx(0.1)
    assert s.seeds[1] == 1234
    for name in ("temperature", "top_k", "top_p", "min_p"):
        np.testing.assert_array_equal(getattr(s, name + "_cpu")[:3], getattr(s, name)[:3].numpy())


def test_unseeded_requests_get_distinct_reproducible_seeds():
    seeds = []
    for _ in range(2):
        s = make_states(seed=7)
        for slot in range(3):
            s.add_request(slot, SamplingParams())
        s.apply_staged_writes()
        seeds.append(s.seeds[:3].tolist())
    assert seeds[0] == seeds[1]
    assert len(set(seeds[0])) == 3


def test_metadata_gathers_rows_and_derives_every_host_flag():
    s = make_states()
    s.add_request(0, SamplingParams(temperature=0.0))
    s.add_request(1, SamplingParams(temperature=1e-6))  # greedy too: the one rule
    s.add_request(2, SamplingParams(temperature=0.8, top_k=50, seed=3))
    s.add_request(3, SamplingParams(temperature=1.0, top_k=20, top_p=0.9, min_p=0.05))
    s.apply_staged_writes()
    md = _metadata(s, [1, 0])
    assert (md.all_greedy, md.all_random, md.no_top_k, md.no_top_p, md.no_min_p, md.max_top_k) == (
        True, False, True, True, True, None)
    md = _metadata(s, [3, 0, 2])
    assert md.temperature.tolist() == pytest.approx([1.0, 0.0, 0.8]) and md.top_k.tolist() == [20, 0, 50]
    assert md.seeds[2] == 3 and md.positions.tolist() == [0, 1, 2]
    assert (md.all_greedy, md.all_random, md.no_top_k, md.no_top_p, md.no_min_p) == (
        False, False, False, False, False)
    assert md.max_top_k == 50  # the fast path's bound: the largest top-k in the batch
    s.add_request(0, SamplingParams(top_p=0.5))  # top-p without top-k: bounded by the vocab only
    assert _metadata(s, [0, 2]).max_top_k == VOCAB
    assert _metadata(s, [2]).all_random


def test_min_tokens_rows_carry_eos_and_stop_ids_with_the_prompt_origin():
    s = make_states()
    s.add_request(0, SamplingParams(max_tokens=8))
    s.add_request(1, SamplingParams(min_tokens=3, max_tokens=8, stop_token_ids=[11]), prompt_len=5,
                  eos_token_ids=(2, 9))
    s.apply_staged_writes()
    assert _metadata(s, [0]).min_tokens is None  # no row has a minimum: the sampler skips it
    md = _metadata(s, [0, 1]).min_tokens
    assert md.min_tokens.tolist() == [0, 3] and md.prompt_len.tolist() == [0, 5]
    assert sorted(t for t in md.stop_ids[1].tolist() if t >= 0) == [2, 9, 11]
