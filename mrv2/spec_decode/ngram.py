"""N-gram (prompt-lookup) drafts: copy what followed the last time the context ended this way.

For a request whose tokens end in the n-gram g, the drafts are the tokens after the
latest earlier occurrence of g in the request's own prompt and output, for the longest
n in [min_n, max_n] that occurs. Nothing is learned and no model runs: it pays where
the output copies its input (quoting, editing, summarising with the source's words,
code), and costs only a verify step's extra positions where it guesses wrong.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


class NgramProposer:
    """Proposes up to `k` drafts per request by prompt lookup (see the module docstring)."""

    def __init__(self, k: int, min_n: int, max_n: int) -> None:
        self.k, self.min_n, self.max_n = k, min_n, max_n

    def propose(self, token_ids: Sequence[int]) -> list[int]:
        """The drafts after `token_ids` (empty when no suffix of length min_n.. recurs)."""
        tokens = np.asarray(token_ids, dtype=np.int64)
        n_tokens = len(tokens)
        for n in range(min(self.max_n, n_tokens - 1), self.min_n - 1, -1):
            # Windows that start before the suffix itself and match it; the latest one wins.
            windows = sliding_window_view(tokens[:n_tokens - 1], n)
            hits = np.flatnonzero((windows == tokens[n_tokens - n:]).all(axis=1))
            if len(hits):
                start = int(hits[-1]) + n
                return tokens[start:start + self.k].tolist()
        return []

    def propose_for(self, requests: Iterable) -> None:
        """Set `spec_token_ids` of each request to its drafts, at most its own `num_speculative_tokens`."""
        for request in requests:
            cap = request.sampling_params.num_speculative_tokens
            if cap != 0:
                request.spec_token_ids = self.propose(request.all_token_ids)[:cap]
