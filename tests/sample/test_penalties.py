"""Penalties, logit bias and allowed tokens on the device equal a direct transcription of vLLM's formulas."""

from __future__ import annotations

import pytest
import torch

from mrv2.sample.allowed_tokens import apply_allowed_tokens
from mrv2.sample.logit_bias import LogitBiasMetadata, apply_logit_bias
from mrv2.sample.penalties import PenaltiesMetadata, apply_penalties
from sampling_reference import reference_penalties


@pytest.mark.parametrize("seed", range(4))
def test_penalties_match_vllm_formulas(seed):
    g = torch.Generator().manual_seed(seed)
    rows, vocab, width = 5, 40, 24
    logits = torch.randn(rows, vocab, generator=g) * 3
    history = torch.randint(0, vocab, (rows, width), generator=g)
    prompt_len = torch.randint(1, 10, (rows,), generator=g)
    positions = prompt_len + torch.randint(0, 12, (rows,), generator=g)  # tokens known before the sampled one
    rep = torch.tensor([1.0, 1.3, 0.7, 2.0, 1.0])
    freq = torch.tensor([0.0, 0.5, -0.5, 2.0, 1.0])
    pres = torch.tensor([0.0, 1.0, 0.0, -2.0, 0.3])
    md = PenaltiesMetadata(rep, freq, pres, history, prompt_len.int())
    got = apply_penalties(logits.clone(), md, positions)
    prompts = [history[i, :prompt_len[i]].tolist() for i in range(rows)]
    outputs = [history[i, prompt_len[i]:positions[i]].tolist() for i in range(rows)]
    expected = reference_penalties(logits, prompts, outputs, rep.tolist(), freq.tolist(), pres.tolist())
    torch.testing.assert_close(got, expected)
    assert torch.equal(got[0], logits[0])  # neutral values leave a row untouched


def test_logit_bias_and_allowed_tokens():
    logits = torch.zeros(2, 10)
    ids = torch.tensor([[3, 7, 0, 0], [0, 0, 0, 0]])
    bias = torch.tensor([[5.0, -100.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    apply_logit_bias(logits, LogitBiasMetadata(ids, bias))
    assert logits[0, 3] == 5 and logits[0, 7] == -100 and logits[0].abs().sum() == 105 and logits[1].abs().sum() == 0
    allowed = torch.ones(2, 10, dtype=torch.bool)
    allowed[1] = False
    allowed[1, [2, 4]] = True
    apply_allowed_tokens(logits, allowed)
    assert torch.isinf(logits[1]).sum() == 8 and logits[1, 2] == 0 and torch.isfinite(logits[0]).all()
