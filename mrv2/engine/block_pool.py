"""The pool of KV cache blocks: allocation, reference counts and the free queue."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

NULL_BLOCK_ID = 0


class BlockPool:
    """Hands out KV block ids from a FIFO free queue; block 0 is the reserved null block.

    The null block absorbs padded writes and is never handed out. Every block keeps a
    reference count so prefix caching can later share blocks between requests (and
    keep freed, hashed blocks evictable in LRU order) without changing this interface.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be at least 2 (block 0 is reserved), got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_cnt = [0] * num_blocks
        self.ref_cnt[NULL_BLOCK_ID] = 1  # held forever
        self._free: deque[int] = deque(range(1, num_blocks))

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

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
        """Pop `num_blocks` blocks off the free queue; None (and nothing taken) if too few are free."""
        if num_blocks < 0:
            raise ValueError(f"cannot allocate {num_blocks} blocks")
        if num_blocks > len(self._free):
            return None
        blocks = [self._free.popleft() for _ in range(num_blocks)]
        for b in blocks:
            self.ref_cnt[b] = 1
        return blocks

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one reference to each block; blocks reaching zero go to the tail of the free queue."""
        for b in block_ids:
            if not NULL_BLOCK_ID < b < self.num_blocks:
                raise ValueError(f"block {b} cannot be freed")
            if self.ref_cnt[b] <= 0:
                raise RuntimeError(f"double free of KV block {b}")
            self.ref_cnt[b] -= 1
            if self.ref_cnt[b] == 0:
                self._free.append(b)
