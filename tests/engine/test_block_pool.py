"""BlockPool and KVCacheManager: allocation, FIFO reuse, null block, double free, prefix caching."""

import pytest

from mrv2.engine.block_pool import NULL_BLOCK_ID, BlockPool
from mrv2.engine.kv_cache_manager import KVCacheManager
from mrv2.engine.request import Request
from mrv2.sampling_params import SamplingParams


def test_allocate_free_fifo_and_null_block():
    pool = BlockPool(5)
    assert pool.num_usable_blocks == 4 and pool.num_free_blocks == 4 and pool.is_whole()
    a = pool.allocate(2)
    assert a == [1, 2] and NULL_BLOCK_ID not in a
    assert pool.num_free_blocks == 2 and not pool.is_whole()
    assert pool.allocate(3) is None and pool.num_free_blocks == 2  # nothing taken on failure
    assert pool.allocate(0) == []
    pool.free([2, 1])
    assert pool.is_whole()
    assert pool.allocate(4) == [3, 4, 2, 1]  # freed blocks go to the tail
    assert pool.num_free_blocks == 0 and pool.allocate(1) is None
    assert pool.usage == 1.0


def test_double_free_and_bad_ids_raise():
    pool = BlockPool(4)
    blocks = pool.allocate(2)
    pool.free(blocks)
    with pytest.raises(RuntimeError, match="double free"):
        pool.free(blocks[:1])
    with pytest.raises(ValueError):
        pool.free([NULL_BLOCK_ID])
    with pytest.raises(ValueError):
        pool.free([4])
    with pytest.raises(ValueError):
        pool.allocate(-1)
    with pytest.raises(ValueError):
        BlockPool(1)


def test_ref_counts():
    pool = BlockPool(3)
    (b,) = pool.allocate(1)
    assert pool.ref_cnt[b] == 1 and pool.ref_cnt[NULL_BLOCK_ID] == 1
    pool.touch([b])  # a second holder, as a prefix-cache hit takes
    pool.free([b])
    assert pool.num_free_blocks == 1
    pool.free([b])
    assert pool.is_whole()


def _req(n: int) -> Request:
    return Request("r", list(range(n)), SamplingParams(max_tokens=4))


def test_kv_cache_manager_grows_and_frees_in_reverse():
    pool = BlockPool(6)
    kv = KVCacheManager(pool, block_size=4, max_model_len=64)
    r = _req(9)
    assert kv.num_blocks_needed(r, 9) == 3
    assert kv.allocate_slots(r, 9) == [1, 2, 3] and r.block_ids == [1, 2, 3]
    r.num_computed_tokens = 9
    assert kv.allocate_slots(r, 3) == []  # tokens 9..11 fit in block 3
    r.num_computed_tokens = 12
    assert kv.allocate_slots(r, 1) == [4]
    r.num_computed_tokens = 13
    assert kv.allocate_slots(r, 8) is None and r.block_ids == [1, 2, 3, 4]  # needs 2, 1 free
    assert pool.num_free_blocks == 1
    kv.free(r)
    assert r.block_ids == [] and pool.is_whole()
    assert pool.allocate(5) == [5, 4, 3, 2, 1]  # tail blocks were freed first


def test_kv_cache_manager_rejects_overlong():
    kv = KVCacheManager(BlockPool(100), block_size=4, max_model_len=16)
    with pytest.raises(ValueError, match="max_model_len"):
        kv.allocate_slots(_req(4), 17)


def test_cached_blocks_stay_findable_when_free_and_are_evicted_oldest_first():
    pool = BlockPool(5)
    a, b, c, d = pool.allocate(4)
    for block, key in ((a, b"A"), (b, b"B"), (c, b"C")):
        pool.cache_block(block, key)
    pool.cache_block(d, b"A")  # a second block with a cached hash stays uncached
    assert pool.cached_block(b"A") == a and pool.block_hash[d] is None
    pool.free([c, b, a, d])  # free order: c, b, a, d
    assert pool.is_whole() and pool.num_cached_blocks == 3
    pool.touch([b])  # a hit on a free cached block takes it out of the queue
    assert pool.ref_cnt[b] == 1 and pool.num_free_blocks == 3
    assert pool.allocate(1) == [c] and pool.cached_block(b"C") is None  # the oldest free one is evicted
    assert pool.cached_block(b"A") == a and pool.cached_block(b"B") == b
    assert not pool.reset_prefix_cache()  # blocks are held
    pool.free([b, c])
    assert pool.reset_prefix_cache() and pool.num_cached_blocks == 0 and pool.is_whole()


def _prompt_req(req_id: str, tokens: list[int]) -> Request:
    return Request(req_id, tokens, SamplingParams(max_tokens=4))


def test_kv_cache_manager_shares_full_prefix_blocks_and_always_computes_the_last_token():
    pool = BlockPool(12)
    kv = KVCacheManager(pool, block_size=4, max_model_len=64, enable_caching=True)
    first = _prompt_req("a", list(range(10)))
    assert kv.get_computed_blocks(first) == []
    kv.allocate_slots(first, 10)
    assert pool.num_cached_blocks == 2  # the two full blocks, at once
    same_prefix = _prompt_req("b", list(range(9)) + [99, 98])
    hits = kv.get_computed_blocks(same_prefix)
    assert hits == first.block_ids[:2]
    same_prefix.num_computed_tokens = 8
    kv.allocate_slots(same_prefix, 3, hits)
    assert same_prefix.block_ids[:2] == first.block_ids[:2] and pool.ref_cnt[first.block_ids[0]] == 2
    exact = _prompt_req("c", list(range(8)))  # whole blocks: the last one is recomputed, never shared
    assert kv.get_computed_blocks(exact) == first.block_ids[:1]
    other = _prompt_req("d", [7] + list(range(1, 10)))
    assert kv.get_computed_blocks(other) == []  # chained: a different first block changes every hash
    for r in (first, same_prefix):
        kv.free(r)
    assert pool.is_whole() and pool.num_cached_blocks == 2


def test_hits_on_free_cached_blocks_count_against_the_free_blocks():
    pool = BlockPool(4)  # 3 usable blocks
    kv = KVCacheManager(pool, block_size=4, max_model_len=64, enable_caching=True)
    first = _prompt_req("a", list(range(9)))
    kv.allocate_slots(first, 9)
    kv.free(first)
    second = _prompt_req("b", list(range(8)) + [50, 51, 52, 53, 54])  # 13 tokens: 4 blocks
    hits = kv.get_computed_blocks(second)
    assert len(hits) == 2
    second.num_computed_tokens = 8
    assert kv.allocate_slots(second, 5, hits) is None  # 2 new + 2 reclaimed > 3 free
    assert pool.is_whole() and second.block_ids == []
