"""LLMEngine end to end on tiny random checkpoints: greedy rule, EOS handling, min_tokens."""

from __future__ import annotations

import torch

from mrv2 import LLM, SamplingParams

PROMPTS = [[5, 6, 7], [40, 41, 42, 43, 44], [100, 3, 250, 9], [77] * 9, [300, 301]]


def _tiny_llm(tiny_checkpoint, **kwargs) -> LLM:
    path, _ = tiny_checkpoint("llama", False)
    return LLM(str(path), dtype="float32", max_model_len=128, max_num_seqs=8, kv_cache_memory=8 << 20, **kwargs)


def _tokens(llm: LLM, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]


def test_tiny_temperature_is_greedy_alone_and_in_a_mixed_batch(tiny_checkpoint):
    """One greedy rule: temperature 1e-6 is greedy in a batch of its own and among random requests."""
    assert SamplingParams(temperature=1e-6).greedy and not SamplingParams(temperature=0.5).greedy
    llm = _tiny_llm(tiny_checkpoint)
    with torch.no_grad():  # logit gaps far below the noise a random draw at temperature 1e-5 would add
        llm.engine.runner.model.norm.weight.mul_(1e-6)  # logits scale with the final norm (the head may be packed)
    tiny = SamplingParams(temperature=1e-6, max_tokens=12, ignore_eos=True)
    greedy = _tokens(llm, PROMPTS[:1], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))[0]
    alone = _tokens(llm, PROMPTS[:1], tiny)[0]
    random = [SamplingParams(temperature=1.0, seed=s, max_tokens=12, ignore_eos=True) for s in range(4)]
    mixed = _tokens(llm, PROMPTS, [tiny] + random)[0]
    assert alone == greedy and mixed == greedy


def test_secondary_eos_is_eos_and_ignore_eos_ignores_it(tiny_checkpoint):
    llm = _tiny_llm(tiny_checkpoint)
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    ref = _tokens(llm, PROMPTS[:1], greedy)[0]
    eot = ref[1]
    assert llm.engine.eos_token_ids[0] not in ref[:2] and eot not in ref[:1]
    llm.engine.eos_token_ids = [llm.engine.eos_token_ids[0], eot]  # as a Llama 3 config lists <|eot_id|>
    assert _tokens(llm, PROMPTS[:1], greedy)[0] == ref
    out = llm.generate([{"prompt_token_ids": PROMPTS[0]}], SamplingParams(temperature=0.0, max_tokens=8))[0]
    assert out.outputs[0].token_ids == ref[:2] and out.outputs[0].finish_reason == "stop"
    assert out.outputs[0].stop_reason is None
    request = llm.engine.make_request({"prompt_token_ids": PROMPTS[0]}, SamplingParams(stop_token_ids=[7]))
    assert request.eos_token_ids == (llm.engine.eos_token_ids[0], eot)
    assert request.sampling_params.stop_token_ids == [7]


def test_production_sampling_metadata_carries_max_top_k(tiny_checkpoint, monkeypatch):
    """The runner's metadata bounds top-k, so top-k/top-p take the torch.topk fast path."""
    llm = _tiny_llm(tiny_checkpoint)
    runner = llm.engine.runner
    seen = []
    sampler = runner.sampler

    def spy(logits, metadata):
        seen.append((metadata.max_top_k, metadata.no_top_k))
        return sampler(logits, metadata)

    monkeypatch.setattr(runner, "sampler", spy)
    params = [SamplingParams(temperature=1.0, top_k=k, seed=1, max_tokens=3) for k in (5, 40)]
    _tokens(llm, PROMPTS[:2], params)
    assert seen and all(bound == 40 and not no_top_k for bound, no_top_k in seen)


def test_min_tokens_masks_eos_and_stop_tokens(tiny_checkpoint):
    """Until min_tokens outputs, EOS ids and stop tokens are never sampled (vLLM); afterwards they stop."""
    llm = _tiny_llm(tiny_checkpoint)
    ref = _tokens(llm, PROMPTS[:1], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))[0]
    eos = llm.engine.eos_token_ids[0]
    llm.engine.eos_token_ids = [eos, ref[2]]  # a secondary EOS the model emits at output 2
    stop = ref[1]
    assert len({eos, ref[1], ref[2]}) == 3 and eos not in ref[:3]
    params = SamplingParams(temperature=0.0, max_tokens=12, min_tokens=6, stop_token_ids=[stop])
    out = _tokens(llm, PROMPTS[:2], [params, SamplingParams(temperature=0.0, max_tokens=3)])
    assert len(out[0]) >= 6 and not {eos, ref[2], stop} & set(out[0][:6])
    assert out[0][0] == ref[0]  # nothing masked that was not a stop id
    random = SamplingParams(temperature=1.0, seed=5, max_tokens=12, min_tokens=6, stop_token_ids=[stop])
    out = _tokens(llm, PROMPTS[:1], random)[0]
    assert len(out) >= 6 and not {eos, ref[2], stop} & set(out[:6])
