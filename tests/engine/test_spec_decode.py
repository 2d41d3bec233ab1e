"""N-gram speculative decoding end to end on the default model (fp32): the output without it, token for
token, greedy and seeded, alone and in batches, chunked, preempted, cached, n > 1; and drafts accepted."""

from __future__ import annotations

import pytest

from mrv2 import LLM, SamplingParams

PASSAGE = ("The river rises in the northern hills, runs past the old mill and the market town, "
           "and reaches the sea after ninety miles. ")
GROUNDED = [f"Repeat the following text exactly.\n\n{PASSAGE * 2}", f"Copy this sentence: {PASSAGE}",
            "List the numbers 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 1, 2, 3,",
            "Write a short poem about the sea."]
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 4}


def _llm(spec: bool, **kwargs) -> LLM:
    kwargs.setdefault("kv_cache_memory", 32 << 20)
    return LLM(dtype="float32", max_model_len=512, speculative_config=NGRAM if spec else None, **kwargs)


def _tokens(llm: LLM, params: SamplingParams, prompts=GROUNDED):
    return [[c.token_ids for c in o.outputs] for o in llm.generate(prompts, params, use_tqdm=False)]


GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.8, top_p=0.95, seed=11, max_tokens=40, ignore_eos=True)


@pytest.fixture(scope="module")
def plain():
    return _llm(False)


@pytest.fixture(scope="module")
def without_drafts(plain):
    return [_tokens(plain, params) for params in (GREEDY, SEEDED)]


@pytest.mark.parametrize("kwargs", [{}, {"max_num_batched_tokens": 16}, {"kv_cache_memory": 10 * 737280 + 65536},
                                    {"enable_prefix_caching": False}], ids=["default", "chunked", "preempted",
                                                                            "no_prefix_cache"])
def test_greedy_and_seeded_equal_the_output_without_drafts(without_drafts, kwargs):
    spec = _llm(True, **kwargs)
    assert spec.engine.proposer is not None
    assert [_tokens(spec, params) for params in (GREEDY, SEEDED)] == without_drafts
    stats = spec.engine.scheduler.spec_stats
    assert stats.num_accepted_tokens > 0 and 0 < stats.acceptance_rate <= 1
    if "kv_cache_memory" in kwargs:
        assert spec.engine.scheduler.num_preemptions > 0
    assert spec.engine.scheduler.block_pool.is_whole()


def test_one_request_at_a_time_n_and_logprobs(plain):
    spec = _llm(True)
    params = SamplingParams(n=2, temperature=0.8, seed=5, max_tokens=32, ignore_eos=True, logprobs=2)
    for prompt in GROUNDED[:2]:
        a, b = spec.generate(prompt, params)[0], plain.generate(prompt, params)[0]
        for ca, cb in zip(a.outputs, b.outputs, strict=True):
            assert ca.token_ids == cb.token_ids
            for ea, eb in zip(ca.logprobs, cb.logprobs, strict=True):  # the target's logprobs
                assert ea.keys() == eb.keys()
                assert all(abs(ea[t].logprob - eb[t].logprob) < 1e-4 for t in ea)
    assert spec.engine.scheduler.spec_stats.mean_acceptance_length > 1


def test_aborts_mid_speculation_return_every_block():
    spec = _llm(True)
    engine = spec.engine
    requests = [engine.make_request(p, GREEDY) for p in GROUNDED]
    for r in requests:
        engine.add_request(r)
    for step in range(12):
        engine.step()
        if step == 6:
            engine.abort([requests[0].req_id, requests[2].req_id])
    while engine.has_unfinished_requests():
        engine.step()
    engine.step()
    assert engine.scheduler.block_pool.is_whole()
    assert engine.runner.states.num_free_slots == engine.runner.max_num_reqs


@pytest.mark.parametrize("config,match", [
    ({"method": "medusa"}, "method"),
    ({"num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"prompt_lookup_min": 3, "prompt_lookup_max": 2}, "prompt_lookup_min"),
    ({"num_spec_tokens": 3}, "unknown keys"),
])
def test_bad_speculative_configs_name_the_problem(config, match):
    with pytest.raises(ValueError, match=match):
        LLM(speculative_config=config)


def test_a_request_may_cap_or_turn_off_its_drafts(without_drafts):
    spec = _llm(True)
    stats = spec.engine.scheduler.spec_stats
    off = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, num_speculative_tokens=0)
    assert _tokens(spec, off) == without_drafts[0] and stats.num_drafts == 0
    one = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, num_speculative_tokens=1)
    mixed = _tokens(spec, [one, off, GREEDY, off])  # per-request parameters: some speculate, some not
    assert mixed == without_drafts[0]
    assert stats.num_drafts > 0 and len(stats.accepted_per_position) == 3  # the uncapped request drafted 3
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        spec.generate("hi", SamplingParams(num_speculative_tokens=-1))
