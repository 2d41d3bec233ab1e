"""bad_words: a word's last token is banned wherever the output so far ends with the rest of it.

As in vLLM, each word is tokenized as written and with a leading space (when that
makes a different token sequence), and a sequence of n tokens bans its last token
when the request's last n - 1 output tokens are its first n - 1 (a one-token word is
always banned). Per slot the sequences live in device tables, prefixes right-aligned
and padded with -1 ("any token"); a step compares every row's recent output tokens
with all of its prefixes at once and masks the matching last tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from mrv2.staged_writes import StagedRowWriter, StagedWrite

MAX_BAD_WORD_SEQUENCES = 128
MAX_BAD_WORD_TOKENS = 16


def bad_words_token_ids(tokenizer, words: list[str]) -> list[list[int]]:
    """The token sequences `words` ban (vLLM's rule); ValueError naming bad_words when over the limits."""
    sequences: list[list[int]] = []
    for word in words:
        plain = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        if plain:
            sequences.append(plain)
        if spaced and (not plain or (spaced[0] != plain[0] and len(spaced) == len(plain))):
            sequences.append(spaced)
    if len(sequences) > MAX_BAD_WORD_SEQUENCES or any(len(s) > MAX_BAD_WORD_TOKENS for s in sequences):
        raise ValueError(f"bad_words must tokenize to at most {MAX_BAD_WORD_SEQUENCES} sequences of at most "
                         f"{MAX_BAD_WORD_TOKENS} tokens")
    return sequences


@dataclass(frozen=True)
class BadWordsMetadata:
    """One step's rows: prefixes int64 [B, S, T - 1] (right-aligned, -1: any), last tokens int64 [B, S]
    (-1: no sequence), token history int64 [B, L] and prompt_len [B]."""

    prefixes: torch.Tensor
    last: torch.Tensor
    history: torch.Tensor
    prompt_len: torch.Tensor


class BadWordsState:
    """Per-slot banned sequences, allocated when the first request with bad words arrives."""

    def __init__(self, max_num_reqs: int, device: torch.device, pin_memory: bool) -> None:
        self.max_num_reqs, self.device, self.pin_memory = max_num_reqs, device, pin_memory
        self.prefixes = self.last = None
        self._writers: tuple[StagedRowWriter, ...] = ()
        self.active_cpu = np.zeros(max_num_reqs, dtype=bool)

    def _allocate(self) -> None:
        s, t = MAX_BAD_WORD_SEQUENCES, MAX_BAD_WORD_TOKENS - 1
        self.prefixes = torch.full((self.max_num_reqs, s * t), -1, dtype=torch.int64, device=self.device)
        self.last = torch.full((self.max_num_reqs, s), -1, dtype=torch.int64, device=self.device)
        self._writers = tuple(StagedRowWriter(x, self.pin_memory) for x in (self.prefixes, self.last))

    def add_request(self, slot: int, sequences: list[list[int]]) -> None:
        if not sequences and not self.active_cpu[slot]:
            return
        if self.prefixes is None:
            self._allocate()
        s, t = MAX_BAD_WORD_SEQUENCES, MAX_BAD_WORD_TOKENS - 1
        prefixes = np.full((s, t), -1, dtype=np.int64)
        last = np.full(s, -1, dtype=np.int64)
        for i, seq in enumerate(sequences):
            if len(seq) > 1:
                prefixes[i, t - (len(seq) - 1):] = seq[:-1]
            last[i] = seq[-1]
        for writer, row in zip(self._writers, (prefixes.reshape(-1), last)):
            writer.stage(slot, 0, row)
        self.active_cpu[slot] = bool(sequences)

    def take_staged(self) -> list[StagedWrite]:
        return [w for w in (w.take() for w in self._writers) if w is not None]

    def any_active(self, idx_cpu: np.ndarray) -> bool:
        return bool(self.active_cpu[idx_cpu].any())

    def metadata(self, idx_mapping: torch.Tensor, history: torch.Tensor, prompt_len: torch.Tensor) -> BadWordsMetadata:
        rows = idx_mapping.shape[0]
        return BadWordsMetadata(self.prefixes[idx_mapping].view(rows, MAX_BAD_WORD_SEQUENCES, -1),
                                self.last[idx_mapping], history, prompt_len)


def apply_bad_words(logits: torch.Tensor, md: BadWordsMetadata, positions: torch.Tensor) -> torch.Tensor:
    """In place: -inf at each banned sequence's last token where the output ends with its prefix."""
    rows, vocab = logits.shape
    t = md.prefixes.shape[-1]
    # The t tokens before each row's sampled position, and whether each is an output token.
    cols = positions[:, None] - t + torch.arange(t, device=logits.device)[None, :]
    recent = md.history.gather(1, cols.clamp(min=0, max=md.history.shape[1] - 1))
    is_output = cols >= md.prompt_len[:, None].long()
    recent = torch.where(is_output, recent, -2)  # never equal to a token of a prefix
    matches = ((md.prefixes == -1) | (md.prefixes == recent[:, None, :])).all(dim=-1)
    banned = matches & (md.last >= 0)
    mask = torch.zeros(rows, vocab + 1, dtype=torch.bool, device=logits.device)
    mask.scatter_(1, torch.where(banned, md.last, vocab), True)
    return logits.masked_fill_(mask[:, :vocab], float("-inf"))
