"""The Model Runner V2: orchestration only.

One step: apply the scheduler's diffs to slot state -> order the batch (decodes
first) -> gather inputs into persistent buffers -> attention metadata -> forward ->
logits at `logits_indices` -> (separately) sample -> post-update slot state on the
device -> one asynchronous copy of the ids to the host. Each part is host work (numpy,
on the caller's thread) or device work (launched on the platform's `DeviceQueue`), so
the host can prepare the next step while this one computes. Model, attention and
sampling logic live in their own packages.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any, Callable, TypeVar

import numpy as np
import torch

from mrv2.attention import get_attention_backend
from mrv2.config import EngineConfig, GraphMode, QuantPolicy
from mrv2.distributed.kv_transfer import KVConnectorMetadata, KVConnectorWorker, build_connector_worker
from mrv2.distributed.parallel import SINGLE, TensorParallel
from mrv2.engine.scheduler_output import SchedulerOutput
from mrv2.kv_spec import KVCacheSpec
from mrv2.layers.linear import use_dense_gemv
from mrv2.layers.packed import row_buckets
from mrv2.models.registry import attention_kind, build_model
from mrv2.platforms import Platform
from mrv2.platforms.device_queue import HostCopy, Pending
from mrv2.runner.async_output import AsyncRunnerOutput, LogprobsCopy, LogprobsHostBuffers
from mrv2.runner.block_table import BlockTables
from mrv2.runner.graphs.descriptor import BatchDescriptor
from mrv2.runner.graphs.draft_graphs import DraftGraphs
from mrv2.runner.graphs.model_graphs import ModelGraphs
from mrv2.runner.input_batch import InputBuffers, StepBatch, StepPlan
from mrv2.runner.kv_cache import KVCache, allocate_kv_cache
from mrv2.runner.prompt_logprobs import PromptLogprobsPlan, plan_prompt_logprobs, score_prompt
from mrv2.runner.states import RequestStates
from mrv2.runner.timing import StepTiming
from mrv2.sample.draft_verify import verify_drafts, verify_drafts_with_probs
from mrv2.sample.logprobs import LogprobsTensors, compute_logprobs
from mrv2.sample.metadata import SamplingFlags
from mrv2.sample.sampler import Sampler
from mrv2.sample.states import SamplingStates
from mrv2.spec_decode.draft_models import build_drafter
from mrv2.spec_decode.drafter import Drafter, DraftStep
from mrv2.sampling_params import is_greedy
from mrv2.staged_writes import StagedWrite, apply_writes

logger = logging.getLogger("mrv2")
T = TypeVar("T")


class ModelRunner:
    """Turns scheduler outputs into sampled tokens on one device."""

    def __init__(self, config: EngineConfig, platform: Platform, hf_config: Any, weights,
                 dtype: torch.dtype, quant_policy: QuantPolicy | None = None, model_path: Path | None = None,
                 tp: TensorParallel = SINGLE) -> None:
        self.config = config
        self.platform = platform
        self.device = platform.device
        self.dtype = dtype
        self.max_model_len = config.max_model_len
        self.block_size = config.cache.block_size
        self.max_num_reqs = config.scheduler.max_num_seqs
        self.max_num_tokens = config.scheduler.max_num_batched_tokens
        pin = platform.pin_memory()

        batch_invariant = config.model.batch_invariant
        self.attn_backend = get_attention_backend(platform, attention_kind(hf_config), batch_invariant,
                                                  config.model.attention_backend)
        logger.info("Attention: %s", self.attn_backend.describe())
        with torch.device(self.device):
            self.model = build_model(hf_config, self.attn_backend, dtype, self.max_model_len, tp)
        self.model.load_weights(weights)
        if quant_policy is not None:
            platform.load_quant_kernels(quant_policy)
            if placed := self.model.finalize_quantization(quant_policy, platform.weight_storage):
                logger.info("Quantized weights: %s", placed)
        spec = config.speculative
        self.drafter: Drafter | None = None
        if spec is not None and spec.uses_model:
            self.drafter = build_drafter(spec, self.model, hf_config, model_path, self.attn_backend, dtype,
                                         self.max_num_reqs, self.max_num_tokens, self.max_model_len,
                                         self.block_size, self.device)
            logger.info("Speculative decoding: %s drafts %d tokens per step on the device", spec.method,
                        spec.num_speculative_tokens)
        # Collectives inside compiled pieces are unmeasured: tensor-parallel ranks take no int4 default.
        int4_rows = self.model.int4_rows() if tp.size == 1 else 0
        buckets: tuple[int, ...] = ()  # row buckets of larger steps, where packed or AMX GEMMs run them
        if batch_invariant:
            self.model.make_batch_invariant()
        elif (rows := platform.linear_pack_rows(dtype)) is not None:
            packed = self.model.pack_linear_weights(rows)
            packed += self.drafter.head.pack_linear_weights(rows) if self.drafter else 0
            if packed:
                logger.info("Dense weights of %d linear layers prepacked for oneDNN (batches of ~%d rows)",
                            packed, rows)
            if packed or (quant_policy is not None and quant_policy.gemm_isa):  # kernels compiled pieces call
                buckets = row_buckets(rows)
        self._use_dense_gemv(platform, dtype)  # not where packed or batch-invariant: those weights are not plain
        # A whole decode step compiles where attention allows it and nothing else runs between its layers
        # (a drafter's verify steps are not decodes; a KV connector is called around every layer; tensor-
        # parallel ranks exchange partial sums through shared memory, which dynamo does not trace).
        compiled_decode = (self.attn_backend.compiled_decode_graphs and self.drafter is None
                           and config.kv_transfer is None and tp.size == 1)
        graph_config = config.graph_config(platform.default_graph_config(int4_rows, buckets, compiled_decode))
        graphs_on = not config.enforce_eager and graph_config.mode is not GraphMode.NONE
        self.model.eval()
        # Prefill/decode disaggregation: the model saves (and waits for loads) per attention call through it.
        self.kv_connector: KVConnectorWorker | None = None
        if config.kv_transfer is not None:
            self.kv_connector = self.model.kv_connector = build_connector_worker(config.kv_transfer, tp.rank)

        max_blocks = -(-self.max_model_len // self.block_size)
        self.states = RequestStates(self.max_num_reqs, self.max_model_len, self.device, pin,
                                    self.drafter.k if self.drafter else 0)
        self.sampling = SamplingStates(self.max_num_reqs, self.model.config.vocab_size, self.device, pin,
                                       config.model.seed)
        self.block_tables = BlockTables(self.max_num_reqs, max_blocks, self.block_size, self.device, pin)
        self.inputs = InputBuffers(self.max_num_reqs, self.max_num_tokens, max_blocks, self.device, pin)
        self.sampler = Sampler(platform.sampling_chunk_elems)
        self.graphs: ModelGraphs | None = None
        if graphs_on:
            self.graphs = ModelGraphs(graph_config, platform.graph_backend, self.model, self.attn_backend,
                                      self.inputs, self.max_num_reqs, self.max_num_tokens, self.max_model_len,
                                      self.block_size)
            if self.drafter is not None:  # the drafter's decode passes, on the same graph machinery
                self.drafter.graphs = DraftGraphs(graph_config, platform.graph_backend, self.drafter.head,
                                                  self.attn_backend, self.drafter.buffers, self.max_num_reqs,
                                                  self.max_model_len, self.block_size, self.graphs.pool,
                                                  greedy=not self.drafter.probabilistic)
        self.kv_cache: KVCache | None = None
        self._attention_layers: list[torch.nn.Module] = []  # bound to the cache's layers, target then drafter
        self._pending: _PendingStep | None = None
        self.timing = StepTiming()
        # Device work runs in launch order on this queue; with async scheduling the host
        # prepares step N+1 while step N computes.
        self.queue = platform.device_queue(config.async_scheduling)
        # Sampled ids land here, alternately, so two steps in flight never share a buffer.
        # With drafts a row holds its emitted count and up to 1 + drafts tokens: at most 2 per token.
        self._host_out = [torch.zeros(2 * self.max_num_tokens + self.max_num_reqs, dtype=torch.int64, pin_memory=pin)
                          for _ in range(2)]
        self._host_logprobs = [LogprobsHostBuffers(self.max_num_tokens, pin) for _ in range(2)]
        self._host_prompt_logprobs = [LogprobsHostBuffers(self.max_num_tokens, pin) for _ in range(2)]
        self._next_host_out = 0

    # -- set-up --

    def kv_cache_specs(self) -> list[KVCacheSpec]:
        """One spec per attention layer: the target's, then the drafter's (cut from the same blocks)."""
        drafter = self.drafter.head.kv_cache_specs() if self.drafter else []
        return self.model.kv_cache_specs() + drafter

    @torch.inference_mode()
    def activation_bytes(self) -> int:
        """Memory the largest step needs besides weights and KV cache.

        The model's part is measured by a profile run (the largest step, no KV cache)
        where the platform keeps peak statistics, and estimated from the model's shapes
        where it does not. Either way the attention backend's transients at the largest
        step are added: the profile run attends causally over its tokens without a
        cache, so it never makes the paged gathers a real step of that size makes.
        """
        n = self.max_num_tokens
        transient = self.attention_transient_bytes(self.max_num_reqs, n, self.max_model_len)
        if not self.platform.measures_peak_memory:
            return self.model.estimate_activation_bytes(n, self.max_num_reqs) + transient
        self.platform.synchronize()
        self.platform.reset_peak_memory()
        before = self.platform.peak_memory()
        ids = torch.zeros(n, dtype=torch.int64, device=self.device)
        positions = torch.arange(n, device=self.device) % self.max_model_len
        hidden = self.model(ids, positions, None)
        self.model.compute_logits(hidden[-self.max_num_reqs:])
        self.platform.synchronize()
        return max(0, self.platform.peak_memory() - before) + transient

    def attention_transient_bytes(self, num_reqs: int, num_tokens: int, max_seq_len: int) -> int:
        """The backend's per-layer transient for a step of these sizes (keys padded to whole blocks)."""
        keys = -(-max_seq_len // self.block_size) * self.block_size
        return max((self.attn_backend.transient_bytes(num_reqs, num_tokens, keys, spec)
                    for spec in self.kv_cache_specs()), default=0)

    def graph_pool_bytes(self) -> int:
        """Memory the captured graphs will keep, reserved when the KV cache is sized (capture comes after it).

        An estimate, 0 where graphs keep no memory pool (the CPU): all graphs share one
        pool and are captured largest first, so the pool holds about the largest
        descriptor's activations (and, for FULL graphs, its attention transients), plus
        the outputs every graph keeps at fixed addresses (see `ModelGraphs.pool_bytes`).
        """
        if self.graphs is None or not self.graphs.uses_pool:
            return 0
        return self.graphs.pool_bytes(self.model.estimate_activation_bytes, self.attention_transient_bytes,
                                      self.model.config.hidden_size * self.dtype.itemsize)

    def initialize_kv_cache(self, num_blocks: int, alignment: int) -> KVCache:
        """Allocate the cache and bind each attention layer to its views."""
        if self.config.cache.layout not in self.attn_backend.supported_layouts:
            raise ValueError(f"attention backend {self.attn_backend.name!r} does not support KV layout "
                             f"{self.config.cache.layout!r}")
        self.kv_cache = allocate_kv_cache(self.kv_cache_specs(), self.config.cache.layout, num_blocks,
                                          self.block_size, alignment, self.device, self.platform.zeroed_storage)
        layers = self.model.attention_layers() + (self.drafter.head.attention_layers() if self.drafter else [])
        self._attention_layers = layers
        for layer, cache in zip(layers, self.kv_cache.layers, strict=True):
            layer.kv_cache = cache
        if self.kv_connector is not None:  # the target's layers travel; a drafter's stay
            regions = self.kv_cache.regions()
            target = len(self.model.attention_layers())
            self.kv_connector.register_kv_caches(self.kv_cache.raw, replace(
                regions, parts=tuple(p for p in regions.parts if p.layer < target)))
        return self.kv_cache

    def capture_graphs(self) -> None:
        """Warm the attention kernels up and capture every graph descriptor (after the KV cache exists)."""
        # On the device queue, where every step runs: compiled code guards on the thread's intra-op
        # thread count and on inference mode, so a variant made elsewhere would not serve the steps.
        self.queue.launch(self._prepare_kernels).result()

    def _prepare_kernels(self) -> None:
        for layer in self._attention_layers:  # layers of one shape cost one compile, in the first
            layer.warm_up()
        if self.graphs is not None:
            self.graphs.capture()
        if self.drafter is not None and self.drafter.graphs is not None:
            self.drafter.graphs.capture()

    # -- the step --

    def _apply_scheduler_diffs(self, sched: SchedulerOutput) -> list[StagedWrite]:
        """Host work: slots for new requests, freed slots, new blocks; returns the packed writes."""
        for req_id in sched.finished_req_ids:
            self.states.remove(req_id)
        for req in sched.scheduled_new_reqs:
            slot = self.states.add(req)
            self.sampling.add_request(slot, req.sampling_params, len(req.prompt_token_ids), req.eos_token_ids)
            self.block_tables.reset(slot)
            self.block_tables.append(slot, req.block_ids)
        cached = sched.scheduled_cached_reqs
        for req_id, blocks in zip(cached.req_ids, cached.new_block_ids):
            if blocks:
                self.block_tables.append(self.states.slot_of[req_id], blocks)
        return self.states.take_staged() + self.sampling.take_staged() + self.block_tables.take_staged()

    def _batch_order(self, sched: SchedulerOutput) -> tuple[list[str], np.ndarray, np.ndarray]:
        req_ids = list(sched.num_scheduled_tokens)
        num_scheduled = np.fromiter((sched.num_scheduled_tokens[r] for r in req_ids), np.int64, len(req_ids))
        order = np.argsort(num_scheduled != 1, kind="stable")  # decodes first
        req_ids = [req_ids[i] for i in order]
        idx = np.fromiter((self.states.slot_of[r] for r in req_ids), np.int64, len(req_ids))
        return req_ids, idx, num_scheduled[order]

    def _use_dense_gemv(self, platform: Platform, dtype: torch.dtype) -> None:
        """Plain dense weights left after packing run small batches on the platform's GEMV where it has one."""
        policy, why = platform.dense_gemv_policy(dtype)
        if policy is None:
            return
        count = self.model.use_dense_gemv(policy, platform.weight_storage)
        count += use_dense_gemv(self.drafter.head, policy) if self.drafter else 0
        if count:
            logger.info("Dense weights: %d of them (linear layers, LM head) run %s", count, why)

    def execute_model(self, sched: SchedulerOutput) -> None:
        """Launch the forward pass for `sched` (host work here, device work queued);
        `sample_tokens` launches the sampling that finishes the step."""
        with self.timing.phase("prep"):
            writes = self._apply_scheduler_diffs(sched)
            if sched.is_empty:
                self._pending = None
                if writes or sched.kv_connector_metadata is not None:
                    self._launch(partial(self._idle_step, writes, sched.kv_connector_metadata))
                return
            req_ids, idx, num_scheduled = self._batch_order(sched)
            seq_lens = self.states.num_computed_cpu[idx] + num_scheduled
            desc, padding = self.graphs.plan(num_scheduled, seq_lens) if self.graphs else (None, None)
            spec = sched.scheduled_spec_decode_tokens
            drafts = [spec.get(r, []) for r in req_ids] if spec else None
            plan = self.inputs.plan(req_ids, idx, num_scheduled, self.states.num_computed_cpu, padding, drafts)
            history = int((self.states.num_tokens_cpu[idx] + plan.num_drafts_cpu).max()) + 1
            flags = self.sampling.host_flags(idx, history)
            scored = None
            if (wanted := self.sampling.num_prompt_logprobs_cpu[idx]).max() >= 0:
                scored = plan_prompt_logprobs(req_ids, idx, num_scheduled, self.states.num_computed_cpu[idx],
                                              plan.query_start_loc_cpu, self.sampling.prompt_len_cpu[idx], wanted)
            self.states.advance_host(idx, num_scheduled, plan.num_drafts_cpu if drafts else None)
        forward = self._launch(partial(self._forward, writes, plan, desc, scored, sched.kv_connector_metadata))
        self._pending = _PendingStep(plan, forward, flags, scored)
        self.timing.steps += 1

    def _idle_step(self, writes: list[StagedWrite], kv_meta: KVConnectorMetadata | None) -> None:
        apply_writes(writes)
        if self.kv_connector is not None:
            self.kv_connector.start_load_kv(kv_meta)

    def _forward(self, writes: list[StagedWrite], plan: StepPlan, desc: BatchDescriptor | None,
                 scored: PromptLogprobsPlan | None, kv_meta: KVConnectorMetadata | None = None) -> _ForwardResult:
        """Device work of one step up to the logits (and the prompt logprobs asked for)."""
        with self.timing.phase("forward"):
            apply_writes(writes)
            if self.kv_connector is not None:
                self.kv_connector.start_load_kv(kv_meta)
            batch = self.inputs.gather(plan, self.states, self.block_tables)
            attn_metadata = None
            if desc:
                hidden = self.graphs.run(desc, batch.attn)
            else:
                attn_metadata = self.attn_backend.build_metadata(batch.attn)
                hidden = self.model(batch.input_ids, batch.positions, attn_metadata)
            logits = self.model.compute_logits(batch.logits_hidden(hidden), self.platform.logits_chunk_rows)
            prompt_scores = None if scored is None else score_prompt(
                scored, hidden, self.states.token_ids,
                partial(self.model.compute_logits, chunk_rows=self.platform.logits_chunk_rows), self.device)
            if self.kv_connector is not None:
                self.kv_connector.wait_for_save()
        return _ForwardResult(batch, logits, prompt_scores, hidden, attn_metadata)

    def sample_tokens(self, grammar: dict[str, np.ndarray] | None = None) -> AsyncRunnerOutput:
        """Launch sampling of the pending step and the post-update of slot state; the sampled
        ids come back through one asynchronous copy (`AsyncRunnerOutput.get()` waits for it).

        `grammar` holds structured output's token bitmasks: per request id, int32 rows for its
        logits rows (its last token and each draft); other rows allow every token.
        """
        pending, self._pending = self._pending, None
        if pending is None:
            return AsyncRunnerOutput.empty()
        bitmask = None if not grammar else self._bitmask_rows(pending.plan, grammar)
        host = self._host_out[self._next_host_out]
        host_logprobs = self._host_logprobs[self._next_host_out]
        host_prompt_logprobs = self._host_prompt_logprobs[self._next_host_out]
        self._next_host_out ^= 1
        event = self.platform.new_event()
        num_logprobs = pending.flags.num_logprobs

        def sample() -> tuple[HostCopy, LogprobsCopy | None, LogprobsCopy | None]:
            forward = pending.forward.result()
            batch, logits, prompt_scores = forward.batch, forward.logits, forward.prompt_scores
            prompt = None if prompt_scores is None else host_prompt_logprobs.start(prompt_scores, event)
            with self.timing.phase("sample"):
                # Per logits row: its request's slot and the position of the token it samples.
                slots = batch.logits_slots()
                positions = batch.logits_positions(self.states.num_tokens[slots])
                # From the raw logits: the sampler masks them in place.
                raw_logprobs = logits.log_softmax(dim=-1) if num_logprobs is not None else None
                metadata = self.sampling.metadata(pending.flags, slots, positions, self.states.token_ids)
                if bitmask is not None:
                    metadata.grammar_bitmask = bitmask.to(self.device, non_blocking=True)
                with_probs = batch.max_drafts > 0 and self.drafter is not None and self.drafter.probabilistic
                sampled, probs = self.sampler.sample(logits, metadata, with_probs=True) if with_probs else \
                    (self.sampler(logits, metadata), None)
                if not batch.max_drafts and self.drafter is None:
                    logprobs = None if raw_logprobs is None else \
                        host_logprobs.start(compute_logprobs(raw_logprobs, sampled, num_logprobs), event)
                    self.states.post_update_device(batch.idx_mapping, batch.num_scheduled, sampled)
                    return HostCopy.start(sampled, host, event), logprobs, prompt
                tokens, num_emitted = self._verify(batch, sampled, probs)
                # Logprobs of the emitted tokens (a logits row's token: its request's token at that offset).
                logprobs = None if raw_logprobs is None else host_logprobs.start(compute_logprobs(
                    raw_logprobs, tokens[batch.logits_rows, batch.logits_offsets], num_logprobs), event)
                emitted = self.states.post_update_device(batch.idx_mapping, batch.num_scheduled, tokens, num_emitted,
                                                         batch.num_drafts)
                if self.drafter is not None:  # the next step reads them from the history, as its input
                    drafts = self.drafter.propose(self._draft_step(forward, num_emitted, emitted))
                    self.states.write_drafts(batch.idx_mapping, drafts)
                ids = HostCopy.start(torch.cat([num_emitted[:, None].long(), tokens], dim=1), host, event)
                return ids, logprobs, prompt

        plan = pending.plan

        def reject_drafts(num_emitted: np.ndarray) -> None:
            # The host mirror counted every draft: take the rejected ones back out.
            self.states.reject_host(plan.idx_cpu, plan.num_drafts_cpu + 1 - num_emitted)

        wanted = self.sampling.num_logprobs_cpu[plan.idx_cpu] if num_logprobs is not None else None
        return AsyncRunnerOutput(plan.req_ids, self._launch(sample), self.timing,
                                 reject_drafts if plan.max_drafts or self.drafter else None, wanted,
                                 plan.num_drafts_cpu + 1, pending.scored.requests if pending.scored is not None else None)

    @staticmethod
    def _bitmask_rows(plan: StepPlan, grammar: dict[str, np.ndarray]) -> torch.Tensor:
        """The step's bitmask in logits-row order (host): each request's rows at its logits offset."""
        words = next(iter(grammar.values())).shape[1]
        rows = np.full((plan.num_logits, words), -1, dtype=np.int32)
        per_row = plan.num_drafts_cpu + 1
        for req_id, start, n in zip(plan.req_ids, np.cumsum(per_row) - per_row, per_row):
            if (mask := grammar.get(req_id)) is not None:
                rows[start:start + min(n, len(mask))] = mask[:n]
        return torch.from_numpy(rows)

    def _verify(self, batch: StepBatch, sampled: torch.Tensor,
                probs: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(tokens [B, 1 + max drafts], emitted counts [B]) of a step: drawing at every position and
        comparing, or, given the target's distributions, the rejection sampler for random rows whose
        drafts were drawn from the drafter's (device work)."""
        if probs is None:
            return verify_drafts(sampled, batch.input_ids, batch.logits_indices, batch.logits_start,
                                 batch.num_drafts, batch.max_drafts)
        idx = batch.idx_mapping
        return verify_drafts_with_probs(sampled, probs, self.drafter.draft_probs[idx], batch.input_ids,
                                        batch.logits_indices, batch.logits_start, batch.num_drafts, batch.max_drafts,
                                        ~is_greedy(self.sampling.temperature[idx]), self.sampling.seeds[idx],
                                        self.states.num_tokens[idx])

    def _draft_step(self, forward: _ForwardResult, num_emitted: torch.Tensor, emitted: torch.Tensor) -> DraftStep:
        """What the drafter reads of a finished step (device work, after the post-update)."""
        batch, idx = forward.batch, forward.batch.idx_mapping
        n, t, b = batch.attn.num_tokens, batch.num_tokens, idx.shape[0]
        features = None
        if self.drafter.head.feature_size:
            features = self.model.aux_hidden[:n] if self.model.aux_hidden is not None else forward.hidden[:n]
        last = batch.logits_start + (num_emitted - 1).clamp(min=0)  # the row of the last emitted token
        attn_metadata = forward.attn_metadata
        if attn_metadata is None:  # a graph built the target's own
            attn_metadata = self.attn_backend.build_metadata(batch.attn)
        drawn = self.drafter.probabilistic  # only drawn drafts read the requests' temperatures and seeds
        return DraftStep(
            input_ids=batch.input_ids[:n], positions=batch.positions[:n], token_slots=idx[self.inputs.token_rows[:t]],
            attn_metadata=attn_metadata, features=features, slots=idx, last_rows=batch.logits_indices[last],
            emitted=emitted, block_table=batch.attn.block_table[:b], seq_lens_cpu=batch.attn.seq_lens_cpu[:b],
            token_ids=self.states.token_ids, num_tokens=self.states.num_tokens,
            temperature=self.sampling.temperature[idx] if drawn else None,
            seeds=self.sampling.seeds[idx] if drawn else None)

    def _launch(self, work: Callable[[], T]) -> Pending[T]:
        if not self.queue.synchronous:
            return self.queue.launch(work)
        with self.timing.phase("wait"):  # the host thread runs the device work itself
            return self.queue.launch(work)

    def target_logprobs(self, token_ids: list[int]) -> torch.Tensor:
        """log p(token_ids[i + 1] | token_ids[:i + 1]) for every i, float32 [len - 1] on the host.

        One causal forward over the tokens, outside the step loop and the KV cache (the
        profile run's path), launched behind any work in flight; for evaluation.
        """
        if not 2 <= len(token_ids) <= self.max_model_len:
            raise ValueError(f"need 2 to max_model_len ({self.max_model_len}) tokens, got {len(token_ids)}")

        def score() -> torch.Tensor:
            ids = torch.tensor(token_ids, dtype=torch.int64, device=self.device)
            hidden = self.model(ids, torch.arange(len(token_ids), device=self.device), None)
            logits = self.model.compute_logits(hidden[:-1], self.platform.logits_chunk_rows)
            return logits.log_softmax(dim=-1).gather(1, ids[1:, None])[:, 0].cpu()

        return self.queue.launch(score).result()

    def close(self) -> None:
        """Finish launched work and stop the device queue."""
        self.queue.close()
        if self.kv_connector is not None:
            self.kv_connector.close()


@dataclass(frozen=True)
class _ForwardResult:
    """A step's forward on the device: its inputs, logits, prompt scores, and what a drafter reads."""

    batch: StepBatch
    logits: torch.Tensor
    prompt_scores: LogprobsTensors | None
    hidden: torch.Tensor  # the final hidden states, one row per input token (graph padding included)
    attn_metadata: Any  # the backend metadata of an eager forward (None when a graph built its own)


@dataclass(frozen=True)
class _PendingStep:
    plan: StepPlan
    forward: Pending[_ForwardResult]
    flags: SamplingFlags
    scored: PromptLogprobsPlan | None = None
