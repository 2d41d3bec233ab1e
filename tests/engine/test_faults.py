"""Injected faults in the forward and in the sampler: the failing step's requests end with the error,
their blocks come back, and the engine serves the requests that were not in that step."""

from __future__ import annotations

import pytest

from mrv2 import LLM, SamplingParams

PROMPT_A = {"prompt_token_ids": list(range(400, 440))}
PROMPT_B = {"prompt_token_ids": list(range(900, 925))}
PARAMS = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


class FailingOnce:
    """Wraps a callable; the `at`-th call raises instead."""

    def __init__(self, fn, at: int) -> None:
        self.fn, self.at, self.calls = fn, at, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        if self.calls == self.at:
            raise RuntimeError(f"injected fault in call {self.at}")
        return self.fn(*args, **kwargs)


# Where the fault is injected: the eager forward (graphs off), a graph replay (a decode of one request
# replays the default's compiled graph), the sampler.
OWNERS = {"forward": (lambda runner: runner.model, "forward"), "graph": (lambda runner: runner.graphs, "run"),
          "sampler": (lambda runner: runner, "sampler")}


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["serial", "async"])
@pytest.mark.parametrize("where", list(OWNERS))
def test_a_fault_fails_its_step_and_the_engine_serves_the_rest(default_llm, async_scheduling, where):
    llm = LLM(dtype="float32", max_model_len=128, max_num_seqs=1, kv_cache_memory=8 << 20,
              async_scheduling=async_scheduling, enforce_eager=where == "forward")
    engine, runner = llm.engine, llm.engine.runner
    a, b = engine.make_request(PROMPT_A, PARAMS), engine.make_request(PROMPT_B, PARAMS)
    engine.add_request(a)
    engine.add_request(b)  # waits: one request at a time, so the fault hits only A's steps
    get_owner, name = OWNERS[where]
    owner = get_owner(runner)
    original = getattr(owner, name)
    # The forward's third call is A's second decode (after its prefill and first decode); the graphs'
    # third replay is A's third decode.
    setattr(owner, name, FailingOnce(original, at=3))
    outputs, error = [], None
    try:
        while engine.has_unfinished_requests():
            try:
                outputs += engine.step()
            except RuntimeError as e:
                error = e
    finally:
        if where == "sampler":
            runner.sampler = original
        else:
            delattr(owner, name)  # back to the class's method
    assert error is not None and "injected fault" in str(error)
    finals = {o.request_id: o for o in outputs if o.finished}
    assert a.req_id not in finals  # failed: it never finishes
    solo = default_llm.generate(PROMPT_B, PARAMS)[0].outputs[0].token_ids
    assert finals[b.req_id].outputs[0].token_ids == solo
    engine.step()  # the runner releases the last slot
    assert engine.scheduler.block_pool.is_whole() and not engine.scheduler.requests
    assert engine.runner.states.num_free_slots == engine.runner.max_num_reqs
    assert llm.generate(PROMPT_A, PARAMS)[0].outputs[0].token_ids == default_llm.generate(
        PROMPT_A, PARAMS)[0].outputs[0].token_ids
