"""ModelRunner memory planning (the largest step's attention transients and the graph pool are reserved); the start-up log."""

from __future__ import annotations

import logging

import pytest

from mrv2 import LLM
from mrv2.runner.kv_cache import num_blocks_for_budget


def _runner(tiny_checkpoint, max_model_len: int = 128, max_num_seqs: int = 8, **kwargs):
    path, _ = tiny_checkpoint("llama", False)
    llm = LLM(str(path), dtype="float32", max_model_len=max_model_len, max_num_seqs=max_num_seqs, kv_cache_memory=4 << 20, **kwargs)
    return llm.engine.runner


def _gather_bytes(runner) -> int:
    """What the torch backend gathers per layer at the largest step: every request's K/V at full length."""
    spec = runner.kv_cache_specs()[0]
    return runner.max_num_reqs * runner.max_model_len * spec.bytes_per_token


@pytest.mark.parametrize("max_model_len,max_num_seqs", [(128, 8), (512, 8), (128, 32)])
def test_estimate_includes_the_paged_gather_of_the_largest_step(tiny_checkpoint, max_model_len, max_num_seqs):
    runner = _runner(tiny_checkpoint, max_model_len, max_num_seqs)
    assert not runner.platform.measures_peak_memory  # CPU: estimated from shapes
    model_part = runner.model.estimate_activation_bytes(runner.max_num_tokens, runner.max_num_reqs)
    transient = runner.activation_bytes() - model_part
    assert transient == runner.attention_transient_bytes(runner.max_num_reqs, runner.max_num_tokens, max_model_len)
    assert transient >= _gather_bytes(runner)


def test_transient_grows_with_max_model_len_and_max_num_seqs_as_the_gather(tiny_checkpoint):
    base = _runner(tiny_checkpoint, 128, 8)
    longer = _runner(tiny_checkpoint, 512, 8)
    wider = _runner(tiny_checkpoint, 128, 32)

    def transient(r):
        return r.activation_bytes() - r.model.estimate_activation_bytes(r.max_num_tokens, r.max_num_reqs)

    # The step's masks: two bools per query and key, queries padded up to 2x (attention/torch_paged.py).
    masks = 2 * 2 * base.max_num_tokens * (512 - 128)
    assert transient(longer) - transient(base) == _gather_bytes(longer) - _gather_bytes(base) + masks
    assert transient(wider) - transient(base) == _gather_bytes(wider) - _gather_bytes(base)


def test_measured_profile_adds_the_backend_transient(tiny_checkpoint, monkeypatch):
    """Where peak memory is measured, the cache-less profile run cannot see the gathers: they are added."""
    runner = _runner(tiny_checkpoint)
    peaks = iter([0, 12345])
    monkeypatch.setattr(runner.platform, "measures_peak_memory", True)
    monkeypatch.setattr(runner.platform, "reset_peak_memory", lambda: None)
    monkeypatch.setattr(runner.platform, "peak_memory", lambda: next(peaks))
    transient = runner.attention_transient_bytes(runner.max_num_reqs, runner.max_num_tokens, runner.max_model_len)
    assert transient > 0 and runner.activation_bytes() == 12345 + transient


def test_planned_kv_budget_subtracts_activations_and_graph_pool(tiny_checkpoint, monkeypatch):
    path, _ = tiny_checkpoint("llama", False)
    llm = LLM(str(path), dtype="float32", max_model_len=128, max_num_seqs=8)  # budget from free memory
    engine, runner = llm.engine, llm.engine.runner
    cfg = engine.config
    assert cfg.cache.kv_cache_memory is None
    assert runner.graph_pool_bytes() == 0  # CPU graph backends keep no pool
    activation = runner.activation_bytes()
    monkeypatch.setattr(runner, "activation_bytes", lambda: activation)
    monkeypatch.setattr(runner, "graph_pool_bytes", lambda: 100_000)
    free = int((activation + 100_000 + 300_000) / cfg.cache.memory_fraction)
    monkeypatch.setattr(engine.platform, "free_memory", lambda: free)
    specs, alignment = runner.kv_cache_specs(), cfg.cache.base_alignment(engine.platform.kv_alignment)
    expected = num_blocks_for_budget(specs, cfg.cache.layout, cfg.cache.block_size, alignment,
                                     int(free * cfg.cache.memory_fraction) - activation - 100_000)
    assert 2 <= expected < num_blocks_for_budget(specs, cfg.cache.layout, cfg.cache.block_size, alignment, 400_000)
    assert engine._plan_kv_cache() == expected


def test_graph_pool_is_estimated_from_the_largest_capture_and_every_output(tiny_checkpoint, monkeypatch):
    runner = _runner(tiny_checkpoint, graph_mode="full", graph_capture_sizes=[1, 2, 4])
    graphs = runner.graphs
    assert not graphs.uses_pool and runner.graph_pool_bytes() == 0
    monkeypatch.setattr(type(graphs), "uses_pool", property(lambda self: True))  # as a device graph backend
    descs = graphs._tiers[0][0].descriptors
    assert {d.num_reqs for d in descs} == {1, 2, 4}
    hidden = runner.model.config.hidden_size * runner.dtype.itemsize
    peak = max(runner.model.estimate_activation_bytes(d.num_tokens, 0)
               + runner.attention_transient_bytes(d.num_reqs, d.num_tokens, d.max_seq_len) for d in descs)
    expected = peak + sum(2 * d.num_tokens * hidden for d in descs)
    assert runner.graph_pool_bytes() == expected > 0


def test_the_start_up_log_names_the_attention_backend_and_its_kernel(tiny_checkpoint, caplog):
    with caplog.at_level(logging.INFO, logger="mrv2"):
        runner = _runner(tiny_checkpoint)
    assert f"Attention: {runner.attn_backend.describe()}" in caplog.text
    assert runner.attn_backend.name in runner.attn_backend.describe()
