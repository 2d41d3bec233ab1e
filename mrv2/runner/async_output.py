"""One step's sampled ids on their way to the host (MRV2 principle 4).

The runner launches sampling and returns at once; the engine calls `get()` when it
needs the ids, normally after it has launched the next step. `get()` is the one
place the host waits for the device, and the time it waits is accounted as "wait".
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from mrv2.engine.scheduler_output import ModelRunnerOutput, TokenLogprobs
from mrv2.platforms.device_queue import HostCopy, Pending
from mrv2.runner.timing import StepTiming
from mrv2.sample.logprobs import LogprobsTensors
from mrv2.sampling_params import MAX_LOGPROBS


class LogprobsHostBuffers:
    """Host buffers one step's logprobs are copied into (a runner keeps one per step in flight)."""

    def __init__(self, max_rows: int, pin_memory: bool) -> None:
        width = 1 + MAX_LOGPROBS
        self.token_ids = torch.zeros(max_rows * width, dtype=torch.int64, pin_memory=pin_memory)
        self.logprobs = torch.zeros(max_rows * width, dtype=torch.float32, pin_memory=pin_memory)
        self.ranks = torch.zeros(max_rows, dtype=torch.int64, pin_memory=pin_memory)

    def start(self, tensors: LogprobsTensors, event) -> "LogprobsCopy":
        """Device work: copy `tensors` into these buffers (the event is recorded behind the last copy)."""
        return LogprobsCopy(HostCopy.start(tensors.token_ids, self.token_ids, event),
                            HostCopy.start(tensors.logprobs, self.logprobs, event),
                            HostCopy.start(tensors.ranks, self.ranks, event))


class LogprobsCopy:
    """One step's logprobs on their way to the host, per logits row."""

    def __init__(self, token_ids: HostCopy, logprobs: HostCopy, ranks: HostCopy) -> None:
        self._copies = (token_ids, logprobs, ranks)

    def wait(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return tuple(c.wait().numpy() for c in self._copies)  # type: ignore[return-value]


class AsyncRunnerOutput:
    """The sampled ids of one launched step, in `req_ids` order.

    Without drafts the copy holds one id per request. With drafts it holds rows of
    [emitted count, tokens...], and `on_drafts(emitted counts)` runs on the host once
    they are known (the runner corrects its host mirror there). `num_logprobs` (per
    request, -1 for none) says how many alternatives each request gets when the step
    computed logprobs; `rows_per_request` is its logits rows (1 + drafts). `prompt_requests`
    says whose prompt tokens the step scored (see `runner/prompt_logprobs.py`).
    """

    def __init__(self, req_ids: list[str], copy: Pending[tuple[HostCopy, LogprobsCopy | None]] | None,
                 timing: StepTiming | None, on_drafts: Callable[[np.ndarray], None] | None = None,
                 num_logprobs: np.ndarray | None = None, rows_per_request: np.ndarray | None = None,
                 prompt_requests: list[tuple[str, int, int]] | None = None) -> None:
        self.req_ids = req_ids
        self._copy = copy
        self._timing = timing
        self._on_drafts = on_drafts
        self._num_logprobs = num_logprobs
        self._rows_per_request = rows_per_request
        self._prompt_requests = prompt_requests  # (req id, first scored position, count), in copy order

    @classmethod
    def empty(cls) -> "AsyncRunnerOutput":
        return cls([], None, None)

    def get(self) -> ModelRunnerOutput:
        """Wait for the ids (only now does the host block on the device)."""
        if self._copy is None:
            return ModelRunnerOutput([], [])
        with self._timing.phase("wait"):
            ids_copy, logprobs_copy, prompt_copy = self._copy.result()
            host = ids_copy.wait().numpy()
            logprobs_host = logprobs_copy.wait() if logprobs_copy is not None else None
            prompt_host = prompt_copy.wait() if prompt_copy is not None else None
        if self._on_drafts is None:
            sampled = [[t] for t in host.tolist()]
        else:
            counts = host[:, 0]
            self._on_drafts(counts)
            sampled = [row[1:1 + m].tolist() for row, m in zip(host, counts)]
        logprobs = None if logprobs_host is None else self._logprobs(logprobs_host, sampled)
        prompt = None
        if prompt_host is not None:
            ids, lps, ranks = prompt_host
            prompt, row = {}, 0
            for req_id, first, count in self._prompt_requests:
                prompt[req_id] = (first, [(ids[r].tolist(), lps[r].tolist(), int(ranks[r]))
                                          for r in range(row, row + count)])
                row += count
        return ModelRunnerOutput(self.req_ids, sampled, logprobs, prompt)

    def _logprobs(self, host: tuple[np.ndarray, np.ndarray, np.ndarray],
                  sampled: list[list[int]]) -> list[list[TokenLogprobs] | None]:
        """Per request that asked: one entry per emitted token (its logits rows come first, in order)."""
        ids, lps, ranks = host  # [rows, 1 + k], [rows, 1 + k], [rows]
        starts = np.cumsum(self._rows_per_request) - self._rows_per_request
        out: list[list[TokenLogprobs] | None] = []
        for i, k in enumerate(self._num_logprobs.tolist()):
            if k < 0:
                out.append(None)
                continue
            r0 = int(starts[i])
            out.append([(ids[r, :1 + k].tolist(), lps[r, :1 + k].tolist(), int(ranks[r]))
                        for r in range(r0, r0 + len(sampled[i]))])
        return out
