"""End to end on the embedded default model (SmolLM2-135M-Instruct), against transformers."""

from __future__ import annotations

import pytest
import torch
from step_helpers import PROMPTS

from mrv2 import LLM, SamplingParams
from mrv2.config import GraphMode

GREEDY_32 = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)


@pytest.fixture(scope="module")
def prompt_ids(default_llm):
    tok = default_llm.get_tokenizer()
    chat = tok.apply_chat_template([{"role": "user", "content": "Name a planet."}], tokenize=True,
                                   add_generation_prompt=True, return_dict=False)
    return [tok.encode(p) for p in PROMPTS] + [list(chat)]


@pytest.fixture(scope="module")
def hf_greedy(hf_default_model, prompt_ids):
    """transformers' greedy 32 tokens for every prompt, one at a time (no padding effects)."""
    refs = []
    with torch.no_grad():
        for ids in prompt_ids:
            x = torch.tensor([ids])
            out = hf_default_model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=32,
                                            do_sample=False, eos_token_id=None, pad_token_id=2)
            refs.append(out[0, len(ids):].tolist())
    return refs


def _tokens(outputs):
    return [o.outputs[0].token_ids for o in outputs]


def _as_inputs(prompt_ids):
    return [{"prompt_token_ids": ids} for ids in prompt_ids]


def test_batch_greedy_matches_transformers(default_llm, prompt_ids, hf_greedy):
    outputs = default_llm.generate(_as_inputs(prompt_ids), GREEDY_32)
    assert _tokens(outputs) == hf_greedy
    assert default_llm.engine.scheduler.block_pool.is_whole()


def test_text_prompts_and_outputs(default_llm, prompt_ids, hf_greedy):
    outputs = default_llm.generate(PROMPTS, GREEDY_32)
    for out, ids, ref, text in zip(outputs, prompt_ids, hf_greedy, PROMPTS):
        assert out.prompt == text and out.prompt_token_ids == ids
        assert out.outputs[0].token_ids == ref
        assert out.outputs[0].text == default_llm.get_tokenizer().decode(ref, skip_special_tokens=True)


def test_one_at_a_time_equals_batch(default_llm, prompt_ids, hf_greedy):
    singles = [default_llm.generate(p, GREEDY_32)[0].outputs[0].token_ids for p in _as_inputs(prompt_ids)]
    assert singles == hf_greedy


def test_chunked_prefill_gives_same_tokens(prompt_ids, hf_greedy):
    llm = LLM(dtype="float32", max_model_len=256, max_num_batched_tokens=8, max_num_seqs=8, kv_cache_memory=32 << 20)
    assert max(map(len, prompt_ids)) > 8  # every long prompt is split into chunks
    assert _tokens(llm.generate(_as_inputs(prompt_ids), GREEDY_32)) == hf_greedy
    assert llm.engine.scheduler.block_pool.is_whole()


@pytest.mark.parametrize("backend", ["inductor-paged", "torch"])
def test_every_cpu_attention_backend_gives_transformers_tokens(default_llm, prompt_ids, hf_greedy, backend):
    # The default (in `default_llm`) reads KV blocks in place through mrv2's C++ kernel;
    # "inductor-paged" through Inductor's code; "torch" gathers them.
    assert default_llm.engine.runner.attn_backend.name == "cpp-paged"
    llm = LLM(dtype="float32", max_model_len=256, kv_cache_memory=32 << 20, attention_backend=backend)
    assert llm.engine.runner.attn_backend.name == backend
    assert _tokens(llm.generate(_as_inputs(prompt_ids), GREEDY_32)) == hf_greedy


@pytest.mark.parametrize("kwargs, match", [
    (dict(attention_backend="flash"), "attention_backend 'flash' is not registered"),
    (dict(attention_backend="torch-mla"), "serves 'mla' attention, but this model needs 'gqa'"),
    (dict(attention_backend="torch", batch_invariant=True), "drop attention_backend"),
])
def test_bad_attention_backends_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LLM(dtype="float32", max_model_len=64, kv_cache_memory=1 << 24, **kwargs)


def test_preemption_gives_same_tokens(prompt_ids, hf_greedy):
    # 16 blocks of 16 tokens cannot hold nine requests of up to ~80 tokens: some are preempted.
    spec_bytes = 30 * 2 * 3 * 64 * 4 * 16
    llm = LLM(dtype="float32", max_model_len=256, max_num_seqs=9, kv_cache_memory=17 * spec_bytes + (1 << 16))
    assert llm.engine.scheduler.block_pool.num_usable_blocks <= 16
    outputs = llm.generate(_as_inputs(prompt_ids), GREEDY_32)
    assert llm.engine.scheduler.num_preemptions > 0
    assert _tokens(outputs) == hf_greedy
    assert llm.engine.scheduler.block_pool.is_whole()


