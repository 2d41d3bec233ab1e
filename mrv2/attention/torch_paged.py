"""Paged attention in plain torch ops: the portable reference backend (every platform's "gqa" default).

Per step, requests form groups, each served by one SDPA call per layer:
- decodes (query length 1), keys padded to the longest decode context, the query
  heads of each KV head grouped as that head's queries;
- prefills (chunks, possibly after a cached prefix), queries padded to the longest
  chunk, with a causal mask offset by each request's prefix; consecutive prefill rows
  are split into several groups where padding would more than 1.5x the work (one long
  prompt beside 31 short chunks after a cached prefix made a step 10.2 s, split 2.7 s).
Keys and values are gathered a whole block at a time (`index_select` over the
block table), which measured 2-5x faster than gathering token by token; with the
joint layout K and V come out of one contiguous gather. Gather indices and masks
are built once per step in `build_metadata` and shared by every layer.

Query lengths are padded to a power of two below `QUERY_MULTIPLE`, to a multiple of it
above, and key lengths to a multiple of `KEY_MULTIPLE`:
torch's CPU flash attention JIT-compiles a kernel per block shape for bf16 and keeps
every one (a per-thread cache without eviction), so a server seeing every length grew
without bound: bf16 SDPA over 3000 random shapes added 475 MB of resident memory,
`mrv2 bench soak` 535 MB over 5000 requests. Padded, the shapes are a few dozen.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from mrv2.attention.backend import AttentionBackend, CommonAttentionMetadata
from mrv2.attention.registry import register_backend
from mrv2.kv_spec import KVCacheSpec, LayerKVCache

QUERY_MULTIPLE = 32  # the CPU kernel's smallest query block size
KEY_MULTIPLE = 64


@dataclass
class _Group:
    """Rows of one SDPA call: their blocks (flattened) and the attention mask."""

    blocks: torch.Tensor  # [R * nb] block ids, row-major
    num_rows: int
    num_keys: int  # nb * block_size, the padded key length
    mask: torch.Tensor  # [R, 1, Lq, num_keys] bool
    query_index: torch.Tensor | None = None  # [R, Lq] token of each padded query (prefill only)
    out_index: torch.Tensor | None = None  # [tokens] row of the flattened padded output (prefill only)
    token_start: int = 0  # the group's tokens in the step: [token_start, token_end) (prefill only)
    token_end: int = 0


@dataclass
class TorchPagedMetadata:
    """Per-step gather indices and masks."""

    slot_mapping: torch.Tensor
    num_decodes: int
    decode: Any  # the decode rows' work (`_decode_metadata`), None without decodes
    prefills: list[_Group]  # consecutive runs of prefill rows, each one SDPA call


def _group_bounds(qlens: np.ndarray, seq_lens: np.ndarray, first_row: int, slack: float = 1.5) -> list[int]:
    """Split consecutive prefill rows into runs whose padded attention (rows x longest query x longest
    key length) stays within `slack` times the real one; returns the runs' boundaries (batch rows)."""
    qlens, seq_lens = qlens.tolist(), seq_lens.tolist()
    bounds = [first_row]
    # The open run's size, longest query and key lengths, and real work, kept as it grows (one pass).
    rows, max_q, max_k, real = 1, qlens[0], seq_lens[0], qlens[0] * seq_lens[0]
    for r in range(1, len(qlens)):
        q, k = qlens[r], seq_lens[r]
        if (rows + 1) * max(max_q, q) * max(max_k, k) > slack * (real + q * k):
            bounds.append(first_row + r)
            rows, max_q, max_k, real = 1, q, k, q * k
        else:
            rows, max_q, max_k, real = rows + 1, max(max_q, q), max(max_k, k), real + q * k
    return bounds + [first_row + len(qlens)]


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _padded_query_len(n: int) -> int:
    """A power of two up to QUERY_MULTIPLE, then multiples of it: at most 2x for short chunks (a
    verify step's 1 + k queries), a few distinct shapes in all."""
    return 1 << max(n - 1, 0).bit_length() if n <= QUERY_MULTIPLE else _round_up(n, QUERY_MULTIPLE)


