"""Per-request sampling parameters in slots, and the one place the sampler's host flags come from.

A request's parameters live in its slot (the runner's slot, see `runner/states.py`)
from admission until it finishes; `add_request` stages them and
`take_staged` packs them for the device (one copy per tensor, applied as device work). The device
tensors feed the sampler through the step's `idx_mapping`; the numpy mirrors hold
what the host already knows, so every host flag (greedy, random, which filters run,
the top-k bound, whether any row has min_tokens) is derived from them without reading
the device.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from mrv2.staged_writes import StagedScalarWriter, StagedWrite, apply_writes
from mrv2.sample.allowed_tokens import AllowedTokensState
from mrv2.sample.bad_words import BadWordsState
from mrv2.sample.logit_bias import LogitBiasState
from mrv2.sample.metadata import SamplingFlags, SamplingMetadata, host_flags
from mrv2.sample.min_tokens import MinTokensState
from mrv2.sample.penalties import PenaltiesState
from mrv2.sampling_params import SamplingParams

_PARAMS = ("temperature", "top_k", "top_p", "min_p", "seeds")


class SamplingStates:
    """Every slot's sampling parameters (each feature's state in its own module), device and host mirror."""

    def __init__(self, max_num_reqs: int, vocab_size: int, device: torch.device, pin_memory: bool,
                 seed: int = 0) -> None:
        self.vocab_size = vocab_size
        self._rng = np.random.default_rng(seed)  # seeds of unseeded requests: reproducible per engine seed

        def full(value: float, dtype: torch.dtype) -> torch.Tensor:
            return torch.full((max_num_reqs,), value, dtype=dtype, device=device)

        # Free slots hold the disabled values, on the device as in the mirrors.
        self.temperature = full(0.0, torch.float32)
        self.top_k = full(0, torch.int32)  # 0: disabled
        self.top_p = full(1.0, torch.float32)
        self.min_p = full(0.0, torch.float32)
        self.seeds = full(0, torch.int64)

        self.temperature_cpu = np.zeros(max_num_reqs, dtype=np.float32)
        self.top_k_cpu = np.zeros(max_num_reqs, dtype=np.int64)
        self.top_p_cpu = np.ones(max_num_reqs, dtype=np.float32)
        self.min_p_cpu = np.zeros(max_num_reqs, dtype=np.float32)
        self.num_logprobs_cpu = np.full(max_num_reqs, -1, dtype=np.int64)  # -1: no logprobs (host only)
        self.num_prompt_logprobs_cpu = np.full(max_num_reqs, -1, dtype=np.int64)
        self.prompt_len_cpu = np.zeros(max_num_reqs, dtype=np.int64)

        self._writers = {name: StagedScalarWriter(getattr(self, name), pin_memory) for name in _PARAMS}
        self.min_tokens = MinTokensState(max_num_reqs, device, pin_memory)
        self.penalties = PenaltiesState(max_num_reqs, device, pin_memory)
        self.logit_bias = LogitBiasState(max_num_reqs, device, pin_memory)
        self.allowed_tokens = AllowedTokensState(max_num_reqs, vocab_size, device, pin_memory)
        self.bad_words = BadWordsState(max_num_reqs, device, pin_memory)

    def add_request(self, slot: int, params: SamplingParams, prompt_len: int = 0,
                    eos_token_ids: Sequence[int] = ()) -> None:
        """Stage `params` into `slot` (the host mirrors change at once, the device at apply_staged_writes).

        `prompt_len` (the original prompt, without tokens generated before a preemption)
        and `eos_token_ids` serve min_tokens: output count origin and ids to mask.
        """
        seed = params.seed if params.seed is not None else int(self._rng.integers(0, 2**62))
        top_k = params.top_k if params.top_k > 0 else 0
        values = (params.temperature, top_k, params.top_p, params.min_p, seed)
        for name, value in zip(_PARAMS, values):
            self._writers[name].stage(slot, value)
        self.temperature_cpu[slot] = params.temperature
        self.top_k_cpu[slot] = top_k
        self.top_p_cpu[slot] = params.top_p
        self.min_p_cpu[slot] = params.min_p
        self.num_logprobs_cpu[slot] = -1 if params.logprobs is None else params.logprobs
        self.num_prompt_logprobs_cpu[slot] = -1 if params.prompt_logprobs is None else params.prompt_logprobs
        self.prompt_len_cpu[slot] = prompt_len
        self.min_tokens.add_request(slot, params.min_tokens, prompt_len,
                                    list(eos_token_ids) + list(params.stop_token_ids))
        self.penalties.add_request(slot, params.repetition_penalty, params.frequency_penalty, params.presence_penalty)
        self.logit_bias.add_request(slot, params.logit_bias)
        self.allowed_tokens.add_request(slot, params.allowed_token_ids)
        self.bad_words.add_request(slot, params.bad_words_token_ids)

    def take_staged(self) -> list[StagedWrite]:
        """Pack the staged parameters (host work); applying them is device work."""
        writes = [w.take() for w in self._writers.values()] + self.min_tokens.take_staged() + \
            self.penalties.take_staged() + self.logit_bias.take_staged() + self.allowed_tokens.take_staged() + \
            self.bad_words.take_staged()
        return [w for w in writes if w is not None]

    def apply_staged_writes(self) -> None:
        apply_writes(self.take_staged())

    def host_flags(self, idx_cpu: np.ndarray, history_len: int = 0) -> SamplingFlags:
        """Host work at launch: what the sampler may skip for the requests in batch order `idx_cpu`.

        `history_len` bounds the tokens before any row's sampled position (for penalties).
        """
        num_logprobs = int(self.num_logprobs_cpu[idx_cpu].max()) if len(idx_cpu) else -1
        return SamplingFlags(**host_flags(self.temperature_cpu[idx_cpu], self.top_k_cpu[idx_cpu],
                                          self.top_p_cpu[idx_cpu], self.min_p_cpu[idx_cpu], self.vocab_size),
                             any_min_tokens=self.min_tokens.any_active(idx_cpu),
                             num_logprobs=num_logprobs if num_logprobs >= 0 else None,
                             any_penalties=self.penalties.any_active(idx_cpu),
                             any_logit_bias=self.logit_bias.any_active(idx_cpu),
                             any_allowed_tokens=self.allowed_tokens.any_active(idx_cpu),
                             any_bad_words=self.bad_words.any_active(idx_cpu), history_len=history_len)

    def metadata(self, flags: SamplingFlags, idx_mapping: torch.Tensor, positions: torch.Tensor,
                 token_ids: torch.Tensor | None = None) -> SamplingMetadata:
        """Device work: the batch's rows gathered through `idx_mapping`, with the flags of its launch.

        `positions` (int64, one per row) is the position of the token being sampled;
        `token_ids` (the runner's per-slot token history) serves penalties and bad words.
        """
        penalties = bad_words = None
        if flags.any_penalties or flags.any_bad_words:
            width = min(max(flags.history_len, 1), token_ids.shape[1])
            history, prompt_len = token_ids[idx_mapping, :width], self.min_tokens.prompt_len[idx_mapping]
            if flags.any_penalties:
                penalties = self.penalties.metadata(idx_mapping, history, prompt_len)
            if flags.any_bad_words:
                bad_words = self.bad_words.metadata(idx_mapping, history, prompt_len)
        return SamplingMetadata(
            temperature=self.temperature[idx_mapping], top_k=self.top_k[idx_mapping], top_p=self.top_p[idx_mapping],
            min_p=self.min_p[idx_mapping], seeds=self.seeds[idx_mapping], positions=positions,
            all_greedy=flags.all_greedy, all_random=flags.all_random, no_top_k=flags.no_top_k,
            no_top_p=flags.no_top_p, no_min_p=flags.no_min_p, max_top_k=flags.max_top_k,
            min_tokens=self.min_tokens.metadata(idx_mapping) if flags.any_min_tokens else None,
            penalties=penalties,
            logit_bias=self.logit_bias.metadata(idx_mapping) if flags.any_logit_bias else None,
            allowed_tokens=self.allowed_tokens.metadata(idx_mapping) if flags.any_allowed_tokens else None,
            bad_words=bad_words,
        )
