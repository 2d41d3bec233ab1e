"""Multi-token steps: a decode step verifies q = 1 + k tokens per request.

A stub proposer hands the scheduler fixed draft tokens (the reference continuation,
right or deliberately wrong from some point). The step's logits at each of the
q positions must equal the one-token-at-a-time path's logits for the same tokens,
and the emitted tokens the output without drafts, greedy and seeded random (fp32).
"""

from __future__ import annotations

import pytest
import torch
from step_helpers import step_with_logits

from mrv2 import LLM, SamplingParams

PROMPT = [(13 * j + 7) % 500 + 3 for j in range(11)]
MAX_TOKENS = 14


class StubProposer:
    """Proposes the next `k` tokens of a known continuation, with a wrong one at draft index `wrong_at`."""

    def __init__(self, continuation: list[int], k: int, wrong_at: int | None = None) -> None:
        self.continuation, self.k, self.wrong_at = continuation, k, wrong_at

    def propose(self, num_output: int) -> list[int]:
        drafts = list(self.continuation[num_output:num_output + self.k])
        if self.wrong_at is not None and self.wrong_at < len(drafts):
            drafts[self.wrong_at] = (drafts[self.wrong_at] + 1) % 500
        return drafts


def _engine(path: str, **kwargs):
    return LLM(model=path, dtype="float32", kv_cache_memory=1 << 22, async_scheduling=False, **kwargs).engine


def _reference(engine, params: SamplingParams) -> tuple[list[int], list[torch.Tensor]]:
    """Tokens and per-token logits, one token per step."""
    request = engine.make_request({"prompt_token_ids": PROMPT}, params)
    engine.add_request(request)
    logits = []
    while engine.has_unfinished_requests():
        updated, step_logits = step_with_logits(engine)
        if updated:
            logits.append(step_logits[0])
    return request.output_token_ids, logits


def _with_drafts(engine, params: SamplingParams, proposer: StubProposer):
    """Tokens, and (output index, logits row) for the logits rows that produced each emitted token."""
    request = engine.make_request({"prompt_token_ids": PROMPT}, params)
    engine.add_request(request)
    rows, steps_with_drafts = [], 0
    while engine.has_unfinished_requests():
        if request.num_output_tokens:
            request.spec_token_ids = proposer.propose(request.num_output_tokens)
        before = request.num_output_tokens
        sched = engine.scheduler.schedule()
        engine.runner.execute_model(sched)
        logits = engine.runner._pending.forward.result().logits
        logits = logits.clone()
        steps_with_drafts += bool(sched.scheduled_spec_decode_tokens)
        engine.scheduler.update_from_output(sched, engine.runner.sample_tokens().get())
        # Rows up to the last emitted token read accepted tokens only; later ones read a rejected draft.
        rows += [(before + o, logits[o]) for o in range(request.num_output_tokens - before)]
    assert engine.scheduler.block_pool.is_whole()
    return request.output_token_ids, rows, steps_with_drafts


@pytest.mark.parametrize("arch", ["llama", "qwen3", "deepseek_v3"])
@pytest.mark.parametrize("k,wrong_at", [(3, None), (3, 1), (4, 0), (1, None)])
def test_draft_steps_give_the_one_token_logits_and_tokens(tiny_checkpoint, arch, k, wrong_at):
    path, _ = tiny_checkpoint(arch, False)
    engine = _engine(str(path))
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    ref_tokens, ref_logits = _reference(engine, greedy)
    tokens, rows, steps = _with_drafts(engine, greedy, StubProposer(ref_tokens, k, wrong_at))
    assert tokens == ref_tokens
    assert steps >= 1 and (wrong_at is not None or steps < MAX_TOKENS - 1)  # drafts were accepted
    for i, logits in rows:
        if i < len(ref_logits):
            torch.testing.assert_close(logits, ref_logits[i], atol=2e-4, rtol=1e-4)


def test_seeded_random_with_drafts_equals_without(tiny_checkpoint):
    """A position's draw depends on (seed, position) only: right drafts are accepted, wrong ones
    replaced by the very token the request draws without drafts."""
    path, _ = tiny_checkpoint("llama", False)
    engine = _engine(str(path))
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=11, max_tokens=MAX_TOKENS, ignore_eos=True)
    ref_tokens, _ = _reference(engine, params)
    for wrong_at in (None, 2):
        tokens, _, steps = _with_drafts(engine, params, StubProposer(ref_tokens, 3, wrong_at))
        assert tokens == ref_tokens and steps >= 1


def test_drafts_in_a_mixed_batch(tiny_checkpoint):
    """Requests with drafts, without, and in prefill share a step; each gets its own tokens."""
    path, _ = tiny_checkpoint("llama", False)
    engine = _engine(str(path), max_num_batched_tokens=16)
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    prompts = [PROMPT, PROMPT[:5], [(7 * j) % 500 + 3 for j in range(30)]]
    refs = [o.outputs[0].token_ids for o in LLM(model=str(path), dtype="float32", kv_cache_memory=1 << 22)
            .generate([{"prompt_token_ids": p} for p in prompts], greedy)]
    requests = [engine.make_request({"prompt_token_ids": p}, greedy) for p in prompts]
    for r in requests:
        engine.add_request(r)
    proposers = [StubProposer(refs[0], 3), None, StubProposer(refs[2], 2, wrong_at=1)]
    while engine.has_unfinished_requests():
        for r, proposer in zip(requests, proposers):
            if proposer and r.num_output_tokens and not r.is_finished:
                r.spec_token_ids = proposer.propose(r.num_output_tokens)
        engine.step()
    assert [r.output_token_ids for r in requests] == refs
    assert engine.scheduler.block_pool.is_whole()
    engine.step()
    assert engine.runner.states.num_free_slots == engine.runner.max_num_reqs


def test_uniform_draft_steps_replay_full_graphs(tiny_checkpoint):
    """Every request verifying k = 3 drafts: uniform q = 4 decode steps replay FULL graphs
    captured for that query length, and give the eager tokens."""
    from mrv2.config import CacheConfig, EngineConfig, GraphConfig, GraphMode, ModelConfig
    from mrv2.engine.llm_engine import LLMEngine

    path, _ = tiny_checkpoint("llama", False)
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    prompts = [PROMPT, PROMPT[:6], PROMPT[2:]]
    refs = [o.outputs[0].token_ids for o in LLM(model=str(path), dtype="float32", kv_cache_memory=1 << 22)
            .generate([{"prompt_token_ids": p} for p in prompts], greedy)]
    engine = LLMEngine(EngineConfig(
        model=ModelConfig(model=str(path), dtype="float32"), cache=CacheConfig(kv_cache_memory=1 << 22),
        graph=GraphConfig(mode=GraphMode.FULL, capture_sizes=(1, 2, 4), decode_query_len=4), async_scheduling=False))
    assert {d.uniform_decode_len for d in engine.runner.graphs.descriptors} == {4}
    requests = [engine.make_request({"prompt_token_ids": p}, greedy) for p in prompts]
    for r in requests:
        engine.add_request(r)
    while engine.has_unfinished_requests():
        for r, ref in zip(requests, refs):
            if r.num_output_tokens and not r.is_finished:
                r.spec_token_ids = StubProposer(ref, 3).propose(r.num_output_tokens)
        engine.step()
    assert [r.output_token_ids for r in requests] == refs
    assert engine.runner.graphs.replays[GraphMode.FULL] >= 2
    assert engine.scheduler.block_pool.is_whole()
