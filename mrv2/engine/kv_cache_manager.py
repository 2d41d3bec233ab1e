"""Maps requests' tokens onto KV blocks from a BlockPool."""

from __future__ import annotations

from mrv2.engine.block_pool import BlockPool
from mrv2.engine.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """Grows and frees each request's block table (`Request.block_ids`); no prefix caching yet."""

    def __init__(self, block_pool: BlockPool, block_size: int, max_model_len: int) -> None:
        self.block_pool = block_pool
        self.block_size = block_size
        self.max_model_len = max_model_len

    @property
    def usage(self) -> float:
        return self.block_pool.usage

    def blocks_for_tokens(self, num_tokens: int) -> int:
        """Blocks that hold `num_tokens` tokens."""
        return cdiv(num_tokens, self.block_size)

    def num_blocks_needed(self, request: Request, num_new_tokens: int) -> int:
        """New blocks the request needs so its computed tokens plus `num_new_tokens` fit."""
        total = self.blocks_for_tokens(request.num_computed_tokens + num_new_tokens)
        return max(0, total - len(request.block_ids))

    def allocate_slots(self, request: Request, num_new_tokens: int) -> list[int] | None:
        """Extend the request's blocks for `num_new_tokens` more tokens; return the new block
        ids, or None (allocating nothing) when the pool has too few free blocks."""
        if request.num_computed_tokens + num_new_tokens > self.max_model_len:
            raise ValueError(f"request {request.req_id} would exceed max_model_len ({self.max_model_len})")
        new_blocks = self.block_pool.allocate(self.num_blocks_needed(request, num_new_tokens))
        if new_blocks is not None:
            request.block_ids.extend(new_blocks)
        return new_blocks

    def free(self, request: Request) -> None:
        """Return all the request's blocks; tail first, so with prefix caching the least
        shareable blocks would be evicted first."""
        self.block_pool.free(reversed(request.block_ids))
        request.block_ids = []
