"""Persistent input buffers and the per-step gather from slot state (MRV2 principle 2).

Every buffer is allocated once at its maximum size; a step writes into a prefix of
each, so addresses never change and a captured graph can replay over them. The
only host-to-device traffic per step is the batch order (`idx_mapping`) and the
per-row scheduled token counts; everything else is gathered on the device.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from mrv2.attention.backend import CommonAttentionMetadata
from mrv2.runner.block_table import BlockTables
from mrv2.runner.states import RequestStates


@dataclass
class StepBatch:
    """Views of one step's inputs in the persistent buffers, plus host-side sizes."""

    req_ids: list[str]
    idx_cpu: np.ndarray
    num_scheduled_cpu: np.ndarray
    num_tokens: int
    idx_mapping: torch.Tensor
    num_scheduled: torch.Tensor
    input_ids: torch.Tensor
    positions: torch.Tensor
    logits_indices: torch.Tensor
    attn: CommonAttentionMetadata


class InputBuffers:
    """Fixed-address tensors the model reads its inputs from."""

    def __init__(self, max_num_reqs: int, max_num_tokens: int, max_blocks_per_req: int,
                 device: torch.device, pin_memory: bool) -> None:
        def zeros(*shape, dtype):
            return torch.zeros(*shape, dtype=dtype, device=device)

        self.device = device
        self.input_ids = zeros(max_num_tokens, dtype=torch.int64)
        self.positions = zeros(max_num_tokens, dtype=torch.int64)
        self.slot_mapping = zeros(max_num_tokens, dtype=torch.int64)
        self.token_rows = zeros(max_num_tokens, dtype=torch.int64)
        self.query_start_loc = zeros(max_num_reqs + 1, dtype=torch.int32)
        self.seq_lens = zeros(max_num_reqs, dtype=torch.int32)
        self.idx_mapping = zeros(max_num_reqs, dtype=torch.int64)
        self.num_scheduled = zeros(max_num_reqs, dtype=torch.int32)
        self.logits_indices = zeros(max_num_reqs, dtype=torch.int64)
        self.block_table = zeros(max_num_reqs, max_blocks_per_req, dtype=torch.int32)
        self.arange = torch.arange(max_num_tokens, dtype=torch.int64, device=device)
        # Host staging: [idx_mapping | num_scheduled | query_start_loc] travel in one copy.
        self._staging = torch.zeros(3 * max_num_reqs + 1, dtype=torch.int64, pin_memory=pin_memory)
        self._max_num_reqs = max_num_reqs

    def prepare(self, req_ids: list[str], idx_cpu: np.ndarray, num_scheduled_cpu: np.ndarray,
                states: RequestStates, block_tables: BlockTables) -> StepBatch:
        """Gather one step's inputs for the requests in batch order `idx_cpu`."""
        b, r = len(idx_cpu), self._max_num_reqs
        qsl_cpu = np.zeros(b + 1, dtype=np.int64)
        np.cumsum(num_scheduled_cpu, out=qsl_cpu[1:])
        t = int(qsl_cpu[-1])
        staging = self._staging.numpy()
        staging[:b] = idx_cpu
        staging[r:r + b] = num_scheduled_cpu
        staging[2 * r:2 * r + b + 1] = qsl_cpu
        dev = self._staging.to(self.device, non_blocking=True)
        self.idx_mapping[:b].copy_(dev[:b])
        self.num_scheduled[:b].copy_(dev[r:r + b])
        self.query_start_loc[:b + 1].copy_(dev[2 * r:2 * r + b + 1])

        idx = self.idx_mapping[:b]
        qsl = self.query_start_loc[:b + 1]
        tokens = self.arange[:t]
        rows = self.token_rows[:t]
        torch.searchsorted(qsl[1:], tokens, right=True, out=rows)
        computed = states.num_computed[idx].long()
        torch.add(computed[rows], tokens - qsl[rows], out=self.positions[:t])
        positions = self.positions[:t]
        self.input_ids[:t] = states.token_ids[idx[rows], positions]
        torch.add(computed, self.num_scheduled[:b], out=self.seq_lens[:b])
        torch.sub(qsl[1:], 1, out=self.logits_indices[:b])
        block_table = block_tables.gather(idx, self.block_table)
        slot_mapping = block_tables.slot_mapping(block_table, rows, positions, self.slot_mapping)

        seq_lens_cpu = states.num_computed_cpu[idx_cpu] + num_scheduled_cpu
        attn = CommonAttentionMetadata(
            num_reqs=b, num_tokens=t, num_decodes=int(np.count_nonzero(num_scheduled_cpu == 1)),
            max_query_len=int(num_scheduled_cpu.max()), max_seq_len=int(seq_lens_cpu.max()),
            query_start_loc=qsl, seq_lens=self.seq_lens[:b], block_table=block_table,
            slot_mapping=slot_mapping, query_start_loc_cpu=qsl_cpu, seq_lens_cpu=seq_lens_cpu,
            block_size=block_tables.block_size,
        )
        return StepBatch(req_ids=req_ids, idx_cpu=idx_cpu, num_scheduled_cpu=num_scheduled_cpu, num_tokens=t,
                         idx_mapping=idx, num_scheduled=self.num_scheduled[:b], input_ids=self.input_ids[:t],
                         positions=positions, logits_indices=self.logits_indices[:b], attn=attn)
