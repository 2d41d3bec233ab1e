"""Wall-clock accounting of the runner's step phases (for `mrv2 bench`)."""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field


@dataclass
class StepTiming:
    """Accumulated seconds per phase.

    "prep" is the host's share of launching steps (diffs, batch order, staging);
    "forward" and "sample" are device work (on the CPU's worker thread with async
    scheduling, so they may overlap the host's phases); "wait" is the host blocked on
    the device: for sampled ids, or, where device work runs synchronously on the
    host's own thread (the serial CPU loop), for that work itself.
    """

    seconds: dict[str, float] = field(
        default_factory=lambda: {"prep": 0.0, "forward": 0.0, "sample": 0.0, "wait": 0.0})
    steps: int = 0

    def reset(self) -> None:
        for k in self.seconds:
            self.seconds[k] = 0.0
        self.steps = 0

    @contextmanager
    def phase(self, name: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] += time.perf_counter() - t0

    def wait_share(self, wall_seconds: float) -> float:
        """The share of `wall_seconds` the host spent waiting for the device."""
        return self.seconds["wait"] / wall_seconds if wall_seconds > 0 else 0.0

    def prep_share(self) -> float:
        """Host preparation as a share of prep + device time."""
        total = self.seconds["prep"] + self.seconds["forward"] + self.seconds["sample"]
        return self.seconds["prep"] / total if total else 0.0
