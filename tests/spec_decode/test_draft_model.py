"""Draft-model speculation on the default model (fp32): the default model drafting for itself and a
layer-truncated copy of it drafting; outputs equal the output without drafts, token for token."""

from __future__ import annotations

import json
import shutil

import pytest
from safetensors.torch import save_file

from mrv2 import LLM, SamplingParams
from mrv2.loader.safetensors_weights import iter_safetensors_weights

PROMPTS = ["Copy this list exactly: apples, pears, plums, figs, dates, limes, apples, pears. Copy:",
           "The capital of France is", "def fibonacci(n):", "Write a short poem about the sea."]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.8, top_p=0.95, seed=3, max_tokens=24, ignore_eos=True)
# One KV block of the default model in fp32 holds 16 tokens x 30 layers x 2 x 3 x 64 x 4 bytes.
BLOCK_BYTES = 737280


def _tokens(llm: LLM, params: SamplingParams) -> list[list[list[int]]]:
    return [[c.token_ids for c in o.outputs] for o in llm.generate(PROMPTS, params, use_tqdm=False)]


@pytest.fixture(scope="module")
def plain():
    return LLM(dtype="float32", max_model_len=256, kv_cache_memory=16 << 20)


@pytest.fixture(scope="module")
def without_drafts(plain):
    return [_tokens(plain, p) for p in (GREEDY, SEEDED)]


@pytest.fixture(scope="module")
def truncated(converted_default_model, tmp_path_factory):
    """The default model's first 6 of 30 layers, with its embedding, norm and tokenizer."""
    path = tmp_path_factory.mktemp("smollm2-6-layers")
    config = json.loads((converted_default_model / "config.json").read_text())
    config["num_hidden_layers"] = 6
    (path / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(converted_default_model / name, path / name)
    keep = {n: t for n, t in iter_safetensors_weights(converted_default_model)
            if not n.startswith("model.layers.") or int(n.split(".")[2]) < 6}
    save_file(keep, str(path / "model.safetensors"))
    return path


def _spec(model, k=3, **kwargs) -> LLM:
    kwargs.setdefault("kv_cache_memory", 32 << 20)
    return LLM(dtype="float32", max_model_len=256,
               speculative_config={"method": "draft_model", "model": str(model), "num_speculative_tokens": k},
               **kwargs)


@pytest.mark.parametrize("kwargs", [{}, {"max_num_batched_tokens": 16, "kv_cache_memory": 9 * 2 * BLOCK_BYTES,
                                         "async_scheduling": False}],
                         ids=["async", "serial_chunked_and_preempted"])
def test_self_drafting_accepts_every_greedy_draft(converted_default_model, without_drafts, kwargs):
    llm = _spec(converted_default_model, **kwargs)
    assert llm.engine.runner.drafter is not None and llm.engine.proposer is None
    assert _tokens(llm, GREEDY) == without_drafts[0]
    stats = llm.engine.scheduler.spec_stats
    # Same weights, same cache contents: a greedy request's drafts are exactly the target's tokens.
    assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens == stats.num_draft_tokens
    # Seeded requests reject where the target's random draw differs from the drafter's argmax.
    assert _tokens(llm, SEEDED) == without_drafts[1]
    if "kv_cache_memory" in kwargs:
        assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.scheduler.block_pool.is_whole()


def test_truncated_copy_drafts_exactly(truncated, without_drafts):
    llm = _spec(truncated)
    assert [_tokens(llm, p) for p in (GREEDY, SEEDED)] == without_drafts
    stats = llm.engine.scheduler.spec_stats
    assert 0 < stats.acceptance_rate < 1  # a weaker drafter: some drafts accepted, some not
    assert llm.engine.scheduler.block_pool.is_whole()


def test_mixed_caps_and_n(converted_default_model, plain):
    """Requests that turn drafting off or cap it run beside drafting ones, n > 1 included."""
    llm = _spec(converted_default_model)
    params = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, num_speculative_tokens=cap)
              for cap in (0, 1, None)] + [SamplingParams(n=2, temperature=0.9, seed=7, max_tokens=24, ignore_eos=True)]
    prompts = PROMPTS[:len(params)]

    def run(engine):
        return [[c.token_ids for c in o.outputs] for o in engine.generate(prompts, params, use_tqdm=False)]

    assert run(llm) == run(plain)


def test_a_draft_model_with_another_vocabulary_is_refused(tiny_checkpoint):
    path, _ = tiny_checkpoint("llama", False)
    with pytest.raises(ValueError, match="vocabulary"):
        _spec(path)
