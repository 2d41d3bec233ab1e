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


class NgramProposer:
    """Proposes up to `k` drafts per request by prompt lookup (see the module docstring)."""

    def __init__(self, k: int, min_n: int, max_n: int) -> None:
        self.k, self.min_n, self.max_n = k, min_n, max_n

    def propose(self, token_ids: Sequence[int]) -> list[int]:
        """The drafts after `token_ids` (empty when no suffix of length min_n.. recurs)."""
        return self.propose_batch([token_ids])[0]

    def propose_batch(self, histories: Sequence[Sequence[int]]) -> list[list[int]]:
        """`propose` for every history at once, vectorized over the batch.

        The histories are right-aligned in one array (padded on the left with -1, which
        matches no token). For every earlier position i, `run[:, i]` counts how many
        tokens ending at i equal the suffix ending at the last token (up to max_n, one
        comparison of the whole array per length); a row's longest matched n is the
        largest count (capped at its length - 1) and its latest occurrence the last i
        reaching it.
        """
        if not histories:
            return []
        width = max(len(h) for h in histories)
        if width < 2:
            return [[] for _ in histories]
        tokens = np.full((len(histories), width), -1, dtype=np.int64)
        for row, h in enumerate(histories):
            tokens[row, width - len(h):] = h
        lengths = np.fromiter((len(h) for h in histories), np.int64, len(histories))
        ends = width - 1  # candidate occurrence ends: 0 .. width - 2
        run = np.zeros((len(histories), ends), dtype=np.int64)
        matching = np.ones((len(histories), ends), dtype=bool)
        for t in range(min(self.max_n, ends)):
            same = np.zeros((len(histories), ends), dtype=bool)
            same[:, t:] = tokens[:, :ends - t] == tokens[:, width - 1 - t, None]
            matching &= same
            run += matching
        run = np.minimum(run, np.minimum(self.max_n, lengths - 1)[:, None])
        best = run.max(axis=1)
        latest = ends - 1 - (run == best[:, None])[:, ::-1].argmax(axis=1)
        return [tokens[row, i + 1:i + 1 + self.k].tolist() if n >= self.min_n else []
                for row, (n, i) in enumerate(zip(best.tolist(), latest.tolist()))]

    def propose_for(self, requests: Iterable) -> None:
        """Set `spec_token_ids` of each request to its drafts, at most its own `num_speculative_tokens`."""
        wanted = [r for r in requests if r.sampling_params.num_speculative_tokens != 0]
        for request, drafts in zip(wanted, self.propose_batch([r.all_token_ids for r in wanted])):
            request.spec_token_ids = drafts[:request.sampling_params.num_speculative_tokens]
