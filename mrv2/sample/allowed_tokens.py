"""allowed_token_ids: a request may sample only from its list; every other logit becomes -inf.

The per-slot masks are one bool table [max_num_reqs, vocab], allocated when the first
request with a list arrives (all True: no restriction). A slot's row is written when
a request with a list is admitted to it, and reset when the next one has none.
"""

from __future__ import annotations

import numpy as np
import torch

from mrv2.staged_writes import StagedRowWriter, StagedWrite


class AllowedTokensState:
    """Per-slot allowed-token masks; `active_cpu` says which slots restrict."""

    def __init__(self, max_num_reqs: int, vocab_size: int, device: torch.device, pin_memory: bool) -> None:
        self.max_num_reqs, self.vocab_size, self.device, self.pin_memory = max_num_reqs, vocab_size, device, pin_memory
        self.mask: torch.Tensor | None = None
        self._writer: StagedRowWriter | None = None
        self.active_cpu = np.zeros(max_num_reqs, dtype=bool)

    def add_request(self, slot: int, allowed: list[int] | None) -> None:
        if not allowed and not self.active_cpu[slot]:
            return
        if self._writer is None:
            self.mask = torch.ones(self.max_num_reqs, self.vocab_size, dtype=torch.bool, device=self.device)
            self._writer = StagedRowWriter(self.mask, self.pin_memory)
        row = np.ones(self.vocab_size, dtype=bool)
        if allowed:
            row[:] = False
            row[allowed] = True
        self._writer.stage(slot, 0, row)
        self.active_cpu[slot] = bool(allowed)

    def take_staged(self) -> list[StagedWrite]:
        write = self._writer.take() if self._writer is not None else None
        return [write] if write is not None else []

    def any_active(self, idx_cpu: np.ndarray) -> bool:
        return bool(self.active_cpu[idx_cpu].any())

    def metadata(self, idx_mapping: torch.Tensor) -> torch.Tensor:
        """Device work: the batch's masks, bool [B, vocab]."""
        return self.mask[idx_mapping]


def apply_allowed_tokens(logits: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """In place: -inf wherever `allowed` is False."""
    return logits.masked_fill_(~allowed, float("-inf"))
