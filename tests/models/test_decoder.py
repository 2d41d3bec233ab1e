"""Tiny random Llama, Qwen2 and Qwen3 checkpoints: mrv2 equals transformers (fp32)."""

from __future__ import annotations

import pytest
import torch

from step_helpers import step_with_logits

from mrv2 import LLM, SamplingParams

CASES = [("llama", False), ("llama", True), ("qwen2", False), ("qwen2", True), ("qwen3", False), ("qwen3", True),
         ("mistral", False)]
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64, "rope_theta": 500000.0}
LINEAR_ROPE = {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}


def _prompts(n_tokens=(5, 17, 33, 8, 40, 3), vocab=512, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in n_tokens]


def _hf_greedy(model, prompt, max_new_tokens):
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False,
                         eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("arch,tied", CASES)
def test_greedy_batch_matches_transformers(tiny_checkpoint, arch, tied):
    path, hf = tiny_checkpoint(arch, tied)
    llm = LLM(dtype="float32", model=str(path), kv_cache_memory=1 << 22, max_num_batched_tokens=64)
    prompts = _prompts()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))
    for p, o in zip(prompts, outs):
        assert o.prompt_token_ids == p
        assert o.outputs[0].token_ids == _hf_greedy(hf, p, 32)
        assert o.outputs[0].finish_reason == "length"
    assert llm.engine.scheduler.block_pool.is_whole()


@pytest.mark.parametrize("arch,tied", [("llama", False), ("qwen2", True), ("qwen3", False)])
@pytest.mark.parametrize("layout", ["joint", "split"])
def test_logits_match_transformers_on_prefill_and_decode(tiny_checkpoint, arch, tied, layout):
    """Step the engine by hand and compare each step's logits with a full HF forward."""
    path, hf = tiny_checkpoint(arch, tied)
    llm = LLM(dtype="float32", model=str(path), kv_cache_memory=1 << 22, kv_cache_layout=layout, max_num_batched_tokens=8)
    engine = llm.engine
    prompt = _prompts((19,))[0]
    engine.add_request(engine.make_request({"prompt_token_ids": prompt},
                                           SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)))
    tokens = list(prompt)
    checked = 0
    while engine.has_unfinished_requests():
        updated, logits = step_with_logits(engine)
        logits = logits[0]
        (req,) = updated or [None]
        if req is None:
            continue  # a partial prefill chunk (19 tokens in chunks of 8)
        with torch.no_grad():
            ref = hf(torch.tensor([tokens])).logits[0, -1]
        torch.testing.assert_close(logits, ref, atol=2e-4, rtol=1e-4)
        tokens.append(req.output_token_ids[-1])
        checked += 1
    assert checked == 6


@pytest.mark.parametrize("rope", [LLAMA3_ROPE, LINEAR_ROPE], ids=["llama3", "linear"])
def test_rope_scaling_matches_transformers(tiny_checkpoint, rope):
    path, hf = tiny_checkpoint("llama", False, rope_parameters=rope)
    llm = LLM(dtype="float32", model=str(path), kv_cache_memory=1 << 22)
    prompts = _prompts((70, 9))  # past original_max_position_embeddings, where the scalings differ
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == _hf_greedy(hf, p, 16)


def test_bfloat16_runs_close_to_fp32(tiny_checkpoint):
    path, hf = tiny_checkpoint("llama", False)
    llm = LLM(model=str(path), kv_cache_memory=1 << 22, dtype="bfloat16")
    assert llm.engine.dtype == torch.bfloat16
    assert next(llm.engine.runner.model.parameters()).dtype == torch.bfloat16
    engine = llm.engine
    prompt = _prompts((12,))[0]
    engine.add_request(engine.make_request({"prompt_token_ids": prompt},
                                           SamplingParams(temperature=0, max_tokens=1)))
    _, logits = step_with_logits(engine)
    logits = logits[0]
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0, -1]
    assert logits.dtype == torch.float32
    assert (logits - ref).abs().max() < 0.05 * ref.abs().max()
    assert engine.scheduler.block_pool.is_whole()


def test_mistral_sliding_window_caps_max_model_len(tiny_checkpoint):
    path, _ = tiny_checkpoint("mistral", False, sliding_window=128)
    llm = LLM(dtype="float32", model=str(path), kv_cache_memory=1 << 22)
    assert llm.engine.config.max_model_len == 128
    with pytest.raises(ValueError, match="sliding_window"):
        LLM(dtype="float32", model=str(path), kv_cache_memory=1 << 22, max_model_len=256)


def test_one_rotary_for_all_layers_sized_to_max_model_len(tiny_checkpoint):
    path, _ = tiny_checkpoint("llama", False)
    llm = LLM(dtype="float32", model=str(path), kv_cache_memory=1 << 22, max_model_len=96)
    rotaries = {id(layer.self_attn.rotary) for layer in llm.engine.runner.model.layers}
    assert len(rotaries) == 1
    assert llm.engine.runner.model.layers[0].self_attn.rotary.cos_sin_cache.shape[0] == 96
