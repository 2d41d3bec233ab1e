"""Tiny random DeepSeek-V2/V3 checkpoints (MLA + MoE) against transformers, fp32."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from step_helpers import step_with_logits

from mrv2 import LLM, SamplingParams

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 32,
        "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.8, "rope_theta": 10000.0}
# (version, q_lora_rank, yarn): both versions, q_lora_rank None and set, YaRN on and off.
CASES = [("deepseek_v2", None, False), ("deepseek_v2", 16, True), ("deepseek_v3", None, True),
         ("deepseek_v3", 16, False)]
IDS = [f"{v}-q{q}-{'yarn' if y else 'rope'}" for v, q, y in CASES]
KV_LORA, ROPE = 32, 8


@pytest.fixture(scope="module", params=CASES, ids=IDS)
def checkpoint(request, tiny_checkpoint):
    version, q_lora_rank, yarn = request.param
    overrides = {"q_lora_rank": q_lora_rank}
    if yarn:
        overrides["rope_parameters"] = YARN
    return tiny_checkpoint(version, False, **overrides)


def _prompts(lengths=(5, 17, 33, 8, 70), seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 512, (n,), generator=g).tolist() for n in lengths]


def _hf_greedy(model, prompt, n):
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                         eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def hf_reference(checkpoint):
    _, hf = checkpoint
    return [_hf_greedy(hf, p, 32) for p in _prompts()]


def _generate(llm):
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in _prompts()],
                                                          SamplingParams(temperature=0, max_tokens=32,
                                                                         ignore_eos=True))]


@pytest.mark.parametrize("mode,compile", [("full", None), ("piecewise", True), ("piecewise", False)])
def test_greedy_with_graphs(checkpoint, hf_reference, mode, compile):
    """MLA and MoE under the graph path (CPU: FULL eager, PIECEWISE compiled or not): still transformers' tokens."""
    path, _ = checkpoint
    # Compiled pieces cost a compile per size: two sizes still pad steps of 1-3 and 5-16 tokens.
    sizes = [4, 16] if compile else [1, 2, 4, 8, 16]
    llm = LLM(dtype="float32", model=str(path), kv_cache_memory=1 << 22, max_num_batched_tokens=16, graph_mode=mode,
              graph_capture_sizes=sizes, graph_compile=compile)
    graphs = llm.engine.runner.graphs
    assert _generate(llm) == hf_reference
    assert graphs.num_replays > 0 and llm.engine.scheduler.block_pool.is_whole()


@pytest.mark.parametrize("layout", ["joint", "split"])
def test_greedy_batch_with_chunked_prefill(checkpoint, hf_reference, layout):
    path, _ = checkpoint
    llm = LLM(dtype="float32", model=str(path), kv_cache_memory=1 << 22, kv_cache_layout=layout, max_num_batched_tokens=16)
    assert _generate(llm) == hf_reference
    assert llm.engine.scheduler.block_pool.is_whole()


def test_greedy_with_forced_preemption(checkpoint, hf_reference):
    path, _ = checkpoint
    bytes_per_block = 3 * (KV_LORA + ROPE) * 4 * 16
    llm = LLM(dtype="float32", model=str(path), kv_cache_memory=9 * bytes_per_block + (1 << 12), max_num_seqs=5)
    assert llm.engine.scheduler.block_pool.num_usable_blocks <= 8
    assert _generate(llm) == hf_reference
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.scheduler.block_pool.is_whole()


@pytest.mark.parametrize("layout", ["joint", "split"])
def test_prefix_cache_hits_on_the_latent_cache(checkpoint, layout):
    """Requests sharing a 40-token prefix reuse its latent and rope blocks and keep transformers' tokens."""
    path, hf = checkpoint
    shared = _prompts((40,), seed=5)[0]
    prompts = [shared + suffix for suffix in _prompts((3, 9, 20), seed=6)]
    want = [_hf_greedy(hf, p, 8) for p in prompts]
    llm = LLM(dtype="float32", model=str(path), kv_cache_memory=1 << 22, kv_cache_layout=layout)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    got = [llm.generate({"prompt_token_ids": p}, params)[0].outputs[0].token_ids for p in prompts]
    assert got == want
    assert llm.engine.scheduler.kv_cache_manager.num_hit_tokens == 2 * 32  # two full blocks, twice
    assert llm.engine.scheduler.block_pool.is_whole()


