"""`AsyncLLM`: the engine loop on a background thread, per-request async generators in front.

Callers (the OpenAI server, or any asyncio code) submit requests and iterate their
outputs; the loop thread owns the `LLMEngine`: it adds and aborts requests between
steps, runs steps while any request is unfinished, and hands each step's outputs to
the waiting generators through their event loops. A generator that is closed or
cancelled before its request finished (a client that went away) aborts the request,
so its blocks return at once. A step that fails (an exception in the forward or the
sampler) fails only the requests of that step, each with the error; the loop serves
the next ones.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from mrv2.engine.llm import engine_config
from mrv2.engine.llm_engine import LLMEngine
from mrv2.engine.outputs import CompletionOutput, RequestOutput
from mrv2.engine.request import Request
from mrv2.engine.stats import IterationStats, LoggingStatLogger, RequestTimes, SchedulerStats, StatLogger
from mrv2.sampling_params import SamplingParams

logger = logging.getLogger("mrv2")


class EngineDeadError(RuntimeError):
    """The engine loop stopped (shut down, or an error it could not recover from)."""


@dataclass
class _Stream:
    """Where one request's outputs go: a queue on the caller's event loop."""

    loop: asyncio.AbstractEventLoop
    request: Request
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)

    def put(self, item: RequestOutput | BaseException) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the caller's event loop is closed: nobody is listening any more
            pass

    def put_aborted(self) -> None:
        """The last output of a request aborted from outside its generator."""
        r = self.request
        self.put(RequestOutput(r.req_id, r.prompt, r.prompt_token_ids, [CompletionOutput(0, "", [], "abort")], True))


class AsyncLLM:
    """An engine for concurrent callers: `async for out in llm.generate(prompt, params)`.

    Takes the same arguments as `LLM`. `stat_loggers` receive the scheduler's state and
    each step's token counts and latencies (see `engine/stats.py`); with `log_stats` the
    engine also logs throughput, load and the prefix-cache hit rate every 10 s.
    """

    def __init__(self, model: str | None = None, *, stat_loggers: list[StatLogger] | None = None,
                 log_stats: bool = True, **kwargs: Any) -> None:
        self.engine = LLMEngine(engine_config(model, **kwargs))
        self.stat_loggers = list(stat_loggers or []) + ([LoggingStatLogger()] if log_stats else [])
        self._commands: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._streams: dict[str, _Stream] = {}
        self._times: dict[str, RequestTimes] = {}
        self._stopped = threading.Event()
        self._dead: BaseException | None = None
        self._num_aborted = 0  # requests aborted since stats were last logged
        self._thread = threading.Thread(target=self._run, name="mrv2-engine", daemon=True)
        self._thread.start()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and self._dead is None

    # -- the caller's side --

    async def generate(self, prompt: Any, sampling_params: SamplingParams,
                       request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        """Outputs of one request as the engine produces them (per `sampling_params.output_kind`),
        the last one finished. Bad input raises ValueError before anything is scheduled."""
        if not self.is_running:
            raise EngineDeadError("the engine is not running") from self._dead
        if isinstance(sampling_params, SamplingParams) and sampling_params.structured_outputs is not None:
            # Compiling a grammar may take a while: off the event loop (the engine loop runs on regardless).
            request = await asyncio.to_thread(self.engine.make_request, prompt, sampling_params, request_id)
        else:
            request = self.engine.make_request(prompt, sampling_params, request_id)
        stream = _Stream(asyncio.get_running_loop(), request)
        self._submit("add", (request, stream))
        finished = False
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    finished = True  # the engine already dropped it
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:  # closed or cancelled early: the client went away
                self._submit("abort", [request.req_id])

    async def abort(self, request_id: str | list[str]) -> None:
        """Abort requests (unknown or finished ids are ignored); their streams end with finish_reason "abort"."""
        self._submit("abort", [request_id] if isinstance(request_id, str) else list(request_id))

    def abort_all(self) -> None:
        """Abort every request in flight (thread-safe; for a server that is shutting down)."""
        self._submit("abort_all", None)

    def shutdown(self, timeout: float = 30.0) -> None:
        """Abort what is in flight, stop the loop and the runner; waits up to `timeout` seconds."""
        if not self._stopped.is_set():
            self._stopped.set()
            self._wakeup.set()
            self._thread.join(timeout)

    def _submit(self, command: str, payload: Any) -> None:
        self._commands.put((command, payload))
        self._wakeup.set()

    # -- the loop thread --

    def _run(self) -> None:
        engine = self.engine
        try:
            while not self._stopped.is_set():
                self._apply_commands()
                if not engine.has_unfinished_requests():
                    self._log_stats(IterationStats())
                    self._wakeup.wait()
                    self._wakeup.clear()
                    continue
                stats = IterationStats()
                try:
                    outputs = engine.step()
                except Exception as e:  # the step's requests failed; the engine serves the rest
                    logger.exception("engine step failed")
                    self._fail_dropped(e)
                    continue
                now = time.monotonic()
                for out in outputs:
                    if (times := self._times.get(out.request_id)) is not None:
                        times.record(out, now, stats)
                # Stats first: a client that has its last token finds it counted in the metrics.
                self._log_stats(stats)
                for out in outputs:
                    if (stream := self._streams.get(out.request_id)) is not None:
                        stream.put(out)
                    if out.finished:
                        self._streams.pop(out.request_id, None)
                        self._times.pop(out.request_id, None)
        except BaseException as e:  # noqa: BLE001 - whatever stopped the loop is every caller's error
            logger.exception("engine loop died")
            self._dead = e
        finally:
            self._close()

    def _apply_commands(self) -> None:
        engine = self.engine
        while True:
            try:
                command, payload = self._commands.get_nowait()
            except queue.Empty:
                return
            if command == "add":
                request, stream = payload
                try:
                    engine.add_request(request)
                except ValueError as e:  # a reused request id
                    stream.put(e)
                    continue
                self._streams[request.req_id] = stream
                self._times[request.req_id] = RequestTimes(request.arrival_time, request.num_prompt_tokens,
                                                          request.sampling_params.output_kind)
            elif command in ("abort", "abort_all"):
                req_ids = list(self._streams) if command == "abort_all" else payload
                engine.abort(req_ids)
                for req_id in req_ids:
                    if (stream := self._streams.pop(req_id, None)) is not None:
                        stream.put_aborted()  # a generator that asked for it is gone already
                        self._num_aborted += 1
                    self._times.pop(req_id, None)

    def _fail_dropped(self, error: Exception) -> None:
        """Requests the engine no longer tracks after a failed step get the error."""
        for req_id in [r for r in self._streams if not self.engine.output_processor.has_request(r)]:
            self._streams.pop(req_id).put(RuntimeError(f"request {req_id} failed in an engine step: {error!r}"))
            self._times.pop(req_id, None)

    def _log_stats(self, iteration: IterationStats) -> None:
        if not self.stat_loggers:
            return
        iteration.finish_reasons += ["abort"] * self._num_aborted
        self._num_aborted = 0
        scheduler = self.engine.scheduler
        kv = scheduler.kv_cache_manager
        sched = SchedulerStats(len(scheduler.running), len(scheduler.waiting), scheduler.block_pool.usage,
                               scheduler.num_preemptions, kv.num_queried_tokens, kv.num_hit_tokens,
                               scheduler.spec_stats.snapshot() if self.engine.config.speculative is not None else None)
        for stat_logger in self.stat_loggers:
            stat_logger.record(sched, iteration)

    def _close(self) -> None:
        error = EngineDeadError("the engine shut down")
        if self._dead is not None:
            error.__cause__ = self._dead
        self._apply_commands()
        live = list(self._streams)
        self.engine.abort(live)
        for req_id in live:
            self._streams.pop(req_id).put(error)
        self._times.clear()
        self._log_stats(IterationStats())
        self.engine.shutdown()
