"""Consistency: a request's greedy tokens and logprobs do not depend on how it was scheduled.

The same probe requests run alone (the reference) and: in a batch of 64, under prefill
chunks of 8 to 2048 tokens, with forced preemption, on a prefix-cache hit and miss, with
async scheduling on and off, and in every graph mode. With `batch_invariant=True` every
token id and logprob is bitwise the reference's; by default (fp32) the tokens are the
same and logprobs agree within `DEFAULT_TOL` (GEMM kernels round differently by row
count: measured up to 2.5e-5 on the default model, see `mrv2.layers.batch_invariant`).
"""

from __future__ import annotations

import random

import pytest
import torch

from mrv2 import LLM, SamplingParams

BLOCK_BYTES = 30 * 2 * 3 * 64 * 4 * 16  # fp32 K and V of the default model, one 16-token block
DEFAULT_TOL = 1e-4
_rng = random.Random(7)
PROBES = [[_rng.randint(100, 9000) for _ in range(n)] for n in (37, 5, 50, 20)]
FILLERS = [[_rng.randint(100, 9000) for _ in range(_rng.randint(5, 60))] for _ in range(60)]
PARAMS = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=3)

# name -> (LLM keyword arguments, fillers run beside the probes)
SCENARIOS = {
    "batch_of_64": ({}, 60),
    "chunks_of_8": ({"max_num_batched_tokens": 8}, 4),
    "chunks_of_40": ({"max_num_batched_tokens": 40}, 12),
    "chunks_of_2048": ({"max_num_batched_tokens": 2048}, 12),
    "preempted": ({"kv_cache_memory": 8 * BLOCK_BYTES + (1 << 16), "max_num_seqs": 8}, 12),
    "async_on": ({"async_scheduling": True}, 12),
    "async_off": ({"async_scheduling": False}, 12),
    "graph_full": ({"graph_mode": "full"}, 12),
    "graph_piecewise": ({"graph_mode": "piecewise", "graph_capture_sizes": [16]}, 12),
    "graph_full_and_piecewise": ({"graph_mode": "full_and_piecewise", "graph_capture_sizes": [16]}, 12),
}


def _llm(batch_invariant: bool, **kwargs) -> LLM:
    kwargs.setdefault("kv_cache_memory", 32 << 20)
    return LLM(dtype="float32", max_model_len=128, batch_invariant=batch_invariant, **kwargs)


def _run(llm: LLM, prompts) -> list[tuple[list[int], list[dict[int, float]]]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], PARAMS, use_tqdm=False)
    return [(o.outputs[0].token_ids, [{t: lp.logprob for t, lp in step.items()} for step in o.outputs[0].logprobs])
            for o in outs]


def _check(got, want, batch_invariant: bool) -> None:
    for (tokens, logprobs), (ref_tokens, ref_logprobs) in zip(got, want, strict=True):
        assert tokens == ref_tokens
        for step, ref_step in zip(logprobs, ref_logprobs, strict=True):
            if batch_invariant:
                assert step == ref_step  # bitwise: the same top tokens and the same floats
            else:
                for t in step.keys() & ref_step.keys():
                    assert abs(step[t] - ref_step[t]) <= DEFAULT_TOL


@pytest.fixture(scope="module", params=[True, False], ids=["batch_invariant", "default"])
def mode(request):
    """(batch_invariant, each probe run alone on a fresh engine without prefix caching)."""
    llm = _llm(request.param, enable_prefix_caching=False)
    return request.param, [_run(llm, [p])[0] for p in PROBES]


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_a_request_gets_its_solo_result_however_it_is_scheduled(mode, scenario):
    batch_invariant, reference = mode
    kwargs, num_fillers = SCENARIOS[scenario]
    llm = _llm(batch_invariant, **kwargs)
    # Probes interleaved with fillers, so they sit at different rows and steps than alone.
    prompts = [p for pair in zip(PROBES, FILLERS) for p in pair] + FILLERS[len(PROBES):num_fillers]
    results = _run(llm, prompts)
    _check([results[2 * i] for i in range(len(PROBES))], reference, batch_invariant)
    if scenario == "preempted":
        assert llm.engine.scheduler.num_preemptions > 0
    if scenario.startswith("graph"):
        assert sum(llm.engine.runner.graphs.replays.values()) > 0
    assert llm.engine.scheduler.block_pool.is_whole()


def test_a_prefix_cache_hit_gives_the_miss_result(mode):
    batch_invariant, reference = mode
    llm = _llm(batch_invariant)
    miss = _run(llm, PROBES)
    kv = llm.engine.scheduler.kv_cache_manager
    hits = kv.num_hit_tokens
    hit = _run(llm, PROBES)  # every probe of 17+ tokens now starts from its cached full blocks
    assert kv.num_hit_tokens - hits == sum((len(p) - 1) // 16 * 16 for p in PROBES) > 0
    _check(miss, reference, batch_invariant)
    _check(hit, reference, batch_invariant)


@pytest.mark.parametrize("arch", ["llama", "qwen3", "deepseek_v3"])
def test_tiny_architectures_are_batch_invariant(tiny_checkpoint, arch):
    """Bitwise over batch size, chunking and preemption for GQA and MLA + MoE models, on transformers' tokens."""
    path, hf = tiny_checkpoint(arch, arch == "qwen3")
    rng = random.Random(3)
    prompts = [[rng.randint(3, 511) for _ in range(rng.randint(3, 70))] for _ in range(24)]

    def llm(**kwargs) -> LLM:
        return LLM(str(path), dtype="float32", max_model_len=128, batch_invariant=True, **kwargs)

    solo = llm(enable_prefix_caching=False)
    reference = [_run(solo, [p])[0] for p in prompts[:4]]
    for p, (tokens, _) in zip(prompts, reference):
        ids = torch.tensor([p])
        hf_out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=len(tokens), do_sample=False,
                             eos_token_id=None, pad_token_id=0)
        assert hf_out[0, len(p):].tolist() == tokens
    block_bytes = sum(s.bytes_per_token for s in solo.engine.runner.kv_cache_specs()) * 16
    small = {"kv_cache_memory": 8 * block_bytes + (1 << 16), "max_num_seqs": 6}  # a 76-token request needs 5
    for kwargs in ({}, {"max_num_batched_tokens": 16}, small):
        engine = llm(**kwargs)
        _check(_run(engine, prompts)[:4], reference, batch_invariant=True)
        assert engine.engine.scheduler.block_pool.is_whole()
    assert engine.engine.scheduler.num_preemptions > 0  # the last, small cache preempted


def test_bfloat16_is_batch_invariant_too():
    llm = LLM(dtype="bfloat16", max_model_len=128, kv_cache_memory=32 << 20, batch_invariant=True,
              enable_prefix_caching=False)
    alone = [_run(llm, [p])[0] for p in PROBES]
    _check(_run(llm, PROBES + FILLERS[:12])[:len(PROBES)], alone, batch_invariant=True)


def test_batch_invariant_refuses_compiled_pieces():
    with pytest.raises(ValueError, match="batch_invariant=True runs piecewise graphs uncompiled"):
        LLM(batch_invariant=True, graph_mode="piecewise", graph_compile=True)
