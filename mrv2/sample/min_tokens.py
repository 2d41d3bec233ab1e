"""min_tokens: EOS and stop-token logits are -inf until a request has that many output tokens.

As in vLLM, the masked ids are every EOS id and the request's stop_token_ids (EOS
ids are masked under ignore_eos too; they cannot be sampled early either way). Per
slot the state holds min_tokens, the prompt length (the origin of the output count)
and the ids to mask as one row of a [max_num_reqs, K] table padded with -1 (K grows
when a request brings more ids). The output count is derived on the device from the
position being sampled, so no step reads the host or loops over requests.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from mrv2.runner.staged_writes import StagedScalarWriter


@dataclass(frozen=True)
class MinTokensMetadata:
    """One step's rows: min_tokens int32 [B], prompt_len int32 [B], stop_ids int64 [B, K] (-1: none)."""

    min_tokens: torch.Tensor
    prompt_len: torch.Tensor
    stop_ids: torch.Tensor


class MinTokensState:
    """Per-slot min_tokens, prompt length and ids to mask; `min_tokens_cpu` is the host mirror."""

    def __init__(self, max_num_reqs: int, device: torch.device, pin_memory: bool, width: int = 4) -> None:
        self.min_tokens = torch.zeros(max_num_reqs, dtype=torch.int32, device=device)
        self.prompt_len = torch.zeros(max_num_reqs, dtype=torch.int32, device=device)
        self.stop_ids = torch.full((max_num_reqs, width), -1, dtype=torch.int64, device=device)
        self.min_tokens_cpu = np.zeros(max_num_reqs, dtype=np.int64)
        self._writers = (StagedScalarWriter(self.min_tokens, pin_memory), StagedScalarWriter(self.prompt_len, pin_memory))
        self._staged_ids: dict[int, list[int]] = {}

    def add_request(self, slot: int, min_tokens: int, prompt_len: int, stop_ids: Sequence[int]) -> None:
        """Stage a request's state; its ids are only kept when it has a minimum to enforce."""
        for writer, value in zip(self._writers, (min_tokens, prompt_len)):
            writer.stage(slot, value)
        self.min_tokens_cpu[slot] = min_tokens
        if min_tokens > 0:
            self._staged_ids[slot] = sorted(set(stop_ids))
        else:
            self._staged_ids.pop(slot, None)

    def apply_staged_writes(self) -> None:
        for writer in self._writers:
            writer.apply()
        if not self._staged_ids:
            return
        width = max(len(ids) for ids in self._staged_ids.values())
        if width > self.stop_ids.shape[1]:  # rare: grow the table, keeping the rows already there
            grown = self.stop_ids.new_full((self.stop_ids.shape[0], max(width, 2 * self.stop_ids.shape[1])), -1)
            grown[:, :self.stop_ids.shape[1]] = self.stop_ids
            self.stop_ids = grown
        rows = np.full((len(self._staged_ids), self.stop_ids.shape[1]), -1, dtype=np.int64)
        for row, ids in zip(rows, self._staged_ids.values()):
            row[:len(ids)] = ids
        slots = torch.tensor(list(self._staged_ids), dtype=torch.int64)
        self.stop_ids.index_copy_(0, slots.to(self.stop_ids.device), torch.from_numpy(rows).to(self.stop_ids.device))
        self._staged_ids.clear()

    def metadata(self, idx_cpu: np.ndarray, idx_mapping: torch.Tensor) -> MinTokensMetadata | None:
        """The batch's rows, or None when no request in it has min_tokens (known from the host mirror)."""
        if not (self.min_tokens_cpu[idx_cpu] > 0).any():
            return None
        return MinTokensMetadata(self.min_tokens[idx_mapping], self.prompt_len[idx_mapping], self.stop_ids[idx_mapping])


def apply_min_tokens(logits: torch.Tensor, md: MinTokensMetadata, positions: torch.Tensor) -> torch.Tensor:
    """In place: -inf at each row's stop ids while its output count (positions - prompt_len) < min_tokens."""
    active = (positions - md.prompt_len) < md.min_tokens  # [B]
    ids = md.stop_ids  # ids first, then -1: a row has ids iff its first entry is one
    # Padding points at the row's first id (column 0 when it has none), so the scatter's
    # duplicate writes agree: a masked row's ids all get -inf, other rows their own values back.
    index = torch.where(ids >= 0, ids, ids[:, :1]).clamp_(min=0)
    masked = (active & (ids[:, 0] >= 0))[:, None].expand_as(index)
    values = logits.gather(1, index).masked_fill_(masked, float("-inf"))
    return logits.scatter_(1, index, values)
