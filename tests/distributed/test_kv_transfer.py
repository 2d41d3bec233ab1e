"""Prefill/decode disaggregation through the ShmConnector: a producer engine prefills (one token)
and hands the prompt's KV to a consumer engine, which decodes; outputs equal a single instance's
(fp32), every block comes back on both sides, the bytes moved are the KV spec's, and transfers no
decode instance claims expire. Then the same through two servers and `mrv2 proxy` over HTTP."""

from __future__ import annotations

import asyncio
import os
import re
import time
from dataclasses import replace

import openai
import pytest

from mrv2 import LLM, SamplingParams
from mrv2.bench.serve import PDDeployment, run_load, summarize
from mrv2.distributed.kv_transfer.shm_connector import segment_name

PRODUCER = {"kv_connector": "ShmConnector", "kv_role": "kv_producer"}
CONSUMER = {"kv_connector": "ShmConnector", "kv_role": "kv_consumer"}
PROMPTS = ["The capital of France is", "List three prime numbers and explain why each is prime:",
           "def fibonacci(n):\n    " + "# compute the n-th Fibonacci number iteratively\n    " * 6]
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


def _prefill(producer: LLM, prompts) -> list[dict]:
    outs = producer.generate(prompts, SamplingParams(temperature=0, max_tokens=1,
                                                      kv_transfer_params={"do_remote_decode": True}))
    return [o.kv_transfer_params for o in outs]


def _decode(consumer: LLM, prompts, params: list[dict]) -> list[list[int]]:
    return [consumer.generate(p, replace(GREEDY, kv_transfer_params=kv))[0].outputs[0].token_ids
            for p, kv in zip(prompts, params)]


def _segments() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith("mrv2kv-")}


def _bytes_per_token(llm: LLM) -> int:
    return sum(s.bytes_per_token for s in llm.engine.runner.model.kv_cache_specs())


@pytest.fixture(scope="module")
def pd_pair():
    # Small prefill chunks on the producer: a prompt is saved over several steps.
    kw = dict(dtype="float32", max_model_len=512, kv_cache_memory=192 << 20)
    producer = LLM(**kw, max_num_batched_tokens=32, kv_transfer_config=PRODUCER)
    consumer = LLM(**kw, kv_transfer_config=CONSUMER)
    yield producer, consumer
    producer.engine.shutdown()
    consumer.engine.shutdown()


def test_prefill_then_decode_equals_one_instance(default_llm, pd_pair):
    producer, consumer = pd_pair
    before = _segments()
    params = _prefill(producer, PROMPTS)
    lens = [len(producer.engine.tokenize(p)[1]) for p in PROMPTS]
    assert all(p["do_remote_prefill"] and p["num_tokens"] == n for p, n in zip(params, lens))
    assert producer.engine.scheduler.block_pool.is_whole()  # the KV travelled: the prefill side is free
    per_token = _bytes_per_token(producer)
    saved = producer.engine.runner.kv_connector.stats.bytes_saved
    assert [saved[p["transfer_id"]] for p in params] == [n * per_token for n in lens]

    out = _decode(consumer, PROMPTS, params)
    assert out == [o.outputs[0].token_ids for o in default_llm.generate(PROMPTS, GREEDY)]
    loaded = consumer.engine.runner.kv_connector.stats.bytes_loaded
    assert [loaded[p["transfer_id"]] for p in params] == [(n - 1) * per_token for n in lens]  # the last is recomputed
    assert consumer.engine.scheduler.block_pool.is_whole()
    assert _segments() == before  # the consumer removed each transfer it loaded


def test_a_decode_side_that_never_comes_frees_everything(pd_pair):
    producer, _ = pd_pair
    connector = producer.engine.kv_connector
    connector.timeout_s = 0.3
    try:
        [params] = _prefill(producer, PROMPTS[:1])
    finally:
        connector.timeout_s = 120.0
    assert producer.engine.scheduler.block_pool.is_whole()
    assert segment_name(params["transfer_id"], 0) in _segments()
    deadline = time.monotonic() + 10
    while segment_name(params["transfer_id"], 0) in _segments() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert segment_name(params["transfer_id"], 0) not in _segments()  # expired and removed
    assert params["transfer_id"] not in connector.pending_transfers()


