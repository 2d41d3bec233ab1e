"""The torch paged-attention backends against dense per-request attention in float64.

`TorchPagedAttention` gathers blocks for every row; `InductorPagedAttention` runs decode rows
through its compiled in-place kernel (warmed up as an engine does) and prefills as the former;
`CppPagedAttention` runs them through the CPU platform's C++ kernel.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from mrv2.attention.backend import CommonAttentionMetadata
from mrv2.attention.cpp_paged import CppPagedAttention
from mrv2.attention.paged_decode import InductorPagedAttention, PagedDecode
from mrv2.attention.torch_paged import TorchPagedAttention
from mrv2.engine.scheduler_output import NewRequestData
from mrv2.kv_spec import KVCacheSpec, LayerKVCache
from mrv2.platforms.cpu import CpuPlatform
from mrv2.runner.block_table import BlockTables
from mrv2.runner.input_batch import InputBuffers
from mrv2.runner.kv_cache import allocate_kv_cache, kv_cache_bytes
from mrv2.runner.states import RequestStates
from mrv2.sampling_params import SamplingParams

CPU = torch.device("cpu")
D = 16  # head dim
NUM_PAD = 3  # padding rows after the real tokens (as a captured graph's padded batch has)

# (num_computed, query_len) per request, decodes (query length 1) first, as the runner orders them.
SCENARIOS = {
    "decode": [(37, 1), (2, 1), (50, 1), (0, 1)],  # (0, 1): a one-token prompt is a "decode" row too
    "prefill": [(0, 23), (0, 40), (0, 2)],
    "prefill_cached": [(20, 13), (3, 30), (33, 4)],
    "mixed": [(45, 1), (16, 1), (0, 19), (33, 7), (4, 3)],
    # One long prompt beside short cached-prefix chunks: several prefill groups.
    "long_and_short": [(3, 1), (0, 60), (48, 4), (50, 2), (47, 5), (0, 3)],
}
HEADS = {"gqa": (8, 2), "mha": (4, 4)}
BACKENDS = {"torch": TorchPagedAttention, "inductor": InductorPagedAttention, "cpp": CppPagedAttention}


@pytest.fixture(autouse=True)
def _room_for_every_compiled_variant():
    # These tests compile the decode kernel for many head counts, layouts and block sizes in one
    # process; dynamo's default limit would quietly run the later ones uncompiled.
    with torch._dynamo.config.patch(recompile_limit=64):
        yield


def new_backend(name: str, heads, cache: LayerKVCache, scale: float):
    if name == "cpp" and "cpp-paged" not in CpuPlatform().attention_backend_names("gqa"):  # loads the kernel
        pytest.skip("mrv2's CPU kernels need AVX2, FMA, F16C and a C++ compiler")
    backend = BACKENDS[name]()
    backend.warm_up(heads[0], scale, cache)
    return backend


@dataclass
class Case:
    reqs: list[tuple[int, int]]
    q: list[torch.Tensor]  # per request [query_len, H, D]: queries of the new tokens
    k: list[torch.Tensor]  # per request [seq_len, Hkv, D]: the whole history
    v: list[torch.Tensor]
    blocks: list[list[int]]
    num_blocks: int
    max_blocks: int
    block_size: int


def make_case(reqs, heads, block_size, seed=0) -> Case:
    g = torch.Generator().manual_seed(seed)
    h, hkv = heads
    seq = [c + n for c, n in reqs]
    need = [-(-s // block_size) for s in seq]
    num_blocks = 1 + sum(need) + 5  # block 0 is reserved; a few blocks nobody owns
    perm = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()  # shuffled, non-contiguous
    blocks, at = [], 0
    for n in need:
        blocks.append(perm[at:at + n])
        at += n
    return Case(reqs=reqs,
                q=[torch.randn(n, h, D, generator=g) for _, n in reqs],
                k=[torch.randn(s, hkv, D, generator=g) for s in seq],
                v=[torch.randn(s, hkv, D, generator=g) for s in seq],
                blocks=blocks, num_blocks=num_blocks, max_blocks=max(need) + 3, block_size=block_size)


def make_cache(case: Case, heads, layout: str, garbage: str, seed=1) -> LayerKVCache:
    """A cache full of garbage except block 0 (zeroed, as the runner does) and the cached prefixes."""
    spec = KVCacheSpec.gqa(heads[1], D, D, torch.float32)
    layer = allocate_kv_cache([spec], layout, case.num_blocks, case.block_size, 64, CPU).layers[0]
    g = torch.Generator().manual_seed(seed)
    for view in layer.parts.values():
        if garbage == "nan":
            view.fill_(float("nan"))
        else:
            view.copy_(1e4 * torch.randn(view.shape, generator=g))
        view[0].zero_()
    bs = case.block_size
    for (computed, _), blocks, k, v in zip(case.reqs, case.blocks, case.k, case.v):
        for p in range(computed):
            layer["k"][blocks[p // bs], p % bs] = k[p]
            layer["v"][blocks[p // bs], p % bs] = v[p]
    return layer


def make_metadata(case: Case, seed=2) -> CommonAttentionMetadata:
    bs = case.block_size
    g = torch.Generator().manual_seed(seed)
    # Columns past a request's own blocks hold stale ids of other blocks (a reused slot's leftovers).
    table = torch.randint(0, case.num_blocks, (len(case.reqs), case.max_blocks), generator=g, dtype=torch.int32)
    slots = []
    for row, ((computed, n), blocks) in enumerate(zip(case.reqs, case.blocks)):
        table[row, :len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        slots += [blocks[p // bs] * bs + p % bs for p in range(computed, computed + n)]
    qlens = np.array([n for _, n in case.reqs])
    qsl = np.concatenate([[0], np.cumsum(qlens)])
    seq_lens = np.array([c + n for c, n in case.reqs])
    return CommonAttentionMetadata(
        num_reqs=len(case.reqs), num_tokens=int(qsl[-1]), num_decodes=int((qlens == 1).sum()),
        max_query_len=int(qlens.max()), max_seq_len=int(seq_lens.max()),
        query_start_loc=torch.from_numpy(qsl).int(), seq_lens=torch.from_numpy(seq_lens).int(), block_table=table,
        slot_mapping=torch.tensor(slots, dtype=torch.int64), query_start_loc_cpu=qsl, seq_lens_cpu=seq_lens,
        block_size=bs)


def step_inputs(case: Case) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The step's query/key/value rows, followed by NaN padding rows that must never be read."""
    def pad(x):
        return torch.cat([x, torch.full((NUM_PAD, *x.shape[1:]), float("nan"))])
    q = pad(torch.cat(case.q))
    k = pad(torch.cat([k[c:] for (c, _), k in zip(case.reqs, case.k)]))
    v = pad(torch.cat([v[c:] for (c, _), v in zip(case.reqs, case.v)]))
    return q, k, v


