"""Maps requests' tokens onto KV blocks from a BlockPool, with automatic prefix caching.

With caching on, every block that fills with known tokens is registered under its
chained hash as soon as it is scheduled (the step that writes it runs before any step
that could read it), and a new request starts from the longest run of cached blocks
matching its tokens, short of its last token (which is always computed, so a request
never writes into a shared block). Hits and queries are counted in tokens.
"""

from __future__ import annotations

from mrv2.engine.block_hash import extend_block_hashes
from mrv2.engine.block_pool import BlockPool
from mrv2.engine.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """Grows and frees each request's block table (`Request.block_ids`), sharing cached prefixes."""

    def __init__(self, block_pool: BlockPool, block_size: int, max_model_len: int,
                 enable_caching: bool = False) -> None:
        self.block_pool = block_pool
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        self.num_queried_tokens = 0
        self.num_hit_tokens = 0

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

    def get_computed_blocks(self, request: Request) -> list[int]:
        """The cached blocks that hold a prefix of a request with no blocks yet (its last token excluded)."""
        if not self.enable_caching or request.sampling_params.prompt_logprobs is not None:
            return []  # prompt logprobs need every prompt position computed
        blocks: list[int] = []
        for block_hash in self._block_hashes(request)[:(request.num_tokens - 1) // self.block_size]:
            block = self.block_pool.cached_block(block_hash)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def record_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Count an admitted request's cache lookup (tokens asked for, tokens found)."""
        if self.enable_caching:
            self.num_queried_tokens += num_tokens
            self.num_hit_tokens += num_hit_tokens

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       computed_blocks: list[int] | None = None) -> list[int] | None:
        """Extend the request's blocks for `num_new_tokens` more tokens (after `computed_blocks`, the
        cache hits of a new request, which its num_computed_tokens already counts); return the new
        block ids, or None (taking nothing) when the pool has too few free blocks."""
        if request.num_computed_tokens + num_new_tokens > self.max_model_len:
            raise ValueError(f"request {request.req_id} would exceed max_model_len ({self.max_model_len})")
        computed_blocks = computed_blocks or []
        needed = self.num_blocks_needed(request, num_new_tokens) - len(computed_blocks)
        # Hits on free cached blocks take them out of the free queue too.
        reclaimed = sum(1 for b in computed_blocks if self.block_pool.ref_cnt[b] == 0)
        if needed + reclaimed > self.block_pool.num_free_blocks:
            return None
        self.block_pool.touch(computed_blocks)
        request.block_ids.extend(computed_blocks)
        new_blocks = self.block_pool.allocate(needed)
        request.block_ids.extend(new_blocks)
        if self.enable_caching:
            self._cache_full_blocks(request, request.num_computed_tokens + num_new_tokens)
        return new_blocks

    def _cache_full_blocks(self, request: Request, num_tokens: int) -> None:
        """Register the request's full blocks of known tokens among its first `num_tokens` (new ones only)."""
        hashes = self._block_hashes(request, num_tokens)
        full = min(num_tokens, request.num_tokens) // self.block_size
        for i in range(request.num_cached_blocks, full):
            self.block_pool.cache_block(request.block_ids[i], hashes[i])
        request.num_cached_blocks = max(request.num_cached_blocks, full)

    def _block_hashes(self, request: Request, num_tokens: int | None = None) -> list[bytes]:
        """The request's block hashes, extended over its full blocks among the first `num_tokens`."""
        return extend_block_hashes(request.block_hashes, request.all_token_ids, self.block_size, num_tokens,
                                   request.hash_salt)

    def free(self, request: Request) -> None:
        """Return all the request's blocks, tail first: the least shareable are evicted first."""
        self.block_pool.free(reversed(request.block_ids))
        request.block_ids = []
        request.num_cached_blocks = 0

    def reset_prefix_cache(self) -> bool:
        return self.block_pool.reset_prefix_cache()
