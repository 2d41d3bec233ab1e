"""The synchronous engine loop: requests in, scheduler + model runner, outputs out."""

from __future__ import annotations

import itertools
import logging
import time
from collections import deque
from dataclasses import replace
from typing import Any

import torch

from mrv2.config import EngineConfig
from mrv2.engine.output_processor import OutputProcessor
from mrv2.engine.outputs import RequestOutput
from mrv2.engine.request import Request, RequestStatus
from mrv2.engine.scheduler import Scheduler
from mrv2.engine.scheduler_output import SchedulerOutput
from mrv2.distributed.executors import RankFailedError, RunnerSpec, build_executor
from mrv2.distributed.kv_transfer import build_connector_scheduler
from mrv2.runner.async_output import AsyncRunnerOutput
from mrv2.runner.kv_cache import num_blocks_for_budget
from mrv2.sample.bad_words import bad_words_token_ids
from mrv2.platforms import get_platform
from mrv2.sampling_params import SamplingParams, StructuredOutputsParams
from mrv2.spec_decode.ngram import NgramProposer
from mrv2.structured.manager import StructuredOutputManager

logger = logging.getLogger("mrv2")


class LLMEngine:
    """Owns the tokenizer, scheduler and model runner; `step()` runs one engine step."""

    def __init__(self, config: EngineConfig) -> None:
        from transformers import AutoConfig, AutoTokenizer

        from mrv2.loader.resolve import check_architecture, resolve_model_path
        from mrv2.loader.gguf_quant import quantized_names

        self._t0 = time.perf_counter()
        self.platform = get_platform(config.device)
        if config.async_scheduling is None:
            config = replace(config, async_scheduling=self.platform.default_async_scheduling)
        if config.speculative is not None and not config.speculative.uses_model and config.async_scheduling:
            # N-gram drafts extend the tokens sampled last step, which async scheduling leaves
            # on the device while it schedules the next step (a drafter's stay there too).
            logger.info("Speculative decoding (%s) runs with serial scheduling", config.speculative.method)
            config = replace(config, async_scheduling=False)
        self.platform.configure_threads(host_only=config.async_scheduling)
        path = resolve_model_path(config.model.model)
        hf_config = AutoConfig.from_pretrained(path)
        check_architecture(hf_config)
        self.tokenizer = AutoTokenizer.from_pretrained(config.model.tokenizer or path)
        self.hf_config = hf_config
        self.model_path = path

        model_max, limit = getattr(hf_config, "max_position_embeddings", None) or 2048, "max_position_embeddings"
        # Attention here is full-context: past a sliding window the model would see more than it was trained to.
        window = getattr(hf_config, "sliding_window", None) if getattr(hf_config, "use_sliding_window", True) else None
        if window is not None and window < model_max:
            model_max, limit = window, "sliding_window"
        max_model_len = config.model.max_model_len or model_max
        if max_model_len > model_max:
            raise ValueError(f"max_model_len ({max_model_len}) exceeds the model's {limit} ({model_max})")
        config = config.with_max_model_len(max_model_len)
        if config.scheduler.max_num_batched_tokens < config.scheduler.max_num_seqs:
            config = replace(config, scheduler=replace(config.scheduler,
                                                       max_num_seqs=config.scheduler.max_num_batched_tokens))
        self.config = config
        checkpoint_dtype = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
        if isinstance(checkpoint_dtype, str):
            checkpoint_dtype = getattr(torch, checkpoint_dtype, None)
        self.dtype, why = self.platform.resolve_dtype(config.model.dtype, checkpoint_dtype)
        logger.info("Running in %s: %s", str(self.dtype).removeprefix("torch."), why)
        torch.manual_seed(config.model.seed)

        quant_policy = None
        if quantized_names(path):
            policy, why = self.platform.quant_policy(self.dtype, config.model.quantization,
                                                     exact=config.model.dtype != "auto",
                                                     int8_activations=config.model.int8_activations)
            if config.model.batch_invariant and policy.uses_int4:
                policy, why = replace(policy, int4_max_rows=0), "batch_invariant=True runs dense weights"
            if policy.uses_int4:
                quant_policy = policy
            logger.info("Quantized GGUF weights %s: %s", "kept quantized" if quant_policy else "dequantized", why)
        tp_size = config.parallel.tensor_parallel_size
        self.kv_connector = None
        if config.kv_transfer is not None:  # first: an unknown connector fails before the model loads
            self.kv_connector = build_connector_scheduler(config.kv_transfer, tp_size)
            logger.info("KV transfer: %s as %s", config.kv_transfer.kv_connector, config.kv_transfer.kv_role)
        if tp_size > 1:
            logger.info("Tensor parallelism over %d ranks (%s executor, %s process groups)", tp_size,
                        config.parallel.executor_backend, self.platform.dist_backend)
        # Rank 0's runner lives here (`self.runner`: read its state, run the model through the executor).
        self.executor = build_executor(RunnerSpec(config, path, hf_config, self.dtype, quant_policy), self.platform)
        self.runner = self.executor.driver
        try:
            self._set_up_cache_and_scheduler()
        except BaseException:
            self.executor.shutdown()
            raise

    def _set_up_cache_and_scheduler(self) -> None:
        config = self.config
        num_blocks = self._plan_kv_cache()
        alignment = config.cache.base_alignment(self.platform.kv_alignment)
        try:
            kv = self.executor.call("initialize_kv_cache", num_blocks, alignment)
        except RankFailedError:
            raise
        except (RuntimeError, MemoryError) as e:  # torch's allocators raise RuntimeError (OutOfMemoryError)
            raise ValueError(
                f"the KV cache ({num_blocks} blocks of {config.cache.block_size} tokens) could not be allocated: "
                f"{str(e).splitlines()[0][:200]}; lower kv_cache_memory (or kv_cache_memory_fraction, "
                f"max_num_seqs or max_model_len)") from e
        self.executor.call("capture_graphs")
        drafter = self.runner.drafter
        max_model_len = config.max_model_len
        self.scheduler = Scheduler(config.scheduler, config.cache.block_size, num_blocks, max_model_len,
                                   config.cache.enable_prefix_caching,
                                   drafter.k if drafter is not None else 0, self.kv_connector)
        logger.info("KV cache: %d blocks of %d tokens (%.1f MiB, %s layout, %d B aligned); max concurrency "
                    "%.1f requests of %d tokens; ready in %.1f s", num_blocks, config.cache.block_size,
                    kv.raw.numel() / 2**20, config.cache.layout, alignment,
                    (num_blocks - 1) * config.cache.block_size / max_model_len, max_model_len,
                    time.perf_counter() - self._t0)
        self.eos_token_ids = self._eos_token_ids()
        self.output_processor = OutputProcessor(self.tokenizer)
        self._ids = itertools.count()
        # Launched steps whose outputs are not processed yet, oldest first.
        self._in_flight: deque[tuple[SchedulerOutput, AsyncRunnerOutput]] = deque()
        self._max_in_flight = 2 if config.async_scheduling else 1
        spec = config.speculative
        self.structured: StructuredOutputManager | None = None  # built with the first constrained request
        self.proposer = None
        if spec is not None and not spec.uses_model:
            self.proposer = NgramProposer(spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max)

    def _plan_kv_cache(self) -> int:
        cfg = self.config
        specs = self.runner.kv_cache_specs()
        alignment = cfg.cache.base_alignment(self.platform.kv_alignment)
        if cfg.cache.kv_cache_memory is not None:
            budget = cfg.cache.kv_cache_memory
        else:
            # The largest step (attention transients included) and the graphs captured after allocation.
            reserved = self.executor.call("activation_bytes") + self.runner.graph_pool_bytes()
            # Ranks that share one memory (host RAM) share its budget too.
            ranks = cfg.parallel.tensor_parallel_size if self.platform.ranks_share_memory else 1
            budget = int(self.platform.free_memory() * cfg.cache.memory_fraction) // ranks - reserved
            if self.platform.kv_cache_cap_bytes is not None:
                budget = min(budget, self.platform.kv_cache_cap_bytes // ranks)
        num_blocks = num_blocks_for_budget(specs, cfg.cache.layout, cfg.cache.block_size, alignment, budget)
        # More blocks than every slot at full length can use would sit idle.
        useful = cfg.scheduler.max_num_seqs * -(-cfg.max_model_len // cfg.cache.block_size) + 1
        num_blocks = min(num_blocks, useful)
        if num_blocks < 2:
            raise ValueError(f"kv_cache_memory ({budget} bytes) is too small for even one KV block "
                             f"({sum(s.bytes_per_token for s in specs) * cfg.cache.block_size} bytes)")
        return num_blocks

    def _eos_token_ids(self) -> list[int]:
        ids: list[int] = []
        for source in (getattr(self.tokenizer, "eos_token_id", None), getattr(self.hf_config, "eos_token_id", None)):
            for t in source if isinstance(source, (list, tuple)) else [source]:
                if t is not None and t not in ids:
                    ids.append(int(t))
        return ids

    # -- requests --

    def tokenize(self, prompt: Any) -> tuple[str | None, list[int]]:
        """A prompt (text, or a dict with `prompt` or `prompt_token_ids`, and optionally `cache_salt`)
        -> (text, token ids)."""
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                ids = prompt["prompt_token_ids"]
                if not isinstance(ids, (list, tuple)) or not all(isinstance(t, int) for t in ids):
                    raise ValueError("prompt_token_ids must be a list of integers")
                vocab = self.runner.model.config.vocab_size
                bad = [t for t in ids if not 0 <= t < vocab]
                if bad:
                    raise ValueError(f"prompt_token_ids contains ids outside the vocabulary [0, {vocab}): {bad[:5]}")
                return prompt.get("prompt"), list(ids)
            if "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        if not isinstance(prompt, str):
            raise ValueError(f"prompt must be a string or a dict, got {type(prompt).__name__}")
        return prompt, self.tokenizer.encode(prompt)

    def apply_chat_template(self, messages: Any, add_generation_prompt: bool = True,
                            chat_template_kwargs: dict[str, Any] | None = None) -> list[int]:
        """Token ids of one conversation (a list of {"role", "content"} dicts) in the model's chat template."""
        if self.tokenizer.chat_template is None:
            raise ValueError("this model's tokenizer has no chat template")
        if not isinstance(messages, (list, tuple)) or not messages or not all(
                isinstance(m, dict) and "role" in m and "content" in m for m in messages):
            raise ValueError("messages must be a non-empty list of dicts with 'role' and 'content'")
        ids = self.tokenizer.apply_chat_template(list(messages), tokenize=True, add_generation_prompt=add_generation_prompt,
                                                 return_dict=False, **(chat_template_kwargs or {}))
        return list(ids)

    def make_request(self, prompt: Any, params: SamplingParams, request_id: str | None = None) -> Request:
        """Validate a prompt and its parameters into a Request (nothing is scheduled yet)."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be SamplingParams, got {type(params).__name__}")
        params.validate()
        vocab = self.runner.model.config.vocab_size
        for name, ids in (("logit_bias", params.logit_bias or ()), ("allowed_token_ids", params.allowed_token_ids or ()),
                          ("stop_token_ids", params.stop_token_ids)):
            if bad := [t for t in ids if t >= vocab]:
                raise ValueError(f"{name} holds ids outside the vocabulary [0, {vocab}): {bad[:5]}")
        if params.bad_words:
            # A sequence with an id the model cannot produce can never occur: it bans nothing.
            words = [w for w in bad_words_token_ids(self.tokenizer, params.bad_words) if max(w) < vocab]
            params = replace(params)  # the caller's object may serve other requests (and tokenizers)
            params.bad_words_token_ids = words
        text, ids = self.tokenize(prompt)
        self.scheduler.validate_prompt(ids)
        grammar = None
        if params.structured_outputs is not None:
            grammar = self.compile_structured_outputs(params.structured_outputs)
        # Every EOS id (Llama 3's <|eot_id|> too) is EOS: ignore_eos ignores them all.
        request = Request(request_id or str(next(self._ids)), ids, params, self.eos_token_ids)
        request.prompt = text
        request.cache_salt = _cache_salt(prompt)
        request.structured_grammar = grammar
        return request

    def compile_structured_outputs(self, params: StructuredOutputsParams) -> Any:
        """The compiled grammar of a structured-output spec (cached per spec); ValueError naming what is wrong."""
        return self._structured_outputs().compile(params)

    def _structured_outputs(self) -> StructuredOutputManager:
        """The structured-output manager, built (and its backend imported) when first needed."""
        if self.structured is None:
            from mrv2.structured.xgrammar_backend import XgrammarBackend

            backend = XgrammarBackend(self.tokenizer, self.runner.model.config.vocab_size, self.eos_token_ids)
            self.structured = StructuredOutputManager(backend)
        return self.structured

    def add_request(self, request: Request) -> None:
        """Queue a request; one with n > 1 runs as n children (completion i of a seeded one uses seed + i)."""
        params = request.sampling_params
        if self.output_processor.has_request(request.req_id):
            raise ValueError(f"request id {request.req_id!r} is already in use")
        if params.n == 1:
            self.scheduler.add_request(request)
            self.output_processor.add_request(request)
            return
        for i in range(params.n):
            child = Request(f"{i}_{request.req_id}", request.prompt_token_ids,
                            replace(params, n=1, seed=None if params.seed is None else params.seed + i),
                            request.eos_token_ids, request.max_model_len, request.arrival_time)
            child.prompt, child.cache_salt = request.prompt, request.cache_salt
            child.structured_grammar = request.structured_grammar
            self.scheduler.add_request(child)
            self.output_processor.add_request(child, request, i)

    def abort(self, request_ids: list[str]) -> None:
        """End these requests now (unknown or finished ids are ignored); their blocks return."""
        engine_ids = self.output_processor.family_ids(request_ids)
        self.scheduler.abort_requests(engine_ids)
        self.output_processor.remove(request_ids + engine_ids)
        if self.structured is not None:
            self.structured.drop(engine_ids)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block (only while no request holds one: False otherwise)."""
        return self.scheduler.kv_cache_manager.reset_prefix_cache()

    def has_unfinished_requests(self) -> bool:
        """Requests waiting or running, or launched steps whose outputs are still to be processed."""
        return self.scheduler.has_unfinished_requests() or bool(self._in_flight)

    def step(self) -> list[RequestOutput]:
        """Launch a step if one fits, then process the oldest launched step's output.

        Serially one step is in flight at a time: schedule -> execute -> sample -> update.
        With async scheduling up to two are: step N+1 is scheduled and launched before
        the host waits for step N's sampled ids, so the host's scheduling, preparation
        and output processing overlap the device's work. A step that samples for a
        structured-output request first processes the steps in flight (its grammar
        matchers need every token sampled so far; the step's forward runs meanwhile),
        then fills the token bitmasks its sampling applies.
        """
        outputs: list[RequestOutput] = []
        if len(self._in_flight) < self._max_in_flight:
            sched = self.scheduler.schedule()
            masked = self.structured is not None and self.structured.needs_masks(sched.sampled_req_ids,
                                                                               self.scheduler.requests)
            try:  # a synchronous device queue runs the forward and the sampler right here
                self.executor.execute_model(sched, defer_sampling=masked)  # also frees finished requests' slots
                while masked and self._in_flight:
                    outputs += self._process_oldest()
                grammar = self.structured.masks(sched.sampled_req_ids, self.scheduler.requests,
                                                sched.scheduled_spec_decode_tokens) if masked else None
                pending = self.executor.sample_tokens(grammar) if not sched.is_empty else None
            except BaseException:
                self._fail(sched)
                raise
            if pending is not None:
                self._in_flight.append((sched, pending))
                if len(self._in_flight) < self._max_in_flight and self.scheduler.has_unfinished_requests():
                    return outputs  # launch the next step before waiting for this one
        if not self._in_flight:
            return outputs
        return outputs + self._process_oldest()

    def _process_oldest(self) -> list[RequestOutput]:
        """Wait for the oldest launched step's sampled ids and turn them into outputs."""
        sched, pending = self._in_flight.popleft()
        try:
            runner_out = pending.get()
        except BaseException:
            self._fail(sched)
            raise
        updated = self.scheduler.update_from_output(sched, runner_out)
        if self.proposer is not None:  # drafts for the next step, from the tokens just sampled
            self.proposer.propose_for(r for r in updated if r.status == RequestStatus.RUNNING)
        stopped = self.output_processor.detokenize(updated)
        if stopped:  # a stop string: the request ends now, like one that sampled a stop token
            self.scheduler.finish_requests([r.req_id for r in stopped], RequestStatus.FINISHED_STOPPED)
        if self.structured is not None:  # after stop strings: it drops the matchers of finished requests
            self.structured.advance(updated)
        return self.output_processor.make_outputs(updated)

    def _fail(self, sched: SchedulerOutput) -> None:
        """A launched step produced no output: its requests end, with their n > 1 siblings."""
        self.abort([r.req_id for r in self.scheduler.fail_step(sched)])

    def shutdown(self) -> None:
        """Finish launched steps (requests ended meanwhile get their blocks back), stop the runner's device queue."""
        while self._in_flight:
            sched, pending = self._in_flight.popleft()
            try:
                self.scheduler.update_from_output(sched, pending.get())
            except Exception:  # noqa: BLE001 - shutting down: the step's requests just end
                self.scheduler.fail_step(sched)
        self.executor.shutdown()
        if self.kv_connector is not None:
            self.kv_connector.shutdown()

    def target_logprobs(self, token_ids: list[int]) -> torch.Tensor:
        """log p(token_ids[i + 1] | token_ids[:i + 1]) for every i (see `ModelRunner.target_logprobs`)."""
        return self.executor.call("target_logprobs", token_ids)


def _cache_salt(prompt: Any) -> str | None:
    salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise ValueError(f"cache_salt must be a non-empty string, got {salt!r}")
    return salt
