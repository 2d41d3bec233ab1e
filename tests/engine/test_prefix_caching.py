"""Automatic prefix caching end to end: the same tokens as without it, shared blocks, no leaks."""

from __future__ import annotations

import pytest

from mrv2 import LLM, SamplingParams

SYSTEM = "You are a careful assistant who answers in one short sentence. " * 6
QUESTIONS = ["What is the capital of France?", "Name a planet.", "What is two plus two?", "Say hello."]


def _run(llm: LLM, prompts, **kwargs):
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1, **kwargs)
    return llm.generate(prompts, params)


def _llm(caching: bool, **kwargs) -> LLM:
    return LLM(dtype="float32", max_model_len=512, kv_cache_memory=kwargs.pop("kv_cache_memory", 16 << 20),
               enable_prefix_caching=caching, **kwargs)


def _same(a, b):
    for x, y in zip(a, b):
        assert x.outputs[0].token_ids == y.outputs[0].token_ids
        for ex, ey in zip(x.outputs[0].logprobs, y.outputs[0].logprobs):
            for t in ex:
                assert abs(ex[t].logprob - ey[t].logprob) < 1e-4


@pytest.mark.parametrize("kwargs", [
    {},
    {"max_num_batched_tokens": 32, "async_scheduling": False},  # chunked prefill, serial
    {"max_num_batched_tokens": 48, "async_scheduling": True},
])
def test_hits_give_the_tokens_of_a_cold_run(kwargs):
    prompts = [SYSTEM + q for q in QUESTIONS]
    cold = _run(_llm(False, **kwargs), prompts)
    warm_llm = _llm(True, **kwargs)
    batched = _run(warm_llm, prompts)  # later requests hit the first one's blocks
    kv = warm_llm.engine.scheduler.kv_cache_manager
    assert kv.num_hit_tokens > 0
    one_by_one = [_run(warm_llm, p)[0] for p in prompts]  # every request hits the cache now
    assert kv.num_hit_tokens >= 2 * (len(prompts) - 1) * 16
    _same(cold, batched)
    _same(cold, one_by_one)
    pool = warm_llm.engine.scheduler.block_pool
    assert pool.is_whole() and all(c == 0 for c in pool.ref_cnt[1:])


def test_preemption_under_a_small_cache_with_shared_blocks():
    prompts = [SYSTEM + q for q in QUESTIONS] * 2
    block_bytes = 30 * 2 * 3 * 64 * 4 * 16  # fp32 K and V of 30 layers, 3 KV heads of 64, 16 tokens
    small = dict(kv_cache_memory=17 * block_bytes + (1 << 16), max_num_seqs=8)  # 16 blocks for 8 x ~6
    cold = _run(_llm(False, **small), prompts)
    warm_llm = _llm(True, **small)
    warm = _run(warm_llm, prompts)
    _same(cold, warm)
    assert warm_llm.engine.scheduler.num_preemptions > 0
    pool = warm_llm.engine.scheduler.block_pool
    assert pool.is_whole() and all(c == 0 for c in pool.ref_cnt[1:])


def test_parallel_samples_share_the_prompt_blocks(default_llm):
    llm = _llm(True)
    prompt = SYSTEM + QUESTIONS[0]
    n_tokens = len(llm.get_tokenizer().encode(prompt))
    out = llm.generate(prompt, SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=8))[0]
    kv = llm.engine.scheduler.kv_cache_manager
    shared = (n_tokens - 1) // 16 * 16
    assert kv.num_hit_tokens == 3 * shared  # children 2-4 reuse the first one's full blocks
    singles = default_llm.generate([prompt] * 4, [SamplingParams(temperature=1.0, seed=3 + i, max_tokens=8)
                                                  for i in range(4)])
    assert [c.token_ids for c in out.outputs] == [s.outputs[0].token_ids for s in singles]


def test_reset_prefix_cache_and_prompt_logprobs_bypass():
    llm = _llm(True)
    prompt = SYSTEM + QUESTIONS[1]
    _run(llm, prompt)
    kv = llm.engine.scheduler.kv_cache_manager
    hits = kv.num_hit_tokens
    with_prompt_lps = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=0))[0]
    assert kv.num_hit_tokens == hits and all(e is not None for e in with_prompt_lps.prompt_logprobs[1:])
    assert llm.reset_prefix_cache() and llm.engine.scheduler.block_pool.num_cached_blocks == 0
    _run(llm, prompt)
    assert kv.num_hit_tokens == hits  # nothing was left to hit


def test_cache_salt_separates_requests_and_keys_every_block():
    llm = _llm(True)
    prompt = SYSTEM + QUESTIONS[2]
    kv = llm.engine.scheduler.kv_cache_manager
    plain = _run(llm, {"prompt": prompt})
    hits = kv.num_hit_tokens
    salted_a = _run(llm, {"prompt": prompt, "cache_salt": "tenant-a"})
    salted_b = _run(llm, {"prompt": prompt, "cache_salt": "tenant-b"})
    assert kv.num_hit_tokens == hits  # no salt, salt a, salt b: three separate caches
    again_a = _run(llm, {"prompt": prompt, "cache_salt": "tenant-a"})
    assert kv.num_hit_tokens > hits  # the same salt hits
    for other in (salted_a, salted_b, again_a):
        _same(plain, other)
    n = _run(llm, {"prompt": prompt, "cache_salt": "tenant-c"}, n=2)  # children carry the salt
    assert len(n[0].outputs) == 2
    for bad in ("", 7):
        with pytest.raises(ValueError, match="cache_salt"):
            llm.generate({"prompt": prompt, "cache_salt": bad})
    assert llm.engine.scheduler.block_pool.is_whole()


def test_the_salt_keys_the_first_block_and_so_every_block():
    from mrv2.engine.block_hash import extend_block_hashes

    tokens = list(range(64))
    plain = extend_block_hashes([], tokens, 16)
    salted = extend_block_hashes([], tokens, 16, salt=b"a")
    assert len(plain) == len(salted) == 4 and not set(plain) & set(salted)
    assert extend_block_hashes([], tokens, 16, salt=b"a") == salted
    assert extend_block_hashes(salted[:2], tokens, 16, salt=b"a") == salted  # extending keeps the chain
