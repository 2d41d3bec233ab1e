"""Tensor parallelism end to end: TP=2 (two worker ranks, one core each, real gloo groups and the
shared-memory exchange) against TP=1, in fp32, on tiny checkpoints of each architecture family and
on the default model; worker lifetimes and failures."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from mrv2 import LLM, SamplingParams
from mrv2.distributed.executors import RankFailedError

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
TINY_PROMPTS = [{"prompt_token_ids": [5, 17, 33, 8, 70, 100]}, {"prompt_token_ids": list(range(3, 60))},
                {"prompt_token_ids": [400, 3]}]


def _greedy(llm: LLM, prompts, params=GREEDY) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


def _assert_idle(llm: LLM) -> None:
    engine = llm.engine
    assert engine.scheduler.block_pool.is_whole() and not engine.scheduler.requests


@pytest.mark.parametrize("arch", ["llama", "qwen3", "deepseek_v3"])
def test_tp2_greedy_equals_tp1_on_tiny_checkpoints(tiny_checkpoint, arch):
    # llama: 4 heads / 2 KV heads; qwen3: head_dim != hidden / heads, q/k norms; DeepSeek-V3: MLA
    # heads, the latent cache on every rank, MoE experts' intermediate features split.
    path, _ = tiny_checkpoint(arch, tied=arch == "qwen3")
    kwargs = dict(dtype="float32", max_model_len=256, kv_cache_memory=8 << 20, max_num_batched_tokens=32)
    reference = _greedy(LLM(str(path), **kwargs), TINY_PROMPTS)  # 32-token chunks: chunked prefill too
    llm = LLM(str(path), tensor_parallel_size=2, **kwargs)
    try:
        assert llm.engine.runner.model.tp.size == 2
        assert _greedy(llm, TINY_PROMPTS) == reference
        _assert_idle(llm)
    finally:
        llm.engine.shutdown()


def test_tp2_kv_heads_fewer_than_ranks_are_replicated(tiny_checkpoint):
    path, _ = tiny_checkpoint("llama", tied=False, num_key_value_heads=1)
    kwargs = dict(dtype="float32", max_model_len=256, kv_cache_memory=8 << 20, async_scheduling=False)
    reference = _greedy(LLM(str(path), **kwargs), TINY_PROMPTS)
    llm = LLM(str(path), tensor_parallel_size=2, **kwargs)
    try:
        assert llm.engine.runner.model.layers[0].self_attn.num_kv_heads == 1
        assert _greedy(llm, TINY_PROMPTS) == reference
    finally:
        llm.engine.shutdown()


def test_tp2_default_model_matches_tp1_on_real_prompts(default_llm):
    # 9 query heads and 3 KV heads: rank 0 holds one GQA group, rank 1 two.
    prompts = ["The capital of France is", "Write a haiku about the sea.", "List three prime numbers:",
               "def fibonacci(n):", "Explain why the sky is blue in one sentence."]
    params = SamplingParams(temperature=0, max_tokens=24)
    llm = LLM(dtype="float32", tensor_parallel_size=2, max_model_len=1024, max_num_seqs=16,
              kv_cache_memory=64 << 20)
    try:
        attn = llm.engine.runner.model.layers[0].self_attn
        assert (attn.num_heads, attn.num_kv_heads) == (3, 1)
        out = [o.outputs[0].text for o in llm.generate(prompts, params)]
        assert out == [o.outputs[0].text for o in default_llm.generate(prompts, params)]
        _assert_idle(llm)
    finally:
        llm.engine.shutdown()
    assert all(p.poll() is not None for p in llm.engine.executor._procs)  # the workers exited


def test_a_worker_that_dies_fails_the_engine_with_its_rank(tiny_checkpoint):
    path, _ = tiny_checkpoint("llama", tied=False)
    llm = LLM(str(path), dtype="float32", tensor_parallel_size=2, max_model_len=256, kv_cache_memory=8 << 20)
    worker = llm.engine.executor._procs[0]
    try:
        assert _greedy(llm, TINY_PROMPTS[:1])
        worker.kill()
        worker.wait()
        with pytest.raises(RankFailedError, match="rank 1 exited with code"):
            _greedy(llm, TINY_PROMPTS[:1])
    finally:
        llm.engine.shutdown()


def test_workers_exit_when_the_engine_process_is_killed(tiny_checkpoint, tmp_path):
    path, _ = tiny_checkpoint("llama", tied=False)
    script = textwrap.dedent(f"""
        import sys, time
        from mrv2 import LLM
        llm = LLM({str(path)!r}, dtype="float32", tensor_parallel_size=2, max_model_len=256,
                  kv_cache_memory=8 << 20)
        print(*[p.pid for p in llm.engine.executor._procs], flush=True)
        time.sleep(600)
    """)
    engine = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(p) for p in engine.stdout.readline().split()]
        assert pids and all(_alive(p) for p in pids)
    finally:
        engine.send_signal(signal.SIGKILL)
        engine.wait()
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(p) for p in pids), "a worker outlived its engine"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (exited, not yet reaped by init) counts as gone.
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(")")[-1].split()[0] != "Z"


def test_bad_parallel_settings_are_refused():
    with pytest.raises(ValueError, match="tensor_parallel_size must be a positive integer"):
        LLM(tensor_parallel_size=0)
    with pytest.raises(ValueError, match="distributed_executor_backend must be one of"):
        LLM(tensor_parallel_size=2, distributed_executor_backend="threads")
    with pytest.raises(ValueError, match="does not run with tensor_parallel_size > 1"):
        LLM(tensor_parallel_size=2, speculative_config={"method": "draft_model", "model": "x"})


def test_a_step_that_fails_on_rank_0_stops_the_engine_cleanly(tiny_checkpoint):
    # The other rank ran (or waits inside) the failed step: the engine refuses to go on out of step,
    # and its shutdown does not wait on the stuck worker.
    path, _ = tiny_checkpoint("llama", tied=False)
    llm = LLM(str(path), dtype="float32", tensor_parallel_size=2, max_model_len=256, kv_cache_memory=8 << 20)
    model = llm.engine.runner.model

    def failing(*args, **kwargs):
        raise RuntimeError("injected fault on rank 0")

    model.forward = failing
    try:
        with pytest.raises(RuntimeError, match="injected fault on rank 0"):
            _greedy(llm, TINY_PROMPTS[:1])
        del model.forward
        with pytest.raises(RankFailedError, match="out of step"):
            _greedy(llm, TINY_PROMPTS[:1])
    finally:
        start = time.monotonic()
        llm.engine.shutdown()
    assert time.monotonic() - start < 10
    assert all(p.poll() is not None for p in llm.engine.executor._procs)
