"""Eagle, Eagle-3 and MTP speculation end to end with small random heads (fp32): no trained head exists
here, so drafts are mostly wrong, and the output must still equal the output without drafts, token for
token, greedy and seeded, with chunked prefill, preemption, graphs and prefix hits."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from mrv2 import LLM, SamplingParams
from mrv2.platforms.cpu import CpuPlatform

H, HEADS, KV_HEADS, HEAD_DIM, FFN, VOCAB = 64, 4, 2, 16, 128, 512
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
SEEDED = SamplingParams(temperature=1.0, seed=9, max_tokens=24, ignore_eos=True)


def _prompts(lengths=(5, 19, 40, 8), seed=3):
    g = torch.Generator().manual_seed(seed)
    return [{"prompt_token_ids": torch.randint(3, VOCAB, (n,), generator=g).tolist()} for n in lengths]


def _rand(*shape, g, scale=0.1):
    return scale * torch.randn(*shape, generator=g)


def _norm(g):
    return 1 + _rand(H, g=g)


def _llama_layer(prefix: str, g: torch.Generator, qkv_in: int = H) -> dict[str, torch.Tensor]:
    return {f"{prefix}self_attn.q_proj.weight": _rand(HEADS * HEAD_DIM, qkv_in, g=g),
            f"{prefix}self_attn.k_proj.weight": _rand(KV_HEADS * HEAD_DIM, qkv_in, g=g),
            f"{prefix}self_attn.v_proj.weight": _rand(KV_HEADS * HEAD_DIM, qkv_in, g=g),
            f"{prefix}self_attn.o_proj.weight": _rand(H, HEADS * HEAD_DIM, g=g),
            f"{prefix}mlp.gate_proj.weight": _rand(FFN, H, g=g), f"{prefix}mlp.up_proj.weight": _rand(FFN, H, g=g),
            f"{prefix}mlp.down_proj.weight": _rand(H, FFN, g=g),
            f"{prefix}post_attention_layernorm.weight": _norm(g)}


def _head_folder(path, arch: str, state: dict[str, torch.Tensor], **config) -> str:
    path.mkdir()
    cfg = dict(architectures=[arch], model_type="llama", vocab_size=VOCAB, hidden_size=H, intermediate_size=FFN,
               num_hidden_layers=1, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, rms_norm_eps=1e-6,
               max_position_embeddings=512, tie_word_embeddings=False, **config)
    (path / "config.json").write_text(json.dumps(cfg))
    save_file({k: v.contiguous() for k, v in state.items()}, str(path / "model.safetensors"))
    return str(path)


@pytest.fixture(scope="module")
def llama_target(tiny_checkpoint):
    path, _ = tiny_checkpoint("llama", False, num_hidden_layers=4)
    return path


@pytest.fixture(scope="module")
def eagle(tmp_path_factory):
    """An Eagle-1 head (the target's embedding and LM head are shared: the checkpoint has neither)."""
    g = torch.Generator().manual_seed(1)
    state = {"fc.weight": _rand(H, 2 * H, g=g), **_llama_layer("layers.0.", g)}
    return _head_folder(tmp_path_factory.mktemp("heads") / "eagle", "LlamaForCausalLMEagle", state)


@pytest.fixture(scope="module")
def eagle3(tmp_path_factory):
    """An Eagle-3 head with its own 256-token draft vocabulary (d2t) over the target's layers 2, 2 and 1."""
    g = torch.Generator().manual_seed(2)
    draft_vocab = 256
    target_ids = torch.randperm(VOCAB, generator=g)[:draft_vocab].sort().values
    state = {"fc.weight": _rand(H, 3 * H, g=g), **_llama_layer("midlayer.", g, qkv_in=2 * H),
             "midlayer.input_layernorm.weight": _norm(g), "midlayer.hidden_norm.weight": _norm(g),
             "norm.weight": _norm(g), "lm_head.weight": _rand(draft_vocab, H, g=g, scale=1.0),
             "d2t": target_ids - torch.arange(draft_vocab), "t2d": torch.zeros(VOCAB, dtype=torch.bool)}
    return _head_folder(tmp_path_factory.mktemp("heads") / "eagle3", "LlamaForCausalLMEagle3", state,
                        draft_vocab_size=draft_vocab)


@pytest.fixture(scope="module")
def deepseek_with_mtp(tiny_checkpoint, tmp_path_factory):
    """A tiny DeepSeek-V3 checkpoint plus one MTP layer (its block: the last layer's weights, perturbed)."""
    src, hf = tiny_checkpoint("deepseek_v3", False)
    path = tmp_path_factory.mktemp("deepseek-mtp")
    for f in src.iterdir():
        if f.is_file():
            (path / f.name).write_bytes(f.read_bytes())
    n = hf.config.num_hidden_layers
    g = torch.Generator().manual_seed(4)
    last = f"model.layers.{n - 1}."
    mtp = {f"model.layers.{n}." + k[len(last):]: v + _rand(*v.shape, g=g, scale=0.02) if v.is_floating_point() else v
           for k, v in hf.state_dict().items() if k.startswith(last)}
    mtp.update({f"model.layers.{n}.enorm.weight": _norm(g), f"model.layers.{n}.hnorm.weight": _norm(g),
                f"model.layers.{n}.eh_proj.weight": _rand(H, 2 * H, g=g),
                f"model.layers.{n}.shared_head.norm.weight": _norm(g)})
    save_file({k: v.contiguous() for k, v in mtp.items()}, str(path / "mtp.safetensors"))
    config = json.loads((path / "config.json").read_text())
    config["num_nextn_predict_layers"] = 1
    (path / "config.json").write_text(json.dumps(config))
    index = path / "model.safetensors.index.json"  # a shard index names both files
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
    else:
        with safe_open(path / "model.safetensors", "pt") as f:
            weight_map = dict.fromkeys(f.keys(), "model.safetensors")
    weight_map.update(dict.fromkeys(mtp, "mtp.safetensors"))
    index.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return path


def _outputs(llm: LLM, params: SamplingParams):
    return [o.outputs[0].token_ids for o in llm.generate(_prompts(), params, use_tqdm=False)]


def _check(target, spec_config, **kwargs):
    kwargs.setdefault("kv_cache_memory", 1 << 22)
    plain = LLM(model=str(target), dtype="float32", max_model_len=256, kv_cache_memory=1 << 22)
    spec = LLM(model=str(target), dtype="float32", max_model_len=256, speculative_config=spec_config, **kwargs)
    for params in (GREEDY, SEEDED):
        assert _outputs(spec, params) == _outputs(plain, params)
    stats = spec.engine.scheduler.spec_stats
    assert stats.num_drafts > 0 and stats.num_draft_tokens > 0
    # Drafts stay on the device: scheduling runs ahead of the outputs where asked.
    assert spec.engine.config.async_scheduling == kwargs.get("async_scheduling", CpuPlatform.default_async_scheduling)
    assert spec.engine.scheduler.block_pool.is_whole()
    return spec


CASES = [{"async_scheduling": True}, {"async_scheduling": False}, {"max_num_batched_tokens": 16},
         {"graph_mode": "piecewise", "graph_capture_sizes": [1, 2, 4, 8, 16]}]
CASE_IDS = ["async", "serial", "chunked", "piecewise_graphs"]


@pytest.mark.parametrize("kwargs", CASES, ids=CASE_IDS)
def test_eagle(llama_target, eagle, kwargs):
    spec = _check(llama_target, {"method": "eagle", "model": eagle, "num_speculative_tokens": 3}, **kwargs)
    assert spec.engine.runner.model.aux_hidden is None  # Eagle-1 reads the final hidden states


@pytest.mark.parametrize("kwargs", CASES, ids=CASE_IDS)
def test_eagle3(llama_target, eagle3, kwargs):
    spec = _check(llama_target, {"method": "eagle3", "model": eagle3, "num_speculative_tokens": 2}, **kwargs)
    assert spec.engine.runner.model.aux_hidden.shape[1] == 3 * H


# Nine blocks of 16 tokens x (3 layers + the MTP layer) x (32 latent + 8 rope) x 4 bytes.
@pytest.mark.parametrize("kwargs", [{}, {"max_num_batched_tokens": 16, "kv_cache_memory": 9 * 16 * 4 * 40 * 4 + 4096}],
                         ids=["default", "chunked_and_preempted"])
def test_mtp(deepseek_with_mtp, kwargs):
    spec = _check(deepseek_with_mtp, {"method": "mtp", "num_speculative_tokens": 2}, **kwargs)
    if "kv_cache_memory" in kwargs:
        assert spec.engine.scheduler.num_preemptions > 0


def test_mtp_needs_the_layer(tiny_checkpoint):
    path, _ = tiny_checkpoint("deepseek_v3", False)
    with pytest.raises(ValueError, match="model.layers.3"):
        LLM(model=str(path), dtype="float32", max_model_len=256, kv_cache_memory=1 << 22,
            speculative_config={"method": "mtp"})


def test_a_drafter_of_the_wrong_kind_is_refused(llama_target, eagle3):
    with pytest.raises(ValueError, match="method 'eagle' needs an Eagle-1 head, but model .* is 'LlamaForCausalLMEagle3'"):
        LLM(model=str(llama_target), dtype="float32", max_model_len=256, kv_cache_memory=1 << 22,
            speculative_config={"method": "eagle", "model": eagle3})
    with pytest.raises(ValueError, match="method 'mtp' needs a DeepSeek-V2/V3 checkpoint with MTP layers, but the "
                                         "target model is 'LlamaForCausalLM'"):
        LLM(model=str(llama_target), dtype="float32", max_model_len=256, kv_cache_memory=1 << 22,
            speculative_config={"method": "mtp"})


def test_self_drafting_through_prefix_hits_and_aborts(llama_target):
    """The target drafting for itself accepts every greedy draft, so a drafter KV entry that a prefix
    hit or an abort got wrong would show as a rejection; every block comes back."""
    llm = LLM(model=str(llama_target), dtype="float32", max_model_len=256, kv_cache_memory=1 << 22,
              speculative_config={"method": "draft_model", "model": str(llama_target), "num_speculative_tokens": 3})
    engine = llm.engine
    shared = _prompts((70,))[0]["prompt_token_ids"]
    prompts = [{"prompt_token_ids": shared + tail["prompt_token_ids"]} for tail in _prompts((3, 9, 5))]
    llm.generate(prompts[:1], GREEDY, use_tqdm=False)  # caches the shared blocks
    requests = [engine.make_request(p, GREEDY) for p in prompts[1:]]
    for r in requests:
        engine.add_request(r)
    for step in range(30):
        engine.step()
        if step == 4:
            engine.abort([requests[0].req_id])
    while engine.has_unfinished_requests():
        engine.step()
    engine.step()
    stats = engine.scheduler.spec_stats
    assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens == stats.num_draft_tokens
    assert engine.scheduler.kv_cache_manager.num_hit_tokens >= 2 * 64  # both remaining requests hit 4 blocks
    assert engine.scheduler.block_pool.is_whole()


def test_probabilistic_drafting_verifies_with_the_rejection_sampler(llama_target):
    """The target drafting for itself with drafts drawn from its own distribution: q equals p, so the
    rejection sampler accepts (all but numerically) every draft, where argmax drafts of a random request
    are mostly rejected; seeded requests repeat alone and in a batch; greedy ones keep the plain output."""
    def spec(draft_sampling):
        return LLM(model=str(llama_target), dtype="float32", max_model_len=256, kv_cache_memory=1 << 22,
                   speculative_config={"method": "draft_model", "model": str(llama_target),
                                       "num_speculative_tokens": 3, "draft_sampling": draft_sampling})

    hot = SamplingParams(temperature=0.8, seed=5, max_tokens=24, ignore_eos=True)
    rates = {}
    for mode in ("greedy", "probabilistic"):
        llm = spec(mode)
        batch = [o.outputs[0].token_ids for o in llm.generate(_prompts(), hot, use_tqdm=False)]
        rates[mode] = llm.engine.scheduler.spec_stats.acceptance_rate
    assert rates["probabilistic"] > 0.99 and rates["greedy"] < 0.5
    alone = [llm.generate([p], hot, use_tqdm=False)[0].outputs[0].token_ids for p in _prompts()]
    assert alone == batch  # (seed, position) keyed draws: the batch does not matter
    plain = LLM(model=str(llama_target), dtype="float32", max_model_len=256, kv_cache_memory=1 << 22)
    assert _outputs(llm, GREEDY) == _outputs(plain, GREEDY)
    assert llm.engine.scheduler.block_pool.is_whole()


@pytest.mark.parametrize("draft_sampling", ["greedy", "probabilistic"])
def test_logprobs_are_the_targets(llama_target, draft_sampling):
    """Each emitted token's logprobs (and top alternatives) are the target's, whichever draft produced it."""
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=3)
    plain = LLM(model=str(llama_target), dtype="float32", max_model_len=256, kv_cache_memory=1 << 22)
    spec = LLM(model=str(llama_target), dtype="float32", max_model_len=256, kv_cache_memory=1 << 22,
               speculative_config={"method": "draft_model", "model": str(llama_target), "num_speculative_tokens": 3,
                                   "draft_sampling": draft_sampling})
    for a, b in zip(spec.generate(_prompts(), params, use_tqdm=False), plain.generate(_prompts(), params,
                                                                                     use_tqdm=False)):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for ea, eb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True):
            assert ea.keys() == eb.keys() and all(abs(ea[t].logprob - eb[t].logprob) < 1e-4 for t in ea)
    assert spec.engine.scheduler.spec_stats.num_accepted_tokens > 0
