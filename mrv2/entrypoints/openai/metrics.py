"""The engine's stats as Prometheus metrics (`GET /metrics`), with vLLM's metric names under `mrv2:`.

Each server has its own `CollectorRegistry`, so several servers (or tests) in one
process never collide.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from mrv2.engine.stats import IterationStats, SchedulerStats
from mrv2.spec_decode.metrics import SpecDecodingStats

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                    10.0, 20.0, 40.0, 80.0, 160.0)


class PrometheusStatLogger:
    """Records `AsyncLLM`'s per-step stats into Prometheus gauges, counters and histograms."""

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        labels, r = ["model_name"], self.registry

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, labels, registry=r).labels(model_name)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, labels, registry=r).labels(model_name)

        def histogram(name: str, doc: str) -> Histogram:
            return Histogram(name, doc, labels, buckets=_LATENCY_BUCKETS, registry=r).labels(model_name)

        self.running = gauge("mrv2:num_requests_running", "Requests in the running batch.")
        self.waiting = gauge("mrv2:num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_usage = gauge("mrv2:kv_cache_usage_perc", "Fraction of KV-cache blocks in use (1 = full).")
        self.preemptions = counter("mrv2:num_preemptions", "Requests preempted to free KV-cache blocks.")
        self.prefix_queries = counter("mrv2:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_hits = counter("mrv2:prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self.prompt_tokens = counter("mrv2:prompt_tokens", "Prompt tokens of requests that got a first token.")
        self.generation_tokens = counter("mrv2:generation_tokens", "Generated tokens.")
        self.ttft = histogram("mrv2:time_to_first_token_seconds", "Time from arrival to the first token.")
        self.itl = histogram("mrv2:inter_token_latency_seconds", "Time between consecutive tokens of a request.")
        self.e2e = histogram("mrv2:e2e_request_latency_seconds", "Time from arrival to the last token.")
        self._success = Counter("mrv2:request_success", "Finished requests, by finish reason.",
                                labels + ["finished_reason"], registry=r)
        self.spec_drafts = counter("mrv2:spec_decode_num_drafts", "Request-steps that verified draft tokens.")
        self.spec_draft_tokens = counter("mrv2:spec_decode_num_draft_tokens", "Draft tokens proposed.")
        self.spec_accepted = counter("mrv2:spec_decode_num_accepted_tokens", "Draft tokens accepted.")
        self._spec_per_pos = Counter("mrv2:spec_decode_num_accepted_tokens_per_pos",
                                     "Draft tokens accepted, by draft position.", labels + ["position"], registry=r)
        self._spec_seen = SpecDecodingStats()
        self._model_name = model_name
        self._preemptions_seen = 0
        self._queries_seen = self._hits_seen = 0

    def record(self, scheduler: SchedulerStats, iteration: IterationStats) -> None:
        self.running.set(scheduler.num_running)
        self.waiting.set(scheduler.num_waiting)
        self.kv_usage.set(scheduler.kv_cache_usage)
        if scheduler.num_preemptions > self._preemptions_seen:
            self.preemptions.inc(scheduler.num_preemptions - self._preemptions_seen)
            self._preemptions_seen = scheduler.num_preemptions
        self.prefix_queries.inc(scheduler.prefix_cache_queries - self._queries_seen)
        self.prefix_hits.inc(scheduler.prefix_cache_hits - self._hits_seen)
        self._queries_seen, self._hits_seen = scheduler.prefix_cache_queries, scheduler.prefix_cache_hits
        self.prompt_tokens.inc(iteration.num_prompt_tokens)
        self.generation_tokens.inc(iteration.num_generation_tokens)
        for value in iteration.time_to_first_tokens:
            self.ttft.observe(value)
        for value in iteration.inter_token_latencies:
            self.itl.observe(value)
        for value in iteration.e2e_latencies:
            self.e2e.observe(value)
        if (spec := scheduler.spec_decoding) is not None:
            delta = spec.minus(self._spec_seen)
            self._spec_seen = spec
            self.spec_drafts.inc(delta.num_drafts)
            self.spec_draft_tokens.inc(delta.num_draft_tokens)
            self.spec_accepted.inc(delta.num_accepted_tokens)
            for position, accepted in enumerate(delta.accepted_per_position):
                self._spec_per_pos.labels(self._model_name, str(position)).inc(accepted)
        for reason in iteration.finish_reasons:
            self._success.labels(self._model_name, reason).inc()
