"""Staged writes: host-side changes to large device state, applied once per step.

Adding a request, appending its new blocks or resetting a counter are small ragged
diffs. They are collected on the host during the step's bookkeeping and applied
with a single index_copy per target tensor, so the cost per step is one small
host-to-device copy and one kernel, however many requests changed.

`take()` packs what was staged into fresh host tensors (host work: each step gets
its own, so a step still in flight never shares a staging buffer with the next);
the returned `StagedWrite.apply()` is the device work.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class StagedWrite:
    """One packed write into a flat view of `target`: `target.view(-1)[index] = values`."""

    target: torch.Tensor
    index: torch.Tensor
    values: torch.Tensor

    def apply(self) -> None:
        index = self.index.to(self.target.device, non_blocking=True)
        values = self.values.to(self.target.device, non_blocking=True)
        self.target.view(-1).index_copy_(0, index, values)


def _host(array: np.ndarray, dtype: torch.dtype, pin_memory: bool) -> torch.Tensor:
    tensor = torch.from_numpy(array).to(dtype)
    return tensor.pin_memory() if pin_memory else tensor


def apply_writes(writes: list[StagedWrite]) -> None:
    """Apply packed writes in order (device work)."""
    for write in writes:
        write.apply()


class _Writer:
    def take(self) -> StagedWrite | None:
        raise NotImplementedError

    def apply(self) -> None:
        """take() and apply at once (the serial path)."""
        if (write := self.take()) is not None:
            write.apply()


class StagedRowWriter(_Writer):
    """Ragged writes of (row, start column, values) into a contiguous 2-D tensor."""

    def __init__(self, target: torch.Tensor, pin_memory: bool = False) -> None:
        if target.dim() != 2 or not target.is_contiguous():
            raise ValueError("StagedRowWriter needs a contiguous 2-D tensor")
        self.target = target
        self.pin_memory = pin_memory
        self._index: list[np.ndarray] = []
        self._values: list[np.ndarray] = []

    def stage(self, row: int, start: int, values) -> None:
        values = np.asarray(values)  # converted to the target's dtype when packed
        if values.size == 0:
            return
        if start < 0 or start + values.size > self.target.shape[1]:
            raise IndexError(f"write of {values.size} values at column {start} overflows width {self.target.shape[1]}")
        first = row * self.target.shape[1] + start
        self._index.append(np.arange(first, first + values.size, dtype=np.int64))
        self._values.append(values)

    def take(self) -> StagedWrite | None:
        """Pack and clear what was staged (host work); None when nothing was."""
        if not self._index:
            return None
        write = StagedWrite(self.target, _host(np.concatenate(self._index), torch.int64, self.pin_memory),
                            _host(np.concatenate(self._values), self.target.dtype, self.pin_memory))
        self._index.clear()
        self._values.clear()
        return write



class StagedScalarWriter(_Writer):
    """Writes of one value per row into a 1-D tensor."""

    def __init__(self, target: torch.Tensor, pin_memory: bool = False) -> None:
        self.target = target
        self.pin_memory = pin_memory
        self._rows: list[int] = []
        self._values: list[float] = []

    def stage(self, row: int, value: float) -> None:
        self._rows.append(row)
        self._values.append(value)

    def take(self) -> StagedWrite | None:
        """Pack and clear what was staged (host work); None when nothing was."""
        if not self._rows:
            return None
        values = torch.tensor(self._values, dtype=self.target.dtype)
        write = StagedWrite(self.target, _host(np.asarray(self._rows, dtype=np.int64), torch.int64, self.pin_memory),
                            values.pin_memory() if self.pin_memory else values)
        self._rows.clear()
        self._values.clear()
        return write

