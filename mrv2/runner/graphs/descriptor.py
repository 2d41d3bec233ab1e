"""Which graph a step replays: capture sizes, batch descriptors, dispatch and padding.

A step of `num_tokens` tokens over `num_reqs` requests is dispatched to the smallest
captured descriptor it fits and padded up to it:

- FULL graphs hold the whole forward, attention included, and serve only uniform
  decode batches (every request has the same query length q, 1 without speculation).
  Descriptor (FULL, n*q, n, q, L) with n the smallest capture size >= num_reqs and
  L the smallest key length >= the step's longest sequence: attention in a graph
  reads a fixed L keys per request, so L is bucketed rather than always max_model_len
  (steps longer than every bucket run eagerly). The runner pads requests and tokens:
    * padded requests get query length q each (`pad_query_start_loc`), sequence
      length 0 and block-table rows of valid block ids (0, the null block);
    * padded tokens read token id 0 at position 0 and their slot-mapping entries
      point into the reserved null block 0 (slot 0), so their KV writes land nowhere;
    * outputs of padded rows are unspecified and are discarded.
- PIECEWISE graphs hold the layers between attention calls; attention runs eagerly
  between them over the real batch, so the request count is not part of the key:
  descriptor (PIECEWISE, t, 0, 0) with t the smallest capture size >= num_tokens.
  The runner pads only token-indexed model inputs (ids and positions 0) up to t; the
  attention metadata keeps the real num_tokens, query_start_loc and slot mapping.
- Anything else (mode NONE, batches above the largest size, mixed batches in FULL
  mode) gets a NONE descriptor carrying the real sizes: run eagerly, no padding.

FULL_AND_PIECEWISE uses one dispatcher per mode (`GraphConfig.single_modes()`), FULL first.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from mrv2.config import GraphConfig, GraphMode, default_capture_sizes  # noqa: F401  (re-exported)


@dataclass(frozen=True)
class BatchDescriptor:
    """The key of one captured graph: padded sizes, the uniform query length (0: mixed), the key length."""

    mode: GraphMode
    num_tokens: int
    num_reqs: int
    uniform_decode_len: int = 0
    max_seq_len: int = 0  # FULL: keys attended per request; 0 where attention is not captured


def _clamp(sizes: list[int], limit: int) -> list[int]:
    """Sizes below `limit`, plus `limit` itself when a configured size reached it."""
    if limit <= 0:
        return []
    kept = [s for s in sizes if s < limit]
    return kept + [limit] if len(kept) < len(sizes) else kept


class GraphDispatcher:
    """Maps a step's sizes to the descriptor to replay (or to a NONE descriptor: eager).

    Capture sizes above the runner's limits are replaced by the limit, so every batch
    up to the configured maximum still finds a graph. `decode_query_len` is the
    query length of a uniform decode step (1 + speculative tokens when verifying).
    """

    def __init__(self, config: GraphConfig, max_num_reqs: int, max_num_tokens: int,
                 decode_query_len: int = 1, key_lengths: Sequence[int] = (0,)) -> None:
        if max_num_reqs <= 0 or max_num_tokens <= 0:
            raise ValueError(f"max_num_reqs and max_num_tokens must be positive, got {max_num_reqs}, {max_num_tokens}")
        if decode_query_len <= 0:
            raise ValueError(f"decode_query_len must be positive, got {decode_query_len}")
        if config.mode is GraphMode.FULL_AND_PIECEWISE:
            raise ValueError("a dispatcher serves one mode: one per GraphConfig.single_modes()")
        if not key_lengths or list(key_lengths) != sorted(set(key_lengths)) or key_lengths[0] < 0:
            raise ValueError(f"key_lengths must be distinct, ascending and non-negative, got {key_lengths}")
        self.config = config
        self.decode_query_len = q = decode_query_len
        # FULL only: 0 alone means one key length fixed by the caller, not dispatched on.
        self._keys = list(key_lengths) if config.mode is GraphMode.FULL else [0]
        if config.mode is GraphMode.FULL:
            self._sizes = _clamp(config.sizes, min(max_num_reqs, max_num_tokens // q))
        elif config.mode is GraphMode.PIECEWISE:
            self._sizes = _clamp(config.sizes, max_num_tokens)
        else:
            self._sizes = []
        self._table = {(s, k): self._descriptor(s, k) for s in self._sizes for k in self._keys}
        self.descriptors = sorted(self._table.values(), key=lambda d: (d.num_tokens, d.max_seq_len), reverse=True)

    def _descriptor(self, size: int, key_len: int) -> BatchDescriptor:
        if self.config.mode is GraphMode.FULL:
            q = self.decode_query_len
            return BatchDescriptor(GraphMode.FULL, size * q, size, q, key_len)
        return BatchDescriptor(GraphMode.PIECEWISE, size, 0, 0)

    def dispatch(self, num_tokens: int, num_reqs: int, uniform_decode_len: int,
                 max_seq_len: int = 0) -> BatchDescriptor:
        """The descriptor to replay for a step (longest sequence `max_seq_len`), or NONE with the real sizes."""
        if num_reqs <= 0 or num_tokens < num_reqs:
            raise ValueError(f"need 0 < num_reqs <= num_tokens, got num_reqs={num_reqs}, num_tokens={num_tokens}")
        mode = self.config.mode
        if mode is GraphMode.FULL:
            q = self.decode_query_len
            if uniform_decode_len == q and num_tokens == num_reqs * q:
                i = bisect.bisect_left(self._sizes, num_reqs)
                j = 0 if self._keys == [0] else bisect.bisect_left(self._keys, max_seq_len)
                if i < len(self._sizes) and j < len(self._keys):
                    return self._table[self._sizes[i], self._keys[j]]
        elif mode is GraphMode.PIECEWISE:
            i = bisect.bisect_left(self._sizes, num_tokens)
            if i < len(self._sizes):
                return self._table[self._sizes[i], 0]
        return BatchDescriptor(GraphMode.NONE, num_tokens, num_reqs, uniform_decode_len)


def padding(num_tokens: int, num_reqs: int, desc: BatchDescriptor) -> tuple[int, int]:
    """(padded tokens, padded requests) the runner fills for a step replaying `desc`.

    PIECEWISE pads tokens only (attention sees the real requests); NONE pads nothing.
    """
    if desc.mode is GraphMode.FULL:
        return desc.num_tokens, desc.num_reqs
    if desc.mode is GraphMode.PIECEWISE:
        return desc.num_tokens, num_reqs
    return num_tokens, num_reqs


def pad_query_start_loc(qsl_cpu: np.ndarray, num_reqs: int, padded_reqs: int, padded_tokens: int) -> np.ndarray:
    """Extend `qsl_cpu[:num_reqs + 1]` to `padded_reqs + 1` entries ending at `padded_tokens`.

    The padded requests share the padded tokens equally (any remainder goes to the
    later ones), so uniform decode stays uniform and the result is non-decreasing.
    """
    qsl = np.asarray(qsl_cpu)[:num_reqs + 1]
    t, extra = int(qsl[-1]), padded_reqs - num_reqs
    if extra < 0 or padded_tokens < t:
        raise ValueError(f"cannot pad {num_reqs} requests / {t} tokens down to {padded_reqs} / {padded_tokens}")
    if extra == 0:
        if padded_tokens != t:
            raise ValueError(f"{padded_tokens - t} padded tokens need at least one padded request")
        return qsl.copy()
    out = np.empty(padded_reqs + 1, dtype=qsl.dtype)
    out[:num_reqs + 1] = qsl
    out[num_reqs + 1:] = t + np.arange(1, extra + 1) * (padded_tokens - t) // extra
    return out
