"""`mrv2 serve` as a real process on 127.0.0.1, driven by the official `openai` client."""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import re
import signal
import socket
import subprocess
import time
import urllib.request

import openai
import pytest

from mrv2 import SamplingParams
from mrv2.bench.serve import ServerProcess

KEY = "test-key-123"
MODEL = "smol"
ENGINE_ARGS = ["--dtype", "float32", "--max-model-len", "512", "--max-num-seqs", "32",
               "--kv-cache-memory", str(48 << 20)]


class Server(ServerProcess):
    """A `mrv2 serve` child process with this module's engine options, and its metrics."""

    def __init__(self, *extra: str) -> None:
        super().__init__(["--served-model-name", MODEL, *ENGINE_ARGS, *extra], start_timeout=180)

    def metrics(self, raw: bool = False) -> dict[str, float]:
        """Sample values by metric name, summed over labels (by the full sample name when `raw`)."""
        text = urllib.request.urlopen(self.url + "/metrics", timeout=5).read().decode()
        values = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                key = name if raw else name.split("{")[0]
                values[key] = values.get(key, 0.0) + float(value)
        return values

    def wait_idle(self) -> dict[str, float]:
        deadline = time.monotonic() + 30
        while True:
            m = self.metrics()
            if (m["mrv2:num_requests_running"] == 0 and m["mrv2:num_requests_waiting"] == 0
                    and m["mrv2:kv_cache_usage_perc"] == 0) or time.monotonic() > deadline:
                return m
            time.sleep(0.1)


@pytest.fixture(scope="module")
def server():
    s = Server("--api-key", KEY)
    yield s
    assert s.stop() in (0, -signal.SIGTERM)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def reference(default_llm):
    """Offline greedy completions on the same model in fp32: what the server must return."""
    def run(prompt, max_tokens, **kw):
        params = SamplingParams(temperature=0, max_tokens=max_tokens, **kw)
        return default_llm.generate(prompt, params)[0].outputs[0]
    return run


def test_models_health_tokenize_detokenize(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    req = urllib.request.Request(server.url + "/tokenize", data=json.dumps({"prompt": "Hello world"}).encode(),
                                 headers={"Content-Type": "application/json"})
    tokens = json.loads(urllib.request.urlopen(req).read())
    assert tokens["count"] == len(tokens["tokens"]) > 0 and tokens["max_model_len"] == 512
    req = urllib.request.Request(server.url + "/detokenize", data=json.dumps({"tokens": tokens["tokens"]}).encode(),
                                 headers={"Content-Type": "application/json"})
    assert json.loads(urllib.request.urlopen(req).read())["prompt"] == "Hello world"


def test_completion_streamed_and_not_equal_offline_greedy(client, reference):
    prompt = "The capital of France is"
    ref = reference(prompt, 24, ignore_eos=True)
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert out.choices[0].text == ref.text and out.choices[0].finish_reason == "length"
    assert out.usage.completion_tokens == 24 and out.usage.prompt_tokens == 5
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0, stream=True,
                                            stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == ref.text
    assert len([c for c in chunks if c.choices]) > 2 and chunks[-1].usage.completion_tokens == 24
    echo = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0, echo=True)
    assert echo.choices[0].text.startswith(prompt)


def test_several_prompts_in_one_completion_request(client, reference):
    prompts = ["Once upon a time", "The capital of France is"]
    out = client.completions.create(model=MODEL, prompt=prompts, max_tokens=8, temperature=0)
    assert [c.index for c in out.choices] == [0, 1]
    assert [c.text for c in out.choices] == [reference(p, 8).text for p in prompts]


def test_chat_streamed_and_not(client, default_llm):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    ref = default_llm.chat(messages, SamplingParams(temperature=0, max_tokens=32))[0].outputs[0]
    out = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=32, temperature=0)
    assert out.choices[0].message.content == ref.text and out.choices[0].message.role == "assistant"
    assert out.choices[0].finish_reason == ref.finish_reason
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=32, temperature=0,
                                            stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == ref.text
    assert chunks[-1].choices[0].finish_reason == ref.finish_reason


