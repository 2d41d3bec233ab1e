"""The graph path on the default model: same tokens as eager, for batches that hit and miss captured sizes."""

from __future__ import annotations

import pytest

from mrv2 import LLM, SamplingParams
from mrv2.config import GraphMode

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time,", "1, 2, 3, 4,", "Water boils at",
           "The three primary colors are", "Translate to French: good morning", "Overfitting means",
           "The largest planet is", "import numpy as np", "Dear Sir or Madam,", "Roses are red,"]


@pytest.fixture(scope="module")
def eager():
    return LLM(dtype="float32", max_model_len=256, max_num_seqs=16, kv_cache_memory=64 << 20, enforce_eager=True)


@pytest.fixture(scope="module")
def graphed():
    return LLM(dtype="float32", max_model_len=256, max_num_seqs=16, kv_cache_memory=64 << 20, graph_mode="full",
               graph_capture_sizes=[1, 2, 4, 8])


def test_eager_builds_no_graphs(eager):
    assert eager.engine.runner.graphs is None


def test_cpu_default_compiles_small_int4_steps_and_whole_decodes():
    from mrv2.layers.packed import row_buckets
    from mrv2.platforms import get_platform

    cpu = get_platform("cpu")
    assert cpu.default_graph_config().mode is GraphMode.NONE
    for rows, sizes in ((4, (1, 2, 4)), (8, (1, 2, 4, 8)), (5, (1, 2, 4)), (1, (1,))):
        config = cpu.default_graph_config(int4_rows=rows)
        assert (config.mode, config.capture_sizes, config.compile) == (GraphMode.PIECEWISE, sizes, True)
    # Where the dense copy is packed, the packed GEMMs' row buckets above the int4 kernel's rows too.
    config = cpu.default_graph_config(int4_rows=4, packed_buckets=row_buckets(64))
    assert config.capture_sizes == (1, 2, 4, 8, 16, 32, 48, 64)
    assert cpu.default_graph_config(packed_buckets=row_buckets(64)).mode is GraphMode.NONE
    # Where a decode step compiles whole, a decode of one request is a compiled FULL graph.
    for rows in (1, 4, 8):
        config = cpu.default_graph_config(int4_rows=rows, packed_buckets=row_buckets(64), compiled_decode=True)
        assert (config.mode, config.full_capture_sizes, config.compile) == (GraphMode.FULL_AND_PIECEWISE, (1,), True)
        assert config.capture_sizes[-5:] == (8, 16, 32, 48, 64)
    # A dense model: a decode of one request compiled whole where it can be, else eager.
    config = cpu.default_graph_config(compiled_decode=True)
    assert (config.mode, config.capture_sizes, config.compile) == (GraphMode.FULL, (1,), True)


@pytest.mark.parametrize("batch", [1, 3, 4, 5, 8, 12])  # hits (1, 4, 8), padded (3, 5), above the largest (12)
def test_graph_path_gives_eager_tokens(eager, graphed, batch):
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    graphs = graphed.engine.runner.graphs
    assert [d.num_reqs for d in graphs.descriptors] == [8, 4, 2, 1]
    before = graphs.num_replays
    want = [o.outputs[0].token_ids for o in eager.generate(PROMPTS[:batch], params)]
    got = [o.outputs[0].token_ids for o in graphed.generate(PROMPTS[:batch], params)]
    assert got == want
    replays = graphs.num_replays - before
    assert replays == (0 if batch > 8 else 11)  # every decode step (12 tokens: 1 prefill + 11 decodes)
    assert graphed.engine.scheduler.block_pool.is_whole()


def test_padded_writes_leave_requests_intact(graphed):
    """Three requests padded to four: the padded row writes the null block, never a request's blocks."""
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    a = [o.outputs[0].token_ids for o in graphed.generate(PROMPTS[:3], params)]
    b = [o.outputs[0].token_ids for o in graphed.generate(PROMPTS[:3], params)]
    assert a == b


@pytest.fixture(scope="module")
def compiled_full():
    llm = LLM(dtype="float32", max_model_len=256, max_num_seqs=16, kv_cache_memory=64 << 20, graph_mode="full",
              graph_capture_sizes=[1, 4], graph_compile=True)
    if not llm.engine.runner.attn_backend.compiled_decode_graphs:
        pytest.skip("whole decode steps compile with mrv2's C++ decode attention (cpp-paged), not built here")
    return llm


@pytest.mark.parametrize("batch", [1, 3, 5])  # a hit, padded to 4, above the largest (eager)
def test_compiled_full_graphs_give_eager_tokens(eager, compiled_full, batch):
    """A decode step compiled whole: attention writes the cache in place (later steps read what it wrote)."""
    graphs = compiled_full.engine.runner.graphs
    # One graph per size: the kernel reads each request's length, so no key-length buckets.
    assert [(d.num_reqs, d.max_seq_len) for d in graphs.descriptors] == [(4, 256), (1, 256)]
    raw = compiled_full.engine.runner.kv_cache.raw
    before = graphs.num_replays
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in eager.generate(PROMPTS[:batch], params)]
    got = [o.outputs[0].token_ids for o in compiled_full.generate(PROMPTS[:batch], params)]
    assert got == want
    assert graphs.num_replays - before == (0 if batch > 4 else 11)
    assert compiled_full.engine.runner.kv_cache.raw is raw
    assert compiled_full.engine.scheduler.block_pool.is_whole()


