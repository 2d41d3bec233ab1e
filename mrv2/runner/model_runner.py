"""The Model Runner V2: orchestration only.

One step: apply the scheduler's diffs to slot state -> order the batch (decodes
first) -> gather inputs into persistent buffers -> attention metadata -> forward ->
logits at `logits_indices` -> (separately) sample -> post-update slot state on the
device. Model, attention and sampling logic live in their own packages.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from mrv2.attention import get_attention_backend
from mrv2.config import EngineConfig, GraphMode
from mrv2.engine.scheduler_output import ModelRunnerOutput, SchedulerOutput
from mrv2.kv_spec import KVCacheSpec
from mrv2.models.registry import attention_kind, build_model
from mrv2.platforms import Platform
from mrv2.runner.block_table import BlockTables
from mrv2.runner.graphs.model_graphs import ModelGraphs
from mrv2.runner.input_batch import InputBuffers, StepBatch
from mrv2.runner.kv_cache import KVCache, allocate_kv_cache
from mrv2.runner.states import RequestStates
from mrv2.runner.timing import StepTiming
from mrv2.sample.metadata import SamplingMetadata
from mrv2.sample.sampler import Sampler

logger = logging.getLogger("mrv2")


@dataclass
class _PendingStep:
    batch: StepBatch
    logits: torch.Tensor


class ModelRunner:
    """Turns scheduler outputs into sampled tokens on one device."""

    def __init__(self, config: EngineConfig, platform: Platform, hf_config: Any, weights,
                 dtype: torch.dtype) -> None:
        self.config = config
        self.platform = platform
        self.device = platform.device
        self.dtype = dtype
        self.max_model_len = config.max_model_len
        self.block_size = config.cache.block_size
        self.max_num_reqs = config.scheduler.max_num_seqs
        self.max_num_tokens = config.scheduler.max_num_batched_tokens
        pin = platform.pin_memory()

        self.attn_backend = get_attention_backend(platform, attention_kind(hf_config))
        with torch.device(self.device):
            self.model = build_model(hf_config, self.attn_backend, dtype)
        self.model.load_weights(weights)
        self.model.eval()

        max_blocks = -(-self.max_model_len // self.block_size)
        self.states = RequestStates(self.max_num_reqs, self.max_model_len, self.device, pin, config.model.seed)
        self.block_tables = BlockTables(self.max_num_reqs, max_blocks, self.block_size, self.device, pin)
        self.inputs = InputBuffers(self.max_num_reqs, self.max_num_tokens, max_blocks, self.device, pin)
        self.sampler = Sampler(platform.sampling_chunk_elems)
        self.graphs: ModelGraphs | None = None
        graph_config = config.graph or platform.default_graph_config()
        if not config.enforce_eager and graph_config.mode is not GraphMode.NONE:
            self.graphs = ModelGraphs(graph_config, platform.graph_backend, self.model, self.attn_backend,
                                      self.inputs, self.max_num_reqs, self.max_num_tokens, self.max_model_len,
                                      self.block_size)
        self.kv_cache: KVCache | None = None
        self._pending: _PendingStep | None = None
        self.timing = StepTiming()

    # -- set-up --

    def kv_cache_specs(self) -> list[KVCacheSpec]:
        return self.model.kv_cache_specs()

    @torch.inference_mode()
    def activation_bytes(self) -> int:
        """Memory the largest step needs besides weights and KV cache.

        Measured by a profile run (the largest step, no KV cache) where the platform
        keeps peak statistics; estimated from the model's shapes where it does not.
        """
        n = self.max_num_tokens
        if not self.platform.measures_peak_memory:
            return self.model.estimate_activation_bytes(n, self.max_num_reqs)
        self.platform.synchronize()
        self.platform.reset_peak_memory()
        before = self.platform.peak_memory()
        ids = torch.zeros(n, dtype=torch.int64, device=self.device)
        positions = torch.arange(n, device=self.device) % self.max_model_len
        hidden = self.model(ids, positions, None)
        self.model.compute_logits(hidden[-self.max_num_reqs:])
        self.platform.synchronize()
        return max(0, self.platform.peak_memory() - before)

    def initialize_kv_cache(self, num_blocks: int, alignment: int) -> KVCache:
        """Allocate the cache and bind each attention layer to its views."""
        if self.config.cache.layout not in self.attn_backend.supported_layouts:
            raise ValueError(f"attention backend {self.attn_backend.name!r} does not support KV layout "
                             f"{self.config.cache.layout!r}")
        self.kv_cache = allocate_kv_cache(self.kv_cache_specs(), self.config.cache.layout, num_blocks,
                                          self.block_size, alignment, self.device)
        for layer, cache in zip(self.model.attention_layers(), self.kv_cache.layers):
            layer.kv_cache = cache
        self.kv_cache.ensure_initialized([0])  # block 0 takes padding reads and writes
        return self.kv_cache

    def capture_graphs(self) -> None:
        """Capture every graph descriptor (after the KV cache exists); a no-op when running eagerly."""
        if self.graphs is not None:
            self.graphs.capture()

    # -- the step --

    def _apply_scheduler_diffs(self, sched: SchedulerOutput) -> None:
        for req_id in sched.finished_req_ids:
            self.states.remove(req_id)
        new_blocks: list[int] = []
        for req in sched.scheduled_new_reqs:
            slot = self.states.add(req)
            self.block_tables.reset(slot)
            self.block_tables.append(slot, req.block_ids)
            new_blocks += req.block_ids
        cached = sched.scheduled_cached_reqs
        for req_id, blocks in zip(cached.req_ids, cached.new_block_ids):
            if blocks:
                self.block_tables.append(self.states.slot_of[req_id], blocks)
                new_blocks += blocks
        if new_blocks:
            self.kv_cache.ensure_initialized(new_blocks)
        self.states.apply_staged()
        self.block_tables.apply_staged()

    def _batch_order(self, sched: SchedulerOutput) -> tuple[list[str], np.ndarray, np.ndarray]:
        req_ids = list(sched.num_scheduled_tokens)
        num_scheduled = np.fromiter((sched.num_scheduled_tokens[r] for r in req_ids), np.int64, len(req_ids))
        order = np.argsort(num_scheduled != 1, kind="stable")  # decodes first
        req_ids = [req_ids[i] for i in order]
        idx = np.fromiter((self.states.slot_of[r] for r in req_ids), np.int64, len(req_ids))
        return req_ids, idx, num_scheduled[order]

    @torch.inference_mode()
    def execute_model(self, sched: SchedulerOutput) -> None:
        """Run the forward pass for `sched`; `sample_tokens` finishes the step."""
        with self.timing.phase("prep"):
            self._apply_scheduler_diffs(sched)
            if sched.is_empty:
                self._pending = None
                return
            req_ids, idx, num_scheduled = self._batch_order(sched)
            seq_lens = self.states.num_computed_cpu[idx] + num_scheduled
            desc, padding = self.graphs.plan(num_scheduled, seq_lens) if self.graphs else (None, None)
            batch = self.inputs.prepare(req_ids, idx, num_scheduled, self.states, self.block_tables, padding)
            attn_metadata = None if desc else self.attn_backend.build_metadata(batch.attn)
        with self.timing.phase("forward"):
            if desc:
                hidden = self.graphs.run(desc, batch.attn)
            else:
                hidden = self.model(batch.input_ids, batch.positions, attn_metadata)
            logits = self.model.compute_logits(hidden[batch.logits_indices], self.platform.logits_chunk_rows)
        self._pending = _PendingStep(batch, logits)
        self.timing.steps += 1

    @torch.inference_mode()
    def sample_tokens(self) -> ModelRunnerOutput:
        """Sample the pending step's logits and write the tokens into slot state."""
        if self._pending is None:
            return ModelRunnerOutput([], [])
        batch, logits = self._pending.batch, self._pending.logits
        self._pending = None
        with self.timing.phase("sample"):
            sampled = self.sampler(logits, self._sampling_metadata(batch))
            self.states.post_update(batch.idx_mapping, batch.num_scheduled, sampled, batch.idx_cpu,
                                    batch.num_scheduled_cpu)
            tokens = sampled.tolist()
        return ModelRunnerOutput(batch.req_ids, tokens)

    def _sampling_metadata(self, batch: StepBatch) -> SamplingMetadata:
        s, idx, idx_cpu = self.states, batch.idx_mapping, batch.idx_cpu
        temperature = s.temperature_cpu[idx_cpu]
        vocab = self.model.config.vocab_size
        return SamplingMetadata(
            temperature=s.temperature[idx], top_k=s.top_k[idx], top_p=s.top_p[idx], min_p=s.min_p[idx],
            seeds=s.seeds[idx], positions=s.num_tokens[idx].long(),
            all_greedy=bool((temperature == 0).all()), all_random=bool((temperature > 0).all()),
            no_top_k=bool(((s.top_k_cpu[idx_cpu] <= 0) | (s.top_k_cpu[idx_cpu] >= vocab)).all()),
            no_top_p=bool((s.top_p_cpu[idx_cpu] >= 1.0).all()),
            no_min_p=bool((s.min_p_cpu[idx_cpu] <= 0.0).all()),
        )
