"""The scheduler -> runner contract for one step, and the runner's answer.

The scheduler never sends a running request's tokens again: the runner keeps
each request's token history in its own slot state and writes sampled tokens
there itself. A preempted request is reported as finished to the runner and
comes back later as a new request carrying all its tokens so far.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from mrv2.engine.request import TokenLogprobs
from mrv2.sampling_params import SamplingParams


@dataclass(frozen=True)
class NewRequestData:
    """A request the runner has not seen (or sees again after preemption)."""

    req_id: str
    prompt_token_ids: list[int]
    # Prompt plus any tokens generated before a preemption: all of them are prefilled.
    all_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    eos_token_ids: tuple[int, ...] = ()  # every EOS id: min_tokens masks them


@dataclass(frozen=True)
class CachedRequestData:
    """Diffs for requests already in the runner: only new blocks and progress."""

    req_ids: list[str] = field(default_factory=list)
    new_block_ids: list[list[int]] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class SchedulerOutput:
    """One step's schedule."""

    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    # Requests finished, aborted or preempted since the previous step: free their slots.
    finished_req_ids: set[str] = field(default_factory=set)
    # Requests whose step reaches their last token, so it samples a new one (not partial prefills).
    sampled_req_ids: frozenset[str] = frozenset()
    # Draft tokens to verify, per decode request: it is scheduled 1 + len(drafts) tokens
    # (its last token and the drafts) and samples at each of them.
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    # The KV connector's work for every rank this step (prefill/decode disaggregation), or None.
    kv_connector_metadata: Any = None

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


@dataclass(frozen=True)
class ModelRunnerOutput:
    """Sampled tokens of one step, one list per scheduled request, in `req_ids` order.

    A request without drafts gets one token; with k drafts it gets the accepted
    drafts and one more (1 to k + 1 tokens). A request whose prefill is still partial
    after this step samples nothing useful; the scheduler ignores its entry.
    """

    req_ids: list[str]
    sampled_token_ids: list[list[int]]
    # Per request (None where it asked for none): per sampled token, (token ids, logprobs, rank):
    # the sampled token first, then the request's top alternatives; rank is the sampled token's.
    logprobs: list[list[TokenLogprobs] | None] | None = None
    # Per request that asked for prompt logprobs and prefilled prompt tokens this step:
    # (the first scored prompt position, one entry per scored position from there).
    prompt_logprobs: dict[str, tuple[int, list[TokenLogprobs]]] | None = None
