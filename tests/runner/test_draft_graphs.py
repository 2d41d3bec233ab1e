"""The drafter's decode passes captured and replayed through the same GraphManager interface as the
target's graphs, side by side in one runner; verify steps replay the target's FULL graphs (q = 1 + k)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from mrv2 import LLM, SamplingParams
from mrv2.config import GraphMode
from mrv2.runner.graphs.draft_graphs import DraftGraphs
from mrv2.runner.graphs.manager import GraphManager

H = 64


@pytest.fixture(scope="module")
def target_and_head(tiny_checkpoint, tmp_path_factory):
    """A tiny Llama and a random Eagle-1 head for it (shared embedding and LM head)."""
    path, hf = tiny_checkpoint("llama", False, num_hidden_layers=4)
    g = torch.Generator().manual_seed(0)
    state = {"fc.weight": 0.1 * torch.randn(H, 2 * H, generator=g)}
    for k, v in hf.state_dict().items():  # the target's layer 0 as the head's layer (not its input norm)
        if k.startswith("model.layers.0.") and "input_layernorm" not in k:
            state[k.removeprefix("model.")] = v + 0.02 * torch.randn(v.shape, generator=g)
    head = tmp_path_factory.mktemp("eagle-head")
    config = json.loads((path / "config.json").read_text())
    config.update(architectures=["LlamaForCausalLMEagle"], num_hidden_layers=1)
    (head / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in state.items()}, str(head / "model.safetensors"))
    return path, head


def _prompts():
    g = torch.Generator().manual_seed(1)
    return [{"prompt_token_ids": torch.randint(3, 512, (n,), generator=g).tolist()} for n in (4, 9, 17, 6, 30)]


PARAMS = [SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
          SamplingParams(temperature=1.0, seed=4, max_tokens=20, ignore_eos=True)]


@pytest.mark.parametrize("mode,method", [("full", "eagle"), ("full_and_piecewise", "eagle"),
                                         ("full", "draft_model")])
def test_target_and_drafter_graphs_side_by_side(target_and_head, mode, method):
    target, head = target_and_head
    spec = {"method": method, "model": str(head if method == "eagle" else target), "num_speculative_tokens": 2}
    common = dict(model=str(target), dtype="float32", max_model_len=128, kv_cache_memory=1 << 22)
    plain = LLM(**common)
    expected = [[o.outputs[0].token_ids for o in plain.generate(_prompts(), p, use_tqdm=False)] for p in PARAMS]
    llm = LLM(**common, graph_mode=mode, graph_capture_sizes=[1, 2, 4, 8],
              speculative_config=spec)
    runner = llm.engine.runner
    target_graphs, draft_graphs = runner.graphs, runner.drafter.graphs
    assert isinstance(draft_graphs, DraftGraphs) and isinstance(draft_graphs.manager, GraphManager)
    # Two managers of one class, each over its own buffers: the target's FULL graphs hold verify steps
    # (1 + k tokens per request), the drafter's hold one-token passes; both captured for every size.
    full = [d for d in target_graphs.descriptors if d.mode is GraphMode.FULL]
    assert full and all(d.uniform_decode_len == 3 and d.num_tokens == 3 * d.num_reqs for d in full)
    assert draft_graphs.manager.descriptors and all(d.uniform_decode_len == 1 and d.num_tokens == d.num_reqs
                                                    for d in draft_graphs.manager.descriptors)
    assert {d.num_reqs for d in draft_graphs.manager.descriptors} == {1, 2, 4, 8}
    got = [[o.outputs[0].token_ids for o in llm.generate(_prompts(), p, use_tqdm=False)] for p in PARAMS]
    assert got == expected
    assert target_graphs.replays[GraphMode.FULL] > 0 and draft_graphs.replays > 0
    assert llm.engine.scheduler.block_pool.is_whole()
    # Verification hides wrong drafts from the output: the replayed passes must draft what eager ones do.
    eager = LLM(**common, speculative_config=spec)
    for p in PARAMS:
        eager.generate(_prompts(), p, use_tqdm=False)
    stats, eager_stats = llm.engine.scheduler.spec_stats, eager.engine.scheduler.spec_stats
    assert stats.accepted_per_position == eager_stats.accepted_per_position
    assert stats.num_draft_tokens == eager_stats.num_draft_tokens


def test_self_drafting_through_graphs_accepts_every_greedy_draft(target_and_head):
    """The target drafting for itself: any replayed pass that drafts wrong shows as a rejection."""
    target, _ = target_and_head
    llm = LLM(model=str(target), dtype="float32", max_model_len=128, kv_cache_memory=1 << 22, graph_mode="full",
              graph_capture_sizes=[1, 2, 4, 8],
              speculative_config={"method": "draft_model", "model": str(target), "num_speculative_tokens": 3})
    llm.generate(_prompts(), PARAMS[0], use_tqdm=False)
    stats = llm.engine.scheduler.spec_stats
    assert llm.engine.runner.drafter.graphs.replays > 0
    assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens == stats.num_draft_tokens
