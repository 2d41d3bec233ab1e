"""Batch-invariant paged attention: a query's output does not depend on the batch it runs in.

The reference backend (`torch_paged`) pads each group of requests to its longest query
and key lengths and calls SDPA, whose blocking follows those shapes, so a token's
attention output changes in its last bits with the step it lands in: batch size,
prefill chunk size, decode or recomputed after a preemption. Here every query row goes
through calls of one shape, fixed for the engine:

- a tile holds `ROW_TILE` consecutive query rows of one request (the last zero-padded;
  a decode is a one-row tile), against that request's keys padded to `num_keys`, the
  engine's max_model_len in whole blocks, with the positions past each row masked;
- scores, a float32 softmax over all `num_keys` columns and the value sum are batched
  matmuls of fixed shape per tile, run over groups of at most `tiles_per_call` tiles.

Masked keys weigh exactly zero and the library runs each tile's fixed-shape matmul
the same way wherever it sits (`mrv2.layers.batch_invariant`), so a row's output is a
function of its query and its request's keys alone. The cost is padding: every tile
reads max_model_len keys, so keep max_model_len to what the requests need. Selected
with `batch_invariant=True`, together with the model's fixed-tile matmuls.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from mrv2.attention.backend import CommonAttentionMetadata
from mrv2.attention.registry import register_backend
from mrv2.attention.torch_mla import TorchMLAAttention
from mrv2.attention.torch_paged import TorchPagedAttention, _Group
from mrv2.kv_spec import KVCacheSpec, LayerKVCache

ROW_TILE = 4  # query rows per tile: small, since a decode pads its one row to a whole tile
TILE_GROUP_BYTES = 64 << 20  # the gathered keys and values of one call, at most (at least one tile)


def _tiles_per_call(num_keys: int, bytes_per_token: int) -> int:
    return max(1, TILE_GROUP_BYTES // (num_keys * bytes_per_token))


@dataclass
class BatchInvariantMetadata:
    """Per-step tiles: which request each serves, its rows' tokens and masks."""

    slot_mapping: torch.Tensor
    blocks: torch.Tensor  # [tiles, blocks_per_tile] block ids of each tile's request
    mask: torch.Tensor  # [tiles, ROW_TILE, num_keys] bool; padded rows attend key 0 only
    token_index: torch.Tensor  # [tiles * ROW_TILE] the query token of each tile row (padded rows: any)
    out_index: torch.Tensor  # [num_tokens] the tile row of each token
    num_tiles: int
    num_keys: int