def longest_context(common: CommonAttentionMetadata, lo: int, hi: int) -> int:
    """The longest sequence of batch rows [lo, hi): the host's, or under graph replay (static
    shapes) the descriptor's fixed `max_seq_len`."""
    return common.max_seq_len if common.static_shapes else int(common.seq_lens_cpu[lo:hi].max())


def _blocks(block_table: torch.Tensor, max_len: int, block_size: int) -> tuple[torch.Tensor, int]:
    """The blocks of `max_len` keys padded to KEY_MULTIPLE (within the table), flattened; the key count."""
    nb = min(-(-_round_up(max_len, KEY_MULTIPLE) // block_size), block_table.shape[1])
    return block_table[:, :nb].reshape(-1).long(), nb * block_size


@register_backend
class TorchPagedAttention(AttentionBackend):
    """Reference paged attention; runs wherever torch runs."""

    name = "torch"

    def build_metadata(self, common: CommonAttentionMetadata) -> TorchPagedMetadata:
        nd, n = common.num_decodes, common.num_reqs
        qsl_cpu, seq_cpu = common.query_start_loc_cpu, common.seq_lens_cpu
        decode = self._decode_metadata(common) if nd > 0 else None
        prefills = []
        if nd < n:
            qlens_cpu = qsl_cpu[nd + 1:n + 1] - qsl_cpu[nd:n]
            # Static shapes (graph capture) keep one group; else runs of similar rows, so one long
            # prompt does not pad every short chunk beside it to its length.
            bounds = [nd, n] if common.static_shapes else _group_bounds(qlens_cpu, seq_cpu[nd:n], nd)
            prefills = [self._prefill_group(common, lo, hi) for lo, hi in zip(bounds, bounds[1:])]
        return TorchPagedMetadata(common.slot_mapping, nd, decode, prefills)

    def _decode_metadata(self, common: CommonAttentionMetadata) -> Any:
        """The decode rows' work (rows [0, num_decodes)): one SDPA group over their gathered blocks."""
        nd = common.num_decodes
        blocks, num_keys = _blocks(common.block_table[:nd], longest_context(common, 0, nd), common.block_size)
        j = torch.arange(num_keys, device=blocks.device)
        # A padded request (length 0) attends key 0 of the null block, so its softmax is never empty.
        mask = j < common.seq_lens[:nd, None].clamp(min=1)
        return _Group(blocks, nd, num_keys, mask[:, None, None, :])

    @staticmethod
    def _prefill_group(common: CommonAttentionMetadata, lo: int, hi: int) -> _Group:
        """Prefill rows [lo, hi) of the batch as one padded SDPA call."""
        qsl_cpu, bs = common.query_start_loc_cpu, common.block_size
        qlens_cpu = qsl_cpu[lo + 1:hi + 1] - qsl_cpu[lo:hi]
        max_q = _padded_query_len(int(qlens_cpu.max()))
        blocks, num_keys = _blocks(common.block_table[lo:hi], longest_context(common, lo, hi), bs)
        seq_lens = common.seq_lens[lo:hi].long()
        starts = common.query_start_loc[lo:hi].long()
        qlens = common.query_start_loc[lo + 1:hi + 1].long() - starts
        i = torch.arange(max_q, device=blocks.device)
        # A padded request (length 0, FULL graphs) has no valid query: its rows attend key 0.
        q_valid = (i < qlens[:, None]) & (seq_lens[:, None] > 0)  # [P, Lq]
        q_pos = seq_lens[:, None] - qlens[:, None] + i  # position of each query
        j = torch.arange(num_keys, device=blocks.device)
        causal = j[None, None, :] <= q_pos[:, :, None]
        # Padded query rows attend key 0 only, so softmax never sees an empty row.
        mask = torch.where(q_valid[:, :, None], causal, j[None, None, :] == 0)
        # Row-major position of each of the group's tokens in the padded [P, Lq] output, from
        # host-known sizes only (no boolean indexing: its size would be data-dependent).
        token_start = int(qsl_cpu[lo])
        token_end = int(qsl_cpu[hi]) if hi < common.num_reqs else common.num_tokens
        tokens = torch.arange(token_start, token_end, device=blocks.device)
        # Indices are clamped: a FULL graph is captured over whatever the buffers hold then.
        rows = torch.searchsorted(common.query_start_loc[lo + 1:hi + 1], tokens, right=True).clamp_(max=hi - lo - 1)
        out_index = (rows * max_q + tokens - starts[rows]).clamp_(0, q_valid.numel() - 1)
        query_index = torch.where(q_valid, starts[:, None] + i, 0).clamp_(0, common.num_tokens - 1)
        return _Group(blocks, hi - lo, num_keys, mask[:, None], query_index, out_index, token_start, token_end)

    def transient_bytes(self, num_reqs: int, num_tokens: int, max_seq_len: int, spec: KVCacheSpec) -> int:
        """The per-layer K/V gather at worst: every request in one group, keys padded to `max_seq_len`.

        Plus the step's masks: `build_metadata` holds two bools per query and key at its peak.
        """
        keys = _round_up(max_seq_len, KEY_MULTIPLE)
        return num_reqs * keys * spec.bytes_per_token + 2 * 2 * num_tokens * keys

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                cache: LayerKVCache | None, metadata: TorchPagedMetadata | None, scale: float) -> torch.Tensor:
        """Write key/value into `cache` at the step's slots, then attend.

        query [T, H, D], key [T, Hkv, D], value [T, Hkv, Dv] -> [T, H, Dv].
        `metadata is None` is a profile run: causal attention over the tokens, no cache.
        """
        if metadata is None:
            return self._causal(query, key, value, scale)
        num_tokens = metadata.slot_mapping.shape[0]
        cache["k"].flatten(0, 1).index_copy_(0, metadata.slot_mapping, key[:num_tokens])
        cache["v"].flatten(0, 1).index_copy_(0, metadata.slot_mapping, value[:num_tokens])
        out = query.new_empty(query.shape[0], query.shape[1], value.shape[-1])
        if metadata.decode is not None:
            out[:metadata.num_decodes] = self._decode(query, cache, metadata.decode, scale)
        for g in metadata.prefills:
            k, v = self._gather(cache, g)
            o = self._sdpa(query[g.query_index].transpose(1, 2), k, v, g.mask, scale)
            out[g.token_start:g.token_end] = o.transpose(1, 2).flatten(0, 1)[g.out_index]
        return out

    def _decode(self, query: torch.Tensor, cache: LayerKVCache, g: Any, scale: float) -> torch.Tensor:
        """Attention of the decode rows (the first `g.num_rows` queries) -> [rows, H, Dv]."""
        k, v = self._gather(cache, g)
        # The query heads sharing a KV head attend as that head's "query positions": no
        # repeated K/V (SDPA's enable_gqa measured 5x slower for one query per request).
        q = query[:g.num_rows].unflatten(1, (k.shape[1], -1))
        return F.scaled_dot_product_attention(q, k, v, attn_mask=g.mask, scale=scale).flatten(1, 2)

    @staticmethod
    def _gather(cache: LayerKVCache, g: _Group) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of the group's blocks as [R, heads, num_keys, dim]."""
        k_cache, v_cache = cache["k"], cache["v"]
        hk, dk, hv, dv = *k_cache.shape[2:], *v_cache.shape[2:]
        if cache.joint is not None:
            kv = cache.joint.index_select(0, g.blocks).view(g.num_rows, g.num_keys, -1)
            k = kv[..., :hk * dk].unflatten(-1, (hk, dk))
            v = kv[..., hk * dk:].unflatten(-1, (hv, dv))
        else:
            k = k_cache.index_select(0, g.blocks).view(g.num_rows, g.num_keys, hk, dk)
            v = v_cache.index_select(0, g.blocks).view(g.num_rows, g.num_keys, hv, dv)
        return k.transpose(1, 2), v.transpose(1, 2)

    @staticmethod
    def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=k.shape[1] != q.shape[1])

    @staticmethod
    def _causal(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float) -> torch.Tensor:
        out = F.scaled_dot_product_attention(query.transpose(0, 1)[None], key.transpose(0, 1)[None],
                                             value.transpose(0, 1)[None], is_causal=True, scale=scale,
                                             enable_gqa=key.shape[1] != query.shape[1])
        return out[0].transpose(0, 1)
