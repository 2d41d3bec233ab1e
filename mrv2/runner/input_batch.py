"""Persistent input buffers and the per-step gather from slot state (MRV2 principle 2).

Every buffer is allocated once at its maximum size; a step writes into a prefix of
each, so addresses never change and a captured graph can replay over them. The
only host-to-device traffic per step is one staging copy (batch order `idx_mapping`,
per-row scheduled token counts, `query_start_loc`, the logits rows and, with drafts,
their positions and ids); everything else is gathered on the device.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from mrv2.attention.backend import CommonAttentionMetadata
from mrv2.runner.block_table import BlockTables
from mrv2.runner.graphs.descriptor import pad_query_start_loc
from mrv2.runner.states import RequestStates


@dataclass(frozen=True)
class StepPadding:
    """Sizes a captured graph was recorded at: the step is padded up to them.

    Padded tokens read token 0 at position 0. With `max_seq_len` set (FULL graphs:
    attention is inside the graph) the attention metadata is padded too: padded tokens
    write their KV into the reserved null block (slot 0), padded requests have sequence
    length 0 and get the padded tokens in equal shares at the end, so query_start_loc
    stays non-decreasing, and attention is sized by `max_seq_len`, not by the step's
    own longest sequence. With `max_seq_len` None (PIECEWISE: attention runs eagerly)
    only the token-indexed model inputs are padded; the attention metadata is the real one.
    """

    num_reqs: int
    num_tokens: int
    max_seq_len: int | None

    @property
    def pads_attention(self) -> bool:
        return self.max_seq_len is not None


@dataclass(frozen=True)
class StepPlan:
    """The host half of one step's inputs: batch order, sizes, host metadata, and the
    staging buffer that carries the device-bound part in one copy."""

    req_ids: list[str]
    idx_cpu: np.ndarray
    num_scheduled_cpu: np.ndarray
    num_tokens: int
    padding: StepPadding | None
    staging: torch.Tensor
    segments: dict[str, slice]  # where each device-bound array lies in `staging`
    query_start_loc_cpu: np.ndarray
    seq_lens_cpu: np.ndarray
    num_drafts_cpu: np.ndarray  # per batch row: draft tokens verified this step
    num_logits: int  # logits rows: one per request, plus one per draft
    logits_lead: bool = False  # the logits rows are the first num_logits tokens

    @property
    def num_reqs(self) -> int:
        return len(self.idx_cpu)

    @property
    def max_drafts(self) -> int:
        return int(self.num_drafts_cpu.max()) if self.num_drafts_cpu.size else 0


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
    # Per logits row: its batch row and its offset within that request's rows (0 .. drafts).
    logits_rows: torch.Tensor
    logits_offsets: torch.Tensor
    # Per batch row: its first logits row and its number of drafts.
    logits_start: torch.Tensor
    num_drafts: torch.Tensor
    max_drafts: int
    logits_lead: bool = False  # logits_indices is 0, 1, ..., num_logits - 1

    def logits_hidden(self, hidden: torch.Tensor) -> torch.Tensor:
        """The rows of `hidden` [tokens, H] the logits are computed from (leading rows: a view, no gather)."""
        return hidden[:self.logits_indices.shape[0]] if self.logits_lead else hidden[self.logits_indices]

    def logits_slots(self) -> torch.Tensor:
        """Per logits row: its request's slot."""
        return self.idx_mapping if self.max_drafts == 0 else self.idx_mapping[self.logits_rows]

    def logits_positions(self, counts: torch.Tensor) -> torch.Tensor:
        """Per logits row: the position of the token it samples, from its request's token count (`counts`)."""
        return counts.long() if self.max_drafts == 0 else counts.long() + self.logits_offsets