def test_logprobs_in_completions_and_chat(client, default_llm):
    prompt = "The capital of France is"
    ref = default_llm.generate(prompt, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True,
                                                      logprobs=3))[0].outputs[0]
    ref_lps = [e[t].logprob for t, e in zip(ref.token_ids, ref.logprobs)]
    for stream in (False, True):
        res = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0, logprobs=3,
                                        stream=stream, extra_body={"ignore_eos": True})
        chunks = [c for c in res if c.choices] if stream else [res]
        lp = [c.choices[0].logprobs for c in chunks if c.choices[0].logprobs]
        tokens = [t for x in lp for t in x.tokens]
        assert tokens == [ref.logprobs[i][t].decoded_token for i, t in enumerate(ref.token_ids)]
        assert [v for x in lp for v in x.token_logprobs] == pytest.approx(ref_lps, abs=1e-5)
        assert all(len(d) >= 3 for x in lp for d in x.top_logprobs)
        assert [o for x in lp for o in x.text_offset][0] == 0
    messages = [{"role": "user", "content": "Name a planet."}]
    for stream in (False, True):
        res = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=5, temperature=0,
                                             logprobs=True, top_logprobs=2, stream=stream)
        chunks = list(res) if stream else [res]
        content = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
        assert len(content) == 5
        for t in content:
            assert [a.token for a in t.top_logprobs][:1] == [t.token] and len(t.top_logprobs) == 2  # greedy: rank 1
            assert t.bytes == list(t.token.encode()) and t.logprob <= 0
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, top_logprobs=2)
    assert e.value.body["param"] == "top_logprobs"


def test_penalties_bias_and_allowed_ids_through_the_server(client, default_llm):
    prompt = "The capital of France is"
    kw = dict(presence_penalty=0.5, frequency_penalty=1.0, logit_bias={7042: -100})
    ref = default_llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                                      repetition_penalty=1.2, **kw))[0].outputs[0]
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0,
                                    presence_penalty=0.5, frequency_penalty=1.0, logit_bias={"7042": -100},
                                    extra_body={"ignore_eos": True, "repetition_penalty": 1.2})
    assert out.choices[0].text == ref.text and "Paris" not in ref.text
    allowed = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=1.0, seed=1,
                                        logprobs=0, extra_body={"allowed_token_ids": [7042, 30]})
    assert set(allowed.choices[0].logprobs.tokens) <= {" Paris", "."}


def test_n_completions_per_prompt(client, default_llm):
    prompts = ["The capital of France is", "Once upon a time"]
    params = SamplingParams(n=2, temperature=1.0, seed=4, max_tokens=6, ignore_eos=True)
    ref = [[c.text for c in o.outputs] for o in default_llm.generate(prompts, params)]
    out = client.completions.create(model=MODEL, prompt=prompts, n=2, temperature=1.0, seed=4, max_tokens=6,
                                    extra_body={"ignore_eos": True})
    assert [c.index for c in out.choices] == [0, 1, 2, 3] and out.usage.completion_tokens == 24
    assert [c.text for c in out.choices] == ref[0] + ref[1]
    texts = ["", "", "", ""]
    for chunk in client.completions.create(model=MODEL, prompt=prompts, n=2, temperature=1.0, seed=4, max_tokens=6,
                                           stream=True, extra_body={"ignore_eos": True}):
        texts[chunk.choices[0].index] += chunk.choices[0].text
    assert texts == ref[0] + ref[1]
    messages = [{"role": "user", "content": "Name a color."}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, n=3, temperature=1.0, seed=2, max_tokens=5)
    assert [c.index for c in chat.choices] == [0, 1, 2]
    streamed = ["", "", ""]
    for chunk in client.chat.completions.create(model=MODEL, messages=messages, n=3, temperature=1.0, seed=2,
                                                max_tokens=5, stream=True):
        streamed[chunk.choices[0].index] += chunk.choices[0].delta.content or ""
    assert streamed == [c.message.content for c in chat.choices]


