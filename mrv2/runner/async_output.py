"""One step's sampled ids on their way to the host (MRV2 principle 4).

The runner launches sampling and returns at once; the engine calls `get()` when it
needs the ids, normally after it has launched the next step. `get()` is the one
place the host waits for the device, and the time it waits is accounted as "wait".
"""

from __future__ import annotations

from mrv2.engine.scheduler_output import ModelRunnerOutput
from mrv2.platforms.device_queue import HostCopy, Pending
from mrv2.runner.timing import StepTiming


class AsyncRunnerOutput:
    """The sampled ids of one launched step, in `req_ids` order."""

    def __init__(self, req_ids: list[str], copy: Pending[HostCopy] | None, timing: StepTiming | None) -> None:
        self.req_ids = req_ids
        self._copy = copy
        self._timing = timing

    @classmethod
    def empty(cls) -> "AsyncRunnerOutput":
        return cls([], None, None)

    def get(self) -> ModelRunnerOutput:
        """Wait for the ids (only now does the host block on the device)."""
        if self._copy is None:
            return ModelRunnerOutput([], [])
        with self._timing.phase("wait"):
            ids = self._copy.result().wait().tolist()
        return ModelRunnerOutput(self.req_ids, ids[:len(self.req_ids)])
