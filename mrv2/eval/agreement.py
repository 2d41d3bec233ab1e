"""Greedy agreement of an engine with a reference engine (e.g. bf16 or int4 against fp32).

Prompts are windows of a text's tokens at evenly spaced offsets, so they are real text
and the same for both engines. Each engine continues every prompt greedily; the
result counts completions identical to the reference's and, per completion, the
share of tokens generated before the first difference (a difference changes
everything after it, so later tokens say nothing about the weights).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class AgreementResult:
    """How often `llm`'s greedy completions match the reference's, over `num_prompts` prompts."""

    num_prompts: int
    max_tokens: int
    identical: int  # completions equal to the reference's, token for token
    prefix_share: float  # mean share of each completion generated before its first difference

    @property
    def identical_share(self) -> float:
        return self.identical / self.num_prompts


def text_prompts(token_ids: list[int], num_prompts: int, prompt_len: int) -> list[list[int]]:
    """`num_prompts` windows of `prompt_len` tokens, evenly spaced over `token_ids`."""
    if num_prompts < 1 or prompt_len < 1:
        raise ValueError(f"need num_prompts >= 1 and prompt_len >= 1, got {num_prompts} and {prompt_len}")
    if len(token_ids) < prompt_len:
        raise ValueError(f"the text has {len(token_ids)} tokens, fewer than one prompt of {prompt_len}")
    starts = np.linspace(0, len(token_ids) - prompt_len, num_prompts).round().astype(int)
    return [token_ids[s:s + prompt_len] for s in starts]


def greedy_agreement(llm, reference, text: str, num_prompts: int = 16, prompt_len: int = 24,
                     max_tokens: int = 32) -> AgreementResult:
    """Greedy agreement of `llm` with `reference` (both `mrv2.LLM`s of the same tokenizer) on `text`."""
    from mrv2 import SamplingParams

    prompts = text_prompts(llm.get_tokenizer().encode(text), num_prompts, prompt_len)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    inputs = [{"prompt_token_ids": p} for p in prompts]
    ours = [o.outputs[0].token_ids for o in llm.generate(inputs, params)]
    theirs = [o.outputs[0].token_ids for o in reference.generate(inputs, params)]
    prefixes = [_common_prefix(a, b) / max_tokens for a, b in zip(ours, theirs)]
    return AgreementResult(len(prompts), max_tokens, sum(a == b for a, b in zip(ours, theirs)),
                           float(np.mean(prefixes)))


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