def test_chat_uses_the_template(default_llm):
    out = default_llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                           SamplingParams(temperature=0, max_tokens=16))[0]
    tok = default_llm.get_tokenizer()
    assert tok.decode(out.prompt_token_ids).startswith("<|im_start|>system")
    assert "Paris" in out.outputs[0].text
    several = default_llm.chat([[{"role": "user", "content": "Hi"}], [{"role": "user", "content": "Bye"}]],
                               SamplingParams(temperature=0, max_tokens=4))
    assert len(several) == 2


def test_seeded_sampling_is_batch_independent(default_llm):
    params = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=1234, max_tokens=24, ignore_eos=True)
    alone = default_llm.generate(PROMPTS[2], params)[0].outputs[0].token_ids
    others = [SamplingParams(temperature=1.0, max_tokens=30, ignore_eos=True)] * 5
    batch = default_llm.generate(PROMPTS[:2] + [PROMPTS[2]] + PROMPTS[3:6], others[:2] + [params] + others[2:])
    assert batch[2].outputs[0].token_ids == alone
    again = default_llm.generate(PROMPTS[2], params)[0].outputs[0].token_ids
    assert again == alone
    other_seed = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=99, max_tokens=24, ignore_eos=True)
    assert default_llm.generate(PROMPTS[2], other_seed)[0].outputs[0].token_ids != alone


def test_stop_conditions(default_llm, prompt_ids, hf_greedy):
    ref = hf_greedy[0]
    stop_tok = ref[5]
    out = default_llm.generate({"prompt_token_ids": prompt_ids[0]},
                               SamplingParams(temperature=0, max_tokens=32, stop_token_ids=[stop_tok]))[0].outputs[0]
    assert out.token_ids == ref[:ref.index(stop_tok) + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_tok
    out = default_llm.generate({"prompt_token_ids": prompt_ids[0]}, SamplingParams(temperature=0, max_tokens=3))[0]
    assert out.outputs[0].token_ids == ref[:3] and out.outputs[0].finish_reason == "length"
    # Without ignore_eos the chat prompt ends on <|im_end|> (EOS, id 2) with finish_reason "stop".
    out = default_llm.generate({"prompt_token_ids": prompt_ids[-1]}, SamplingParams(temperature=0, max_tokens=200))[0]
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].token_ids[-1] == 2


@pytest.mark.parametrize("include", [False, True])
def test_stop_strings_end_the_request_and_cut_the_text(default_llm, prompt_ids, hf_greedy, include):
    tok = default_llm.get_tokenizer()
    full = tok.decode(hf_greedy[0])
    stop = full.split()[3]  # a word a few tokens in
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, stop=[stop, "never appears"],
                            include_stop_str_in_output=include)
    others = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    outs = default_llm.generate(_as_inputs(prompt_ids[:3]), [params, others, others])
    out = outs[0].outputs[0]
    at = full.index(stop)
    assert out.text == (full[:at + len(stop)] if include else full[:at])
    assert out.finish_reason == "stop" and out.stop_reason == stop
    # Its tokens end with the one that completed the stop string; the batch-mates ran on.
    assert out.token_ids == hf_greedy[0][:len(out.token_ids)] and len(out.token_ids) < 32
    assert stop in tok.decode(out.token_ids) and stop not in tok.decode(out.token_ids[:-1])
    assert _tokens(outs[1:]) == hf_greedy[1:3]
    assert default_llm.engine.scheduler.block_pool.is_whole()


def test_abort_mid_run_returns_blocks(default_llm, prompt_ids):
    engine = default_llm.engine
    pool = engine.scheduler.block_pool
    requests = [engine.make_request({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=64,
                                                                              ignore_eos=True))
                for ids in prompt_ids]
    for r in requests:
        engine.add_request(r)
    for _ in range(4):
        engine.step()
    held = pool.num_usable_blocks - pool.num_free_blocks
    victims = [r.req_id for r in requests[::2]]
    victim_blocks = sum(len(r.block_ids) for r in requests[::2])
    # With async scheduling a step of theirs is in flight: its blocks return when it completes.
    in_flight = [r for r in requests[::2] if r.num_steps_in_flight]
    assert victim_blocks > 0 and bool(in_flight) == engine.config.async_scheduling
    engine.abort(victims)
    in_flight_blocks = sum(len(r.block_ids) for r in in_flight)
    assert pool.num_usable_blocks - pool.num_free_blocks == held - victim_blocks + in_flight_blocks
    engine.step()  # processes the oldest step in flight: the victims' last one
    assert all(not r.block_ids for r in requests[::2])
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    assert set(finished) == {r.req_id for r in requests[1::2]}
    assert all(len(o.outputs[0].token_ids) == 64 for o in finished.values())
    assert pool.is_whole()
    engine.step()  # the runner releases the last slots
    assert engine.runner.states.num_free_slots == engine.runner.max_num_reqs


