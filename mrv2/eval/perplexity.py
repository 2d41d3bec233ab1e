"""Perplexity of a model on a text, with a sliding window (as the transformers docs compute it).

The text is tokenized once; windows of `window` tokens advance by `stride`, and each
window scores only the tokens the previous one did not, with up to `window - stride`
tokens of context before them. So every token after the first is scored exactly once,
and numbers are comparable across dtypes and weight formats of the same model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass



@dataclass(frozen=True)
class PerplexityResult:
    """Mean negative log-likelihood (nats per token) over `num_tokens` scored tokens, and its exp."""

    num_tokens: int
    nll: float

    @property
    def perplexity(self) -> float:
        return math.exp(self.nll)


def perplexity(llm, text: str | list[int], window: int = 1024, stride: int | None = None) -> PerplexityResult:
    """Perplexity of `llm`'s model (an `mrv2.LLM`) on `text`, or on token ids; `stride` defaults to
    half the window."""
    window = min(window, llm.engine.config.max_model_len)
    stride = window // 2 if stride is None else stride
    if window < 2 or not 0 < stride <= window - 1:
        raise ValueError(f"need window >= 2 and 0 < stride < window, got window={window}, stride={stride}")
    ids = llm.get_tokenizer().encode(text) if isinstance(text, str) else list(text)
    if len(ids) < 2:
        raise ValueError(f"the text has {len(ids)} token(s): perplexity needs at least 2")
    total, count, scored_to = 0.0, 0, 1  # tokens [1, scored_to) are scored
    start = 0
    while scored_to < len(ids):
        end = min(start + window, len(ids))
        logprobs = llm.engine.target_logprobs(ids[start:end])  # logprobs[i]: token start + i + 1
        new = logprobs[scored_to - start - 1:]
        total -= float(new.double().sum())
        count += new.numel()
        scored_to = end
        start = max(0, min(start + stride, end - 1))
    return PerplexityResult(count, total / count)
