"""n > 1: n completions per prompt, seeded reproducibly, streamed per index, aborted together."""

from __future__ import annotations

import asyncio

import pytest

from mrv2 import LLM, SamplingParams
from mrv2.sampling_params import RequestOutputKind

PROMPT = "The capital of France is"


def test_seeded_completions_equal_single_runs_with_consecutive_seeds(default_llm):
    out = default_llm.generate(PROMPT, SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=10, ignore_eos=True))
    assert len(out) == 1 and [c.index for c in out[0].outputs] == [0, 1, 2]
    singles = default_llm.generate([PROMPT] * 3, [SamplingParams(temperature=1.0, seed=11 + i, max_tokens=10,
                                                                 ignore_eos=True) for i in range(3)])
    assert [c.token_ids for c in out[0].outputs] == [s.outputs[0].token_ids for s in singles]
    again = default_llm.generate(PROMPT, SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=10, ignore_eos=True))
    assert [c.text for c in again[0].outputs] == [c.text for c in out[0].outputs]
    greedy = default_llm.generate(PROMPT, SamplingParams(n=2, temperature=0, max_tokens=8))[0].outputs
    assert greedy[0].token_ids == greedy[1].token_ids
    assert default_llm.engine.scheduler.block_pool.is_whole()


def test_abort_of_the_parent_ends_every_child(default_llm):
    engine = default_llm.engine
    request = engine.make_request(PROMPT, SamplingParams(n=4, temperature=1.0, max_tokens=200, ignore_eos=True))
    engine.add_request(request)
    for _ in range(3):
        engine.step()
    assert len(engine.scheduler.running) == 4
    engine.abort([request.req_id])
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.scheduler.block_pool.is_whole() and not engine.output_processor.has_request(request.req_id)


def test_streamed_outputs_carry_their_index_and_the_last_one_finishes_the_request(async_llm):
    params = SamplingParams(n=2, temperature=1.0, seed=5, max_tokens=6, ignore_eos=True,
                            output_kind=RequestOutputKind.DELTA)

    async def main():
        return [out async for out in async_llm.generate(PROMPT, params)]

    outs = asyncio.run(main())
    assert all(len(o.outputs) == 1 for o in outs) and [o.finished for o in outs].count(True) == 1 and outs[-1].finished
    tokens = {0: [], 1: []}
    for o in outs:
        tokens[o.outputs[0].index] += o.outputs[0].token_ids
    assert len(tokens[0]) == len(tokens[1]) == 6


def test_a_failed_step_or_an_abort_of_one_completion_ends_all_n(default_llm):
    engine = default_llm.engine
    params = SamplingParams(n=2, temperature=1.0, max_tokens=30, ignore_eos=True)
    # One completion of n aborted by its own id: its sibling ends with it.
    request = engine.make_request(PROMPT, params)
    engine.add_request(request)
    engine.step()
    engine.abort([f"0_{request.req_id}"])
    while engine.has_unfinished_requests():
        assert all(o.request_id != request.req_id for o in engine.step())
    assert not engine.output_processor.has_request(request.req_id)
    # A step that fails while only one completion of n is in it (the other waits for a slot).
    small = LLM(dtype="float32", max_model_len=256, kv_cache_memory=8 << 20, max_num_seqs=1,
                async_scheduling=False)
    request = small.engine.make_request(PROMPT, params)
    small.engine.add_request(request)
    model = small.engine.runner.model
    forward = model.forward
    model.forward = lambda *a, **k: (_ for _ in ()).throw(RuntimeError("injected fault"))
    try:
        with pytest.raises(RuntimeError, match="injected fault"):
            small.engine.step()
    finally:
        model.forward = forward
    assert not small.engine.has_unfinished_requests()
    assert not small.engine.output_processor.has_request(request.req_id)
    assert small.engine.scheduler.block_pool.is_whole()
    out = small.generate(PROMPT, SamplingParams(n=2, temperature=0, max_tokens=4))[0]
    assert [len(c.token_ids) for c in out.outputs] == [4, 4]
