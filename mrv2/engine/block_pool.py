"""The pool of KV cache blocks: allocation, reference counts, the free queue and cached full blocks.

A block's reference count is the number of requests holding it. A block that is full
of known tokens can be cached under its chained hash (see `block_hash.py`); when its
last holder frees it, it joins the free queue but stays findable by hash until an
allocation evicts it, oldest-freed first (LRU). A cache hit on a free block takes it
back out of the queue ("touch").
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

NULL_BLOCK_ID = 0


class BlockPool:
    """Hands out KV block ids; block 0 is the reserved null block.

    The null block absorbs padded writes and is never handed out. The free queue is an
    ordered set, so a cached free block can leave it from the middle in O(1).
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be at least 2 (block 0 is reserved), got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_cnt = [0] * num_blocks
        self.ref_cnt[NULL_BLOCK_ID] = 1  # held forever
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(1, num_blocks))
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self._cached: dict[bytes, int] = {}

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        """Blocks no request holds (cached ones among them stay findable until evicted)."""
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    @property
    def usage(self) -> float:
        """Fraction of usable blocks in use."""
        return 1.0 - self.num_free_blocks / self.num_usable_blocks

    def is_whole(self) -> bool:
        """True when every usable block is back in the free queue."""
        return self.num_free_blocks == self.num_usable_blocks

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= len(self._free)

    def allocate(self, num_blocks: int) -> list[int] | None:
        """Take `num_blocks` blocks off the head of the free queue (evicting their cached hashes);
        None, taking nothing, if too few are free."""
        if num_blocks < 0:
            raise ValueError(f"cannot allocate {num_blocks} blocks")
        if num_blocks > len(self._free):
            return None
        blocks = [self._free.popitem(last=False)[0] for _ in range(num_blocks)]
        for b in blocks:
            self.ref_cnt[b] = 1
            self._evict(b)
        return blocks

    def touch(self, block_ids: Iterable[int]) -> None:
        """Take one more reference to cached blocks (a prefix-cache hit); free ones leave the queue."""
        for b in block_ids:
            if self.ref_cnt[b] == 0:
                del self._free[b]
            self.ref_cnt[b] += 1

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one reference to each block; blocks reaching zero go to the tail of the free queue."""
        for b in block_ids:
            if not NULL_BLOCK_ID < b < self.num_blocks:
                raise ValueError(f"block {b} cannot be freed")
            if self.ref_cnt[b] <= 0:
                raise RuntimeError(f"double free of KV block {b}")
            self.ref_cnt[b] -= 1
            if self.ref_cnt[b] == 0:
                self._free[b] = None

    def cache_block(self, block_id: int, block_hash: bytes) -> None:
        """Make a full block findable by its hash (a block already cached under it keeps the entry)."""
        if self.block_hash[block_id] is None and block_hash not in self._cached:
            self._cached[block_hash] = block_id
            self.block_hash[block_id] = block_hash

    def cached_block(self, block_hash: bytes) -> int | None:
        return self._cached.get(block_hash)

    def _evict(self, block_id: int) -> None:
        block_hash = self.block_hash[block_id]
        if block_hash is not None:
            del self._cached[block_hash]
            self.block_hash[block_id] = None

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; only when no request holds a block (False, nothing done, otherwise)."""
        if not self.is_whole():
            return False
        self._cached.clear()
        self.block_hash = [None] * self.num_blocks
        return True
