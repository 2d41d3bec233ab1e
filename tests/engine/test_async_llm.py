"""AsyncLLM on the default model: concurrent streams, cancellation, bad input, stats, shutdown."""

from __future__ import annotations

import asyncio
import time

import pytest

from mrv2 import SamplingParams
from mrv2.engine.async_llm import AsyncLLM, EngineDeadError
from mrv2.sampling_params import RequestOutputKind

PROMPTS = ["The capital of France is", "Once upon a time", "def fibonacci(n):", "Water boils at"]


def _wait_idle(llm: AsyncLLM) -> None:
    deadline = time.monotonic() + 30
    while llm.engine.has_unfinished_requests() and time.monotonic() < deadline:
        time.sleep(0.01)


async def _collect(llm, prompt, params):
    deltas, final = [], None
    async for out in llm.generate(prompt, params):
        deltas.append(out.outputs[0])
        final = out
    return deltas, final


def test_concurrent_streams_equal_offline_generation(async_llm, default_llm, recorder):
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
    recorder.records.clear()

    async def main():
        return await asyncio.gather(*[_collect(async_llm, p, params) for p in PROMPTS])

    results = asyncio.run(main())
    offline = default_llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    for (deltas, final), ref in zip(results, offline):
        assert final.finished and final.outputs[0].finish_reason == "length"
        assert len(deltas) > 1  # streamed, not one final output
        assert [t for d in deltas for t in d.token_ids] == ref.outputs[0].token_ids
        assert "".join(d.text for d in deltas) == ref.outputs[0].text
    _wait_idle(async_llm)
    assert async_llm.engine.scheduler.block_pool.is_whole()
    iterations = [it for _, it in recorder.records]
    assert sum(it.num_generation_tokens for it in iterations) == 24 * len(PROMPTS)
    assert sum(it.num_prompt_tokens for it in iterations) == sum(len(r.prompt_token_ids) for r in offline)
    assert len([t for it in iterations for t in it.time_to_first_tokens]) == len(PROMPTS)
    assert sorted(r for it in iterations for r in it.finish_reasons) == ["length"] * len(PROMPTS)
    assert all(0 < t < 60 for it in iterations for t in it.inter_token_latencies)


def test_a_finished_request_is_in_the_stats_before_its_caller_has_it(async_llm, recorder):
    """A client that reads the metrics right after its last token finds that token counted,
    however slowly the stat loggers record."""
    _wait_idle(async_llm)
    recorder.records.clear()
    recorder.delay = 0.05
    try:
        async def main():
            return await _collect(async_llm, PROMPTS[0], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))

        _, final = asyncio.run(main())
        counted = sum(it.num_generation_tokens for _, it in list(recorder.records))
    finally:
        recorder.delay = 0.0
    assert final.finished and len(final.outputs[0].token_ids) == 5 and counted == 5


def test_a_closed_stream_aborts_its_request_and_others_finish(async_llm):
    long = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
    short = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)

    async def main():
        async def leave_early():
            n = 0
            async for _ in async_llm.generate(PROMPTS[0], long):
                n += 1
                if n == 3:
                    break  # the generator is closed: the client went away
            return n

        async def cancelled():
            task = asyncio.ensure_future(_collect(async_llm, PROMPTS[1], long))
            await asyncio.sleep(0.3)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

        return await asyncio.gather(leave_early(), cancelled(), _collect(async_llm, PROMPTS[2], short))

    n, _, (_, final) = asyncio.run(main())
    assert n == 3 and len(final.outputs[0].token_ids) == 16
    _wait_idle(async_llm)
    assert not async_llm.engine.has_unfinished_requests()
    assert async_llm.engine.scheduler.block_pool.is_whole()


@pytest.mark.parametrize("prompt,params,field", [
    ("", SamplingParams(), "prompt"),
    ({"prompt_token_ids": [5] * 600}, SamplingParams(), "max_model_len"),
])
def test_bad_input_raises_before_scheduling_and_the_engine_keeps_serving(async_llm, prompt, params, field):
    async def main():
        with pytest.raises(ValueError, match=field):
            await _collect(async_llm, prompt, params)
        return await _collect(async_llm, PROMPTS[0], SamplingParams(temperature=0, max_tokens=4))

    _, final = asyncio.run(main())
    assert len(final.outputs[0].token_ids) == 4
    assert async_llm.engine.scheduler.block_pool.is_whole()


