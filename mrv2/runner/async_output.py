"""One step's sampled ids on their way to the host (MRV2 principle 4).

The runner launches sampling and returns at once; the engine calls `get()` when it
needs the ids, normally after it has launched the next step. `get()` is the one
place the host waits for the device, and the time it waits is accounted as "wait".
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from mrv2.engine.scheduler_output import ModelRunnerOutput
from mrv2.platforms.device_queue import HostCopy, Pending
from mrv2.runner.timing import StepTiming


class AsyncRunnerOutput:
    """The sampled ids of one launched step, in `req_ids` order.

    Without drafts the copy holds one id per request. With drafts it holds rows of
    [emitted count, tokens...], and `on_drafts(emitted counts)` runs on the host once
    they are known (the runner corrects its host mirror there).
    """

    def __init__(self, req_ids: list[str], copy: Pending[HostCopy] | None, timing: StepTiming | None,
                 on_drafts: Callable[[np.ndarray], None] | None = None) -> None:
        self.req_ids = req_ids
        self._copy = copy
        self._timing = timing
        self._on_drafts = on_drafts

    @classmethod
    def empty(cls) -> "AsyncRunnerOutput":
        return cls([], None, None)

    def get(self) -> ModelRunnerOutput:
        """Wait for the ids (only now does the host block on the device)."""
        if self._copy is None:
            return ModelRunnerOutput([], [])
        with self._timing.phase("wait"):
            host = self._copy.result().wait().numpy()
        if self._on_drafts is None:
            return ModelRunnerOutput(self.req_ids, [[t] for t in host.tolist()])
        counts = host[:, 0]
        self._on_drafts(counts)
        return ModelRunnerOutput(self.req_ids, [row[1:1 + m].tolist() for row, m in zip(host, counts)])
