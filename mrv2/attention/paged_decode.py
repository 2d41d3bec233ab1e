"""Decode attention that reads the KV cache's blocks in place: the CPU's default GQA backend.

`TorchPagedAttention` gathers every decode request's blocks into a padded copy and
runs SDPA over it. Here decode rows go through one compiled function instead: written
as plain reductions over the block table (`paged_decode_attention`), which Inductor's
C++ code generation fuses so that each key and value is loaded straight from its
block (an indirect load), never copied. Prefill groups stay on the gather + SDPA
path, where the SDPA kernel's query blocks are full.

One layer of the default model (9 query / 3 KV heads of 64, bf16) on a 2 vCPU Sapphire
Rapids, compiled against gather + SDPA: 89 vs 168 us at batch 1 and 160 keys, 2.6 vs 5.6 ms
at batch 64 and 160 keys, 14 vs 45 ms at batch 64 and 1,100 keys.

The function is compiled once per process. Batch size and block count are dynamic:
a batch of one is specialized, so two variants serve every step, both compiled by
`warm_up` at start-up (Inductor's on-disk cache makes later processes fast). A step finds
its variant once (`dynamo_entry`) and calls it directly for every layer: through dynamo's
dispatch a call took 75 instead of 57 us at batch 1 and 160 keys. Without a
C++ compiler, or should compiling fail, the log says why and the gather + SDPA path runs.
"""

from __future__ import annotations

import functools
import logging
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from mrv2.attention.backend import CommonAttentionMetadata
from mrv2.attention.registry import register_backend
from mrv2.attention.torch_paged import TorchPagedAttention, longest_context
from mrv2.kv_spec import LayerKVCache
from mrv2.platforms.graphs import dynamo_entry, replay_guards

logger = logging.getLogger("mrv2")