def test_one_rotary_for_all_layers_sized_to_max_model_len(checkpoint):
    path, _ = checkpoint
    llm = LLM(dtype="float32", model=str(path), kv_cache_memory=1 << 22, max_model_len=96)
    rotaries = {id(layer.self_attn.rotary) for layer in llm.engine.runner.model.layers}
    assert len(rotaries) == 1
    assert llm.engine.runner.model.layers[0].self_attn.rotary.cos_sin_cache.shape[0] == 96


def _step_logits(llm, prompt, steps):
    """Drive the engine by hand; yield (tokens so far, logits) for every step that samples."""
    engine = llm.engine
    engine.add_request(engine.make_request({"prompt_token_ids": prompt},
                                           SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True)))
    tokens = list(prompt)
    while engine.has_unfinished_requests():
        updated, logits = step_with_logits(engine)
        logits = logits[0] if logits is not None else None
        if updated:
            yield list(tokens), logits
            tokens.append(updated[0].output_token_ids[-1])


def test_logits_match_on_prefill_and_decode(checkpoint):
    path, hf = checkpoint
    llm = LLM(dtype="float32", model=str(path), kv_cache_memory=1 << 22, max_num_batched_tokens=8)
    checked = 0
    for tokens, logits in _step_logits(llm, _prompts((21,))[0], 8):
        with torch.no_grad():
            ref = hf(torch.tensor([tokens])).logits[0, -1]
        torch.testing.assert_close(logits, ref, atol=2e-4, rtol=1e-4)
        checked += 1
    assert checked == 8


def test_absorbed_and_up_projected_paths_agree(checkpoint):
    """Default (up-projected prefill, absorbed decode) against the opposite on both groups."""
    path, _ = checkpoint
    prompt = _prompts((40,))[0]
    up = LLM(dtype="float32", model=str(path), kv_cache_memory=1 << 22)
    absorbed = LLM(dtype="float32", model=str(path), kv_cache_memory=1 << 22)
    backend = up.engine.runner.attn_backend
    assert backend.prefill_absorbed is False and backend.decode_absorbed is True
    absorbed.engine.runner.attn_backend.prefill_absorbed = True
    absorbed.engine.runner.attn_backend.decode_absorbed = False
    pairs = zip(_step_logits(up, prompt, 4), _step_logits(absorbed, prompt, 4))
    for (tokens_a, logits_a), (tokens_b, logits_b) in pairs:
        assert tokens_a == tokens_b
        torch.testing.assert_close(logits_a, logits_b, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("layout", ["joint", "split"])
def test_cache_holds_only_latent_and_rope_key(checkpoint, layout):
    path, _ = checkpoint
    llm = LLM(dtype="float32", model=str(path), kv_cache_memory=1 << 22, kv_cache_layout=layout)
    kv = llm.engine.runner.kv_cache
    per_token = (KV_LORA + ROPE) * 4  # fp32
    for spec in llm.engine.runner.kv_cache_specs():
        assert spec.bytes_per_token == per_token
    for layer in kv.layers:
        assert set(layer.parts) == {"latent", "rope"}
        latent, rope = layer["latent"], layer["rope"]
        assert latent.shape == (kv.num_blocks, kv.block_size, 1, KV_LORA)
        assert rope.shape == (kv.num_blocks, kv.block_size, 1, ROPE)
        token_bytes = (latent[0, 0].numel() + rope[0, 0].numel()) * latent.element_size()
        assert token_bytes == per_token
        if layout == "joint":
            assert layer.joint.stride(1) * layer.joint.element_size() == per_token
    # The whole allocation: layers x blocks x block_size x bytes per token, plus alignment padding only.
    payload = len(kv.layers) * kv.num_blocks * kv.block_size * per_token
    tensors = len(kv.layers) * (1 if layout == "joint" else 2)
    assert payload <= kv.raw.numel() <= payload + (tensors + 1) * kv.alignment


def test_runner_never_mentions_cos_sin():
    runner = Path(__file__).resolve().parents[2] / "mrv2" / "runner"
    pattern = re.compile(r"\bcos\b|\bsin\b|cos_sin|cos/sin", re.IGNORECASE)
    offenders = [f"{p.name}:{i}" for p in sorted(runner.glob("*.py"))
                 for i, line in enumerate(p.read_text().splitlines(), 1) if pattern.search(line)]
    assert offenders == []
