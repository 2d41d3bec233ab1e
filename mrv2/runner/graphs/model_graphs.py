"""The target model's graphs: dispatch, padding sizes, capture and replay over the runner's buffers.

FULL graphs of uniform decode steps hold the whole forward, attention metadata
included: `build_metadata` runs inside the captured callable over the persistent
buffers, sized by the descriptor's key length (static shapes: one graph per bucket of
the longest sequence), so a replay recomputes masks and gather indices from whatever
the step wrote into the buffers. A backend whose decode attention reads each request's
length on the device (`compiled_decode_graphs`) needs one graph for every length.

PIECEWISE graphs hold the segments between attention calls, per padded token count;
attention runs eagerly between them with the step's own metadata
(`mrv2.runner.graphs.piecewise`), so they serve any batch, prefill included.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from functools import partial
from typing import Any

import numpy as np
import torch
from torch import nn

from mrv2.attention.backend import AttentionBackend, CommonAttentionMetadata
from mrv2.config import GraphConfig, GraphMode
from mrv2.platforms.graphs import GraphBackend
from mrv2.runner.graphs.descriptor import BatchDescriptor, GraphDispatcher
from mrv2.runner.graphs.manager import GraphInputs, GraphManager, WholeForward
from mrv2.runner.graphs.piecewise import PiecewiseForward
from mrv2.runner.input_batch import InputBuffers, StepPadding

_GRAPH_INPUTS = ("input_ids", "positions", "slot_mapping", "query_start_loc", "seq_lens", "block_table")


class ModelGraphs:
    """Captured graphs of one model, keyed by batch descriptor: FULL decode graphs, PIECEWISE pieces or both.

    With both, a step replays a FULL graph when one fits it, else PIECEWISE pieces,
    else runs eagerly. All graphs share one memory pool.
    """

    def __init__(self, config: GraphConfig, graph_backend: Callable[[GraphConfig], GraphBackend], model: nn.Module,
                 attn_backend: AttentionBackend, inputs: InputBuffers, max_num_reqs: int, max_num_tokens: int,
                 max_model_len: int, block_size: int) -> None:
        single_modes = config.single_modes()
        if not single_modes:
            raise ValueError("graph mode NONE captures nothing; run eagerly instead")
        self.model, self.attn_backend, self.inputs = model, attn_backend, inputs
        self.block_size = block_size
        self._tiers: list[tuple[GraphDispatcher, GraphManager]] = []
        pool = None
        for cfg in single_modes:
            manager = self._manager(cfg.mode, graph_backend(cfg), pool)
            pool = manager.pool
            # Attention in a FULL graph reads a fixed number of keys: one graph per key-length bucket,
            # unless the backend reads each request's length from the buffers (one graph for all).
            keys = (0,)
            if cfg.mode is GraphMode.FULL:
                keys = cfg.key_lengths(max_model_len, block_size)
                keys = keys[-1:] if attn_backend.compiled_decode_graphs else keys
            q = cfg.decode_query_len if cfg.mode is GraphMode.FULL else 1
            self._tiers.append((GraphDispatcher(cfg, max_num_reqs, max_num_tokens, decode_query_len=q,
                                                key_lengths=keys), manager))
        self.replays: Counter[GraphMode] = Counter()

    def _manager(self, mode: GraphMode, backend: GraphBackend, pool: Any) -> GraphManager:
        if mode is GraphMode.FULL:
            # A plain function of its modules and buffers: a compiled graph backend then calls the code
            # it made for a capture directly (`dynamo_entry`), not through dynamo's guards.
            forward = partial(_full_forward, self.model, self.attn_backend, self.inputs)
            return GraphManager(backend, GraphInputs.of(self.inputs, _GRAPH_INPUTS), self._static_metadata,
                                WholeForward(forward), [self.attn_backend], pool)
        recorder = PiecewiseForward(self.model, self.inputs.input_ids, self.inputs.positions,
                                    self.attn_backend.build_metadata)
        return GraphManager(backend, GraphInputs.of(self.inputs, ("input_ids", "positions")), lambda desc: None,
                            recorder, [self.attn_backend], pool)

    @property
    def descriptors(self) -> list[BatchDescriptor]:
        """Every captured descriptor, in capture order."""
        return [desc for _, manager in self._tiers for desc in manager.descriptors]

    @property
    def pool(self) -> Any:
        """The memory pool every graph of this model shares (None where graphs keep no pool)."""
        return self._tiers[0][1].pool

    @property
    def uses_pool(self) -> bool:
        """Whether the graphs keep device memory in a pool (device graphs; not the CPU's backends)."""
        return any(manager.pool is not None for _, manager in self._tiers)

    def pool_bytes(self, activation_bytes: Callable[[int, int], int], attention_bytes: Callable[[int, int, int], int],
                   hidden_bytes_per_token: int) -> int:
        """Estimated pool memory once every planned descriptor is captured.

        The largest capture's activations (`activation_bytes(num_tokens, 0)`: logits are
        computed outside graphs) and, for FULL graphs, its attention transients
        (`attention_bytes(num_reqs, num_tokens, max_seq_len)`): later captures reuse that
        memory. Plus each graph's outputs, kept at fixed addresses: the hidden states and
        residual (`hidden_bytes_per_token` each) of every piece.
        """
        peak = outputs = 0
        for dispatcher, _ in self._tiers:
            for desc in dispatcher.descriptors:
                t = desc.num_tokens
                need = activation_bytes(t, 0)
                pieces = 1
                if desc.mode is GraphMode.FULL:
                    need += attention_bytes(desc.num_reqs, t, desc.max_seq_len)
                else:
                    pieces = self.model.num_attention_calls + 1
                peak = max(peak, need)
                outputs += pieces * 2 * t * hidden_bytes_per_token
        return peak + outputs

    @property
    def num_replays(self) -> int:
        return sum(self.replays.values())

    @torch.inference_mode()
    def capture(self) -> None:
        # A FULL graph attends through the KV cache's allocation; its size (the block count) stays out of
        # what compiled code is specialized on, so engines with other cache sizes reuse it (on disk).
        for layer in self.model.attention_layers():
            if (raw := getattr(layer.kv_cache, "raw", None)) is not None:
                torch._dynamo.maybe_mark_dynamic(raw, 0)
        for dispatcher, manager in self._tiers:
            manager.capture(dispatcher.descriptors)

    def plan(self, num_scheduled: np.ndarray,
             seq_lens: np.ndarray) -> tuple[BatchDescriptor | None, StepPadding | None]:
        """The captured descriptor a step replays and the padding it needs; (None, None) for eager.

        `seq_lens` are the requests' sequence lengths after the step (host upper bounds).
        """
        q = int(num_scheduled[0])
        uniform = q if (num_scheduled == q).all() else 0
        for dispatcher, manager in self._tiers:
            desc = dispatcher.dispatch(int(num_scheduled.sum()), len(num_scheduled), uniform, int(seq_lens.max()))
            if desc.mode is GraphMode.NONE or not manager.has(desc):
                continue
            if desc.mode is GraphMode.PIECEWISE:  # tokens only: attention sees the real batch
                return desc, StepPadding(len(num_scheduled), desc.num_tokens, None)
            return desc, StepPadding(desc.num_reqs, desc.num_tokens, desc.max_seq_len)
        return None, None

    def run(self, desc: BatchDescriptor, common: CommonAttentionMetadata) -> torch.Tensor:
        self.replays[desc.mode] += 1
        manager = next(m for _, m in self._tiers if m.has(desc))
        return manager.replay(desc, common)

    def _static_metadata(self, desc: BatchDescriptor) -> CommonAttentionMetadata:
        b, t, q = desc.num_reqs, desc.num_tokens, desc.uniform_decode_len
        buf = self.inputs
        keys = desc.max_seq_len
        return CommonAttentionMetadata(
            num_reqs=b, num_tokens=t, num_decodes=b if q == 1 else 0, max_query_len=q, max_seq_len=keys,
            query_start_loc=buf.query_start_loc[:b + 1], seq_lens=buf.seq_lens[:b], block_table=buf.block_table[:b],
            slot_mapping=buf.slot_mapping[:t], query_start_loc_cpu=np.arange(b + 1) * q,
            seq_lens_cpu=np.full(b, keys), block_size=self.block_size, static_shapes=True)


def _full_forward(model: nn.Module, attn_backend: AttentionBackend, inputs: InputBuffers, desc: BatchDescriptor,
                  common: CommonAttentionMetadata) -> torch.Tensor:
    t = desc.num_tokens
    metadata = attn_backend.build_metadata(common)  # inside the graph: replays recompute it
    return model(inputs.input_ids[:t], inputs.positions[:t], metadata)
