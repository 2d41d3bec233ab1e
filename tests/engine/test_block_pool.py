"""BlockPool and KVCacheManager: allocation, FIFO reuse, null block, double free."""

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
    pool.ref_cnt[b] += 1  # a second holder, as prefix caching will do
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
