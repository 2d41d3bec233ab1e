"""LLMEngine end to end on tiny random checkpoints: greedy rule, EOS handling, min_tokens."""

from __future__ import annotations

import pytest
import torch

from mrv2 import LLM, SamplingParams

PROMPTS = [[5, 6, 7], [40, 41, 42, 43, 44], [100, 3, 250, 9], [77] * 9, [300, 301]]


def _tiny_llm(tiny_checkpoint, **kwargs) -> LLM:
    path, _ = tiny_checkpoint("llama", False)
    return LLM(str(path), max_model_len=128, max_num_seqs=8, kv_cache_memory=8 << 20, **kwargs)


def _tokens(llm: LLM, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]


def test_tiny_temperature_is_greedy_alone_and_in_a_mixed_batch(tiny_checkpoint):
    """One greedy rule: temperature 1e-6 is greedy in a batch of its own and among random requests."""
    assert SamplingParams(temperature=1e-6).greedy and not SamplingParams(temperature=0.5).greedy
    llm = _tiny_llm(tiny_checkpoint)
    with torch.no_grad():  # logit gaps far below the noise a random draw at temperature 1e-5 would add
        llm.engine.runner.model.lm_head_weight.mul_(1e-6)
    tiny = SamplingParams(temperature=1e-6, max_tokens=12, ignore_eos=True)
    greedy = _tokens(llm, PROMPTS[:1], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))[0]
    alone = _tokens(llm, PROMPTS[:1], tiny)[0]
    random = [SamplingParams(temperature=1.0, seed=s, max_tokens=12, ignore_eos=True) for s in range(4)]
    mixed = _tokens(llm, PROMPTS, [tiny] + random)[0]
    assert alone == greedy and mixed == greedy