CHUNKED = dict(max_model_len=256, max_num_seqs=16, kv_cache_memory=64 << 20, max_num_batched_tokens=32)


@pytest.fixture(scope="module")
def eager_chunked():
    return LLM(dtype="float32", **CHUNKED, enforce_eager=True)


@pytest.fixture(scope="module")
def piecewise():
    return LLM(dtype="float32", **CHUNKED, graph_mode="piecewise", graph_capture_sizes=[1, 2, 4, 8, 16])


@pytest.mark.parametrize("batch", [1, 5, 12])
def test_piecewise_gives_eager_tokens_with_chunked_prefill(eager_chunked, piecewise, batch, monkeypatch):
    """Prefill chunks, mixed prefill/decode steps and decodes replay pieces; steps above 16 tokens run eagerly."""
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    graphs = piecewise.engine.runner.graphs
    assert [d.num_tokens for d in graphs.descriptors] == [16, 8, 4, 2, 1]
    assert all(d.mode is GraphMode.PIECEWISE and d.num_reqs == 0 for d in graphs.descriptors)
    step_sizes, plan = [], graphs.plan
    monkeypatch.setattr(graphs, "plan", lambda n, lens: step_sizes.append(n.copy()) or plan(n, lens))
    before = graphs.num_replays
    want = [o.outputs[0].token_ids for o in eager_chunked.generate(PROMPTS[:batch], params)]
    got = [o.outputs[0].token_ids for o in piecewise.generate(PROMPTS[:batch], params)]
    assert got == want
    assert graphs.num_replays - before == sum(n.sum() <= 16 for n in step_sizes) > 0
    if batch == 12:
        assert any(n.sum() > 16 for n in step_sizes)  # some steps run eagerly
        # a replayed step mixing decodes and a prefill chunk
        assert any(n.sum() <= 16 and (n == 1).any() and (n > 1).any() for n in step_sizes)
    assert piecewise.engine.scheduler.block_pool.is_whole()


def test_full_and_piecewise_replays_full_for_decodes_and_pieces_for_the_rest(eager_chunked, monkeypatch):
    llm = LLM(dtype="float32", **CHUNKED, graph_mode="full_and_piecewise", graph_capture_sizes=[1, 2, 4, 8, 16])
    graphs = llm.engine.runner.graphs
    # FULL sizes count requests (clamped to max_num_seqs 16), PIECEWISE sizes count tokens.
    assert [(d.mode, d.num_tokens, d.num_reqs) for d in graphs.descriptors] == (
        [(GraphMode.FULL, n, n) for n in (16, 8, 4, 2, 1)] + [(GraphMode.PIECEWISE, n, 0) for n in (16, 8, 4, 2, 1)])
    step_sizes, plan = [], graphs.plan
    monkeypatch.setattr(graphs, "plan", lambda n, lens: step_sizes.append(n.copy()) or plan(n, lens))
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in eager_chunked.generate(PROMPTS, params)]
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)] == want
    decodes = sum((n == 1).all() for n in step_sizes)
    others = sum(not (n == 1).all() and n.sum() <= 16 for n in step_sizes)
    assert graphs.replays[GraphMode.FULL] == decodes > 0
    assert graphs.replays[GraphMode.PIECEWISE] == others > 0
    assert llm.engine.scheduler.block_pool.is_whole()


def test_full_graphs_per_key_length_bucket(monkeypatch):
    """max_model_len 512: FULL graphs for keys 256 and 512; decodes pick the bucket of their longest sequence.

    With the gather + SDPA backend, whose decode attention reads a fixed number of keys (cpp-paged reads
    each request's length: one graph per size, see test_compiled_full_graphs_give_eager_tokens)."""
    kwargs = dict(max_model_len=512, max_num_seqs=4, kv_cache_memory=64 << 20, attention_backend="torch")
    eager = LLM(dtype="float32", **kwargs, enforce_eager=True)
    full = LLM(dtype="float32", **kwargs, graph_mode="full", graph_capture_sizes=[1, 2, 4])
    graphs = full.engine.runner.graphs
    assert [(d.num_reqs, d.max_seq_len) for d in graphs.descriptors] == [
        (4, 512), (4, 256), (2, 512), (2, 256), (1, 512), (1, 256)]
    chosen, plan = [], graphs.plan

    def spy(num_scheduled, seq_lens):
        desc, padding = plan(num_scheduled, seq_lens)
        chosen.append((int(seq_lens.max()), desc))
        return desc, padding

    monkeypatch.setattr(graphs, "plan", spy)
    long_prompt = {"prompt_token_ids": [(i * 37) % 5000 + 10 for i in range(248)]}
    prompts = [long_prompt, PROMPTS[0], PROMPTS[1]]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in eager.generate(prompts, params)]
    assert [o.outputs[0].token_ids for o in full.generate(prompts, params)] == want
    replayed = [(longest, desc.max_seq_len) for longest, desc in chosen if desc is not None]
    assert all(longest <= keys and (keys == 256 or longest > 256) for longest, keys in replayed)
    assert {keys for _, keys in replayed} == {256, 512}  # the long prompt crossed 256 while decoding
    assert full.engine.scheduler.block_pool.is_whole()