def test_echo_with_logprobs_and_prompt_logprobs(client, default_llm):
    prompt = "The capital of France is"
    ref = default_llm.generate(prompt, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=1,
                                                      prompt_logprobs=1))[0]
    ids = ref.prompt_token_ids
    for stream in (False, True):
        res = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0, echo=True,
                                        logprobs=1, stream=stream, extra_body={"ignore_eos": True})
        chunks = [c for c in res if c.choices] if stream else [res]
        assert "".join(c.choices[0].text for c in chunks) == prompt + ref.outputs[0].text
        lp = [c.choices[0].logprobs for c in chunks if c.choices[0].logprobs]
        token_logprobs = [v for x in lp for v in x.token_logprobs]
        assert len(token_logprobs) == len(ids) + 4 and token_logprobs[0] is None
        assert token_logprobs[1:len(ids)] == pytest.approx([ref.prompt_logprobs[p][ids[p]].logprob
                                                            for p in range(1, len(ids))], abs=1e-5)
        offsets = [o for x in lp for o in x.text_offset]
        assert offsets == sorted(offsets) and offsets[len(ids)] == len(prompt)
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0,
                                    extra_body={"prompt_logprobs": 0})
    prompt_lps = out.choices[0].model_extra["prompt_logprobs"]
    assert prompt_lps[0] is None and len(prompt_lps) == len(ids)
    assert prompt_lps[2][str(ids[2])]["logprob"] == pytest.approx(ref.prompt_logprobs[2][ids[2]].logprob, abs=1e-5)


def test_stop_strings_through_the_server(client, reference):
    prompt = "The capital of France is"
    full = reference(prompt, 24, ignore_eos=True).text
    stop = full.split()[2]
    for stream in (False, True):
        res = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0, stop=[stop],
                                        stream=stream)
        chunks = list(res) if stream else [res]
        assert "".join(c.choices[0].text for c in chunks) == full[:full.index(stop)]
        assert chunks[-1].choices[0].finish_reason == "stop"


def test_32_concurrent_clients(server, default_llm):
    prompts = [f"Count to {i}:" for i in range(32)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    expected = [o.outputs[0].text for o in default_llm.generate(prompts, params)]

    async def main():
        aclient = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)

        async def one(i, prompt):
            if i % 2:
                out = await aclient.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0,
                                                       extra_body={"ignore_eos": True})
                return out.choices[0].text
            stream = await aclient.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0,
                                                      stream=True, extra_body={"ignore_eos": True})
            return "".join([c.choices[0].text async for c in stream])

        try:
            return await asyncio.gather(*[one(i, p) for i, p in enumerate(prompts)])
        finally:
            await aclient.close()

    assert asyncio.run(main()) == expected
    assert server.wait_idle()["mrv2:kv_cache_usage_perc"] == 0


def test_a_client_killed_mid_stream_frees_its_request(server):
    before = server.metrics() | server.metrics(raw=True)
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    body = json.dumps({"model": MODEL, "prompt": "Tell me a long story.", "max_tokens": 400, "temperature": 0,
                       "stream": True, "ignore_eos": True})
    conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json",
                                                   "Authorization": f"Bearer {KEY}"})
    resp = conn.getresponse()
    assert resp.status == 200
    for _ in range(3):
        assert resp.readline().startswith(b"data: ")
        resp.readline()
    assert server.metrics()["mrv2:num_requests_running"] == 1
    conn.sock.shutdown(socket.SHUT_RDWR)  # the client dies
    conn.close()
    after = server.wait_idle()
    assert after["mrv2:num_requests_running"] == 0 and after["mrv2:kv_cache_usage_perc"] == 0
    assert after["mrv2:generation_tokens_total"] - before["mrv2:generation_tokens_total"] < 400
    aborted = 'mrv2:request_success_total{finished_reason="abort",model_name="smol"}'
    assert server.metrics(raw=True).get(aborted, 0) - before.get(aborted, 0) == 1


