"""No host reads inside the step: the host never waits on the device between a step's
launch and its one designated output copy (`AsyncRunnerOutput.get`).

`ForbidHostReads` is a torch function mode that raises on every way a tensor's value
reaches Python (`item`, `tolist`, `cpu`, `numpy`, `__bool__`, `__index__`, `__int__`,
`__float__`) unless the call comes from the designated copy. The engine loop runs
under it on the host thread, and every item of device work under it on whichever
thread runs it (the CPU's worker thread with async scheduling), so a new sync
anywhere in the step fails here, on every platform and in every graph mode.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import TypeVar

import pytest
import torch
from torch.overrides import TorchFunctionMode

from mrv2 import LLM, SamplingParams
from mrv2.platforms.device_queue import DeviceQueue, Pending
from mrv2.runner.async_output import AsyncRunnerOutput

T = TypeVar("T")
_HOST_READS = {"item", "tolist", "cpu", "numpy", "__bool__", "__index__", "__int__", "__float__"}
_DESIGNATED = AsyncRunnerOutput.get.__code__


class HostReadError(AssertionError):
    pass


def _in_designated_copy() -> bool:
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code is _DESIGNATED:
            return True
        frame = frame.f_back
    return False


class ForbidHostReads(TorchFunctionMode):
    """Raises HostReadError when a tensor's value is read on the host outside the designated copy."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in _HOST_READS and not _in_designated_copy():
            raise HostReadError(f"host read of a tensor inside the step: Tensor.{name}")
        return func(*args, **(kwargs or {}))


class GuardedQueue(DeviceQueue):
    """Runs every item of device work of `inner` under ForbidHostReads, on the thread that runs it."""

    def __init__(self, inner: DeviceQueue) -> None:
        self.inner = inner
        self.synchronous = inner.synchronous

    def launch(self, work: Callable[[], T]) -> Pending[T]:
        def guarded() -> T:
            with ForbidHostReads():
                return work()

        return self.inner.launch(guarded)

    def close(self) -> None:
        self.inner.close()


def test_the_guard_catches_every_host_read():
    x = torch.arange(4.0)
    reads = [lambda: x[1].item(), x.tolist, x.cpu, x.numpy, lambda: bool(x[1]), lambda: [0, 1][x.long()[1]],
             lambda: int(x[1]), lambda: float(x[1]), lambda: x.sum().item()]
    for read in reads:
        with ForbidHostReads(), pytest.raises(HostReadError):
            read()
    with ForbidHostReads():
        (x * 2).add_(1)  # device work is fine


def _run_guarded(llm: LLM, prompts, params) -> list[list[int]]:
    engine = llm.engine
    engine.runner.queue = GuardedQueue(engine.runner.queue)
    requests = [engine.make_request(p, sp) for p, sp in zip(prompts, params)]
    for r in requests:
        engine.add_request(r)
    finished = {}
    with ForbidHostReads():
        while engine.has_unfinished_requests():
            finished.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
        engine.step()
    assert engine.scheduler.block_pool.is_whole()
    return [finished[r.req_id] for r in requests]


PROMPTS = [{"prompt_token_ids": [(11 * i + 5 * j) % 500 + 3 for j in range(4 + 5 * i)]} for i in range(5)]
# Greedy, seeded random with every filter, plain random, and penalties, logit bias, allowed ids and
# logprobs: every sampler branch.
PARAMS = [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
          SamplingParams(temperature=0.8, top_k=20, top_p=0.9, min_p=0.05, seed=3, max_tokens=12, ignore_eos=True),
          SamplingParams(temperature=1.0, seed=4, max_tokens=9, ignore_eos=True, allowed_token_ids=list(range(3, 300))),
          SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True, repetition_penalty=1.2, frequency_penalty=0.5,
                         presence_penalty=0.3, logit_bias={5: 2.0}, logprobs=2),
          SamplingParams(temperature=0.7, top_p=0.8, seed=5, max_tokens=12, ignore_eos=True,
                         bad_words=["a", "b c", "the"])]  # "the" is outside the tiny vocabulary


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "serial"])
@pytest.mark.parametrize("graph", [
    dict(enforce_eager=True),
    dict(graph_mode="full", graph_capture_sizes=[1, 2, 4, 8]),
    dict(graph_mode="piecewise", graph_capture_sizes=[1, 2, 4, 8, 16], graph_compile=False),
    dict(graph_mode="full_and_piecewise", graph_capture_sizes=[1, 2, 4, 8, 16], graph_compile=False),
], ids=["eager", "full", "piecewise", "full_and_piecewise"])
@pytest.mark.parametrize("arch", ["llama", "deepseek_v3"])
def test_step_has_no_host_reads(tiny_checkpoint, arch, graph, async_scheduling):
    path, _ = tiny_checkpoint(arch, False)
    kwargs = dict(model=str(path), dtype="float32", kv_cache_memory=1 << 22, max_num_batched_tokens=16,
                  async_scheduling=async_scheduling)
    guarded = _run_guarded(LLM(**kwargs, **graph), PROMPTS, PARAMS)
    plain = LLM(**kwargs, enforce_eager=True).generate(PROMPTS, PARAMS)
    assert guarded == [o.outputs[0].token_ids for o in plain]


def test_a_host_read_in_the_step_fails(tiny_checkpoint):
    """The guard sees device work on the CPU's worker thread: a sync there fails the step."""
    path, _ = tiny_checkpoint("llama", False)
    llm = LLM(model=str(path), dtype="float32", kv_cache_memory=1 << 22, async_scheduling=True)
    model = llm.engine.runner.model
    forward = model.forward
    model.forward = lambda *a, **k: forward(*a, **k) if a[0].sum().item() >= 0 else None  # a sync
    with pytest.raises(HostReadError, match="Tensor.item"):
        _run_guarded(llm, PROMPTS[:1], PARAMS[:1])


@pytest.mark.parametrize("arch", ["llama", "deepseek_v3"])
def test_draft_steps_have_no_host_reads(tiny_checkpoint, arch):
    """Steps verifying drafts (q = 1 + k) under the guard: logits rows, draft ids and the
    verification are device work; the accepted counts come back with the designated copy."""
    path, _ = tiny_checkpoint(arch, False)
    kwargs = dict(model=str(path), dtype="float32", kv_cache_memory=1 << 22, async_scheduling=False)
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    ref = LLM(**kwargs).generate(PROMPTS[:2], greedy)
    llm = LLM(**kwargs)
    engine = llm.engine
    engine.runner.queue = GuardedQueue(engine.runner.queue)
    requests = [engine.make_request(p, greedy) for p in PROMPTS[:2]]
    for r in requests:
        engine.add_request(r)
    drafted = 0
    with ForbidHostReads():
        while engine.has_unfinished_requests():
            for r, out in zip(requests, ref):
                n = r.num_output_tokens
                if n and not r.is_finished:  # right, then one wrong draft
                    r.spec_token_ids = out.outputs[0].token_ids[n:n + 2] + [7]
            drafted += bool(engine.scheduler.running and any(r.spec_token_ids for r in requests))
            engine.step()
    assert drafted and [r.output_token_ids for r in requests] == [o.outputs[0].token_ids for o in ref]
