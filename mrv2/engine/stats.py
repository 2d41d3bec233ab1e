"""What the engine reports about itself each step: scheduler state, token counts, latencies.

`AsyncLLM` fills an `IterationStats` per step from its requests' `RequestTimes` and
hands it, with a `SchedulerStats` snapshot, to every `StatLogger` (the server's
Prometheus metrics are one). Times are `time.monotonic()` seconds.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Protocol

from mrv2.engine.outputs import RequestOutput
from mrv2.sampling_params import RequestOutputKind
from mrv2.spec_decode.metrics import SpecDecodingStats

logger = logging.getLogger("mrv2")


@dataclass(frozen=True)
class SchedulerStats:
    """The scheduler's state after a step."""

    num_running: int
    num_waiting: int
    kv_cache_usage: float  # fraction of usable KV blocks in use
    num_preemptions: int  # since the engine started
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache, since the start
    prefix_cache_hits: int = 0  # of those, tokens found
    spec_decoding: SpecDecodingStats | None = None  # since the start, when the engine speculates


@dataclass
class IterationStats:
    """Token counts and latencies observed in one step (empty when the engine is idle)."""

    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    time_to_first_tokens: list[float] = field(default_factory=list)
    inter_token_latencies: list[float] = field(default_factory=list)
    e2e_latencies: list[float] = field(default_factory=list)
    finish_reasons: list[str] = field(default_factory=list)


@dataclass
class RequestTimes:
    """One request's arrival, first and latest token, for its latencies."""

    arrival: float
    num_prompt_tokens: int
    kind: RequestOutputKind  # what its outputs carry: new tokens only (DELTA) or all so far
    first_token: float | None = None
    last_token: float | None = None
    num_generated: int = 0
    generated_by_index: dict[int, int] = field(default_factory=dict)  # per completion (n > 1)

    def record(self, out: RequestOutput, now: float, stats: IterationStats) -> None:
        """Account for `out`, the request's newest output, produced at `now`."""
        new = 0
        for completion in out.outputs:
            before = self.generated_by_index.get(completion.index, 0)
            total = before + len(completion.token_ids) if self.kind == RequestOutputKind.DELTA else \
                len(completion.token_ids)
            self.generated_by_index[completion.index] = total
            new += total - before
        completion = out.outputs[0]
        if new > 0:
            if self.first_token is None:
                self.first_token = now
                stats.num_prompt_tokens += self.num_prompt_tokens
                stats.time_to_first_tokens.append(now - self.arrival)
            else:  # tokens that arrive together share the interval since the previous ones
                stats.inter_token_latencies.extend([(now - self.last_token) / new] * new)
            self.last_token = now
            self.num_generated += new
            stats.num_generation_tokens += new
        if out.finished:
            stats.e2e_latencies.append(now - self.arrival)
            stats.finish_reasons.append(completion.finish_reason or "abort")


class StatLogger(Protocol):
    """Receives the engine's state after every step (and once when it goes idle)."""

    def record(self, scheduler: SchedulerStats, iteration: IterationStats) -> None: ...


class LoggingStatLogger:
    """Logs throughput, load, KV-cache usage, the prefix-cache hit rate and speculative decoding's
    acceptance every `interval` seconds (at INFO, as vLLM's engine does) while the engine is busy."""

    def __init__(self, interval: float = 10.0) -> None:
        self.interval = interval
        self._last = time.monotonic()
        self._prompt = self._generated = 0
        self._queries = self._hits = 0
        self._spec = SpecDecodingStats()

    def record(self, scheduler: SchedulerStats, iteration: IterationStats) -> None:
        self._prompt += iteration.num_prompt_tokens
        self._generated += iteration.num_generation_tokens
        now = time.monotonic()
        if now - self._last < self.interval or not (self._prompt or self._generated or scheduler.num_running):
            return
        elapsed, self._last = now - self._last, now
        queries = scheduler.prefix_cache_queries - self._queries
        hits = scheduler.prefix_cache_hits - self._hits
        self._queries, self._hits = scheduler.prefix_cache_queries, scheduler.prefix_cache_hits
        logger.info("Prompt throughput %.1f tok/s, generation %.1f tok/s; running %d, waiting %d requests; "
                    "KV cache usage %.1f%%; prefix cache hit rate %.1f%%", self._prompt / elapsed,
                    self._generated / elapsed, scheduler.num_running, scheduler.num_waiting,
                    100 * scheduler.kv_cache_usage, 100 * hits / queries if queries else 0.0)
        self._prompt = self._generated = 0
        if (spec := scheduler.spec_decoding) is not None and spec.num_drafts > self._spec.num_drafts:
            delta = spec.minus(self._spec)
            self._spec = spec
            logger.info("Speculative decoding: mean acceptance length %.2f, draft acceptance rate %.1f%% "
                        "(%d of %d drafts), per position %s", delta.mean_acceptance_length,
                        100 * delta.acceptance_rate, delta.num_accepted_tokens, delta.num_draft_tokens,
                        ", ".join(f"{r:.2f}" for r in delta.position_rates()))
