"""The executor interface, what a rank's runner is built from, and the single-rank executor."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mrv2.config import EngineConfig, QuantPolicy
from mrv2.distributed.parallel import SINGLE, TensorParallel
from mrv2.engine.scheduler_output import SchedulerOutput
from mrv2.platforms import Platform
from mrv2.runner.async_output import AsyncRunnerOutput
from mrv2.runner.model_runner import ModelRunner


@dataclass(frozen=True)
class RunnerSpec:
    """Everything a rank needs to build its model runner (picklable: it travels to worker processes)."""

    config: EngineConfig
    model_path: Path
    hf_config: Any
    dtype: torch.dtype
    quant_policy: QuantPolicy | None


def load_runner(spec: RunnerSpec, platform: Platform, tp: TensorParallel = SINGLE) -> ModelRunner:
    """Rank `tp.rank`'s runner, reading only its slice of every sharded checkpoint tensor."""
    from mrv2.loader.gguf_quant import iter_weights_keeping_quantized
    from mrv2.loader.safetensors_weights import iter_safetensors_weights

    path = spec.model_path
    weights = (iter_weights_keeping_quantized(path, lazy=True) if spec.quant_policy is not None
               else iter_safetensors_weights(path, lazy=True))
    return ModelRunner(spec.config, platform, spec.hf_config, weights, spec.dtype, spec.quant_policy, path, tp)


class RankFailedError(RuntimeError):
    """A rank of a tensor-parallel engine is gone (or never came up): the engine cannot run another step."""


class Executor:
    """Runs the model runner's calls on every rank. `driver` is rank 0's runner, in this process:
    read its state directly, but run the model only through the executor's methods."""

    driver: ModelRunner

    def call(self, method: str, *args: Any) -> Any:
        """`runner.method(*args)` on every rank (in the same order everywhere); rank 0's result."""
        return getattr(self.driver, method)(*args)

    def execute_model(self, sched: SchedulerOutput, defer_sampling: bool = False) -> None:
        """Launch a step; `sample_tokens()` must follow unless the schedule is empty: at once, or, with
        `defer_sampling`, after the host prepared structured output's bitmasks (and nothing else between)."""
        self.call("execute_model", sched)

    def sample_tokens(self, grammar: dict[str, Any] | None = None) -> AsyncRunnerOutput:
        """The launched step's sampled output (on every rank; `get()` waits for rank 0's)."""
        return self.driver.sample_tokens(grammar)

    def check_health(self) -> None:
        """Raise if a rank is gone."""

    def shutdown(self) -> None:
        """Stop every rank (launched work finishes first)."""
        self.driver.close()


class UniProcExecutor(Executor):
    """One rank, in this process."""

    def __init__(self, spec: RunnerSpec, platform: Platform) -> None:
        self.driver = load_runner(spec, platform)
