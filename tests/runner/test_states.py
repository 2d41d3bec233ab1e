"""Slot-based request state: slot lifetime, staged admission, and the device post-update."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mrv2.engine.scheduler_output import NewRequestData
from mrv2.runner.states import RequestStates
from mrv2.sampling_params import SamplingParams

CPU = torch.device("cpu")


def new_req(req_id: str, tokens: list[int], computed: int = 0, **params) -> NewRequestData:
    return NewRequestData(req_id=req_id, prompt_token_ids=list(tokens), all_token_ids=list(tokens),
                          sampling_params=SamplingParams(**params), block_ids=[], num_computed_tokens=computed)


def make_states(max_num_reqs: int = 4, max_model_len: int = 16) -> RequestStates:
    return RequestStates(max_num_reqs, max_model_len, CPU, pin_memory=False)


def step(states: RequestStates, rows: list[tuple[int, int, int]]) -> None:
    """post_update for [(slot, num_scheduled, sampled token)] in that batch order."""
    idx = np.array([r[0] for r in rows], dtype=np.int64)
    n = np.array([r[1] for r in rows], dtype=np.int64)
    sampled = torch.tensor([r[2] for r in rows], dtype=torch.int64)
    states.post_update(torch.from_numpy(idx), torch.from_numpy(n).int(), sampled, idx, n)


def test_slot_allocation_and_reuse():
    s = make_states(max_num_reqs=3)
    assert s.num_free_slots == 3
    assert [s.add(new_req(r, [1, 2])) for r in "abc"] == [0, 1, 2]
    assert s.num_free_slots == 0
    with pytest.raises(RuntimeError, match="no free request slot"):
        s.add(new_req("d", [1]))
    with pytest.raises(ValueError, match="already"):
        s.add(new_req("a", [1]))
    assert s.remove("b") == 1
    assert s.remove("b") is None and s.remove("never") is None
    assert s.slot_of == {"a": 0, "c": 2}, "removal must not move the other requests"
    assert s.add(new_req("d", [3])) == 1  # the freed slot is reused
    assert s.slot_of == {"a": 0, "c": 2, "d": 1}
    # A preempted request comes back as new: it gets a (possibly different) free slot.
    s.remove("a")
    s.remove("c")
    assert s.add(new_req("c", [5, 6, 7])) in (0, 2)


def test_add_stages_tokens_and_progress():
    s = make_states(max_num_reqs=4, max_model_len=8)
    s.add(new_req("x", [5, 6, 7]))
    slot_y = s.add(new_req("y", [9, 8, 7, 6, 5], computed=2))
    slot_z = s.add(new_req("z", [4]))
    # The host mirror is updated at once; the device only at apply_staged().
    assert s.num_tokens_cpu[slot_y] == 5 and s.num_computed_cpu[slot_y] == 2
    assert s.token_ids.abs().sum() == 0 and s.num_tokens.abs().sum() == 0
    s.apply_staged()

    assert s.token_ids[slot_y].tolist() == [9, 8, 7, 6, 5, 0, 0, 0, 0]  # max_model_len + 1 columns
    assert s.token_ids[0, :3].tolist() == [5, 6, 7] and s.token_ids[slot_z, :1].tolist() == [4]
    assert s.num_tokens.tolist() == [3, 5, 1, 0]
    assert s.num_computed.tolist() == [0, 2, 0, 0]
    # The host mirrors agree with the device.
    for name in ("num_tokens", "num_computed"):
        np.testing.assert_array_equal(getattr(s, name + "_cpu")[:3], getattr(s, name)[:3].numpy())


def test_post_update_prefill_done_partial_and_decode():
    s = make_states(max_num_reqs=6, max_model_len=12)
    full = s.add(new_req("full", [1, 2, 3, 4, 5]))  # whole prompt this step
    part = s.add(new_req("part", [1, 2, 3, 4, 5, 6, 7, 8]))  # first chunk only
    cached = s.add(new_req("cached", [7, 7, 7, 7, 7, 7], computed=4))  # prefix cached, rest this step
    dec = s.add(new_req("dec", [3, 1, 4, 1], computed=3))  # decode of its last token
    s.apply_staged()
    before = s.token_ids.clone()

    # Batch order differs from slot order: rows are matched by idx_mapping, not position.
    step(s, [(dec, 1, 40), (part, 3, 41), (full, 5, 42), (cached, 2, 43)])

    assert s.token_ids[full, :6].tolist() == [1, 2, 3, 4, 5, 42]
    assert s.num_tokens[full] == 6 and s.num_computed[full] == 5
    assert torch.equal(s.token_ids[part], before[part]), "a partial prefill must not append"
    assert s.num_tokens[part] == 8 and s.num_computed[part] == 3
    assert s.token_ids[cached, :7].tolist() == [7] * 6 + [43]
    assert s.num_tokens[cached] == 7 and s.num_computed[cached] == 6
    assert s.token_ids[dec, :5].tolist() == [3, 1, 4, 1, 40]
    assert s.num_tokens[dec] == 5 and s.num_computed[dec] == 4

    # Next step: the rest of "part" completes and appends at position 8; "full" decodes.
    step(s, [(full, 1, 50), (part, 5, 51)])
    assert s.token_ids[part, :9].tolist() == [1, 2, 3, 4, 5, 6, 7, 8, 51]
    assert s.num_tokens[part] == 9 and s.num_computed[part] == 8
    assert s.token_ids[full, :7].tolist() == [1, 2, 3, 4, 5, 42, 50]
    for name in ("num_tokens", "num_computed"):
        np.testing.assert_array_equal(getattr(s, name + "_cpu"), getattr(s, name).numpy())


def test_post_update_at_length_limit_uses_spare_column():
    s = make_states(max_num_reqs=2, max_model_len=4)
    slot = s.add(new_req("a", [1, 2, 3, 4], computed=3))
    s.apply_staged()
    step(s, [(slot, 1, 9)])
    assert s.token_ids[slot].tolist() == [1, 2, 3, 4, 9]
    assert s.num_tokens[slot] == 5 and s.num_tokens_cpu[slot] == 5


def test_random_steps_device_matches_host_and_naive_model():
    rng = np.random.default_rng(1)
    max_reqs, max_len = 6, 40
    s = make_states(max_num_reqs=max_reqs, max_model_len=max_len)
    live: dict[str, dict] = {}  # naive model: tokens and computed count per request
    next_id = 0
    for _ in range(60):
        # Finish / preempt some requests, admit some (possibly with a cached prefix).
        for req_id in list(live):
            if rng.random() < 0.15 or len(live[req_id]["tokens"]) >= max_len:
                s.remove(req_id)
                del live[req_id]
        while s.num_free_slots and rng.random() < 0.5:
            req_id, next_id = f"r{next_id}", next_id + 1
            tokens = rng.integers(1, 1000, size=int(rng.integers(1, 12))).tolist()
            computed = int(rng.integers(0, len(tokens)))
            slot = s.add(new_req(req_id, tokens, computed=computed))
            live[req_id] = {"tokens": tokens, "computed": computed, "slot": slot}
        s.apply_staged()
        if not live:
            continue
        # Schedule every live request: the rest of its prefill (maybe chunked) or one decode token.
        batch = [r for r in live if rng.random() < 0.8]
        rng.shuffle(batch)
        rows = []
        for req_id in batch:
            st = live[req_id]
            remaining = len(st["tokens"]) - st["computed"]
            n = int(rng.integers(1, remaining + 1))
            sampled = int(rng.integers(1, 1000))
            rows.append((st["slot"], n, sampled))
            st["computed"] += n
            if st["computed"] >= len(st["tokens"]):
                st["tokens"].append(sampled)
        if rows:
            step(s, rows)
        for name in ("num_tokens", "num_computed"):
            np.testing.assert_array_equal(getattr(s, name + "_cpu"), getattr(s, name).numpy(), err_msg=name)
        for st in live.values():
            n = len(st["tokens"])
            assert s.num_tokens_cpu[st["slot"]] == n
            assert s.num_computed_cpu[st["slot"]] == st["computed"]
            assert s.token_ids[st["slot"], :n].tolist() == st["tokens"]
    assert next_id > 10


def test_one_token_rows_update_as_the_general_case_does():
    # post_update_device with [B] samples (one token a row) takes a shorter path; fed the same rows as
    # [B, 1] it takes the general one: both leave the same state, partial prefills included.
    rng = np.random.default_rng(2)
    short, general = make_states(6, 30), make_states(6, 30)
    for req_id, tokens, computed in (("a", [5, 6, 7], 0), ("b", [1] * 9, 2), ("c", [4, 4], 1), ("d", [9] * 5, 4)):
        for s in (short, general):
            s.add(new_req(req_id, tokens, computed=computed))
            s.apply_staged()
    for _ in range(12):
        idx = torch.from_numpy(rng.permutation(4)[:int(rng.integers(1, 5))])
        left = (short.num_tokens[idx] - short.num_computed[idx]).clamp(min=1)
        n = torch.minimum(left, torch.from_numpy(rng.integers(1, 4, size=len(idx))).int())
        sampled = torch.from_numpy(rng.integers(1, 1000, size=len(idx)))
        got = short.post_update_device(idx, n, sampled)
        want = general.post_update_device(idx, n, sampled[:, None])
        assert torch.equal(got, want)
        for name in ("token_ids", "num_tokens", "num_computed"):
            assert torch.equal(getattr(short, name), getattr(general, name)), name
    assert (short.num_tokens > torch.tensor([3, 9, 2, 5, 0, 0], dtype=torch.int32)).sum() >= 3  # tokens appended