def test_shutdown_fails_streams_in_flight_and_new_requests():
    llm = AsyncLLM(dtype="float32", max_model_len=256, kv_cache_memory=8 << 20)
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True, output_kind=RequestOutputKind.DELTA)

    async def main():
        got = 0
        with pytest.raises(EngineDeadError):
            async for _ in llm.generate(PROMPTS[0], params):
                got += 1
                if got == 2:
                    await asyncio.to_thread(llm.shutdown)
        with pytest.raises(EngineDeadError):
            await _collect(llm, PROMPTS[0], params)
        return got

    assert asyncio.run(main()) >= 2
    assert not llm.is_running and llm.engine.scheduler.block_pool.is_whole()


def test_a_failing_step_fails_its_requests_and_the_engine_serves_the_next(async_llm):
    model = async_llm.engine.runner.model
    forward = model.forward
    failures = []

    def failing_once(*args, **kwargs):
        if not failures:
            failures.append(1)
            raise RuntimeError("injected fault in the forward")
        return forward(*args, **kwargs)

    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, output_kind=RequestOutputKind.DELTA)

    async def main():
        model.forward = failing_once
        try:
            with pytest.raises(RuntimeError, match="injected fault"):
                await _collect(async_llm, PROMPTS[0], params)
        finally:
            del model.forward  # back to the class's method
        return await _collect(async_llm, PROMPTS[1], params)

    _, final = asyncio.run(main())
    assert failures and len([t for t in final.outputs[0].token_ids]) > 0
    _wait_idle(async_llm)
    assert async_llm.engine.scheduler.block_pool.is_whole() and async_llm.is_running


def test_a_stream_whose_event_loop_closed_does_not_stop_the_engine(async_llm):
    params = SamplingParams(temperature=0, max_tokens=300, ignore_eos=True, output_kind=RequestOutputKind.DELTA)

    async def start_and_leave():
        agen = async_llm.generate(PROMPTS[0], params)
        await agen.__anext__()  # running; the loop then closes with the generator never closed

    asyncio.run(start_and_leave())  # asyncio.run finalizes the generator: an abort, then the loop closes
    _wait_idle(async_llm)
    _, final = asyncio.run(_collect(async_llm, PROMPTS[1], SamplingParams(temperature=0, max_tokens=3)))
    assert async_llm.is_running and len(final.outputs[0].token_ids) == 3
    assert async_llm.engine.scheduler.block_pool.is_whole()


def test_the_logging_stat_logger_reports_the_prefix_cache_hit_rate(caplog):
    import logging

    from mrv2.engine.stats import IterationStats, LoggingStatLogger, SchedulerStats

    stat_logger = LoggingStatLogger(interval=0.0)
    with caplog.at_level(logging.INFO, logger="mrv2"):
        stat_logger.record(SchedulerStats(3, 1, 0.25, 0, prefix_cache_queries=200, prefix_cache_hits=150),
                           IterationStats(num_prompt_tokens=200, num_generation_tokens=3))
    assert "prefix cache hit rate 75.0%" in caplog.text and "running 3, waiting 1" in caplog.text
    assert "KV cache usage 25.0%" in caplog.text
    from mrv2.spec_decode.metrics import SpecDecodingStats

    spec = SpecDecodingStats()
    for accepted in (3, 1, 2, 0):
        spec.observe(3, accepted)
    with caplog.at_level(logging.INFO, logger="mrv2"):
        stat_logger.record(SchedulerStats(1, 0, 0.1, 0, spec_decoding=spec.snapshot()),
                           IterationStats(num_generation_tokens=10))
    assert "mean acceptance length 2.50, draft acceptance rate 50.0% (6 of 12 drafts)" in caplog.text
    assert "per position 0.75, 0.50, 0.25" in caplog.text