def reference(case: Case, scale: float) -> torch.Tensor:
    """Plain causal softmax attention per request, in float64, over the request's full K/V."""
    outs = []
    for (computed, n), q, k, v in zip(case.reqs, case.q, case.k, case.v):
        group = q.shape[1] // k.shape[1]
        k = k.double().repeat_interleave(group, dim=1)  # [S, H, D]
        v = v.double().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
        pos = torch.arange(computed, computed + n)
        scores = scores.masked_fill(torch.arange(k.shape[0])[None, :] > pos[:, None], -math.inf)
        outs.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), v))
    return torch.cat(outs)


def run(case: Case, heads, layout: str, garbage: str = "finite", backend: str = "torch"):
    cache = make_cache(case, heads, layout, garbage)
    scale = D ** -0.5
    backend = new_backend(backend, heads, cache, scale)
    meta = backend.build_metadata(make_metadata(case))
    if meta.num_decodes and isinstance(backend, InductorPagedAttention):
        assert isinstance(meta.decode, PagedDecode)  # the compiled kernel serves the decode rows
    q, k, v = step_inputs(case)
    out = backend.forward(q, k, v, cache, meta, scale)
    assert out.shape == (q.shape[0], heads[0], D)
    return out[:q.shape[0] - NUM_PAD], cache


