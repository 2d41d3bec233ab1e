"""Async scheduling end to end: outputs identical with it on and off, in every scheduling mode.

fp32 explicitly: the comparison is exact. Each workload mixes greedy and seeded random
requests, some of which stop on EOS, so stop checks on arrival are exercised too.
"""

from __future__ import annotations

import pytest
from step_helpers import PROMPTS as DEFAULT_MODEL_PROMPTS

from mrv2 import LLM, SamplingParams

PROMPTS = DEFAULT_MODEL_PROMPTS[:6]
# Tiny checkpoints have a 512-token vocabulary: prompts as ids below it.
TINY_PROMPTS = [{"prompt_token_ids": [(7 * i + 31 * j) % 500 + 3 for j in range(5 + 3 * i)]} for i in range(6)]


def _params(n: int) -> list[SamplingParams]:
    """Greedy and seeded random in turn; the random ones may stop on EOS."""
    return [SamplingParams(temperature=0.0, max_tokens=20 + i, ignore_eos=True) if i % 2 == 0 else
            SamplingParams(temperature=0.9, top_p=0.9, top_k=40, seed=i, max_tokens=24 - i) for i in range(n)]


def _results(llm: LLM, prompts) -> list[tuple[list[int], str]]:
    outs = llm.generate(prompts, _params(len(prompts)))
    assert llm.engine.scheduler.block_pool.is_whole()
    return [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in outs]


def _pair(**kwargs) -> tuple[LLM, LLM]:
    return tuple(LLM(dtype="float32", async_scheduling=a, **kwargs) for a in (True, False))


@pytest.mark.parametrize("kwargs", [
    dict(max_model_len=256, max_num_seqs=8, kv_cache_memory=32 << 20),
    dict(max_model_len=256, max_num_seqs=8, kv_cache_memory=32 << 20, max_num_batched_tokens=8),  # chunked
    # 12 blocks of 16 tokens for six requests of up to ~40 tokens: preemption.
    dict(max_model_len=256, max_num_seqs=6, kv_cache_memory=13 * 30 * 2 * 3 * 64 * 4 * 16 + (1 << 16)),
], ids=["batch", "chunked-prefill", "preemption"])
def test_default_model_same_outputs_async_on_and_off(kwargs):
    on, off = _pair(**kwargs)
    assert on.engine.config.async_scheduling and not off.engine.config.async_scheduling
    assert _results(on, PROMPTS) == _results(off, PROMPTS)
    if "max_num_seqs" in kwargs and kwargs["max_num_seqs"] == 6:
        assert on.engine.scheduler.num_preemptions > 0


def test_abort_mid_run_same_survivors():
    """Aborts while steps are in flight: the survivors' outputs are unchanged, nothing leaks."""
    on, off = _pair(max_model_len=256, max_num_seqs=8, kv_cache_memory=32 << 20)
    survivors = {}
    for llm in (on, off):
        engine = llm.engine
        reqs = [engine.make_request(p, sp) for p, sp in zip(PROMPTS, _params(len(PROMPTS)))]
        for r in reqs:
            engine.add_request(r)
        for _ in range(5):
            engine.step()
        engine.abort([r.req_id for r in reqs[1::2]])
        done = {}
        while engine.has_unfinished_requests():
            done.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
        engine.step()  # the runner frees the last slots
        assert engine.scheduler.block_pool.is_whole()
        assert engine.runner.states.num_free_slots == engine.runner.max_num_reqs
        survivors[llm] = [done[r.req_id] for r in reqs[::2]]
    assert survivors[on] == survivors[off]


@pytest.mark.parametrize("graph", [
    dict(graph_mode="full", graph_capture_sizes=[1, 2, 4, 8]),
    dict(graph_mode="piecewise", graph_capture_sizes=[1, 4, 16]),  # each size compiles its pieces
    dict(graph_mode="full_and_piecewise", graph_capture_sizes=[1, 4, 16]),
], ids=["full", "piecewise", "full_and_piecewise"])
def test_graph_modes_same_outputs_async_on_and_off(tiny_checkpoint, graph):
    path, _ = tiny_checkpoint("llama", False)
    on, off = _pair(model=str(path), kv_cache_memory=1 << 22, max_num_batched_tokens=16, **graph)
    eager = LLM(model=str(path), dtype="float32", kv_cache_memory=1 << 22, max_num_batched_tokens=16,
                enforce_eager=True, async_scheduling=False)
    assert _results(on, TINY_PROMPTS) == _results(off, TINY_PROMPTS) == _results(eager, TINY_PROMPTS)
    assert on.engine.runner.graphs.num_replays > 0


@pytest.mark.parametrize("arch", ["llama", "qwen3", "deepseek_v3"])
def test_tiny_architectures_same_outputs_async_on_and_off(tiny_checkpoint, arch):
    path, _ = tiny_checkpoint(arch, arch == "qwen3")
    on, off = _pair(model=str(path), kv_cache_memory=1 << 22, max_num_batched_tokens=8)
    assert _results(on, TINY_PROMPTS) == _results(off, TINY_PROMPTS)