def paged_decode_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_table: torch.Tensor, seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """One query token per request over its first `seq_lens` cached tokens; fp32 softmax and sums.

    query [B, H, D], k_cache / v_cache [num_blocks, block_size, Hkv, D(v)] (views of one layer),
    block_table [B, nb] (int32), seq_lens [B] (each at least 1) -> [B, H, Dv] in the query's dtype.
    Eager, this gathers the blocks like the reference path; compiled, the gathers fuse into the loads.
    """
    b, h, d = query.shape
    nb, bs, hkv = block_table.shape[1], k_cache.shape[1], k_cache.shape[2]
    blocks = block_table.long()
    k = k_cache[blocks].reshape(b, nb * bs, hkv, 1, d)  # [B, keys, Hkv, 1, D]
    v = v_cache[blocks].reshape(b, nb * bs, hkv, 1, v_cache.shape[-1])
    q = query.reshape(b, 1, hkv, h // hkv, d).float()  # a KV head's query heads side by side
    scores = (q * k.float()).sum(-1) * scale  # [B, keys, Hkv, G]
    valid = torch.arange(nb * bs, device=query.device)[None, :] < seq_lens[:, None]
    probs = torch.softmax(scores.masked_fill(~valid[:, :, None, None], float("-inf")), dim=1)
    out = (probs[..., None] * v.float()).sum(1)  # [B, Hkv, G, Dv]
    return out.reshape(b, h, -1).to(query.dtype)


def compiler_found() -> bool:
    """Whether Inductor's C++ code generation has a compiler to call."""
    return any(shutil.which(c) for c in ("g++", "c++", "clang++"))


@functools.cache
def compiled_paged_decode() -> Callable[..., torch.Tensor]:
    """`paged_decode_attention` through torch.compile (Inductor): one per process, shared by every engine."""
    # Not fullgraph: past dynamo's recompile limit a call then runs eagerly instead of raising.
    return torch.compile(paged_decode_attention, options={"guard_filter_fn": replay_guards})


@dataclass
class PagedDecode:
    """The decode rows' whole blocks (covering the longest context) and lengths."""

    block_table: torch.Tensor  # [R, nb] int32, contiguous
    seq_lens: torch.Tensor  # [R], at least 1: a padded row (length 0) attends key 0 of the null block
    num_rows: int
    # The compiled variant for this step's shapes, found once per step (`dynamo_entry`), and the
    # per-layer properties it was found for (layers of one model share them).
    entry: Callable[..., torch.Tensor] | None = None
    entry_key: tuple | None = None


@register_backend
class InductorPagedAttention(TorchPagedAttention):
    """Decode rows through the compiled in-place kernel; prefill groups as in `TorchPagedAttention`."""

    name = "inductor-paged"

    @classmethod
    def is_available(cls) -> bool:
        return compiler_found()

    def __init__(self) -> None:
        self._decode_fn: Callable[..., torch.Tensor] | None = compiled_paged_decode()

    def _decode_metadata(self, common: CommonAttentionMetadata) -> Any:
        if self._decode_fn is None:
            return super()._decode_metadata(common)
        nd = common.num_decodes
        max_len = longest_context(common, 0, nd)
        # At least two blocks (one would be another specialization to compile). Always a fresh
        # row-major copy: the compiled variants guard on strides and on inference-mode tensors.
        nb = min(max(2, -(-max_len // common.block_size)), common.block_table.shape[1])
        table = common.block_table[:nd, :nb].clone(memory_format=torch.contiguous_format)
        return PagedDecode(table, common.seq_lens[:nd].clamp(min=1), nd)

    def _decode(self, query: torch.Tensor, cache: LayerKVCache, g: Any, scale: float) -> torch.Tensor:
        if not isinstance(g, PagedDecode):
            return super()._decode(query, cache, g, scale)
        # Row-major strides even for one row (whose stride `contiguous()` leaves as it is): the
        # compiled variants guard on strides.
        query = query[:g.num_rows].clone(memory_format=torch.contiguous_format)
        k, v = cache["k"], cache["v"]
        args = (query, k, v, g.block_table, g.seq_lens, scale)
        key = (query.shape, query.dtype, k.shape, k.stride(), k.dtype, v.shape, v.stride(), scale)
        if g.entry_key != key:
            g.entry = dynamo_entry(paged_decode_attention, args, {}) or self._decode_fn
            g.entry_key = key
        return g.entry(*args)

    def warm_up(self, num_heads: int, scale: float, cache: LayerKVCache) -> None:
        """Compile both variants (one row; several rows and any block count) before the first request."""
        if self._decode_fn is None:
            return
        # Variants pile up per process (dtypes, head counts, cache sizes of every engine made in it), and
        # past dynamo's limit a call would quietly run uncompiled; steps never compile, so lift it here.
        try:
            with torch._dynamo.config.patch(recompile_limit=64):
                self._compile_variants(num_heads, scale, cache)
        except Exception as e:  # a broken toolchain must not stop the engine: the reference path works
            logger.warning("Compiling the paged decode attention failed (%s: %s); decode attention gathers "
                           "its blocks instead", type(e).__name__, e)
            self._decode_fn = None

    def _compile_variants(self, num_heads: int, scale: float, cache: LayerKVCache) -> None:
        k = cache["k"]
        # Inductor splits a loop across threads only where the example sizes (its hints for the
        # dynamic ones) give each thread enough work: compiled at 2 rows, the softmax passes ran on
        # one thread at every batch size. At 64 rows and 8 blocks a call of 64 rows took 1.18-1.45x
        # less time (16 rows: 1.34x), and a batch of one is its own variant.
        for rows, blocks in ((1, 2), (64, 8)):
            query = torch.zeros(rows, num_heads, k.shape[-1], dtype=k.dtype, device=k.device)
            table = torch.zeros(rows, blocks, dtype=torch.int32, device=k.device)
            lens = torch.ones(rows, dtype=torch.int32, device=k.device)
            # Rows, blocks per row and the cache's block count (each engine sizes its own) are symbols.
            for t in (query, table, lens, k, cache["v"]):
                torch._dynamo.maybe_mark_dynamic(t, 0)
            torch._dynamo.maybe_mark_dynamic(table, 1)
            self._decode_fn(query, k, cache["v"], table, lens, scale)
