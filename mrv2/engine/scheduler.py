"""Continuous-batching scheduler with a token budget, chunked prefill and preemption (vLLM V1)."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

from mrv2.config import SchedulerConfig
from mrv2.distributed.kv_transfer import KVConnectorScheduler
from mrv2.engine.block_pool import BlockPool
from mrv2.engine.kv_cache_manager import KVCacheManager
from mrv2.engine.request import Request, RequestStatus, validate_prompt_length
from mrv2.engine.scheduler_output import (CachedRequestData, ModelRunnerOutput, NewRequestData,
                                          SchedulerOutput)
from mrv2.spec_decode.metrics import SpecDecodingStats


class Scheduler:
    """Decides, each step, which requests run and how many tokens each computes.

    Running requests are served first, in admission order (oldest first), so decodes
    are never starved; when blocks run out the most recently admitted running request
    is preempted (its KV dropped, to be recomputed later). Waiting requests are then
    admitted first come, first served, unless something was preempted this step.

    `num_gpu_blocks` counts block 0, the null block. A request that would outgrow the
    whole KV cache is finished as length-capped: `max_model_len` is capped at the
    cache's capacity plus one (the last sampled token needs no KV).

    Async scheduling: `schedule()` may run again before the previous step's output is
    processed. A request whose step samples a token gets an output placeholder, and is
    scheduled from its known tokens plus placeholders (the runner reads the token from
    device state). Stop conditions apply when the ids arrive in `update_from_output`:
    a token sampled past a stop is discarded. A request finished or aborted while a
    step of its is in flight keeps its blocks until that step's output is processed;
    a preempted one is not readmitted before then. A request that will reach
    `max_tokens` or `max_model_len` with its placeholders is not scheduled again.

    With a KV connector (prefill/decode disaggregation), a new request's prompt tokens whose
    KV another instance computed count as computed, like prefix-cache hits; the runner's
    connector loads them into their blocks before the step's forward.
    """

    def __init__(self, scheduler_config: SchedulerConfig, block_size: int, num_gpu_blocks: int,
                 max_model_len: int, enable_prefix_caching: bool = False, num_device_drafts: int = 0,
                 kv_connector: KVConnectorScheduler | None = None) -> None:
        if not scheduler_config.enable_chunked_prefill and scheduler_config.max_num_batched_tokens < max_model_len:
            raise ValueError(
                f"max_num_batched_tokens ({scheduler_config.max_num_batched_tokens}) must be at least "
                f"max_model_len ({max_model_len}) when chunked prefill is disabled")
        self.config = scheduler_config
        self.block_size = block_size
        self.block_pool = BlockPool(num_gpu_blocks)
        self.model_max_len = max_model_len
        self.max_model_len = min(max_model_len, self.block_pool.num_usable_blocks * block_size + 1)
        self.kv_cache_manager = KVCacheManager(self.block_pool, block_size, self.max_model_len,
                                               enable_prefix_caching)
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        # Finished, aborted or preempted since the last schedule(): the runner frees their slots.
        self.finished_req_ids: set[str] = set()
        # Finished or aborted with steps still in flight: their blocks return when those complete.
        self._draining: dict[str, Request] = {}
        self.num_preemptions = 0
        self.spec_stats = SpecDecodingStats()
        # A model-based drafter proposes this many drafts per request on the device after every step
        # that samples: the scheduler verifies them as placeholders (the runner reads their ids from
        # the slot's history) and allocates as many KV positions ahead, which the drafter writes.
        self.num_device_drafts = num_device_drafts
        self.kv_connector = kv_connector

    # Requests in and out.

    def validate_prompt(self, prompt_token_ids: list[int]) -> None:
        """Raise ValueError if the prompt is empty, too long for max_model_len, or larger than the KV cache."""
        validate_prompt_length(prompt_token_ids, self.model_max_len)
        needed = self.kv_cache_manager.blocks_for_tokens(len(prompt_token_ids))
        if needed > self.block_pool.num_usable_blocks:
            raise ValueError(
                f"prompt has {len(prompt_token_ids)} tokens, needing {needed} KV cache blocks, but the "
                f"cache has only {self.block_pool.num_usable_blocks} (num_gpu_blocks)")

    def add_request(self, request: Request) -> None:
        """Validate and queue a request (FCFS); raises ValueError for a bad prompt or reused id."""
        if request.req_id in self.requests or request.req_id in self._draining:
            raise ValueError(f"request id {request.req_id!r} is already in use")
        self.validate_prompt(request.prompt_token_ids)
        if request.max_model_len is None or request.max_model_len > self.max_model_len:
            request.max_model_len = self.max_model_len
        request.status = RequestStatus.WAITING
        self.requests[request.req_id] = request
        self.waiting.append(request)

    def abort_requests(self, req_ids: str | Iterable[str]) -> list[Request]:
        """Abort unfinished requests now (unknown ids are ignored) and free their blocks."""
        return self.finish_requests(req_ids, RequestStatus.FINISHED_ABORTED)

    def finish_requests(self, req_ids: str | Iterable[str], status: RequestStatus) -> list[Request]:
        """End unfinished requests now with a final `status` (unknown or finished ids are ignored);
        their blocks return at once, or when their steps in flight complete."""
        assert status.is_finished, status
        finished = []
        for req_id in [req_ids] if isinstance(req_ids, str) else req_ids:
            request = self.requests.get(req_id)
            if request is None:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
                self.finished_req_ids.add(req_id)  # only a running request holds a runner slot
            else:
                self.waiting.remove(request)
            self._finish(request, status)
            finished.append(request)
        return finished

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def has_finished_requests(self) -> bool:
        """True when finished ids are still to be reported to the runner."""
        return bool(self.finished_req_ids)

    def get_num_unfinished_requests(self) -> int:
        return len(self.waiting) + len(self.running)

    # One step.

    def schedule(self) -> SchedulerOutput:
        """Pick this step's requests and token counts, then advance their num_computed_tokens."""
        budget = self.config.max_num_batched_tokens
        chunked = self.config.enable_chunked_prefill
        num_scheduled: dict[str, int] = {}
        cached: list[tuple[Request, list[int]]] = []
        new: list[Request] = []
        spec: dict[str, list[int]] = {}
        preempted = False

        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            pending = request.num_output_placeholders
            if (request.num_output_tokens + pending >= request.max_tokens
                    or request.num_tokens + pending >= self.max_model_len):
                i += 1  # finishes by length when its in-flight token arrives
                continue
            # >= 1: the known tokens and placeholders not computed yet.
            num_new = min(request.num_tokens + pending - request.num_computed_tokens, budget)
            drafts = self._drafts_to_verify(request, budget, pending) if num_new == 1 else []
            num_new += len(drafts)
            while (new_blocks := self.kv_cache_manager.allocate_slots(
                    request, num_new + self._lookahead(request, num_new))) is None:
                victim = self.running.pop()
                self._preempt(victim)
                preempted = True
                if victim is request:
                    break
            if new_blocks is None:
                break
            cached.append((request, new_blocks))
            num_scheduled[request.req_id] = num_new
            if drafts:
                spec[request.req_id] = drafts
            budget -= num_new
            i += 1

        # A preemption means blocks are short: admitting more would only cause thrashing.
        while not preempted and self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            if request.num_steps_in_flight:
                break  # preempted with a step in flight: its token arrives first (FCFS holds)
            # A request without blocks (new, or preempted) starts after its longest cached prefix.
            computed = self.kv_cache_manager.get_computed_blocks(request) if not request.block_ids else []
            num_hit = len(computed) * self.block_size
            external = 0
            if self.kv_connector is not None and not request.block_ids:
                external = self.kv_connector.get_num_new_matched_tokens(request, num_hit)
            num_new = request.num_tokens - num_hit - external
            if num_new > budget:
                if not chunked:
                    break
                num_new = budget
            request.num_computed_tokens = num_hit
            num_slots = external + num_new
            if self.kv_cache_manager.allocate_slots(request, num_slots + self._lookahead(request, num_slots),
                                                    computed) is None:
                request.num_computed_tokens = 0
                break
            self.kv_cache_manager.record_lookup(request.num_tokens, num_hit)
            if external:
                self.kv_connector.update_state_after_alloc(request, external)
                request.num_computed_tokens += external
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            new.append(request)
            num_scheduled[request.req_id] = num_new
            budget -= num_new

        sampled: set[str] = set()
        for req_id, n in num_scheduled.items():
            request = self.requests[req_id]
            request.num_computed_tokens += n
            request.num_steps_in_flight += 1
            if request.num_computed_tokens >= request.num_tokens + request.num_output_placeholders:
                # Up to one token per draft and one more (an upper bound until the output arrives).
                request.num_output_placeholders += 1 + len(spec.get(req_id, ()))
                sampled.add(req_id)
        output = SchedulerOutput(
            scheduled_new_reqs=[
                NewRequestData(req_id=r.req_id, prompt_token_ids=list(r.prompt_token_ids),
                               all_token_ids=list(r.all_token_ids), sampling_params=r.sampling_params,
                               block_ids=list(r.block_ids),
                               num_computed_tokens=r.num_computed_tokens - num_scheduled[r.req_id],
                               eos_token_ids=r.eos_token_ids)
                for r in new],
            scheduled_cached_reqs=CachedRequestData(
                req_ids=[r.req_id for r, _ in cached],
                new_block_ids=[b for _, b in cached],
                num_computed_tokens=[r.num_computed_tokens - num_scheduled[r.req_id] for r, _ in cached]),
            num_scheduled_tokens=num_scheduled,
            total_num_scheduled_tokens=self.config.max_num_batched_tokens - budget,
            finished_req_ids=self.finished_req_ids,
            sampled_req_ids=frozenset(sampled),
            scheduled_spec_decode_tokens=spec,
            kv_connector_metadata=None if self.kv_connector is None else
            self.kv_connector.build_connector_meta(num_scheduled, self.requests),
        )
        self.finished_req_ids = set()
        return output

    def update_from_output(self, scheduler_output: SchedulerOutput,
                           model_runner_output: ModelRunnerOutput) -> list[Request]:
        """Apply one step's sampled tokens and stop checks; return the requests that got a new
        token (finished ones included, with their final status).

        Steps are processed in launch order. A token of a request that finished or was
        aborted since its step was launched is discarded; a preempted request keeps it.
        """
        sampled = dict(zip(model_runner_output.req_ids, model_runner_output.sampled_token_ids))
        logprobs = dict(zip(model_runner_output.req_ids, model_runner_output.logprobs or ()))
        updated = []
        for req_id in scheduler_output.num_scheduled_tokens:
            request = self.requests.get(req_id) or self._draining.get(req_id)
            if request is None:
                continue
            request.num_steps_in_flight -= 1
            if model_runner_output.prompt_logprobs and req_id in model_runner_output.prompt_logprobs:
                first, entries = model_runner_output.prompt_logprobs[req_id]
                request.set_prompt_logprobs(first, entries)
            if req_id in scheduler_output.sampled_req_ids:
                drafts = scheduler_output.scheduled_spec_decode_tokens.get(req_id, ())
                request.num_output_placeholders -= 1 + len(drafts)
                token_ids = sampled.get(req_id)
                if token_ids and not request.is_finished:
                    if request.status == RequestStatus.RUNNING:  # a preempted one recomputes from 0
                        # Rejected drafts: their KV is written but not part of the sequence.
                        request.num_computed_tokens -= len(drafts) + 1 - len(token_ids)
                    if drafts:
                        self.spec_stats.observe(len(drafts), len(token_ids) - 1)
                    was_running = request.status == RequestStatus.RUNNING
                    token_logprobs = logprobs.get(req_id)
                    for i, token_id in enumerate(token_ids):
                        request.append_output_token(token_id, token_logprobs[i] if token_logprobs else None)
                        if request.check_stop(self.max_model_len):
                            if was_running:
                                self.running.remove(request)
                                self.finished_req_ids.add(req_id)
                            else:  # preempted: its slot is already freed
                                self.waiting.remove(request)
                            self._finish(request, request.status)
                            break
                    updated.append(request)
            if request.num_steps_in_flight == 0 and self._draining.pop(req_id, None) is not None:
                self.kv_cache_manager.free(request)
        return updated

    def _lookahead(self, request: Request, num_new: int) -> int:
        return max(0, min(self.num_device_drafts, self.max_model_len - request.num_computed_tokens - num_new))

    def _drafts_to_verify(self, request: Request, budget: int, pending: int) -> list[int]:
        """The drafts a decoding request verifies this step, as many as fit: the budget, max_tokens and
        max_model_len count every token the step may emit (the drafts and one more), after the
        `pending` ones steps in flight may emit.

        Host drafts (n-gram) extend known tokens, so they wait for those; device drafts (a model
        drafter's, written into the slot by the step that sampled the request's last token) are
        placeholders (-1), as many as the drafter made and the request allows.
        """
        room = min(budget - 1, request.max_tokens - request.num_output_tokens - pending - 1,
                   self.max_model_len - request.num_tokens - pending - 1)
        if self.num_device_drafts:
            if request.structured_grammar is not None:
                return []  # device drafts are unknown to the host, which fills the grammar's masks
            cap = request.sampling_params.num_speculative_tokens
            k = self.num_device_drafts if cap is None else min(cap, self.num_device_drafts)
            return [-1] * max(0, min(room, k))
        if pending:
            return []
        drafts, request.spec_token_ids = request.spec_token_ids[:max(room, 0)], []
        return drafts

    def fail_step(self, scheduler_output: SchedulerOutput) -> list[Request]:
        """A launched step produced no output: abort its requests; their blocks return once
        no other step of theirs is in flight."""
        self.update_from_output(scheduler_output, ModelRunnerOutput([], []))
        return self.abort_requests(list(scheduler_output.num_scheduled_tokens))

    def _preempt(self, request: Request) -> None:
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)
        self.finished_req_ids.add(request.req_id)

    def _finish(self, request: Request, status: RequestStatus) -> None:
        request.status = status
        if self.kv_connector is not None:
            request.kv_transfer_params = self.kv_connector.request_finished(request)
        del self.requests[request.req_id]
        if request.num_steps_in_flight:
            self._draining[request.req_id] = request
        else:
            self.kv_cache_manager.free(request)
