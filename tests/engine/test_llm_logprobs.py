"""Logprobs end to end on the default model in fp32, against transformers' log_softmax."""

from __future__ import annotations

import pytest
import torch

from mrv2 import LLM, SamplingParams

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]


@pytest.fixture(scope="module")
def hf_logprobs(hf_default_model):
    """log_softmax of transformers' fp32 logits for each position of a token sequence."""
    def run(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return hf_default_model(torch.tensor([ids])).logits[0].float().log_softmax(dim=-1)
    return run


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_logprobs_equal_transformers_and_include_the_sampled_token(default_llm, hf_logprobs, async_scheduling):
    llm = default_llm if async_scheduling == default_llm.engine.config.async_scheduling else \
        LLM(dtype="float32", max_model_len=1024, kv_cache_memory=32 << 20, async_scheduling=async_scheduling)
    params = [SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=5),
              SamplingParams(temperature=1.5, seed=3, max_tokens=8, ignore_eos=True, logprobs=1),
              SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)]
    outs = llm.generate(PROMPTS, params)
    tok = llm.get_tokenizer()
    for out, p in zip(outs, params):
        c = out.outputs[0]
        if p.logprobs is None:
            assert c.logprobs is None
            continue
        assert len(c.logprobs) == len(c.token_ids) == 8
        ref = hf_logprobs(out.prompt_token_ids + c.token_ids)[len(out.prompt_token_ids) - 1:-1]
        for pos, (token, entry) in enumerate(zip(c.token_ids, c.logprobs)):
            row = ref[pos]
            assert token in entry and len(entry) <= p.logprobs + 1
            order = row.argsort(descending=True)
            top = order[:p.logprobs].tolist()
            assert set(top) <= set(entry)  # the k most likely are all there
            for t, lp in entry.items():
                assert abs(lp.logprob - row[t].item()) < 1e-4
                assert lp.decoded_token == tok.decode([t])
            rank = int((row > row[token]).sum()) + 1
            assert entry[token].rank == rank
            assert [entry[t].rank for t in top if t != token] == [i + 1 for i, t in enumerate(top) if t != token]


def test_logprobs_stay_aligned_with_tokens_cut_by_a_stop_string(default_llm):
    full = default_llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))[0]
    stop = full.outputs[0].text.split()[2]
    out = default_llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True,
                                                          stop=[stop], logprobs=2))[0].outputs[0]
    assert out.finish_reason == "stop" and len(out.logprobs) == len(out.token_ids) < 16
    assert all(t in entry for t, entry in zip(out.token_ids, out.logprobs))


@pytest.mark.parametrize("value", [-1, 21, 2.5, True])
def test_bad_logprobs_values_raise(value):
    with pytest.raises(ValueError, match="logprobs"):
        SamplingParams(logprobs=value)


@pytest.mark.parametrize("chunk", [None, 8])
def test_prompt_logprobs_equal_transformers_with_and_without_chunked_prefill(default_llm, hf_logprobs, chunk):
    llm = default_llm if chunk is None else LLM(dtype="float32", max_model_len=1024, kv_cache_memory=32 << 20,
                                                max_num_batched_tokens=chunk, max_num_seqs=4)
    prompts = ["The capital of France is not a city in Germany or Spain", "Hi", "def fibonacci(n):"]
    params = [SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=2),
              SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=0),
              SamplingParams(temperature=0, max_tokens=2)]
    outs = llm.generate(prompts, params)
    assert outs[2].prompt_logprobs is None
    for out, p in zip(outs[:2], params):
        ids = out.prompt_token_ids
        assert len(out.prompt_logprobs) == len(ids) and out.prompt_logprobs[0] is None
        ref = hf_logprobs(ids)
        for pos in range(1, len(ids)):
            entry, row = out.prompt_logprobs[pos], ref[pos - 1]
            assert ids[pos] in entry and len(entry) <= p.prompt_logprobs + 1
            for t, lp in entry.items():
                assert abs(lp.logprob - row[t].item()) < 1e-4
            assert entry[ids[pos]].rank == int((row > row[ids[pos]]).sum()) + 1