@pytest.mark.parametrize("kwargs,param", [
    ({"prompt": "hi", "temperature": -1}, "temperature"),
    ({"prompt": "hi", "top_p": 0}, "top_p"),
    ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "hi", "max_tokens": 600}, "max_tokens"),
    ({"prompt": "", "max_tokens": 4}, "prompt"),
    ({"prompt": "word " * 600}, "prompt"),
    ({"prompt": [10**9]}, "prompt"),
    ({"prompt": "hi", "extra_body": {"top_k": -5}}, "top_k"),
    ({"prompt": "hi", "extra_body": {"min_tokens": 99}}, "min_tokens"),
    ({"prompt": "hi", "stop": [""]}, "stop"),
    ({"prompt": "hi", "n": "two"}, "n"),
    ({"prompt": "hi", "n": 0}, "n"),
    ({"prompt": "hi", "logprobs": 50}, "logprobs"),
    ({"prompt": "hi", "presence_penalty": 2.5}, "presence_penalty"),
    ({"prompt": "hi", "logit_bias": {"x": 1}}, "logit_bias"),
    ({"prompt": "hi", "extra_body": {"allowed_token_ids": [10**9]}}, "allowed_token_ids"),
    ({"prompt": "hi", "extra_body": {"bad_words": [""]}}, "bad_words"),
    ({"prompt": "hi", "extra_body": {"prompt_logprobs": 50}}, "prompt_logprobs"),
    ({"prompt": "hi", "extra_body": {"cache_salt": ""}}, "cache_salt"),
])
def test_bad_completion_requests_are_400_naming_the_field(client, kwargs, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, **kwargs)
    assert e.value.status_code == 400 and e.value.body["param"] == param, e.value.body
    assert client.completions.create(model=MODEL, prompt="hi", max_tokens=2).usage.completion_tokens == 2


@pytest.mark.parametrize("kwargs,param", [
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}, "temperature"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": -1}, "max_tokens"),
    ({"messages": [{"role": "user"}]}, "messages"),
])
def test_bad_chat_requests_are_400_naming_the_field(client, kwargs, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, **kwargs)
    assert e.value.status_code == 400 and e.value.body["param"] == param, e.value.body


def test_malformed_json_unknown_model_and_wrong_key(server, client):
    req = urllib.request.Request(server.url + "/v1/completions", data=b"{not json",
                                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req)
    assert e.value.code == 400 and "JSON" in json.loads(e.value.read())["error"]["message"]
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt="hi", max_tokens=2)
    for key in ("wrong", ""):
        bad = openai.OpenAI(base_url=server.url + "/v1", api_key=key or "x", max_retries=0,
                            default_headers={} if key else {"Authorization": ""})
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()
    assert urllib.request.urlopen(server.url + "/health").status == 200  # outside /v1: no key needed
    assert client.completions.create(model=MODEL, prompt="hi", max_tokens=2).usage.completion_tokens == 2


def test_metrics_count_tokens_and_latencies(server, client):
    before = server.metrics()
    client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=5, temperature=0,
                              extra_body={"ignore_eos": True})
    after = server.wait_idle()
    assert after["mrv2:generation_tokens_total"] - before["mrv2:generation_tokens_total"] == 5
    assert after["mrv2:prompt_tokens_total"] - before["mrv2:prompt_tokens_total"] == 5
    assert after["mrv2:time_to_first_token_seconds_count"] - before["mrv2:time_to_first_token_seconds_count"] == 1
    assert after["mrv2:inter_token_latency_seconds_count"] - before["mrv2:inter_token_latency_seconds_count"] == 4
    assert after["mrv2:e2e_request_latency_seconds_count"] - before["mrv2:e2e_request_latency_seconds_count"] == 1
    assert "mrv2:num_preemptions_total" in after
    hits = after["mrv2:prefix_cache_hits_total"]
    client.completions.create(model=MODEL, prompt="The capital of France is " * 8, max_tokens=2)
    client.completions.create(model=MODEL, prompt="The capital of France is " * 8, max_tokens=2)
    again = server.wait_idle()
    assert again["mrv2:prefix_cache_hits_total"] - hits >= 32  # the second request reused two blocks
    assert again["mrv2:prefix_cache_queries_total"] > after["mrv2:prefix_cache_queries_total"]
    # A salted request shares nothing with unsalted ones, then hits its own salt's blocks.
    salted = {"cache_salt": "tenant-a"}
    client.completions.create(model=MODEL, prompt="The capital of France is " * 8, max_tokens=2, extra_body=salted)
    assert server.wait_idle()["mrv2:prefix_cache_hits_total"] == again["mrv2:prefix_cache_hits_total"]
    client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Paris? " * 20}],
                                   max_tokens=2, extra_body=salted)
    client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Paris? " * 20}],
                                   max_tokens=2, extra_body=salted)
    assert server.wait_idle()["mrv2:prefix_cache_hits_total"] - again["mrv2:prefix_cache_hits_total"] >= 32


