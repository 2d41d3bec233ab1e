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

from mrv2.staged_writes import StagedScalarWriter, apply_writes


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

    def take_staged(self) -> list:
        """Pack the staged state (host work); each returned write's `apply()` is device work."""
        writes = [w.take() for w in self._writers]
        if self._staged_ids:
            width = max(len(ids) for ids in self._staged_ids.values())
            rows = np.full((len(self._staged_ids), width), -1, dtype=np.int64)
            for row, ids in zip(rows, self._staged_ids.values()):
                row[:len(ids)] = ids
            writes.append(_IdRowsWrite(self, torch.tensor(list(self._staged_ids), dtype=torch.int64),
                                       torch.from_numpy(rows)))
            self._staged_ids.clear()
        return [w for w in writes if w is not None]

    def apply_staged_writes(self) -> None:
        apply_writes(self.take_staged())

    def any_active(self, idx_cpu: np.ndarray) -> bool:
        """Host: whether a request in the batch has a minimum to enforce."""
        return bool((self.min_tokens_cpu[idx_cpu] > 0).any())

    def metadata(self, idx_mapping: torch.Tensor) -> MinTokensMetadata:
        """Device work: the batch's rows."""
        return MinTokensMetadata(self.min_tokens[idx_mapping], self.prompt_len[idx_mapping], self.stop_ids[idx_mapping])


@dataclass(frozen=True)
class _IdRowsWrite:
    """Rows of ids to mask for some slots; growing the table (rare) is part of the device work."""

    state: MinTokensState
    slots: torch.Tensor
    rows: torch.Tensor

    def apply(self) -> None:
        table = self.state.stop_ids
        width = self.rows.shape[1]
        if width > table.shape[1]:  # keep the rows already there
            grown = table.new_full((table.shape[0], max(width, 2 * table.shape[1])), -1)
            grown[:, :table.shape[1]] = table
            self.state.stop_ids = table = grown
        rows = self.rows.new_full((self.rows.shape[0], table.shape[1]), -1)
        rows[:, :width] = self.rows
        table.index_copy_(0, self.slots.to(table.device, non_blocking=True), rows.to(table.device, non_blocking=True))


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
