"""Penalties, logit_bias and allowed_token_ids end to end on the default model (fp32), against references."""

from __future__ import annotations

import pytest
import torch

from mrv2 import SamplingParams
from sampling_reference import reference_penalties

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def prompt_ids(default_llm):
    return default_llm.get_tokenizer().encode(PROMPT)


def test_repetition_penalty_equals_transformers(default_llm, hf_default_model, prompt_ids):
    x = torch.tensor([prompt_ids])
    with torch.no_grad():
        ref = hf_default_model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=16, do_sample=False,
                                        repetition_penalty=1.3, eos_token_id=None, pad_token_id=2)[0, x.shape[1]:]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, repetition_penalty=1.3)
    others = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    outs = default_llm.generate([{"prompt_token_ids": prompt_ids}] * 2, [params, others])
    assert outs[0].outputs[0].token_ids == ref.tolist()
    assert outs[1].outputs[0].token_ids != ref.tolist()  # the batch-mate without penalties is unaffected


@pytest.mark.parametrize("kwargs", [
    {"frequency_penalty": 1.5, "presence_penalty": 0.5},
    {"presence_penalty": -1.0, "repetition_penalty": 0.8, "logit_bias": {7042: -100.0, 28: 3.0}},
])
def test_penalties_and_bias_equal_vllm_formulas_on_transformers_logits(default_llm, hf_default_model, prompt_ids,
                                                                       kwargs):
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, **kwargs)
    got = default_llm.generate({"prompt_token_ids": prompt_ids}, params)[0].outputs[0].token_ids
    ids = list(prompt_ids)
    for _ in range(10):
        with torch.no_grad():
            logits = hf_default_model(torch.tensor([ids])).logits[0, -1:].float()
        for t, b in (kwargs.get("logit_bias") or {}).items():
            logits[0, t] += b
        logits = reference_penalties(logits, [prompt_ids], [ids[len(prompt_ids):]],
                                     [kwargs.get("repetition_penalty", 1.0)], [kwargs.get("frequency_penalty", 0.0)],
                                     [kwargs.get("presence_penalty", 0.0)])
        ids.append(int(logits.argmax()))
    assert got == ids[len(prompt_ids):]


def test_allowed_token_ids_bound_random_samples(default_llm):
    allowed = [7042, 30, 198, 260, 378]
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=16, ignore_eos=True, allowed_token_ids=allowed)
              for s in range(3)] + [SamplingParams(temperature=1.0, seed=9, max_tokens=16, ignore_eos=True)]
    outs = default_llm.generate([PROMPT] * 4, params)
    assert all(set(o.outputs[0].token_ids) <= set(allowed) for o in outs[:3])
    assert not set(outs[3].outputs[0].token_ids) <= set(allowed)
    # The slot's mask is reset for the next request without a list.
    again = default_llm.generate(PROMPT, params[3])[0].outputs[0].token_ids
    assert again == outs[3].outputs[0].token_ids


@pytest.mark.parametrize("kwargs,field", [
    ({"presence_penalty": 3.0}, "presence_penalty"),
    ({"frequency_penalty": -2.5}, "frequency_penalty"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"logit_bias": {5: 101}}, "logit_bias"),
    ({"logit_bias": {10**9: 1.0}}, "logit_bias"),
    ({"allowed_token_ids": []}, "allowed_token_ids"),
    ({"allowed_token_ids": [10**9]}, "allowed_token_ids"),
])
def test_bad_values_name_the_field_and_the_engine_keeps_serving(default_llm, kwargs, field):
    with pytest.raises(ValueError, match=field):
        default_llm.generate(PROMPT, SamplingParams(max_tokens=2, **kwargs))
    assert default_llm.engine.scheduler.block_pool.is_whole()


@pytest.mark.parametrize("words", [["Paris"], ["The answer"], ["answer is", "capital"]])
def test_bad_words_never_appear_in_greedy_output(default_llm, words):
    plain = default_llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))[0].outputs[0]
    assert any(w in plain.text for w in words)  # the test can fail
    out = default_llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True,
                                                      bad_words=words))[0].outputs[0]
    assert not any(w in out.text for w in words)
