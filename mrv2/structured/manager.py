"""The engine's side of structured output: a grammar matcher per request, its bitmasks per step.

Grammars compile when a request is made (on the caller's thread: the engine loop keeps
running; a bad spec raises there, before anything is scheduled) and once per distinct
spec (the backend caches them). Each step that samples for a constrained request, the
engine brings that request's matcher up to date with every token sampled so far (with
async scheduling it first processes the steps still in flight, while this step's
forward runs), then asks for its rows: one for the token sampled after the request's
last token and one per draft it verifies, each from the matcher advanced through the
drafts before it (rolled back afterwards; a draft the grammar refuses ends its rows
there, since it will be rejected). The matcher takes the request's accepted tokens
when its output arrives.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch

from mrv2.sampling_params import StructuredOutputsParams

logger = logging.getLogger("mrv2")


class StructuredOutputManager:
    """Matchers of the constrained requests in flight, over one backend (`XgrammarBackend`)."""

    def __init__(self, backend: Any) -> None:
        self.backend = backend
        self._matchers: dict[str, Any] = {}
        self._seen: dict[str, int] = {}  # output tokens each matcher has taken

    def compile(self, params: StructuredOutputsParams) -> Any:
        """The compiled grammar (cached); ValueError naming the problem for a bad spec."""
        return self.backend.compile(params)

    def needs_masks(self, request_ids: frozenset[str], requests: dict[str, Any]) -> bool:
        """Whether any of these sampling requests is constrained."""
        return any((r := requests.get(i)) is not None and r.structured_grammar is not None for i in request_ids)

    def _matcher(self, request: Any) -> Any:
        if (m := self._matchers.get(request.req_id)) is None:
            m = self._matchers[request.req_id] = self.backend.matcher(request.structured_grammar)
            self._seen[request.req_id] = 0
        return m

    def masks(self, request_ids: frozenset[str], requests: dict[str, Any],
              drafts: dict[str, list[int]]) -> dict[str, np.ndarray]:
        """Per constrained request: int32 bitmask rows [1 + its drafts, words] for this step."""
        out = {}
        words = self.backend.bitmask_words()
        for req_id in request_ids:
            request = requests.get(req_id)
            if request is None or request.structured_grammar is None:
                continue
            matcher = self._matcher(request)
            row_drafts = drafts.get(req_id, [])
            rows = torch.full((1 + len(row_drafts), words), -1, dtype=torch.int32)
            self._fill(matcher, rows, 0)
            taken = 0
            for i, token in enumerate(row_drafts):
                if matcher.is_terminated() or token < 0 or not matcher.accept_token(token):
                    break
                taken += 1
                self._fill(matcher, rows, i + 1)
            if taken:
                matcher.rollback(taken)
            out[req_id] = rows.numpy()
        return out

    def _fill(self, matcher: Any, rows: torch.Tensor, i: int) -> None:
        if matcher.is_terminated():  # the format is complete: only a stop token may follow
            rows[i] = 0
            for t in self.backend.stop_token_ids:
                rows[i, t // 32] |= 1 << (t % 32)
        else:
            matcher.fill_next_token_bitmask(rows, i)

    def advance(self, requests: list[Any]) -> None:
        """Feed each constrained request's new output tokens to its matcher; drop finished ones."""
        for request in requests:
            if request.structured_grammar is None:
                continue
            matcher = self._matcher(request)
            seen = self._seen[request.req_id]
            for token in request.output_token_ids[seen:]:
                if matcher.is_terminated():
                    break  # tokens past the end (ignore_eos): nothing more to match
                if not matcher.accept_token(token):
                    logger.warning("request %s: token %d does not fit its grammar", request.req_id, token)
                    break
            self._seen[request.req_id] = len(request.output_token_ids)
            if request.is_finished:
                self.drop([request.req_id])

    def drop(self, req_ids: list[str]) -> None:
        for req_id in req_ids:
            self._matchers.pop(req_id, None)
            self._seen.pop(req_id, None)

    @property
    def num_active(self) -> int:
        return len(self._matchers)