def test_no_key_server_and_sigterm_mid_stream_exits_cleanly():
    s = Server()
    try:
        c = openai.OpenAI(base_url=s.url + "/v1", api_key="anything", max_retries=0)
        assert c.completions.create(model=MODEL, prompt="hi", max_tokens=2).usage.completion_tokens == 2
        stream = c.completions.create(model=MODEL, prompt="Tell me a story.", max_tokens=400, stream=True,
                                      extra_body={"ignore_eos": True})
        chunks = iter(stream)
        next(chunks)
        t0 = time.monotonic()
        assert s.stop() in (0, -signal.SIGTERM) and time.monotonic() - t0 < 30
        assert list(chunks)[-1].choices[0].finish_reason == "abort"  # the stream ended, it was not cut
        assert "Traceback" not in s.output()
    finally:
        s.stop()
    # No engine or server process is left behind.
    alive = subprocess.run(["pgrep", "-f", f"--port {s.port}"], capture_output=True, text=True).stdout.split()
    assert [p for p in alive if int(p) != os.getpid()] == []


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_speculative_decoding_serves_the_same_text_and_reports_acceptance(client, converted_default_model, method):
    config = {"method": method, "num_speculative_tokens": 3}
    if method == "draft_model":  # the default model drafting for itself (its KV takes half the cache)
        config["model"] = str(converted_default_model)
    s = Server("--speculative-config", json.dumps(config))
    try:
        spec = openai.OpenAI(base_url=s.url + "/v1", api_key="anything", max_retries=0)
        prompt = "Copy this list: apples, pears, plums, apples, pears, plums, apples, pears, plums, apples,"
        kwargs = dict(model=MODEL, prompt=prompt, max_tokens=24, temperature=0, extra_body={"ignore_eos": True})
        streamed = "".join(c.choices[0].text for c in spec.completions.create(stream=True, **kwargs))
        assert streamed == client.completions.create(**kwargs).choices[0].text
        m = s.wait_idle()
        accepted = m["mrv2:spec_decode_num_accepted_tokens_total"]
        assert m["mrv2:spec_decode_num_draft_tokens_total"] >= accepted > 0
        assert m["mrv2:spec_decode_num_accepted_tokens_per_pos_total"] == accepted
    finally:
        assert s.stop() in (0, -signal.SIGTERM)


def test_structured_output_through_response_format_and_structured_outputs(client, server):
    import jsonschema

    schema = {"type": "object", "additionalProperties": False, "required": ["city", "population"],
              "properties": {"city": {"type": "string", "maxLength": 20},
                             "population": {"type": "integer", "minimum": 0, "maximum": 10**9}}}
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "A city as JSON"}], max_tokens=80, temperature=1.0, n=3,
        seed=7,
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": schema}})
    for choice in chat.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), schema)
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt="Call me at", max_tokens=20, stream=True, extra_body={"structured_outputs": {
            "regex": r" \d{3}-\d{4}"}}))
    assert re.fullmatch(r" \d{3}-\d{4}", streamed)
    with pytest.raises(openai.BadRequestError, match="structured_outputs.regex is invalid"):
        client.completions.create(model=MODEL, prompt="x", max_tokens=5, extra_body={"structured_outputs": {
            "regex": "([a-z"}})
    with pytest.raises(openai.BadRequestError, match="response_format.type must be"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=5,
                                       response_format={"type": "yaml"})
    assert server.wait_idle()["mrv2:kv_cache_usage_perc"] == 0
