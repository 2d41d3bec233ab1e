"""logit_bias: per-request additive biases on chosen token ids, applied to the raw logits.

Each slot holds up to MAX_LOGIT_BIAS (id, bias) pairs, padded with (0, 0.0), in two
[max_num_reqs, MAX_LOGIT_BIAS] tables; a step adds them with one scatter over the
batch's rows (padding adds zero). Only a slot whose request has biases, or whose
previous request had some, is written when a request is admitted.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from mrv2.sampling_params import MAX_LOGIT_BIAS
from mrv2.staged_writes import StagedRowWriter, StagedWrite


@dataclass(frozen=True)
class LogitBiasMetadata:
    """One step's rows: token ids int64 [B, MAX_LOGIT_BIAS] and their biases float32 [B, MAX_LOGIT_BIAS]."""

    token_ids: torch.Tensor
    bias: torch.Tensor


class LogitBiasState:
    """Per-slot bias tables on the device; `active_cpu` says which slots have any."""

    def __init__(self, max_num_reqs: int, device: torch.device, pin_memory: bool) -> None:
        self.token_ids = torch.zeros(max_num_reqs, MAX_LOGIT_BIAS, dtype=torch.int64, device=device)
        self.bias = torch.zeros(max_num_reqs, MAX_LOGIT_BIAS, dtype=torch.float32, device=device)
        self.active_cpu = np.zeros(max_num_reqs, dtype=bool)
        self._writers = (StagedRowWriter(self.token_ids, pin_memory), StagedRowWriter(self.bias, pin_memory))

    def add_request(self, slot: int, logit_bias: dict[int, float] | None) -> None:
        if not logit_bias and not self.active_cpu[slot]:
            return  # the slot's rows are padding already
        ids = np.zeros(MAX_LOGIT_BIAS, dtype=np.int64)
        bias = np.zeros(MAX_LOGIT_BIAS, dtype=np.float32)
        items = sorted((logit_bias or {}).items())
        ids[:len(items)] = [t for t, _ in items]
        bias[:len(items)] = [b for _, b in items]
        self._writers[0].stage(slot, 0, ids)
        self._writers[1].stage(slot, 0, bias)
        self.active_cpu[slot] = bool(items)

    def take_staged(self) -> list[StagedWrite]:
        return [w for w in (w.take() for w in self._writers) if w is not None]

    def any_active(self, idx_cpu: np.ndarray) -> bool:
        return bool(self.active_cpu[idx_cpu].any())

    def metadata(self, idx_mapping: torch.Tensor) -> LogitBiasMetadata:
        return LogitBiasMetadata(self.token_ids[idx_mapping], self.bias[idx_mapping])


def apply_logit_bias(logits: torch.Tensor, md: LogitBiasMetadata) -> torch.Tensor:
    """In place: logits[row, id] += bias for each of the row's pairs."""
    return logits.scatter_add_(1, md.token_ids, md.bias)
