"""Model-based drafting on the device, right after a step's tokens are known (draft model, Eagle, MTP).

The drafter's layers keep their KV cache in the target's blocks: same block table,
same slots, so allocation, prefix caching and preemption need nothing of their own.
After the target's step and its post-update (the emitted tokens are in the slots'
token history), one propose call runs:

1. a pass over the step's own tokens, attending exactly as the target did, which
   writes the drafter's KV for every position the target computed. A draft model
   reads token i at position i; a head (Eagle, Eagle-3, MTP) reads the token at i + 1
   and the target's features at i, so its row at the last accepted input position
   already predicts the first draft.
2. single-token decode passes from each request's last emitted token, one draft
   each, until k drafts exist. Their KV lands past the step's tokens, in blocks the
   scheduler allocated ahead (k positions); rows with nothing to draft (a partial
   prefill) or positions past max_model_len write into the null block.

The runner writes the drafts into each slot's token history right after its last
token, where the next step's gather reads a verify step's inputs: the scheduler only
schedules k placeholders, so the host never needs the ids, and with async scheduling
the next step is launched before this one's tokens are known.

Drafting is greedy by default (argmax of the drafter's logits): verification then keeps
greedy and seeded outputs identical to the output without drafts (see
`mrv2.sample.draft_verify`). With `probabilistic` drafting, random requests draw their
drafts from the drafter's temperature-scaled distribution q, kept per slot for the
probabilistic rejection sampler: more drafts are accepted at high temperatures, and the
output is distributed as the target's (not draw for draw the same). Everything here is
device work with host-known shapes: no host sync.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from mrv2.attention.backend import AttentionBackend, CommonAttentionMetadata
from mrv2.models.draft_head import DraftHead
from mrv2.sample.rejection_sampler import draw_drafts


@dataclass
class DraftStep:
    """What one step hands the drafter (device tensors; batch rows are the step's requests)."""

    input_ids: torch.Tensor  # [n] the step's input ids (graph padding included)
    positions: torch.Tensor  # [n]
    token_slots: torch.Tensor  # [t] the slot of each real token (t <= n)
    attn_metadata: Any  # the backend metadata the target attended with
    features: torch.Tensor | None  # [n, feature_size] the target's features (heads only)
    slots: torch.Tensor  # [B] slot of each batch row
    last_rows: torch.Tensor  # [B] token row of each request's last accepted input
    emitted: torch.Tensor  # [B] tokens the step emitted per row (0: partial prefill)
    block_table: torch.Tensor  # [B, max blocks] the batch's block table
    seq_lens_cpu: np.ndarray  # [B] host upper bounds of the sequence lengths the step computed
    token_ids: torch.Tensor  # the slots' token history, after the post-update
    num_tokens: torch.Tensor  # the slots' token counts, after the post-update
    temperature: torch.Tensor | None  # [B] each request's sampling temperature (probabilistic drafting only)
    seeds: torch.Tensor | None  # [B] each request's seed (probabilistic drafting only)


class DraftBuffers:
    """The decode passes' inputs at fixed addresses (graphs replay over them), sized for every request."""

    def __init__(self, max_num_reqs: int, max_blocks_per_req: int, feature_size: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        def zeros(*shape, dtype=torch.int64):
            return torch.zeros(*shape, dtype=dtype, device=device)

        self.input_ids = zeros(max_num_reqs)
        self.positions = zeros(max_num_reqs)
        self.features = zeros(max_num_reqs, max(feature_size, 1), dtype=dtype)
        self.slot_mapping = zeros(max_num_reqs)
        self.seq_lens = zeros(max_num_reqs, dtype=torch.int32)
        self.query_start_loc = torch.arange(max_num_reqs + 1, dtype=torch.int32, device=device)
        self.block_table = zeros(max_num_reqs, max_blocks_per_req, dtype=torch.int32)
        self.uses_features = feature_size > 0

    def pad(self, num_reqs: int, padded: int) -> None:
        """Rows [num_reqs, padded) as padding: token 0 at position 0, length 0, writing the null block."""
        for buf in (self.input_ids, self.positions, self.slot_mapping, self.seq_lens, self.block_table):
            buf[num_reqs:padded].zero_()


def decode_forward(head: DraftHead, buffers: DraftBuffers, num_reqs: int, attn_metadata: Any,
                   greedy: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One draft pass over the buffers' first `num_reqs` rows: (greedy draft ids, or with `greedy`
    False the logits, and the head's next features).

    The whole pass, LM head (and argmax) included, so a captured graph holds all of it.
    """
    features = buffers.features[:num_reqs] if buffers.uses_features else None
    hidden, features = head(buffers.input_ids[:num_reqs], buffers.positions[:num_reqs], features, attn_metadata)
    logits = head.compute_logits(hidden)
    return (logits.argmax(dim=-1) if greedy else logits), features


class DecodePassGraphs(Protocol):
    """Captured decode passes (`mrv2.runner.graphs.draft_graphs`): replay one that fits, or None."""

    def run(self, num_reqs: int, max_seq_len: int) -> tuple[torch.Tensor, torch.Tensor | None] | None: ...


class Drafter:
    """Proposes `k` draft tokens per request with a draft model or head, greedily or drawn (see the module
    docstring)."""

    def __init__(self, head: DraftHead, k: int, shifted: bool, backend: AttentionBackend, max_num_reqs: int,
                 max_model_len: int, block_size: int, dtype: torch.dtype, device: torch.device,
                 probabilistic: bool = False, vocab_size: int = 0) -> None:
        self.head, self.k, self.shifted, self.backend = head, k, shifted, backend
        self.probabilistic = probabilistic
        # Per slot and draft: the distribution a random request's draft was drawn from.
        self.draft_probs = torch.zeros(max_num_reqs, k, vocab_size, device=device) if probabilistic else None
        self.max_model_len, self.block_size = max_model_len, block_size
        self.buffers = DraftBuffers(max_num_reqs, -(-max_model_len // block_size), head.next_feature_size, dtype,
                                    device)
        self.graphs: DecodePassGraphs | None = None  # set by the runner when it captures graphs
        self._rows = torch.arange(max_num_reqs, device=device)

    @torch.inference_mode()
    def propose(self, s: DraftStep) -> torch.Tensor:
        """[B, k] draft ids (rows that emitted nothing hold junk the engine never reads)."""
        n, t, b = s.input_ids.shape[0], s.token_slots.shape[0], s.slots.shape[0]
        ids = s.input_ids
        if self.shifted:  # each position reads its successor; the just-emitted tokens are in the history
            ids = ids.clone()
            ids[:t] = s.token_ids[s.token_slots, s.positions[:t] + 1]
        features = s.features[:n] if s.features is not None else None
        hidden, features = self.head(ids, s.positions, features, s.attn_metadata)
        last_pos = s.num_tokens[s.slots].long() - 1  # position of each request's last emitted token
        self.buffers.block_table[:b, :s.block_table.shape[1]].copy_(s.block_table)
        drafts = []
        if self.shifted:
            token = self._choose(self.head.compute_logits(hidden[s.last_rows]), s, last_pos, 0)
            features = features[s.last_rows]
            drafts.append(token)
        else:
            token = s.token_ids[s.slots, last_pos]
            features = None
        for j in range(self.k - len(drafts)):
            out, features = self._decode_pass(s, token, last_pos + j, features, j)
            token = out if not self.probabilistic else self._choose(out, s, last_pos, len(drafts))
            drafts.append(token)
        return torch.stack(drafts, dim=1)

    def _choose(self, logits: torch.Tensor, s: DraftStep, last_pos: torch.Tensor, j: int) -> torch.Tensor:
        """Draft j of every row from its logits: the argmax, or a draw kept with its distribution."""
        if not self.probabilistic:
            return logits.argmax(dim=-1)
        token, q = draw_drafts(logits, s.temperature, s.seeds, last_pos + 1 + j)
        self.draft_probs[s.slots, j] = q
        return token

    def _decode_pass(self, s: DraftStep, token: torch.Tensor, positions: torch.Tensor,
                     features: torch.Tensor | None, j: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One token per request at `positions`; invalid rows write the null block (slot 0)."""
        b, bs, buf = s.slots.shape[0], self.block_size, self.buffers
        valid = (s.emitted > 0) & (positions < self.max_model_len)
        positions = positions.clamp(max=self.max_model_len - 1)
        buf.input_ids[:b].copy_(token)
        buf.positions[:b].copy_(positions)
        if features is not None:
            buf.features[:b].copy_(features)
        blocks = buf.block_table[self._rows[:b], positions // bs].long()
        buf.slot_mapping[:b].copy_(torch.where(valid, blocks * bs + positions % bs, 0))
        buf.seq_lens[:b].copy_(torch.where(valid, positions + 1, 1))
        seq_lens_cpu = np.minimum(s.seq_lens_cpu + j + 1, self.max_model_len)
        max_seq_len = int(seq_lens_cpu.max())
        if self.graphs is not None and (out := self.graphs.run(b, max_seq_len)) is not None:
            return out
        common = CommonAttentionMetadata(
            num_reqs=b, num_tokens=b, num_decodes=b, max_query_len=1, max_seq_len=max_seq_len,
            query_start_loc=buf.query_start_loc[:b + 1], seq_lens=buf.seq_lens[:b], block_table=buf.block_table[:b],
            slot_mapping=buf.slot_mapping[:b], query_start_loc_cpu=np.arange(b + 1), seq_lens_cpu=seq_lens_cpu,
            block_size=bs)
        return decode_forward(self.head, buf, b, self.backend.build_metadata(common), not self.probabilistic)
