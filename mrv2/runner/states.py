"""Slot-based request state (MRV2 principle 1: state is not input).

Every live request owns one row ("slot") of these tensors from admission until it
finishes or is preempted. Rows are never reordered or compacted; a step's batch is
an `idx_mapping` into them. The device tensors are the source of truth for token
history and progress; the numpy arrays mirror what the host knows (exact without
speculative decoding) so it can size work without reading the device.
"""

from __future__ import annotations

import numpy as np
import torch

from mrv2.engine.scheduler_output import NewRequestData
from mrv2.staged_writes import StagedRowWriter, StagedScalarWriter, StagedWrite, apply_writes


class RequestStates:
    """Per-request token history and progress counters (sampling parameters: `mrv2.sample.states`)."""

    def __init__(self, max_num_reqs: int, max_model_len: int, device: torch.device, pin_memory: bool,
                 num_draft_columns: int = 0) -> None:
        self.max_num_reqs = max_num_reqs
        self.max_model_len = max_model_len
        self._free_slots = list(range(max_num_reqs - 1, -1, -1))
        self.slot_of: dict[str, int] = {}

        def zeros(*shape, dtype):
            return torch.zeros(*shape, dtype=dtype, device=device)

        # One spare column: the post-update writes position num_tokens even at the length limit;
        # and room for a drafter's proposals after the last token (`write_drafts`).
        self.token_ids = zeros(max_num_reqs, max_model_len + 1 + num_draft_columns, dtype=torch.int64)
        self.num_tokens = zeros(max_num_reqs, dtype=torch.int32)
        self.num_computed = zeros(max_num_reqs, dtype=torch.int32)

        self.num_tokens_cpu = np.zeros(max_num_reqs, dtype=np.int64)
        self.num_computed_cpu = np.zeros(max_num_reqs, dtype=np.int64)

        self._token_writer = StagedRowWriter(self.token_ids, pin_memory)
        self._scalar_writers = {name: StagedScalarWriter(getattr(self, name), pin_memory)
                                for name in ("num_tokens", "num_computed")}

    @property
    def num_free_slots(self) -> int:
        return len(self._free_slots)

    def add(self, req: NewRequestData) -> int:
        """Give `req` a slot and stage its tokens and progress."""
        if req.req_id in self.slot_of:
            raise ValueError(f"request {req.req_id!r} is already in the runner")
        if not self._free_slots:
            raise RuntimeError("no free request slot: the scheduler exceeded max_num_seqs")
        slot = self._free_slots.pop()
        self.slot_of[req.req_id] = slot
        n = len(req.all_token_ids)
        self._token_writer.stage(slot, 0, req.all_token_ids)
        for name, value in (("num_tokens", n), ("num_computed", req.num_computed_tokens)):
            self._scalar_writers[name].stage(slot, value)
        self.num_tokens_cpu[slot] = n
        self.num_computed_cpu[slot] = req.num_computed_tokens
        return slot

    def remove(self, req_id: str) -> int | None:
        """Free the slot of a finished or preempted request; None if it was never added."""
        slot = self.slot_of.pop(req_id, None)
        if slot is not None:
            self._free_slots.append(slot)
        return slot

    def take_staged(self) -> list[StagedWrite]:
        """Pack the staged writes (host work); applying them is device work."""
        writes = [self._token_writer.take(), *(w.take() for w in self._scalar_writers.values())]
        return [w for w in writes if w is not None]

    def apply_staged(self) -> None:
        apply_writes(self.take_staged())

    def advance_host(self, idx_cpu: np.ndarray, num_scheduled_cpu: np.ndarray,
                     num_drafts_cpu: np.ndarray | None = None) -> None:
        """The host mirror's half of the post-update, done when the step is launched.

        A request whose step reaches its last known token gains one token (not yet
        known to the host); with k drafts it gains up to 1 + k, counted in full here
        (an upper bound) and corrected by `reject_host` when the outcome arrives. A
        partial prefill chunk gains none.
        """
        computed_cpu = self.num_computed_cpu[idx_cpu] + num_scheduled_cpu
        self.num_computed_cpu[idx_cpu] = computed_cpu
        done = computed_cpu >= self.num_tokens_cpu[idx_cpu]
        self.num_tokens_cpu[idx_cpu] += done * (1 if num_drafts_cpu is None else 1 + num_drafts_cpu)

    def reject_host(self, idx_cpu: np.ndarray, num_rejected: np.ndarray) -> None:
        """Take rejected drafts back out of the host mirror (their KV does not count)."""
        self.num_computed_cpu[idx_cpu] -= num_rejected
        self.num_tokens_cpu[idx_cpu] -= num_rejected

    def post_update_device(self, idx_mapping: torch.Tensor, num_scheduled: torch.Tensor, sampled: torch.Tensor,
                           num_emitted: torch.Tensor | None = None,
                           num_drafts: torch.Tensor | None = None) -> torch.Tensor:
        """Advance progress and append each request's new tokens, on the device.

        `sampled` is [B] (one token per row) or [B, 1 + max drafts] with `num_emitted`
        tokens valid per row (the accepted drafts and one more) out of 1 + `num_drafts`
        computed. A request whose prefill is still partial after this step keeps its
        history unchanged (its sample is discarded), decided per row on the device.
        Returns the tokens each row emitted [B] (0 for a partial prefill).
        """
        computed = self.num_computed[idx_mapping] + num_scheduled
        n = self.num_tokens[idx_mapping]
        done = computed >= n
        if num_emitted is None:
            emitted = done.int()
        else:
            emitted = torch.where(done, num_emitted, 0).int()
            computed = computed - torch.where(done, num_drafts + 1 - num_emitted, 0).int()
        self.num_computed[idx_mapping] = computed
        if sampled.dim() == 1:  # one token a row, at position n: a third of the ops of the columns below
            pos = n.long()
            wrote = done if num_emitted is None else emitted > 0
            self.token_ids[idx_mapping, pos] = torch.where(wrote, sampled, self.token_ids[idx_mapping, pos])
        else:
            # Column j of a row writes its min(j, emitted - 1)-th token: duplicates write equal values.
            cols = torch.arange(sampled.shape[1], device=sampled.device)
            take = torch.minimum(cols[None, :], (emitted - 1).clamp(min=0)[:, None].long())
            pos = n.long()[:, None] + take
            rows = idx_mapping[:, None].expand_as(pos)
            current = self.token_ids[rows, pos]
            self.token_ids[rows, pos] = torch.where((emitted > 0)[:, None], sampled.gather(1, take), current)
        self.num_tokens[idx_mapping] = n + emitted
        return emitted

    def write_drafts(self, idx_mapping: torch.Tensor, drafts: torch.Tensor) -> None:
        """Put a drafter's proposals [B, k] right after each row's last token, where the next step's
        gather reads a verify step's inputs; a step that emits overwrites them with its tokens."""
        cols = self.num_tokens[idx_mapping].long()[:, None] + torch.arange(drafts.shape[1], device=drafts.device)
        self.token_ids[idx_mapping[:, None].expand_as(cols), cols] = drafts

    def post_update(self, idx_mapping: torch.Tensor, num_scheduled: torch.Tensor, sampled: torch.Tensor,
                    idx_cpu: np.ndarray, num_scheduled_cpu: np.ndarray) -> None:
        """Both halves of the post-update at once (the serial path)."""
        self.post_update_device(idx_mapping, num_scheduled, sampled)
        self.advance_host(idx_cpu, num_scheduled_cpu)