class InputBuffers:
    """Fixed-address tensors the model reads its inputs from.

    `plan` is host work (numpy only); `gather` is device work. Two host staging
    buffers alternate, so the next step's plan never writes into the buffer the step
    in flight is still copying from.
    """

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
        # Logits rows: one per request plus one per draft token, at most one per token.
        self.logits_indices = zeros(max_num_tokens, dtype=torch.int64)
        self.logits_rows = zeros(max_num_tokens, dtype=torch.int64)
        self.logits_offsets = zeros(max_num_tokens, dtype=torch.int64)
        self.logits_start = zeros(max_num_reqs, dtype=torch.int64)
        self.num_drafts = zeros(max_num_reqs, dtype=torch.int64)
        self.block_table = zeros(max_num_reqs, max_blocks_per_req, dtype=torch.int32)
        self.arange = torch.arange(max_num_tokens, dtype=torch.int64, device=device)
        # Host staging: everything the step's inputs need from the host, in one copy (see plan()).
        size = 5 * max_num_reqs + 1 + 5 * max_num_tokens
        self._staging = [torch.zeros(size, dtype=torch.int64, pin_memory=pin_memory) for _ in range(2)]
        self._staging_np = [t.numpy() for t in self._staging]  # host views, taken once
        self._next_staging = 0
        self._max_num_reqs = max_num_reqs

    def prepare(self, req_ids: list[str], idx_cpu: np.ndarray, num_scheduled_cpu: np.ndarray,
                states: RequestStates, block_tables: BlockTables, padding: StepPadding | None = None) -> StepBatch:
        """plan() then gather() at once (the serial path)."""
        plan = self.plan(req_ids, idx_cpu, num_scheduled_cpu, states.num_computed_cpu, padding)
        return self.gather(plan, states, block_tables)

    def plan(self, req_ids: list[str], idx_cpu: np.ndarray, num_scheduled_cpu: np.ndarray,
             num_computed_cpu: np.ndarray, padding: StepPadding | None = None,
             drafts: list[list[int]] | None = None) -> StepPlan:
        """Host work: order, sizes and host metadata of the requests in batch order `idx_cpu`
        (padded to `padding` if given); `num_computed_cpu` is the slots' host mirror.

        `drafts[i]` are the draft tokens of batch row i (its last `len(drafts[i])` scheduled
        tokens): their input ids come from here, and the row gets a logits row at each of
        its last 1 + len(drafts[i]) tokens. Every index the device needs for that (logits
        rows, their requests and offsets, draft positions and ids) is computed here and
        travels in the one staging copy: no data-dependent op runs on the device.
        """
        b = len(idx_cpu)
        t = int(num_scheduled_cpu.sum())
        padded_attn = padding is not None and padding.pads_attention
        ba, ta = (padding.num_reqs, padding.num_tokens) if padded_attn else (b, t)  # the sizes attention sees
        qsl_cpu = np.zeros(b + 1, dtype=np.int64)
        np.cumsum(num_scheduled_cpu, out=qsl_cpu[1:])
        if ba > b:
            qsl_cpu = pad_query_start_loc(qsl_cpu, b, ba, ta)
        num_drafts = np.fromiter((len(d) for d in drafts), np.int64, b) if drafts else np.zeros(b, np.int64)
        per_row = num_drafts + 1
        num_logits = int(per_row.sum())
        logits_rows = np.repeat(np.arange(b), per_row)
        logits_start = np.cumsum(per_row) - per_row
        logits_offsets = np.arange(num_logits) - logits_start[logits_rows]
        logits_indices = (qsl_cpu[1:b + 1] - per_row)[logits_rows] + logits_offsets
        draft_pos = logits_indices[logits_offsets > 0]  # a draft's input sits after each non-first logits row
        draft_ids = np.fromiter((x for d in drafts for x in d), np.int64, len(draft_pos)) if drafts else draft_pos
        if drafts:  # placeholders (-1): a drafter already wrote those ids into the slot's history
            known = draft_ids >= 0
            draft_pos, draft_ids = draft_pos[known], draft_ids[known]

        arrays = {"idx": idx_cpu, "num_scheduled": num_scheduled_cpu, "qsl": qsl_cpu,
                  "logits_indices": logits_indices, "logits_rows": logits_rows, "logits_offsets": logits_offsets,
                  "logits_start": logits_start, "num_drafts": num_drafts, "draft_pos": draft_pos,
                  "draft_ids": draft_ids}
        staging, host = self._staging[self._next_staging], self._staging_np[self._next_staging]
        self._next_staging ^= 1
        segments, at = {}, 0
        for name, array in arrays.items():
            host[at:at + len(array)] = array
            segments[name] = slice(at, at + len(array))
            at += len(array)
        seq_lens_cpu = np.zeros(ba, dtype=np.int64)
        seq_lens_cpu[:b] = num_computed_cpu[idx_cpu] + num_scheduled_cpu
        # Every token a logits row (each row scheduled just its logits rows): they are tokens 0, 1, ...
        return StepPlan(req_ids, idx_cpu, num_scheduled_cpu, t, padding, staging[:at], segments, qsl_cpu,
                        seq_lens_cpu, num_drafts, num_logits, logits_lead=t == num_logits)

    def gather(self, plan: StepPlan, states: RequestStates, block_tables: BlockTables) -> StepBatch:
        """Device work: one copy of the staging buffer, then every input gathered from slot state."""
        padding, b, t = plan.padding, plan.num_reqs, plan.num_tokens
        bp, tp = (padding.num_reqs, padding.num_tokens) if padding else (b, t)
        padded_attn = padding is not None and padding.pads_attention
        ba, ta = (bp, tp) if padded_attn else (b, t)
        dev = plan.staging.to(self.device, non_blocking=True)
        seg = plan.segments
        n = plan.num_logits
        for name, buf in (("idx", self.idx_mapping), ("num_scheduled", self.num_scheduled),
                          ("qsl", self.query_start_loc), ("logits_indices", self.logits_indices),
                          ("logits_rows", self.logits_rows), ("logits_offsets", self.logits_offsets),
                          ("logits_start", self.logits_start), ("num_drafts", self.num_drafts)):
            part = dev[seg[name]]
            buf[:part.shape[0]].copy_(part)

        idx = self.idx_mapping[:b]
        qsl = self.query_start_loc[:b + 1]
        if padding:
            self._fill_padding(b, t, bp, tp)
        tokens = self.arange[:t]
        rows = self.token_rows[:t]
        torch.searchsorted(qsl[1:], tokens, right=True, out=rows)
        computed = states.num_computed[idx].long()
        torch.add(computed[rows], tokens - qsl[rows], out=self.positions[:t])
        positions = self.positions[:t]
        # Drafts lie past the known history: their ids come from the host, not from token_ids.
        self.input_ids[:t] = states.token_ids[idx[rows], positions]
        if seg["draft_pos"].stop > seg["draft_pos"].start:  # drafts whose ids the host knows
            self.input_ids.index_copy_(0, dev[seg["draft_pos"]], dev[seg["draft_ids"]])
        torch.add(computed, self.num_scheduled[:b], out=self.seq_lens[:b])
        block_tables.gather(idx, self.block_table)
        block_tables.slot_mapping(self.block_table[:b], rows, positions, self.slot_mapping)

        qsl_cpu, seq_lens_cpu = plan.query_start_loc_cpu, plan.seq_lens_cpu
        query_lens_cpu = np.diff(qsl_cpu)
        not_decode = np.flatnonzero(query_lens_cpu != 1)  # decodes lead the batch
        attn = CommonAttentionMetadata(
            num_reqs=ba, num_tokens=ta, num_decodes=int(not_decode[0]) if not_decode.size else ba,
            max_query_len=int(query_lens_cpu.max()),
            max_seq_len=padding.max_seq_len if padded_attn else int(seq_lens_cpu.max()),
            query_start_loc=self.query_start_loc[:ba + 1], seq_lens=self.seq_lens[:ba],
            block_table=self.block_table[:ba], slot_mapping=self.slot_mapping[:ta], query_start_loc_cpu=qsl_cpu,
            seq_lens_cpu=seq_lens_cpu, block_size=block_tables.block_size, static_shapes=padded_attn,
        )
        return StepBatch(req_ids=plan.req_ids, idx_cpu=plan.idx_cpu, num_scheduled_cpu=plan.num_scheduled_cpu,
                         num_tokens=t, idx_mapping=idx, num_scheduled=self.num_scheduled[:b],
                         input_ids=self.input_ids[:tp], positions=self.positions[:tp],
                         logits_indices=self.logits_indices[:n], attn=attn, logits_rows=self.logits_rows[:n],
                         logits_offsets=self.logits_offsets[:n], logits_start=self.logits_start[:b],
                         num_drafts=self.num_drafts[:b], max_drafts=plan.max_drafts, logits_lead=plan.logits_lead)

    def _fill_padding(self, b: int, t: int, bp: int, tp: int) -> None:
        for buf in (self.input_ids, self.positions, self.slot_mapping):
            buf[t:tp].zero_()
        self.seq_lens[b:bp].zero_()
        self.block_table[b:bp].zero_()