@register_backend
class BatchInvariantAttention(TorchPagedAttention):
    """Paged attention in fixed-shape tiles (see the module docstring)."""

    name = "torch-batch-invariant"
    batch_invariant = True

    def build_metadata(self, common: CommonAttentionMetadata) -> BatchInvariantMetadata:
        n, nt = common.num_reqs, common.num_tokens
        blocks_per_tile = common.block_table.shape[1]  # the engine's max_model_len in blocks
        num_keys = blocks_per_tile * common.block_size
        qsl = np.asarray(common.query_start_loc_cpu[:n + 1], dtype=np.int64)
        qlens = np.diff(qsl)
        tiles_per_req = -(-qlens // ROW_TILE)
        tile_req = np.repeat(np.arange(n), tiles_per_req)
        first_tile = np.cumsum(tiles_per_req) - tiles_per_req  # each request's first tile
        # Offset of each tile's first row within its request's query.
        tile_first = (np.arange(len(tile_req)) - first_tile[tile_req]) * ROW_TILE
        device = common.seq_lens.device
        req = torch.from_numpy(tile_req).to(device)
        r = torch.arange(ROW_TILE, device=device)
        starts = common.query_start_loc[:n].long()[req]
        qlen = (common.query_start_loc[1:n + 1].long() - common.query_start_loc[:n].long())[req]
        seq = common.seq_lens[:n].long()[req]
        offset = torch.from_numpy(tile_first).to(device)[:, None] + r  # [tiles, ROW_TILE] row within the query
        valid = (offset < qlen[:, None]) & (seq[:, None] > 0)
        pos = seq[:, None] - qlen[:, None] + offset  # position of each row's query
        j = torch.arange(num_keys, device=device)
        mask = torch.where(valid[..., None], j <= pos[..., None], j == 0)
        token_index = torch.where(valid, starts[:, None] + offset, 0).clamp_(0, max(nt - 1, 0)).flatten()
        # Each token's tile row, from host-known sizes (tokens past the last request are padding).
        tokens = np.arange(nt)
        tok_req = np.minimum(np.searchsorted(qsl[1:], tokens, side="right"), n - 1)
        within = np.minimum(tokens - qsl[tok_req], np.maximum(qlens[tok_req] - 1, 0))
        out_index = first_tile[tok_req] * ROW_TILE + within
        blocks = common.block_table[:n][req].long()
        return BatchInvariantMetadata(common.slot_mapping, blocks, mask, token_index,
                                      torch.from_numpy(out_index).to(device), len(tile_req), num_keys)

    def transient_bytes(self, num_reqs: int, num_tokens: int, max_seq_len: int, spec: KVCacheSpec) -> int:
        """One call's gathered keys and values, its scores and the step's masks."""
        tiles = min(num_tokens // ROW_TILE + num_reqs, _tiles_per_call(max_seq_len, spec.bytes_per_token))
        return tiles * max_seq_len * spec.bytes_per_token * 3 + (num_tokens + num_reqs) * ROW_TILE * max_seq_len

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                cache: LayerKVCache | None, metadata: BatchInvariantMetadata | None, scale: float) -> torch.Tensor:
        """Write key/value into `cache` at the step's slots, then attend tile by tile.

        query [T, H, D], key [T, Hkv, D], value [T, Hkv, Dv] -> [T, H, Dv].
        """
        if metadata is None:
            return self._causal(query, key, value, scale)
        m = metadata
        num_tokens = m.slot_mapping.shape[0]
        cache["k"].flatten(0, 1).index_copy_(0, m.slot_mapping, key[:num_tokens])
        cache["v"].flatten(0, 1).index_copy_(0, m.slot_mapping, value[:num_tokens])
        heads, hkv = query.shape[1], cache["k"].shape[2]
        q = query[m.token_index].view(m.num_tiles, ROW_TILE, hkv, heads // hkv, -1)
        # [tiles, Hkv, ROW_TILE * G, D]: the query heads sharing a KV head as that head's rows.
        q = q.permute(0, 2, 1, 3, 4).flatten(2, 3)
        outs = []
        for lo, hi, g in _calls(m, cache):
            k, v = self._gather(cache, g)
            scores = torch.matmul(q[lo:hi], k.transpose(-1, -2)).float().mul_(scale)
            scores = scores.view(hi - lo, hkv, ROW_TILE, -1, m.num_keys)
            probs = scores.masked_fill_(~m.mask[lo:hi, None, :, None], float("-inf")).softmax(dim=-1)
            o = torch.matmul(probs.flatten(2, 3).to(v.dtype), v)  # [tiles, Hkv, ROW_TILE * G, Dv]
            outs.append(o.unflatten(2, (ROW_TILE, -1)).permute(0, 2, 1, 3, 4).flatten(2, 3))  # [tiles, R, H, Dv]
        return _tokens(torch.cat(outs), m, query.shape[0])


def _calls(m: BatchInvariantMetadata, cache: LayerKVCache):
    """(first tile, end tile, gather group) of each call: groups of at most TILE_GROUP_BYTES of keys."""
    per_token = sum(t.shape[-2] * t.shape[-1] * t.element_size() for t in cache.parts.values())
    step = _tiles_per_call(m.num_keys, per_token)
    for lo in range(0, m.num_tiles, step):
        hi = min(lo + step, m.num_tiles)
        yield lo, hi, _Group(m.blocks[lo:hi].flatten(), hi - lo, m.num_keys, m.mask)


def _tokens(tiles: torch.Tensor, m: BatchInvariantMetadata, num_tokens: int) -> torch.Tensor:
    """[tiles, ROW_TILE, ...] tile rows -> [num_tokens, ...] (padded tokens past the last request: zeros)."""
    out = tiles.flatten(0, 1)[m.out_index]
    if out.shape[0] < num_tokens:
        out = torch.cat([out, out.new_zeros(num_tokens - out.shape[0], *out.shape[1:])])
    return out


@register_backend
class BatchInvariantMLA(BatchInvariantAttention, TorchMLAAttention):
    """Multi-head latent attention in the same fixed-shape tiles, absorbed for every row (decode or prefill),
    so a token's output does not depend on which kind of step computed it."""

    name = "torch-mla-batch-invariant"
    kind = "mla"

    def forward_mla(self, q_nope: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor, k_pe: torch.Tensor,
                    w_kv_b: torch.Tensor, cache: LayerKVCache | None, metadata: BatchInvariantMetadata | None,
                    scale: float) -> torch.Tensor:
        """As `TorchMLAAttention.forward_mla`, tile by tile."""
        if metadata is None:
            return self._causal_up_projected(q_nope, q_pe, latent, k_pe, w_kv_b, scale)
        m = metadata
        num_tokens = m.slot_mapping.shape[0]
        cache["latent"].flatten(0, 1).index_copy_(0, m.slot_mapping, latent[:num_tokens, None])
        cache["rope"].flatten(0, 1).index_copy_(0, m.slot_mapping, k_pe[:num_tokens, None])
        nope, heads = q_nope.shape[-1], q_nope.shape[1]
        w_uk, w_uv = w_kv_b[:, :nope], w_kv_b[:, nope:]  # [H, nope, kv_lora], [H, v, kv_lora]
        # [tiles, H, ROW_TILE, *]; matmuls broadcast over (tile, head) with ROW_TILE rows each.
        qn = q_nope[m.token_index].view(m.num_tiles, ROW_TILE, heads, -1).transpose(1, 2)
        qp = q_pe[m.token_index].view(m.num_tiles, ROW_TILE, heads, -1).transpose(1, 2)
        outs = []
        for lo, hi, g in _calls(m, cache):
            q = torch.cat([torch.matmul(qn[lo:hi], w_uk), qp[lo:hi]], dim=-1)  # [tiles, H, ROW_TILE, kv_lora + rope]
            lat, rope = self._gather_latent(cache, g)
            k = torch.cat([lat, rope], dim=-1)  # one key head for all query heads
            scores = torch.matmul(q.flatten(1, 2), k.transpose(1, 2)).float().mul_(scale)
            scores = scores.view(hi - lo, heads, ROW_TILE, m.num_keys)
            probs = scores.masked_fill_(~m.mask[lo:hi, None], float("-inf")).softmax(dim=-1)
            o = torch.matmul(probs.flatten(1, 2).to(lat.dtype), lat).view(hi - lo, heads, ROW_TILE, -1)
            outs.append(torch.matmul(o, w_uv.transpose(1, 2)).transpose(1, 2))  # [tiles, ROW_TILE, H, v]
        return _tokens(torch.cat(outs), m, q_nope.shape[0])
