"""Staged writes: host-side changes to large device state, applied once per step.

Adding a request, appending its new blocks or resetting a counter are small ragged
diffs. They are collected on the host during the step's bookkeeping and applied
with a single index_copy per target tensor, so the cost per step is one small
host-to-device copy and one kernel, however many requests changed.
"""

from __future__ import annotations

import numpy as np
import torch


class StagedRowWriter:
    """Ragged writes of (row, start column, values) into a contiguous 2-D tensor."""

    def __init__(self, target: torch.Tensor, pin_memory: bool = False) -> None:
        if target.dim() != 2 or not target.is_contiguous():
            raise ValueError("StagedRowWriter needs a contiguous 2-D tensor")
        self.target = target
        self.pin_memory = pin_memory
        self._index: list[np.ndarray] = []
        self._values: list[np.ndarray] = []

    def stage(self, row: int, start: int, values) -> None:
        values = np.asarray(values, dtype=np.int64)
        if values.size == 0:
            return
        if start < 0 or start + values.size > self.target.shape[1]:
            raise IndexError(f"write of {values.size} values at column {start} overflows width {self.target.shape[1]}")
        first = row * self.target.shape[1] + start
        self._index.append(np.arange(first, first + values.size, dtype=np.int64))
        self._values.append(values)

    def apply(self) -> None:
        if not self._index:
            return
        index = _to_device(np.concatenate(self._index), self.target.device, self.pin_memory)
        values = _to_device(np.concatenate(self._values), self.target.device, self.pin_memory)
        self.target.view(-1).index_copy_(0, index, values.to(self.target.dtype))
        self._index.clear()
        self._values.clear()


class StagedScalarWriter:
    """Writes of one value per row into a 1-D tensor."""

    def __init__(self, target: torch.Tensor, pin_memory: bool = False) -> None:
        self.target = target
        self.pin_memory = pin_memory
        self._rows: list[int] = []
        self._values: list[float] = []

    def stage(self, row: int, value: float) -> None:
        self._rows.append(row)
        self._values.append(value)

    def apply(self) -> None:
        if not self._rows:
            return
        rows = _to_device(np.asarray(self._rows, dtype=np.int64), self.target.device, self.pin_memory)
        values = torch.tensor(self._values, dtype=self.target.dtype)
        self.target.index_copy_(0, rows, values.to(self.target.device, non_blocking=True))
        self._rows.clear()
        self._values.clear()


def _to_device(array: np.ndarray, device: torch.device, pin_memory: bool) -> torch.Tensor:
    tensor = torch.from_numpy(array)
    if pin_memory:
        tensor = tensor.pin_memory()
    return tensor.to(device, non_blocking=True)
