"""The compiled in-place decode attention: the default model's shapes, its compiled variants, its fallback.

Exactness against float64 over every scenario, layout and block size is in test_torch_paged.py
(both backends run there); this file covers what is particular to compiling.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from mrv2.attention.backend import CommonAttentionMetadata
from mrv2.attention.paged_decode import InductorPagedAttention, PagedDecode, paged_decode_attention
from mrv2.attention.torch_paged import TorchPagedAttention
from mrv2.kv_spec import KVCacheSpec
from mrv2.runner.kv_cache import allocate_kv_cache

H, HKV, D, BS = 9, 3, 64, 16  # the default model's heads; its block size
NUM_BLOCKS = 512


def _cache(dtype: torch.dtype, layout: str = "joint", seed: int = 0, num_blocks: int = NUM_BLOCKS):
    spec = KVCacheSpec.gqa(HKV, D, D, dtype)
    layer = allocate_kv_cache([spec], layout, num_blocks, BS, 64, torch.device("cpu")).layers[0]
    g = torch.Generator().manual_seed(seed)
    for view in layer.parts.values():
        view.copy_(torch.randn(view.shape, generator=g))
    return layer


def _decode_metadata(seq_lens: list[int], seed: int = 1) -> CommonAttentionMetadata:
    """Decode rows only: one new token each, `seq_lens` long with it, blocks shuffled over the cache."""
    g = torch.Generator().manual_seed(seed)
    n, max_blocks = len(seq_lens), -(-max(seq_lens) // BS) + 2
    table = (torch.randperm(NUM_BLOCKS - 1, generator=g)[:n * max_blocks] + 1).view(n, max_blocks).int()
    lens = np.array(seq_lens)
    slots = [int(table[r, (s - 1) // BS]) * BS + (s - 1) % BS for r, s in enumerate(seq_lens)]
    qsl = np.arange(n + 1)
    return CommonAttentionMetadata(
        num_reqs=n, num_tokens=n, num_decodes=n, max_query_len=1, max_seq_len=int(lens.max()),
        query_start_loc=torch.from_numpy(qsl).int(), seq_lens=torch.from_numpy(lens).int(), block_table=table,
        slot_mapping=torch.tensor(slots), query_start_loc_cpu=qsl, seq_lens_cpu=lens, block_size=BS)


def _attend(backend, cache, common, seed: int = 2):
    g = torch.Generator().manual_seed(seed)
    dtype = cache["k"].dtype
    q = torch.randn(common.num_tokens, H, D, generator=g).to(dtype)
    k = torch.randn(common.num_tokens, HKV, D, generator=g).to(dtype)
    v = torch.randn(common.num_tokens, HKV, D, generator=g).to(dtype)
    return backend.forward(q, k, v, cache, backend.build_metadata(common), D ** -0.5)


def _warm(cache) -> InductorPagedAttention:
    backend = InductorPagedAttention()
    with torch.inference_mode():
        backend.warm_up(H, D ** -0.5, cache)
    return backend


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_the_default_models_shapes_match_the_gathering_backend(dtype, tol):
    cache = _cache(dtype)
    paged = _warm(cache)
    for lens in ([1], [37], [5, 300, 17, 64, 65, 1]):
        common = _decode_metadata(lens)
        before, after = _cache(dtype), _cache(dtype)  # allocated outside inference mode, as the runner does
        with torch.inference_mode():
            assert isinstance(paged.build_metadata(common).decode, PagedDecode)
            want = _attend(TorchPagedAttention(), before, common)
            got = _attend(paged, after, common)
        torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


def test_two_compiled_variants_serve_every_batch_and_context_after_warm_up():
    cache = _cache(torch.bfloat16)
    paged = _warm(cache)
    # Another engine's cache of another size, same model: what a second engine in the process holds.
    other = _cache(torch.bfloat16, num_blocks=NUM_BLOCKS + 100)
    # Any recompile from here on (a new batch size, block count, stride or tensor kind) raises.
    with torch._dynamo.config.patch(error_on_recompile=True), torch.inference_mode():
        for lens in ([1], [150], [2, 3], [40] * 7, list(range(1, 65)), [16 * 40] * 3):
            _attend(paged, cache, _decode_metadata(lens))
            _attend(paged, other, _decode_metadata(lens))


def test_a_step_finds_its_compiled_variant_once_and_calls_it_directly_for_every_layer():
    torch._dynamo.reset()  # variants of earlier tests' engines may have reached the recompile limit
    layers = [_cache(torch.bfloat16, seed=s) for s in range(3)]
    paged = _warm(layers[0])
    q = torch.randn(2, H, D).bfloat16()
    with torch.inference_mode():
        meta = paged.build_metadata(_decode_metadata([40, 90])).decode
        got = [paged._decode(q, layers[0], meta, 0.125)]
        entry = meta.entry
        got += [paged._decode(q, layer, meta, 0.125) for layer in layers[1:]]
        # dynamo's own code for this variant (its output code, not the torch.compile wrapper)
        assert entry is not paged._decode_fn and entry.__code__ is not paged_decode_attention.__code__
        want = [paged._decode_fn(q, layer["k"], layer["v"], meta.block_table, meta.seq_lens, 0.125)
                for layer in layers]
    assert meta.entry is entry  # found once, at the first layer
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)


def test_the_eager_function_is_the_same_computation():
    cache = _cache(torch.float32)
    common = _decode_metadata([33, 7, 90])
    meta = InductorPagedAttention().build_metadata(common).decode
    q = torch.randn(3, H, D)
    got = paged_decode_attention(q, cache["k"], cache["v"], meta.block_table, meta.seq_lens, 0.125)
    with torch.inference_mode():
        want = _warm(cache)._decode(q, cache, meta, 0.125)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_a_failed_compile_falls_back_to_gathering(caplog):
    cache = _cache(torch.float32)
    backend = InductorPagedAttention()

    def broken(*args):
        raise RuntimeError("no compiler today")

    backend._decode_fn = broken  # what a broken toolchain does at the first compile
    with caplog.at_level(logging.WARNING, logger="mrv2"), torch.inference_mode():
        backend.warm_up(H, D ** -0.5, cache)
        common = _decode_metadata([20, 3])
        assert not isinstance(backend.build_metadata(common).decode, PagedDecode)
        got = _attend(backend, cache, common)
    assert "no compiler today" in caplog.text and "gathers its blocks instead" in caplog.text
    fresh = _cache(torch.float32)
    with torch.inference_mode():
        want = _attend(TorchPagedAttention(), fresh, common)
    torch.testing.assert_close(got, want)
