"""The Ray executor on a local Ray cluster the test starts (two CPUs): TP=2 with the worker rank as
a Ray actor in a placement group gives TP=1's greedy output; a killed actor fails the engine."""

from __future__ import annotations

import pytest

from mrv2 import LLM, SamplingParams
from mrv2.distributed.executors import RankFailedError

PROMPTS = [{"prompt_token_ids": [5, 17, 33, 8, 70, 100]}, {"prompt_token_ids": list(range(3, 60))}]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def ray_cluster():
    import ray
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


def test_ray_tp2_equals_tp1_and_releases_its_placement(ray_cluster, tiny_checkpoint):
    path, _ = tiny_checkpoint("qwen3", tied=True)
    kwargs = dict(dtype="float32", max_model_len=256, kv_cache_memory=8 << 20)
    reference = [o.outputs[0].token_ids for o in LLM(str(path), **kwargs).generate(PROMPTS, GREEDY)]
    llm = LLM(str(path), tensor_parallel_size=2, distributed_executor_backend="ray", **kwargs)
    executor = llm.engine.executor
    try:
        assert type(executor).__name__ == "RayExecutor" and len(executor._actors) == 1
        assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)] == reference
        assert llm.engine.scheduler.block_pool.is_whole()
    finally:
        llm.engine.shutdown()
    from ray.util.placement_group import placement_group_table

    assert placement_group_table(executor._pg)["state"] == "REMOVED"


def test_a_killed_ray_actor_fails_the_engine_with_its_rank(ray_cluster, tiny_checkpoint):
    path, _ = tiny_checkpoint("llama", tied=False)
    llm = LLM(str(path), dtype="float32", tensor_parallel_size=2, distributed_executor_backend="ray",
              max_model_len=256, kv_cache_memory=8 << 20)
    try:
        llm.generate(PROMPTS[:1], GREEDY)
        ray_cluster.kill(llm.engine.executor._actors[0])
        with pytest.raises(RankFailedError, match=r"rank 1 \(Ray actor\) failed"):
            llm.generate(PROMPTS[:1], GREEDY)
    finally:
        llm.engine.shutdown()
