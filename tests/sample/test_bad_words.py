"""bad_words: the device tables and masking equal vLLM's rule; tokenization follows vLLM's two variants."""

from __future__ import annotations

import pytest
import torch

from mrv2.sample.bad_words import BadWordsState, apply_bad_words, bad_words_token_ids
from sampling_reference import reference_bad_words


@pytest.mark.parametrize("seed", range(5))
def test_masking_equals_vllm_rule(seed):
    g = torch.Generator().manual_seed(seed)
    rows, vocab, width = 4, 12, 20
    history = torch.randint(0, 4, (rows, width), generator=g)  # a small alphabet: prefixes do match
    prompt_len = torch.randint(1, 6, (rows,), generator=g)
    positions = prompt_len + torch.randint(0, 10, (rows,), generator=g)
    sequences = [[[int(x) for x in torch.randint(0, 4, (n,), generator=g)] for n in (1, 2, 3, 3)] for _ in range(rows)]
    sequences[1] = []  # a row without bad words
    state = BadWordsState(rows, torch.device("cpu"), False)
    for slot, seqs in enumerate(sequences):
        state.add_request(slot, seqs)
    for write in state.take_staged():
        write.apply()
    logits = torch.randn(rows, vocab, generator=g)
    md = state.metadata(torch.arange(rows), history, prompt_len.int())
    got = apply_bad_words(logits.clone(), md, positions)
    outputs = [history[i, prompt_len[i]:positions[i]].tolist() for i in range(rows)]
    assert torch.equal(got, reference_bad_words(logits, sequences, outputs))
    # A slot reused without bad words is cleared.
    state.add_request(0, [])
    for write in state.take_staged():
        write.apply()
    assert not state.any_active(torch.tensor([0]).numpy()) and (state.last[0] == -1).all()


def test_tokenization_variants_and_limits(converted_default_model):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(converted_default_model)
    seqs = bad_words_token_ids(tok, ["Paris", " answer is"])
    assert tok.encode("Paris") in seqs and tok.encode(" Paris") in seqs
    assert tok.encode("answer is") in seqs and tok.encode(" answer is") in seqs
    with pytest.raises(ValueError, match="bad_words"):
        bad_words_token_ids(tok, ["word"] * 100)
