"""Reference implementations of vLLM's sampling formulas, shared by the sampler and engine tests."""

from __future__ import annotations

import torch


def reference_penalties(logits, prompts, outputs, rep, freq, pres):
    """vLLM's apply_penalties, one row at a time."""
    out = logits.clone()
    for i, (prompt, output) in enumerate(zip(prompts, outputs)):
        vocab = logits.shape[1]
        counts = torch.bincount(torch.tensor(output, dtype=torch.long), minlength=vocab).float()
        seen = torch.zeros(vocab, dtype=torch.bool)
        seen[torch.tensor(prompt + output, dtype=torch.long)] = True
        row = out[i]
        penalty = torch.where(seen, torch.tensor(rep[i]), torch.tensor(1.0))
        row[row > 0] /= penalty[row > 0]
        row[row <= 0] *= penalty[row <= 0]
        row -= freq[i] * counts
        row -= pres[i] * (counts > 0)
    return out


def reference_bad_words(logits, sequences, outputs):
    """vLLM's _apply_bad_words_single_batch, one row at a time (past tokens: the row's output)."""
    out = logits.clone()
    for i, (row_sequences, past) in enumerate(zip(sequences, outputs)):
        for seq in row_sequences:
            if len(seq) > len(past) + 1:
                continue
            prefix_length = len(seq) - 1
            actual = past[-prefix_length:] if prefix_length > 0 else []
            if actual == seq[:prefix_length]:
                out[i, seq[-1]] = float("-inf")
    return out
