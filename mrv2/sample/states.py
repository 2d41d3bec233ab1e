"""Per-request sampling parameters in slots, and the one place the sampler's host flags come from.

A request's parameters live in its slot (the runner's slot, see `runner/states.py`)
from admission until it finishes; `add_request` stages them and
`apply_staged_writes` lands them on the device with one copy per tensor. The device
tensors feed the sampler through the step's `idx_mapping`; the numpy mirrors hold
what the host already knows, so every host flag (greedy, random, which filters run,
the top-k bound, whether any row has min_tokens) is derived from them without reading
the device.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from mrv2.runner.staged_writes import StagedScalarWriter
from mrv2.sample.metadata import SamplingMetadata, host_flags
from mrv2.sample.min_tokens import MinTokensState
from mrv2.sampling_params import SamplingParams

_PARAMS = ("temperature", "top_k", "top_p", "min_p", "seeds")


class SamplingStates:
    """Temperature, top-k, top-p, min-p, seed and min_tokens state of every slot, device and host mirror."""

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

        self._writers = {name: StagedScalarWriter(getattr(self, name), pin_memory) for name in _PARAMS}
        self.min_tokens = MinTokensState(max_num_reqs, device, pin_memory)

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
        self.min_tokens.add_request(slot, params.min_tokens, prompt_len,
                                    list(eos_token_ids) + list(params.stop_token_ids))

    def apply_staged_writes(self) -> None:
        for writer in self._writers.values():
            writer.apply()
        self.min_tokens.apply_staged_writes()

    def metadata(self, idx_cpu: np.ndarray, idx_mapping: torch.Tensor, positions: torch.Tensor) -> SamplingMetadata:
        """The batch's sampling inputs: rows gathered through `idx_mapping` (host copy `idx_cpu`).

        `positions` (int64, one per row) is the position of the token being sampled.
        """
        return SamplingMetadata(
            temperature=self.temperature[idx_mapping], top_k=self.top_k[idx_mapping], top_p=self.top_p[idx_mapping],
            min_p=self.min_p[idx_mapping], seeds=self.seeds[idx_mapping], positions=positions,
            **host_flags(self.temperature_cpu[idx_cpu], self.top_k_cpu[idx_cpu], self.top_p_cpu[idx_cpu],
                         self.min_p_cpu[idx_cpu], self.vocab_size),
            min_tokens=self.min_tokens.metadata(idx_cpu, idx_mapping),
        )
