"""Executors: how the engine's model runner calls reach every rank.

`Executor` is the interface the engine drives; `UniProcExecutor` is one rank in the
engine's process, `MultiprocExecutor` adds one worker process per further rank, and
`RayExecutor` runs those workers as Ray actors. In each, rank 0's runner lives in the
engine's process (the driver): the engine reads its state directly, and every call that
runs the model is broadcast to the other ranks first, in the same order.
"""

from __future__ import annotations

from mrv2.distributed.executors.base import Executor, RankFailedError, RunnerSpec, UniProcExecutor
from mrv2.platforms import Platform


def build_executor(spec: RunnerSpec, platform: Platform) -> Executor:
    """The executor `spec.config.parallel` asks for, with every rank's runner loaded."""
    backend = spec.config.parallel.executor_backend
    if backend is None:
        return UniProcExecutor(spec, platform)
    if backend == "ray":
        from mrv2.distributed.executors.ray import RayExecutor

        return RayExecutor(spec, platform)
    from mrv2.distributed.executors.multiproc import MultiprocExecutor

    return MultiprocExecutor(spec, platform)


__all__ = ["Executor", "RankFailedError", "RunnerSpec", "UniProcExecutor", "build_executor"]