@pytest.mark.parametrize("prompt,params,field", [
    ("", SamplingParams(), "prompt"),
    ({"prompt_token_ids": []}, SamplingParams(), "prompt"),
    ({"prompt_token_ids": [5] * 1024}, SamplingParams(), "max_model_len"),
    ({"prompt_token_ids": [10**9]}, SamplingParams(), "prompt_token_ids"),
    (42, SamplingParams(), "prompt"),
])
def test_bad_prompts_raise_and_engine_keeps_serving(default_llm, prompt, params, field):
    with pytest.raises(ValueError, match=field):
        default_llm.generate(["The capital of France is", prompt], params)
    assert default_llm.engine.scheduler.block_pool.is_whole()
    assert not default_llm.engine.has_unfinished_requests()
    out = default_llm.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=4))[0]
    assert len(out.outputs[0].token_ids) == 4


@pytest.mark.parametrize("kwargs,field", [
    ({"max_tokens": 0}, "max_tokens"),
    ({"temperature": -0.5}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": -3}, "top_k"),
    ({"min_p": 2.0}, "min_p"),
    ({"stop": [""]}, "stop"),
    ({"stop": [3]}, "stop"),
    ({"skip_special_tokens": "no"}, "skip_special_tokens"),
])
def test_bad_sampling_params_raise(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_params_mutated_after_construction_are_rechecked(default_llm):
    params = SamplingParams()
    params.temperature = -1.0
    with pytest.raises(ValueError, match="temperature"):
        default_llm.generate("hello", params)
    assert default_llm.generate("hello", SamplingParams(max_tokens=2))[0].outputs[0].token_ids


def test_a_kv_cache_that_does_not_fit_in_memory_names_kv_cache_memory():
    with pytest.raises(ValueError, match="kv_cache_memory"):
        LLM(dtype="float32", kv_cache_memory=1 << 50, max_num_seqs=1 << 20, max_model_len=8192)


def test_keyboard_interrupt_inside_generate_leaves_the_llm_usable(default_llm):
    engine = default_llm.engine
    step = engine.step
    calls = []

    def interrupted_step():
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return step()

    engine.step = interrupted_step
    try:
        with pytest.raises(KeyboardInterrupt):
            default_llm.generate(["The capital of France is"] * 3, SamplingParams(temperature=0, max_tokens=20))
    finally:
        del engine.step
    out = default_llm.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=5))[0]
    assert len(out.outputs[0].token_ids) == 5
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.scheduler.block_pool.is_whole()


def test_unknown_model_path_names_the_path(tmp_path):
    missing = tmp_path / "no-such-model"
    with pytest.raises(ValueError, match=str(missing)):
        LLM(dtype="float32", model=str(missing))


@pytest.mark.parametrize("kwargs,match", [
    (dict(graph_mode="sometimes"), "graph_mode"),
    (dict(graph_mode="none", graph_compile=True), "compile"),
    (dict(graph_capture_sizes=[0]), "capture_sizes"),
])
def test_bad_graph_options_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LLM(dtype="float32", max_model_len=64, kv_cache_memory=1 << 24, **kwargs)


def test_graph_options_without_a_mode():
    """Capture sizes alone mean FULL graphs; asking to compile alone means (compiled) PIECEWISE pieces."""
    sizes = LLM(dtype="float32", max_model_len=64, kv_cache_memory=1 << 24, graph_capture_sizes=[2, 1], graph_compile=False)
    assert {d.mode for d in sizes.engine.runner.graphs.descriptors} == {GraphMode.FULL}
    compiled = LLM(dtype="float32", max_model_len=64, kv_cache_memory=1 << 24, graph_capture_sizes=[1], graph_compile=True)
    assert [d.mode for d in compiled.engine.runner.graphs.descriptors] == [GraphMode.PIECEWISE]
    params = SamplingParams(temperature=0, max_tokens=4)
    assert (compiled.generate("Hello", params)[0].outputs[0].token_ids
            == sizes.generate("Hello", params)[0].outputs[0].token_ids)
