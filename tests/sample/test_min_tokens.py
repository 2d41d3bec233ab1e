"""min_tokens: stop and EOS ids are -inf until the minimum is reached, per row, on the device."""

from __future__ import annotations

import numpy as np
import torch

from mrv2.sample import Sampler, SamplingMetadata
from mrv2.sample.min_tokens import MinTokensState, apply_min_tokens

CPU = torch.device("cpu")
NEG_INF = float("-inf")


def _batch(state: MinTokensState, slots: list[int]):
    idx = np.asarray(slots, dtype=np.int64)
    return state.metadata(torch.from_numpy(idx)) if state.any_active(idx) else None


def test_masks_ids_only_while_output_count_is_below_min_tokens():
    state = MinTokensState(5, CPU, pin_memory=False)
    state.add_request(0, min_tokens=3, prompt_len=4, stop_ids=[7, 2, 2])  # duplicates are fine
    state.add_request(1, min_tokens=3, prompt_len=4, stop_ids=[0, 7])  # token 0 is a real id here
    state.add_request(2, min_tokens=2, prompt_len=6, stop_ids=[])  # nothing to mask
    state.add_request(3, min_tokens=0, prompt_len=1, stop_ids=[5])  # no minimum
    state.apply_staged_writes()
    assert state.stop_ids[0].tolist()[:2] == [2, 7] and state.stop_ids[0, 2:].eq(-1).all()
    md = _batch(state, [0, 1, 2, 3, 0])
    logits = torch.arange(10, dtype=torch.float32).repeat(5, 1)
    positions = torch.tensor([6, 4, 6, 1, 7])  # output counts 2, 0, 0, 0, 3
    out = apply_min_tokens(logits.clone(), md, positions)
    expected = logits.clone()
    expected[0, [2, 7]] = NEG_INF
    expected[1, [0, 7]] = NEG_INF
    assert torch.equal(out, expected)


def test_no_minimum_in_the_batch_skips_entirely():
    state = MinTokensState(4, CPU, pin_memory=False)
    state.add_request(0, min_tokens=0, prompt_len=3, stop_ids=[2])
    state.add_request(1, min_tokens=2, prompt_len=3, stop_ids=[2])
    state.apply_staged_writes()
    assert _batch(state, [0]) is None and _batch(state, [1, 0]) is not None
    state.add_request(1, min_tokens=0, prompt_len=3, stop_ids=[2])  # the slot is reused
    assert _batch(state, [1, 0]) is None


def test_table_grows_for_many_ids_and_keeps_other_rows():
    state = MinTokensState(3, CPU, pin_memory=False, width=2)
    state.add_request(0, min_tokens=1, prompt_len=1, stop_ids=[3, 4])
    state.apply_staged_writes()
    state.add_request(1, min_tokens=1, prompt_len=1, stop_ids=list(range(10, 19)))
    state.apply_staged_writes()
    assert state.stop_ids.shape[1] >= 9
    assert state.stop_ids[0, :2].tolist() == [3, 4] and state.stop_ids[0, 2:].eq(-1).all()
    out = apply_min_tokens(torch.zeros(2, 20), _batch(state, [0, 1]), torch.tensor([1, 1]))
    assert out[0].isinf().nonzero().flatten().tolist() == [3, 4]
    assert out[1].isinf().nonzero().flatten().tolist() == list(range(10, 19))


def test_sampler_applies_it_to_greedy_and_random_rows():
    state = MinTokensState(2, CPU, pin_memory=False)
    for slot in range(2):
        state.add_request(slot, min_tokens=5, prompt_len=3, stop_ids=[9])
    state.apply_staged_writes()
    logits = torch.zeros(2, 10)
    logits[:, 9] = 50.0  # the stop id would win every draw
    logits[:, 4] = 1.0
    md = SamplingMetadata.from_lists([0.0, 1.0], [1, 2], [3, 3], 10)
    assert Sampler()(logits.clone(), md).tolist() == [9, 9]
    md.min_tokens = _batch(state, [0, 1])
    out = Sampler()(logits.clone(), md)
    assert out[0] == 4 and out[1] != 9
