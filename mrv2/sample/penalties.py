"""Repetition, frequency and presence penalties, with vLLM's formulas, from the token history on the device.

For each row, over the request's tokens before the position being sampled (its
slot's `token_ids`, prompt first):
- repetition_penalty r (1: off), on every token seen in the prompt or the output:
  a positive logit is divided by r, a negative one multiplied by r;
- frequency_penalty f: `logit -= f * count` of the token in the output;
- presence_penalty p: `logit -= p` if the token occurs in the output.
The counts are rebuilt each step from the history (one scatter over the batch's rows),
so preemption and async scheduling need no extra state; only the three values live
in slots. Sequences are read up to the longest history in the batch, known on the
host as an upper bound.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from mrv2.staged_writes import StagedScalarWriter, StagedWrite

_FIELDS = ("repetition", "frequency", "presence")
_NEUTRAL = {"repetition": 1.0, "frequency": 0.0, "presence": 0.0}


@dataclass(frozen=True)
class PenaltiesMetadata:
    """One step's rows: the three penalties float32 [B], token history int64 [B, L], prompt_len int32 [B]."""

    repetition: torch.Tensor
    frequency: torch.Tensor
    presence: torch.Tensor
    history: torch.Tensor
    prompt_len: torch.Tensor


class PenaltiesState:
    """Per-slot penalties on the device, with host mirrors for the batch flag."""

    def __init__(self, max_num_reqs: int, device: torch.device, pin_memory: bool) -> None:
        for name in _FIELDS:
            setattr(self, name, torch.full((max_num_reqs,), _NEUTRAL[name], dtype=torch.float32, device=device))
        self.active_cpu = np.zeros(max_num_reqs, dtype=bool)
        self._writers = {name: StagedScalarWriter(getattr(self, name), pin_memory) for name in _FIELDS}

    def add_request(self, slot: int, repetition: float, frequency: float, presence: float) -> None:
        for name, value in zip(_FIELDS, (repetition, frequency, presence)):
            self._writers[name].stage(slot, value)
        self.active_cpu[slot] = (repetition, frequency, presence) != (1.0, 0.0, 0.0)

    def take_staged(self) -> list[StagedWrite]:
        return [w for w in (w.take() for w in self._writers.values()) if w is not None]

    def any_active(self, idx_cpu: np.ndarray) -> bool:
        return bool(self.active_cpu[idx_cpu].any())

    def metadata(self, idx_mapping: torch.Tensor, history: torch.Tensor, prompt_len: torch.Tensor) -> PenaltiesMetadata:
        """Device work: the batch's rows; `history` [B, L] and `prompt_len` [B] are already gathered."""
        return PenaltiesMetadata(self.repetition[idx_mapping], self.frequency[idx_mapping],
                                 self.presence[idx_mapping], history, prompt_len)


def apply_penalties(logits: torch.Tensor, md: PenaltiesMetadata, positions: torch.Tensor) -> torch.Tensor:
    """In place on float32 logits [B, V]; `positions` [B] is each row's sampled position (its history length)."""
    rows, vocab = logits.shape
    cols = torch.arange(md.history.shape[1], device=logits.device)
    seen = cols[None, :] < positions[:, None]
    in_output = seen & (cols[None, :] >= md.prompt_len[:, None].long())
    # Tokens outside a row's history go to a spare column `vocab`, dropped afterwards.
    output_ids = torch.where(in_output, md.history, vocab)
    counts = torch.zeros(rows, vocab + 1, dtype=torch.float32, device=logits.device)
    counts.scatter_add_(1, output_ids, torch.ones_like(output_ids, dtype=torch.float32))
    counts = counts[:, :vocab]
    seen_ids = torch.where(seen, md.history, vocab)
    occurred = torch.zeros(rows, vocab + 1, dtype=torch.bool, device=logits.device)
    occurred.scatter_(1, seen_ids, True)
    factor = torch.where(occurred[:, :vocab], md.repetition[:, None], 1.0)
    logits.copy_(torch.where(logits > 0, logits / factor, logits * factor))
    logits -= md.frequency[:, None] * counts
    logits -= md.presence[:, None] * (counts > 0)
    return logits
