"""Per-slot block tables on the device, and the per-step slot mapping."""

from __future__ import annotations

import numpy as np
import torch

from mrv2.staged_writes import StagedRowWriter, StagedWrite, apply_writes


class BlockTables:
    """Row `slot` lists the KV blocks of the request in that slot, in order."""

    def __init__(self, max_num_reqs: int, max_blocks_per_req: int, block_size: int,
                 device: torch.device, pin_memory: bool) -> None:
        self.block_size = block_size
        self.max_blocks_per_req = max_blocks_per_req
        self.table = torch.zeros(max_num_reqs, max_blocks_per_req, dtype=torch.int32, device=device)
        self.num_blocks = np.zeros(max_num_reqs, dtype=np.int64)
        self._writer = StagedRowWriter(self.table, pin_memory)
        self._cleared: set[int] = set()  # rows reset since the last take_staged

    def reset(self, slot: int) -> None:
        """Empty the row for a new request: every entry reads the null block 0 until appended, so a
        position past the request's blocks (a drafter's lookahead) can only touch the null block."""
        self._cleared.add(slot)
        self.num_blocks[slot] = 0

    def append(self, slot: int, block_ids: list[int]) -> None:
        self._writer.stage(slot, int(self.num_blocks[slot]), block_ids)
        self.num_blocks[slot] += len(block_ids)

    def take_staged(self) -> list[StagedWrite]:
        """Pack the staged rows (host work); applying them is device work."""
        for slot in self._cleared:  # the columns past the appended blocks (no index written twice)
            self._writer.stage(slot, int(self.num_blocks[slot]),
                               np.zeros(self.max_blocks_per_req - int(self.num_blocks[slot]), np.int64))
        self._cleared.clear()
        write = self._writer.take()
        return [] if write is None else [write]

    def apply_staged(self) -> None:
        apply_writes(self.take_staged())

    def gather(self, idx_mapping: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Copy the rows of `idx_mapping` into `out` (a persistent buffer) and return the view."""
        n = idx_mapping.shape[0]
        torch.index_select(self.table, 0, idx_mapping, out=out[:n])
        return out[:n]

    def slot_mapping(self, batch_block_table: torch.Tensor, token_rows: torch.Tensor, positions: torch.Tensor,
                     out: torch.Tensor) -> torch.Tensor:
        """Flat cache slot of every token: block_table[row, pos // bs] * bs + pos % bs."""
        n = positions.shape[0]
        blocks = batch_block_table[token_rows, positions // self.block_size]
        torch.add(blocks.long() * self.block_size, positions % self.block_size, out=out[:n])
        return out[:n]