def test_a_consumer_without_its_transfer_computes_the_prompt(default_llm, pd_pair):
    producer, consumer = pd_pair
    [params] = _prefill(producer, PROMPTS[1:2])
    stale = dict(params, num_tokens=params["num_tokens"] - 1)  # another prompt's (hash and length differ)
    gone = dict(params, transfer_id="mrv2kv-never-made")
    expected = default_llm.generate(PROMPTS[1], GREEDY)[0].outputs[0].token_ids
    for kv in (stale, gone):
        assert _decode(consumer, PROMPTS[1:2], [kv]) == [expected]
    assert consumer.engine.runner.kv_connector.stats.bytes_loaded.get("mrv2kv-never-made") is None
    assert _decode(consumer, PROMPTS[1:2], [params]) == [expected]  # the real one still loads


def test_mla_latent_cache_travels(tiny_checkpoint):
    path, _ = tiny_checkpoint("deepseek_v3", tied=False)
    prompts = [{"prompt_token_ids": list(range(3, 50))}, {"prompt_token_ids": [7, 9, 11, 400]}]
    kw = dict(dtype="float32", max_model_len=256, kv_cache_memory=32 << 20)
    single = LLM(str(path), **kw)
    producer = LLM(str(path), **kw, kv_transfer_config=PRODUCER)
    consumer = LLM(str(path), **kw, kv_transfer_config=CONSUMER)
    try:
        params = _prefill(producer, prompts)
        assert _decode(consumer, prompts, params) == [o.outputs[0].token_ids for o in single.generate(prompts, GREEDY)]
        spec = producer.engine.runner.model.kv_cache_specs()[0]
        assert [p.name for p in spec.parts] == ["latent", "rope"]
        saved = producer.engine.runner.kv_connector.stats.bytes_saved
        assert [saved[p["transfer_id"]] for p in params] == [47 * _bytes_per_token(producer),
                                                            4 * _bytes_per_token(producer)]
        assert producer.engine.scheduler.block_pool.is_whole() and consumer.engine.scheduler.block_pool.is_whole()
    finally:
        producer.engine.shutdown()
        consumer.engine.shutdown()


def test_proxy_between_two_servers_streams_what_one_server_answers(default_llm):
    # The deployment `mrv2 bench serve --pd` measures: two `mrv2 serve` processes and `mrv2 proxy`.
    pd = PDDeployment(["--dtype", "float32", "--max-model-len", "512", "--kv-cache-memory", str(192 << 20)])
    try:
        client = openai.OpenAI(base_url=pd.url + "/v1", api_key="none")
        model = client.models.list().data[0].id  # the decode instance's, through the proxy
        expected = default_llm.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=20))[0].outputs[0].text
        answer = client.completions.create(model=model, prompt=PROMPTS[1], max_tokens=20, temperature=0)
        assert answer.choices[0].text == expected
        streamed = "".join(c.choices[0].text for c in client.completions.create(
            model=model, prompt=PROMPTS[1], max_tokens=20, temperature=0, stream=True))
        assert streamed == expected
        chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi!"}],
                                              max_tokens=8, temperature=0)
        assert chat.choices[0].message.content
        with pytest.raises(openai.BadRequestError):  # the prefill instance's 400 comes back as it is
            client.completions.create(model=model, prompt="", max_tokens=5)
        # The bench's load through it: concurrent streamed requests, none failing.
        results, wall = asyncio.run(run_load(pd.url, "none", model, [[100 + i] * 8 for i in range(4)], 4, 4, None, 0))
        assert summarize(results, wall)["failed"] == 0
    finally:
        pd.stop()


@pytest.mark.parametrize("config, problem", [
    ({"kv_connector": "NoSuchConnector"}, "unknown kv_connector 'NoSuchConnector' (available: ShmConnector)"),
    ({"kv_connector": "ShmConnector", "kv_role": "kv_sender"}, "kv_role must be one of"),
    ({"kv_role": "kv_producer"}, "kv_transfer_config needs 'kv_connector'"),
    ({"kv_connector": "ShmConnector", "timeout": 3}, "kv_transfer_config has unknown keys ['timeout']"),
])
def test_bad_kv_transfer_configs_are_refused(config, problem):
    with pytest.raises(ValueError, match=re.escape(problem)):
        LLM(kv_transfer_config=config)
