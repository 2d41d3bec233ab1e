"""n > 1: n completions per prompt, seeded reproducibly, streamed per index, aborted together."""

from __future__ import annotations

import asyncio

from mrv2 import SamplingParams
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
