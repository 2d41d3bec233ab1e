"""The mrv2 engines a benchmark times: in this process, or each in a process of its own.

Two engines in one process share its threads. On the CPU each brings its own OpenMP
team (an async engine computes on a worker thread, a serial one on the caller's), and
one team's spinning threads take the cores the other computes on, so neither is timed
as a user would run it. `IsolatedEngine` runs an engine in a spawned process, driven
through a pipe; only one runs at a time while the other waits on its pipe, asleep.
"""

from __future__ import annotations

import multiprocessing as mp
import pickle
import time
import traceback
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any


@dataclass(frozen=True)
class EngineInfo:
    """What a benchmark reports of an engine and needs to build its workload."""

    model_path: str
    dtype: str
    device: str
    threads: int
    async_scheduling: bool
    vocab_size: int
    special_ids: frozenset[int]


@dataclass(frozen=True)
class TimedRun:
    """One timed `generate`: wall seconds, the host's share of them spent waiting for the device, output ids."""

    seconds: float
    host_wait_share: float
    token_ids: list[list[int]]
    ttft: list[float] | None = None  # per request, seconds from the start to its first token (streamed runs)
    spec: Any = None  # the run's SpecDecodingStats when the engine speculates


class BenchEngine(ABC):
    """An mrv2 engine a benchmark can describe and time."""

    info: EngineInfo

    @abstractmethod
    def timed_generate(self, prompts: list[list[int]], params: Any) -> TimedRun:
        """Generate from token-id prompts with `params` (a `SamplingParams`), timed."""

    @abstractmethod
    def timed_stream(self, prompts: list[list[int]], params: Any, cold_cache: bool = True) -> TimedRun:
        """Like `timed_generate`, with each request's time to first token; from an empty prefix cache
        when `cold_cache`."""

    def close(self) -> None:
        """Release the engine."""


class LocalEngine(BenchEngine):
    """An `LLM` in this process."""

    def __init__(self, llm: Any) -> None:
        self.llm = llm
        self.info = _info(llm)

    def timed_generate(self, prompts: list[list[int]], params: Any) -> TimedRun:
        timing = self.llm.engine.runner.timing
        timing.reset()
        spec_before = self.llm.engine.scheduler.spec_stats.snapshot()
        t0 = time.perf_counter()
        outputs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        seconds = time.perf_counter() - t0
        return TimedRun(seconds, timing.wait_share(seconds), [o.outputs[0].token_ids for o in outputs],
                        spec=self.llm.engine.scheduler.spec_stats.minus(spec_before)
                        if self.llm.engine.config.speculative is not None else None)

    def timed_stream(self, prompts: list[list[int]], params: Any, cold_cache: bool = True) -> TimedRun:
        from mrv2.sampling_params import RequestOutputKind

        engine = self.llm.engine
        if cold_cache and not self.llm.reset_prefix_cache():
            raise RuntimeError("the prefix cache cannot be reset while requests run")
        params = replace(params, output_kind=RequestOutputKind.DELTA)
        requests = [engine.make_request({"prompt_token_ids": p}, params) for p in prompts]
        index = {r.req_id: i for i, r in enumerate(requests)}
        tokens: list[list[int]] = [[] for _ in prompts]
        ttft: list[float | None] = [None] * len(prompts)
        engine.runner.timing.reset()
        t0 = time.perf_counter()
        for r in requests:
            engine.add_request(r)
        while engine.has_unfinished_requests():
            for out in engine.step():
                i = index[out.request_id]
                if out.outputs[0].token_ids and ttft[i] is None:
                    ttft[i] = time.perf_counter() - t0
                tokens[i] += out.outputs[0].token_ids
        seconds = time.perf_counter() - t0
        return TimedRun(seconds, engine.runner.timing.wait_share(seconds), tokens, [t or seconds for t in ttft])

    def close(self) -> None:
        self.llm.engine.shutdown()


class ConstrainedEngine(BenchEngine):
    """Another engine's runs with every request's output constrained by `structured` (structured output)."""

    def __init__(self, inner: LocalEngine, structured: Any) -> None:
        self.inner, self.structured, self.info = inner, structured, inner.info

    def timed_generate(self, prompts: list[list[int]], params: Any) -> TimedRun:
        return self.inner.timed_generate(prompts, replace(params, structured_outputs=self.structured))

    def timed_stream(self, prompts: list[list[int]], params: Any, cold_cache: bool = True) -> TimedRun:
        return self.inner.timed_stream(prompts, replace(params, structured_outputs=self.structured), cold_cache)


class IsolatedEngine(BenchEngine):
    """An `LLM(**kwargs)` in a spawned process of its own; calls go through a pipe and block."""

    def __init__(self, kwargs: dict[str, Any]) -> None:
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_serve, args=(child, kwargs), daemon=True, name="mrv2-bench-engine")
        self._proc.start()
        child.close()
        self.info = self._call(None)

    def timed_generate(self, prompts: list[list[int]], params: Any) -> TimedRun:
        return self._call(("generate", prompts, params))

    def timed_stream(self, prompts: list[list[int]], params: Any, cold_cache: bool = True) -> TimedRun:
        return self._call(("stream", prompts, params, cold_cache))

    def close(self) -> None:
        if self._proc.is_alive():
            try:
                self._conn.send("close")
            except (BrokenPipeError, OSError):
                pass
            self._proc.join(timeout=30)
        if self._proc.is_alive():
            self._proc.kill()
        self._conn.close()

    def _call(self, request: Any) -> Any:
        if request is not None:
            self._conn.send(request)
        try:
            ok, value = self._conn.recv()
        except EOFError:
            raise RuntimeError(f"the benchmark's engine process exited (code {self._proc.exitcode})") from None
        if not ok:
            raise value
        return value


def _info(llm: Any) -> EngineInfo:
    engine = llm.engine
    return EngineInfo(model_path=str(engine.model_path), dtype=str(engine.dtype), device=engine.platform.name,
                      threads=engine.platform.compute_threads(), async_scheduling=engine.config.async_scheduling,
                      vocab_size=engine.runner.model.config.vocab_size,
                      special_ids=frozenset(llm.get_tokenizer().all_special_ids))


def _outcome(fn: Callable[[], Any]) -> tuple[bool, Any]:
    """(True, fn()) or (False, the exception), made picklable: the parent re-raises it, so bad
    arguments read as they would in-process."""
    try:
        return True, fn()
    except Exception as e:
        try:
            pickle.dumps(e)
        except Exception:
            e = RuntimeError("".join(traceback.format_exception_only(e)).strip())
        return False, e


def _serve(conn: Any, kwargs: dict[str, Any]) -> None:
    """The engine process: answer `(ok, value)` to each request until "close" or the pipe closes."""
    from mrv2 import LLM

    ok, engine = _outcome(lambda: LocalEngine(LLM(**kwargs)))
    conn.send((True, engine.info) if ok else (False, engine))
    if not ok:
        return
    while True:
        try:
            request = conn.recv()
        except EOFError:
            break
        if request == "close":
            break
        method = engine.timed_generate if request[0] == "generate" else engine.timed_stream
        conn.send(_outcome(lambda: method(*request[1:])))
    engine.close()
