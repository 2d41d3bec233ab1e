"""Request storms: random arrivals, shared prefixes, n > 1 and aborts at random steps under a small KV
cache with prefix caching and async scheduling; afterwards every request ended exactly once, greedy
outputs equal their solo runs, and no block, reference, hash entry or slot is left behind."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mrv2 import LLM, SamplingParams
from mrv2.sampling_params import RequestOutputKind

BLOCK_BYTES = 30 * 2 * 3 * 64 * 4 * 16  # fp32 K and V of the default model, one 16-token block
PREFIXES = [[], list(range(300, 340)), list(range(500, 520)) * 2]


@pytest.fixture(scope="module")
def storm_llm():
    return LLM(dtype="float32", max_model_len=256, max_num_seqs=6, max_num_batched_tokens=48,
               kv_cache_memory=10 * BLOCK_BYTES + (1 << 16), async_scheduling=True)


@pytest.fixture(scope="module")
def solo_llm(default_llm):
    return default_llm


request_strategy = st.fixed_dictionaries({
    "prefix": st.integers(0, len(PREFIXES) - 1),
    "suffix": st.lists(st.integers(1000, 9000), min_size=4, max_size=16),
    "max_tokens": st.integers(1, 10),
    "n": st.sampled_from([1, 1, 2]),
    "greedy": st.booleans(),
    "arrive": st.integers(0, 8),
    "abort": st.one_of(st.none(), st.integers(0, 14)),
})


def _params(r: dict, seed: int) -> SamplingParams:
    return SamplingParams(n=r["n"], temperature=0.0 if r["greedy"] else 0.9, seed=None if r["greedy"] else seed,
                          max_tokens=r["max_tokens"], ignore_eos=True, output_kind=RequestOutputKind.FINAL_ONLY)


@settings(max_examples=6, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(storm=st.lists(request_strategy, min_size=5, max_size=10))
def test_a_storm_ends_every_request_once_and_leaks_nothing(storm_llm, solo_llm, storm):
    engine = storm_llm.engine
    requests = []
    for i, r in enumerate(storm):
        prompt = PREFIXES[r["prefix"]] + r["suffix"]
        requests.append((r, engine.make_request({"prompt_token_ids": prompt}, _params(r, seed=i))))
    finished: dict[str, list] = {}
    step = 0
    while step < 400:
        for r, request in requests:
            if r["arrive"] == step:
                engine.add_request(request)
            if r["abort"] == step and r["arrive"] <= step:
                engine.abort([request.req_id])
        for out in engine.step():
            finished.setdefault(out.request_id, []).append(out)
        step += 1
        if step > 15 and not engine.has_unfinished_requests():
            break
    assert not engine.has_unfinished_requests()
    for r, request in requests:
        outs = finished.get(request.req_id, [])
        aborted = r["abort"] is not None and r["abort"] >= r["arrive"]
        assert len(outs) <= 1  # final-only: at most one output, and never after an abort
        if not aborted:
            assert len(outs) == 1 and outs[0].finished
        if outs:
            completions = outs[0].outputs
            assert len(completions) == r["n"] and all(len(c.token_ids) == r["max_tokens"] for c in completions)
            if r["greedy"]:  # greedy equals the request run alone, on a fresh cache
                solo = solo_llm.generate({"prompt_token_ids": request.prompt_token_ids},
                                         SamplingParams(temperature=0, max_tokens=r["max_tokens"],
                                                        ignore_eos=True))[0].outputs[0].token_ids
                assert all(c.token_ids == solo for c in completions)
    engine.step()  # the runner releases the last slots
    pool = engine.scheduler.block_pool
    assert pool.is_whole() and all(c == 0 for c in pool.ref_cnt[1:])
    for block in range(1, pool.num_blocks):  # the hash table and the blocks agree
        h = pool.block_hash[block]
        assert h is None or pool.cached_block(h) == block
    assert pool.num_cached_blocks == sum(h is not None for h in pool.block_hash)
    assert engine.runner.states.num_free_slots == engine.runner.max_num_reqs
    assert not engine.scheduler.requests and not engine.output_processor._states


def test_the_storms_above_preempted_and_hit_the_prefix_cache(storm_llm):
    """Runs after the storms (file order): the small cache made them preempt, and prefixes were shared."""
    scheduler = storm_llm.engine.scheduler
    assert scheduler.num_preemptions > 0 and scheduler.kv_cache_manager.num_hit_tokens > 0
