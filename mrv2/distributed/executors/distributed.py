"""The driver side of a multi-rank executor: rank 0 here, the other ranks started by a subclass
(worker processes or Ray actors) and driven over the control group."""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, TypeVar

import torch.distributed as dist

from mrv2.distributed.executors.base import Executor, RankFailedError, RunnerSpec, load_runner
from mrv2.distributed.executors.worker import CONNECT_TIMEOUT, SAMPLE, SHUTDOWN, STEP, RankGroups, join_groups
from mrv2.distributed.parallel import broadcast_object
from mrv2.engine.scheduler_output import ModelRunnerOutput, SchedulerOutput
from mrv2.platforms import Platform
from mrv2.runner.async_output import AsyncRunnerOutput

T = TypeVar("T")
LOOPBACK = "127.0.0.1"


class DistributedExecutor(Executor):
    """Rank 0's runner in this process; ranks 1.. started by `_start_workers`."""

    def __init__(self, spec: RunnerSpec, platform: Platform) -> None:
        self.world = spec.config.parallel.tensor_parallel_size
        self.platform = platform
        self._closed = False
        self._broken: str | None = None  # why the ranks are out of step (a call failed on this rank)
        self._waited = 0  # step outputs waited for here since the last message (the workers follow)
        self._deferred = False  # the launched step samples after its own message
        self.groups: RankGroups | None = None
        self._store = dist.TCPStore(self._store_host(), 0, self.world, is_master=True, wait_for_workers=False,
                                    timeout=CONNECT_TIMEOUT)
        self._start_workers(spec, self._store_host(), self._store.port)
        try:
            platform.bind_rank(0, self.world)
            platform.configure_threads(host_only=bool(spec.config.async_scheduling))
            self.groups = self._while_workers_live(
                "connecting", lambda: join_groups(platform, self._store, 0, self.world, spec))
            self.driver = load_runner(spec, platform, self.groups.tensor_parallel(0, self.world))
            self._while_workers_live("loading the model", self._wait_ready)
        except BaseException:
            self._stop_workers(timeout=0)
            if self.groups is not None:
                self.groups.close()
            platform.release_rank()
            raise

    # -- what subclasses provide --

    def _store_host(self) -> str:
        """The address the other ranks reach this process's store at."""
        return LOOPBACK

    def _start_workers(self, spec: RunnerSpec, host: str, port: int) -> None:
        raise NotImplementedError

    def _dead_workers(self) -> list[str]:
        """'rank R: why' for every worker that is gone."""
        raise NotImplementedError

    def _stop_workers(self, timeout: float) -> None:
        """Wait up to `timeout` seconds for the workers to exit, then kill what is left."""
        raise NotImplementedError

    # -- the interface --

    def call(self, method: str, *args: Any) -> Any:
        self._broadcast((method, args))
        return self._guarded(lambda: getattr(self.driver, method)(*args))

    def execute_model(self, sched: SchedulerOutput, defer_sampling: bool = False) -> None:
        # One message per step: the workers sample right after executing (the engine samples every
        # step that is not empty, and nothing else runs in between), unless sampling waits for bitmasks.
        self._deferred = defer_sampling
        self._broadcast((STEP, (sched, not defer_sampling)))
        self._guarded(lambda: self.driver.execute_model(sched))

    def sample_tokens(self, grammar: dict[str, Any] | None = None) -> "_RankedOutput":
        if self._deferred:
            self._broadcast((SAMPLE, (grammar,)))
        return _RankedOutput(self._guarded(lambda: self.driver.sample_tokens(grammar)), self)

    def check_health(self) -> None:
        if dead := self._dead_workers():
            raise _gone(dead)
        if self._broken is not None:
            raise RankFailedError(f"a tensor-parallel step failed on rank 0 ({self._broken}) while the other "
                                  f"ranks ran it: the ranks are out of step; restart the engine")

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._broadcast((SHUTDOWN, ()))
        except RankFailedError:
            pass
        try:
            self.driver.close()
        finally:
            # Out-of-step workers may wait in a collective forever: they are stopped at once.
            self._stop_workers(timeout=30 if self._broken is None else 0)
            self.groups.close()
            self.platform.release_rank()

    # -- helpers --

    def _broadcast(self, message: tuple[str, tuple]) -> None:
        self.check_health()
        waited, self._waited = self._waited, 0
        self._guarded(lambda: broadcast_object(self.groups.control, (*message, waited), 0))

    def _guarded(self, fn: Callable[[], T]) -> T:
        """`fn()`; a collective that failed because a worker died is reported as that worker's death, and
        any other failure leaves the engine unusable (the other ranks ran, or wait in, the failed call)."""
        try:
            return fn()
        except RankFailedError:
            raise
        except Exception as exc:
            if isinstance(exc, RuntimeError):
                deadline = time.monotonic() + 1  # the peer's socket may close before its exit is seen
                while time.monotonic() < deadline and not self._dead_workers():
                    time.sleep(0.05)
                if dead := self._dead_workers():
                    raise _gone(dead) from exc
            self._broken = f"{type(exc).__name__}: {str(exc)[:200]}"
            raise

    def _while_workers_live(self, what: str, fn: Callable[[], T]) -> T:
        """`fn()` on a helper thread, failing fast if a worker dies meanwhile (it would block forever)."""
        result: list[Any] = []
        thread = threading.Thread(target=lambda: result.append(_outcome(fn)), daemon=True)
        thread.start()
        while thread.is_alive():
            thread.join(0.1)
            if dead := self._dead_workers():
                raise _gone(dead, f" while {what}")
        ok, value = result[0]
        if not ok:
            raise value
        return value

    def _wait_ready(self) -> None:
        for rank in range(1, self.world):
            self._store.wait([f"ready/{rank}"])
            status = self._store.get(f"ready/{rank}").decode()
            if status != "ok":
                raise RankFailedError(f"tensor-parallel worker rank {rank} failed to load the model: {status}")


def _gone(dead: list[str], tail: str = "; the engine cannot continue") -> RankFailedError:
    """The error for workers that are gone ('rank R ...' each, from `_dead_workers`)."""
    return RankFailedError(f"tensor-parallel worker {'; '.join(dead)}{tail}")


def _outcome(fn: Callable[[], T]) -> tuple[bool, Any]:
    try:
        return True, fn()
    except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread
        return False, exc


class _RankedOutput:
    """Rank 0's step output; waiting for it makes every rank wait for its own, in the same order."""

    def __init__(self, inner: AsyncRunnerOutput, executor: DistributedExecutor) -> None:
        self._inner, self._executor = inner, executor

    def get(self) -> ModelRunnerOutput:
        self._executor._waited += 1  # the workers wait for theirs before the next message
        return self._executor._guarded(self._inner.get)

