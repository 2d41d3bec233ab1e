"""The drafter's graphs: its single-token decode pass, captured per batch descriptor.

The same `GraphManager`, dispatcher and attention-backend hooks as the target's
graphs, built from what the pass reads and nothing else: the draft head, the
drafter's persistent buffers (`mrv2.spec_decode.drafter.DraftBuffers`) and the
attention backend. It never holds the runner or the drafter. A decode pass is a
uniform one-token step, so its graphs are FULL graphs (attention, LM head and
argmax inside), one per padded batch size and key-length bucket, on whatever graph
backend the platform gives FULL graphs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import numpy as np
import torch

from mrv2.attention.backend import AttentionBackend, CommonAttentionMetadata
from mrv2.config import GraphConfig, GraphMode
from mrv2.models.draft_head import DraftHead
from mrv2.platforms.graphs import GraphBackend
from mrv2.runner.graphs.descriptor import BatchDescriptor, GraphDispatcher
from mrv2.runner.graphs.manager import GraphInputs, GraphManager, WholeForward
from mrv2.spec_decode.drafter import DraftBuffers, decode_forward

_GRAPH_INPUTS = ("input_ids", "positions", "features", "slot_mapping", "query_start_loc", "seq_lens", "block_table")


class DraftGraphs:
    """FULL graphs of a draft head's decode pass over `buffers` (implements `DecodePassGraphs`)."""

    def __init__(self, config: GraphConfig, graph_backend: Callable[[GraphConfig], GraphBackend], head: DraftHead,
                 attn_backend: AttentionBackend, buffers: DraftBuffers, max_num_reqs: int, max_model_len: int,
                 block_size: int, pool: Any = None, greedy: bool = True) -> None:
        cfg = replace(config, mode=GraphMode.FULL, decode_query_len=1, compile=None, full_capture_sizes=None)
        self.head, self.attn_backend, self.buffers, self.block_size = head, attn_backend, buffers, block_size
        self.greedy = greedy  # False: the passes return logits (probabilistic drafting draws outside)
        self.dispatcher = GraphDispatcher(cfg, max_num_reqs, max_num_reqs, decode_query_len=1,
                                          key_lengths=cfg.key_lengths(max_model_len, block_size))
        self.manager = GraphManager(graph_backend(cfg), GraphInputs.of(buffers, _GRAPH_INPUTS), self._static_metadata,
                                    WholeForward(self._forward), [attn_backend], pool)
        self.replays = 0

    @torch.inference_mode()
    def capture(self) -> None:
        self.manager.capture(self.dispatcher.descriptors)

    def run(self, num_reqs: int, max_seq_len: int) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """Replay the pass for the buffers' first `num_reqs` rows (rows past them padded here), or None
        when no captured graph fits (the drafter then runs the pass eagerly).

        The draft ids (or logits) are copied out (the graph's output is overwritten by the next
        pass); the features stay a view of the output, which the drafter copies into its buffers
        before then.
        """
        desc = self.dispatcher.dispatch(num_reqs, num_reqs, 1, max_seq_len)
        if desc.mode is GraphMode.NONE or not self.manager.has(desc):
            return None
        self.buffers.pad(num_reqs, desc.num_reqs)
        self.replays += 1
        tokens, features = self.manager.replay(desc, self.manager.captured_metadata(desc))
        return tokens[:num_reqs].clone(), None if features is None else features[:num_reqs]

    def _static_metadata(self, desc: BatchDescriptor) -> CommonAttentionMetadata:
        b, keys, buf = desc.num_reqs, desc.max_seq_len, self.buffers
        return CommonAttentionMetadata(
            num_reqs=b, num_tokens=b, num_decodes=b, max_query_len=1, max_seq_len=keys,
            query_start_loc=buf.query_start_loc[:b + 1], seq_lens=buf.seq_lens[:b], block_table=buf.block_table[:b],
            slot_mapping=buf.slot_mapping[:b], query_start_loc_cpu=np.arange(b + 1), seq_lens_cpu=np.full(b, keys),
            block_size=self.block_size, static_shapes=True)

    def _forward(self, desc: BatchDescriptor, common: CommonAttentionMetadata) -> Any:
        # Metadata is built inside the captured callable: a replay recomputes it from the buffers.
        return decode_forward(self.head, self.buffers, desc.num_reqs, self.attn_backend.build_metadata(common),
                              self.greedy)
