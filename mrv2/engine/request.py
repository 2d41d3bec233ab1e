"""Engine-side request state: tokens, progress, KV blocks, status and stop checks."""

from __future__ import annotations

import enum
import itertools
import sys
import time
from typing import Any
from collections.abc import Sequence

from mrv2.sampling_params import SamplingParams

TokenLogprobs = tuple[list[int], list[float], int]  # sampled token first, then the top ones; the sampled rank

_arrival_counter = itertools.count()


class RequestStatus(enum.IntEnum):
    """Lifecycle of a request; every status after PREEMPTED is final."""

    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()

    @property
    def is_finished(self) -> bool:
        return self > RequestStatus.PREEMPTED


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


def validate_prompt_length(prompt_token_ids: list[int], max_model_len: int) -> None:
    """Raise ValueError unless the prompt is non-empty and leaves room for one output token."""
    if not prompt_token_ids:
        raise ValueError("prompt must contain at least one token")
    if len(prompt_token_ids) >= max_model_len:
        raise ValueError(
            f"prompt has {len(prompt_token_ids)} tokens, which is not less than "
            f"max_model_len ({max_model_len}): no room to generate")


class Request:
    """One generation request as the scheduler tracks it.

    `eos_token_ids` are the model's end-of-sequence ids, the primary one first and any
    secondary ones (Llama 3's `<|eot_id|>`) after it: all of them end the request
    unless `ignore_eos` is set. `max_model_len` bounds prompt + output; the scheduler
    fills it in on `add_request` when left None. `num_computed_tokens` counts tokens
    whose KV is written (or scheduled to be written in the steps in flight). With async
    scheduling a request may be scheduled again before its sampled token reaches the
    host: each such token is an output placeholder until it arrives.
    """

    def __init__(self, req_id: str, prompt_token_ids: list[int], sampling_params: SamplingParams,
                 eos_token_ids: Sequence[int] = (), max_model_len: int | None = None,
                 arrival_time: float | None = None) -> None:
        self.req_id = req_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_ids = tuple(eos_token_ids)
        self.max_model_len = max_model_len
        self.arrival_index = next(_arrival_counter)
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(self.prompt_token_ids)
        self.num_computed_tokens = 0
        self.block_ids: list[int] = []
        self.status = RequestStatus.WAITING
        self.stop_reason: int | None = None
        self.num_preemptions = 0
        # Tokens sampled by steps in flight whose ids the host does not know yet.
        self.num_output_placeholders = 0
        # Launched steps that scheduled this request and whose output is not processed yet.
        self.num_steps_in_flight = 0
        # Per output token when the request asked for logprobs (see ModelRunnerOutput.logprobs).
        self.output_logprobs: list[TokenLogprobs] = []
        # Per prompt position when it asked for prompt logprobs (position 0 has none).
        self.prompt_logprobs: list[TokenLogprobs | None] | None = \
            [None] * len(prompt_token_ids) if sampling_params.prompt_logprobs is not None else None
        # Chained hashes of the full blocks of known tokens (prefix caching), extended as tokens arrive.
        self.block_hashes: list[bytes] = []
        self.cache_salt: str | None = None  # requests share cached blocks only with equally salted ones
        self.num_cached_blocks = 0  # leading blocks of `block_ids` already registered in the cache
        # Draft tokens proposed for the next step (verified there, then cleared).
        self.spec_token_ids: list[int] = []
        # What a KV connector hands on once this request ends (a prefill instance's transfer), or None.
        self.kv_transfer_params: dict | None = None
        # The compiled grammar its output must follow (structured output), or None.
        self.structured_grammar: Any = None

    @property
    def hash_salt(self) -> bytes:
        """The first block hash's extra key: the cache salt, if any."""
        return b"" if self.cache_salt is None else self.cache_salt.encode()

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def max_tokens(self) -> int:
        """Output-token cap: the sampling cap and the room left under max_model_len."""
        cap = self.sampling_params.max_tokens or sys.maxsize
        if self.max_model_len is not None:
            cap = min(cap, self.max_model_len - self.num_prompt_tokens)
        return cap

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self.status)

    def set_prompt_logprobs(self, first: int, entries: list[TokenLogprobs]) -> None:
        """Store the scores of prompt positions first, first + 1, ... (again after a preemption: same values)."""
        self.prompt_logprobs[first:first + len(entries)] = entries

    def append_output_token(self, token_id: int, logprobs: TokenLogprobs | None = None) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        if logprobs is not None:
            self.output_logprobs.append(logprobs)

    def check_stop(self, max_model_len: int | None = None) -> bool:
        """After appending a token: set a finished status and return True if the request is done."""
        max_model_len = max_model_len or self.max_model_len or sys.maxsize
        params = self.sampling_params
        if self.output_token_ids and self.num_output_tokens >= params.min_tokens:
            last = self.output_token_ids[-1]
            if not params.ignore_eos and last in self.eos_token_ids:
                self.status = RequestStatus.FINISHED_STOPPED
                return True
            if last in params.stop_token_ids:
                self.status = RequestStatus.FINISHED_STOPPED
                self.stop_reason = last
                return True
        if self.num_output_tokens >= self.max_tokens or self.num_tokens >= max_model_len:
            self.status = RequestStatus.FINISHED_LENGTH_CAPPED
            return True
        return False

    def __repr__(self) -> str:
        return (f"Request({self.req_id!r}, status={self.status.name}, prompt={self.num_prompt_tokens}, "
                f"output={self.num_output_tokens}, computed={self.num_computed_tokens}, "
                f"blocks={len(self.block_ids)})")