@pytest.mark.parametrize("scenario", list(SCENARIOS))
@pytest.mark.parametrize("heads", list(HEADS))
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("layout", ["joint", "split"])
@pytest.mark.parametrize("backend", list(BACKENDS))
def test_matches_dense_reference(scenario, heads, block_size, layout, backend):
    case = make_case(SCENARIOS[scenario], HEADS[heads], block_size)
    out, _ = run(case, HEADS[heads], layout, backend=backend)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), reference(case, D ** -0.5), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("scenario", list(SCENARIOS))
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("backend", list(BACKENDS))
def test_layouts_agree(scenario, block_size, backend):
    case = make_case(SCENARIOS[scenario], HEADS["gqa"], block_size, seed=3)
    joint, _ = run(case, HEADS["gqa"], "joint", backend=backend)
    split, _ = run(case, HEADS["gqa"], "split", backend=backend)
    torch.testing.assert_close(joint, split, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("layout", ["joint", "split"])
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("scenario, backend", [("mixed", "torch"), ("mixed", "cpp"), ("decode", "cpp")])
def test_new_kv_written_at_slot_mapping_and_nowhere_else(layout, block_size, scenario, backend):
    # cpp: a decode-only step writes its keys and values in its one kernel call per layer
    case = make_case(SCENARIOS[scenario], HEADS["gqa"], block_size, seed=4)
    before = make_cache(case, HEADS["gqa"], layout, "finite")
    expected = {name: t.clone() for name, t in before.parts.items()}
    bs = block_size
    for (computed, n), blocks, k, v in zip(case.reqs, case.blocks, case.k, case.v):
        for p in range(computed, computed + n):
            expected["k"][blocks[p // bs], p % bs] = k[p]
            expected["v"][blocks[p // bs], p % bs] = v[p]
    _, cache = run(case, HEADS["gqa"], layout, backend=backend)  # same seeds: same initial garbage as `before`
    for name in ("k", "v"):
        assert torch.equal(cache[name], expected[name]), name


@pytest.mark.parametrize("layout", ["joint", "split"])
def test_never_written_blocks_read_as_zeros(layout):
    """The backend reads whole blocks, so 0 * NaN from never-written memory would leak through SDPA.

    The contract that prevents it: the allocation is zeroed once, when it is made, and
    never per step. Freed NaN bytes of the same size come first, so an allocator that
    hands back recycled memory uninitialised would show them.
    """
    spec = KVCacheSpec.gqa(2, D, D, torch.float32)
    size = kv_cache_bytes([spec, spec], layout, 8, 4, 64)
    for _ in range(3):
        garbage = torch.full((size,), 0xFF, dtype=torch.uint8)  # all-ones bytes: NaN in every float
        del garbage
        cache = allocate_kv_cache([spec, spec], layout, 8, 4, 64, CPU)
        assert (cache.raw == 0).all()
        for layer in cache.layers:
            for view in layer.parts.values():
                assert (view == 0).all()


@pytest.mark.parametrize("heads", list(HEADS))
def test_profile_path_is_causal_self_attention(heads):
    """metadata=None: causal attention over all tokens as one sequence, no cache."""
    case = make_case([(0, 29)], HEADS[heads], 4, seed=7)
    scale = 0.3
    out = TorchPagedAttention().forward(case.q[0], case.k[0], case.v[0], None, None, scale)
    torch.testing.assert_close(out.double(), reference(case, scale), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("layout", ["joint", "split"])
@pytest.mark.parametrize("backend", list(BACKENDS))
def test_with_metadata_from_input_buffers(layout, backend):
    """End to end with the runner's own metadata: RequestStates + BlockTables -> InputBuffers.prepare."""
    bs, heads = 4, HEADS["gqa"]
    reqs = SCENARIOS["mixed"]
    case = make_case(reqs, heads, bs, seed=8)
    max_blocks = case.max_blocks
    states = RequestStates(8, max_blocks * bs, CPU, pin_memory=False)
    tables = BlockTables(8, max_blocks, bs, CPU, pin_memory=False)
    inputs = InputBuffers(8, 128, max_blocks, CPU, pin_memory=False)
    # Occupy and free a slot first so that slot order differs from batch order.
    states.add(NewRequestData("tmp", [1], [1], SamplingParams(), [], 0))
    idx = []
    for i, ((computed, n), blocks) in enumerate(zip(reqs, case.blocks)):
        tokens = list(range(1, computed + n + 1))
        slot = states.add(NewRequestData(f"r{i}", tokens, tokens, SamplingParams(), blocks, computed))
        tables.reset(slot)
        tables.append(slot, blocks)
        idx.append(slot)
        if i == 1:
            states.remove("tmp")
    states.apply_staged()
    tables.apply_staged()
    batch = inputs.prepare([f"r{i}" for i in range(len(reqs))], np.array(idx), np.array([n for _, n in reqs]),
                           states, tables)
    assert batch.attn.num_decodes == 2
    torch.testing.assert_close(batch.attn.slot_mapping, make_metadata(case).slot_mapping)

    caches = [make_cache(case, heads, layout, "finite", seed=10 + layer) for layer in range(2)]
    backend = new_backend(backend, heads, caches[0], D ** -0.5)
    meta = backend.build_metadata(batch.attn)
    q, k, v = step_inputs(case)
    want = reference(case, D ** -0.5)
    for cache in caches:  # one metadata serves every layer
        out = backend.forward(q, k, v, cache, meta, D ** -0.5)[:batch.num_tokens]
        torch.testing.assert_close(out.double(), want, rtol=1e-4, atol=1e-5)


def test_prefill_rows_split_into_groups_without_padding_waste():
    from mrv2.attention.torch_paged import _group_bounds

    assert _group_bounds(np.array([1056, 32, 32, 32]), np.array([1056, 1056, 1056, 1056]), 5) == [5, 6, 9]
    assert _group_bounds(np.array([32, 30, 31]), np.array([100, 90, 95]), 0) == [0, 3]  # alike: one group
    case = make_case(SCENARIOS["long_and_short"], HEADS["gqa"], 4)
    meta = TorchPagedAttention().build_metadata(make_metadata(case))
    assert len(meta.prefills) >= 2
    assert [g.token_start for g in meta.prefills[1:]] == [g.token_end for g in meta.prefills[:-1]]
