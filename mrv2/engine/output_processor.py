"""Per-request output state: new tokens in, detokenized RequestOutputs out, stop strings found.

The scheduler knows tokens; this knows text. Each step the engine hands over the
requests that got tokens; their new tokens go through the request's
`IncrementalDetokenizer`, and a request whose text reached a stop string is
reported back so that the engine ends it in the scheduler (its blocks return at
once). Outputs follow the request's `output_kind`: cumulative, delta or final only.
A request with n > 1 runs as n child requests; their outputs come back under the
parent's id, each completion with its index (final only: all n in one output).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from mrv2.engine.detokenizer import IncrementalDetokenizer
from mrv2.engine.outputs import CompletionOutput, Logprob, RequestOutput
from mrv2.engine.request import Request, TokenLogprobs
from mrv2.sampling_params import RequestOutputKind


@dataclass
class _Parent:
    """A request with n > 1: its children's ids and their latest completions."""

    request: Request
    child_ids: list[str]
    completions: dict[int, CompletionOutput] = field(default_factory=dict)
    num_finished: int = 0


@dataclass
class _RequestState:
    detokenizer: IncrementalDetokenizer
    kind: RequestOutputKind
    index: int = 0  # the completion's index within its parent
    parent: _Parent | None = None
    num_processed: int = 0  # output tokens already through the detokenizer
    num_sent: int = 0  # output tokens already in a DELTA output
    prompt_logprobs_sent: bool = False


class OutputProcessor:
    """Detokenizes every live request's output and builds its RequestOutputs."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._states: dict[str, _RequestState] = {}
        self._token_texts: dict[int, str] = {}  # each token's text, decoded once
        self._parents: dict[str, _Parent] = {}

    def _logprob_dict(self, entry: TokenLogprobs) -> dict[int, Logprob]:
        """The sampled token (with its rank) and the top alternatives (ranks 1..k), each with its text."""
        ids, logprobs, rank = entry
        out = {ids[0]: Logprob(logprobs[0], rank, self._token_text(ids[0]))}
        for i, (t, lp) in enumerate(zip(ids[1:], logprobs[1:]), 1):
            if t not in out:
                out[t] = Logprob(lp, i, self._token_text(t))
        return out

    def _token_text(self, token_id: int) -> str:
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = self.tokenizer.decode([token_id])
        return text

    def add_request(self, request: Request, parent: Request | None = None, index: int = 0) -> None:
        """Track `request`; a child of a request with n > 1 names its `parent` and completion `index`."""
        params = request.sampling_params
        record = None
        if parent is not None:
            record = self._parents.get(parent.req_id)
            if record is None:
                record = self._parents[parent.req_id] = _Parent(parent, [])
            record.child_ids.append(request.req_id)
        self._states[request.req_id] = _RequestState(
            IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids, params), params.output_kind, index,
            record)

    def family_ids(self, req_ids: list[str]) -> list[str]:
        """The engine's request ids that end together with these: a parent's children, a child's siblings
        (one completion of n cannot end alone), any other id as given."""
        out = []
        for req_id in req_ids:
            parent = self._parents.get(req_id)
            state = self._states.get(req_id)
            if parent is None and state is not None:
                parent = state.parent
            out += [i for i in (parent.child_ids if parent is not None else [req_id]) if i not in out]
        return out

    def remove(self, req_ids: list[str]) -> None:
        for req_id in req_ids:
            parent = self._parents.pop(req_id, None)
            for child in parent.child_ids if parent is not None else [req_id]:
                state = self._states.pop(child, None)
                if state is not None and state.parent is not None:
                    self._parents.pop(state.parent.request.req_id, None)

    def has_request(self, req_id: str) -> bool:
        return req_id in self._states or req_id in self._parents

    def detokenize(self, requests: list[Request]) -> list[Request]:
        """Feed each request's new tokens to its detokenizer; return the unfinished requests whose
        text reached a stop string, their output cut after the token that completed it."""
        stopped = []
        for request in requests:
            state = self._states.get(request.req_id)
            if state is None:
                continue
            tokens = request.output_token_ids
            while state.num_processed < len(tokens):
                state.num_processed += 1
                if state.detokenizer.add_token(tokens[state.num_processed - 1]):
                    excess = len(tokens) - state.num_processed  # tokens of the same step after the stop
                    if excess:
                        del request.output_token_ids[-excess:], request.all_token_ids[-excess:]
                        del request.output_logprobs[len(request.output_token_ids):]
                    if not request.is_finished:
                        stopped.append(request)
                    break
        return stopped

    def make_outputs(self, requests: list[Request]) -> list[RequestOutput]:
        """RequestOutputs for `requests` (after `detokenize`, with final statuses); finished ones are dropped."""
        outputs = []
        for request in requests:
            state = self._states.get(request.req_id)
            if state is None:
                continue
            finished = request.is_finished
            if finished:
                del self._states[request.req_id]
            detok = state.detokenizer
            if state.kind == RequestOutputKind.FINAL_ONLY and not finished:
                continue
            first = state.num_sent if state.kind == RequestOutputKind.DELTA else 0
            text = detok.delta(finished) if state.kind == RequestOutputKind.DELTA else detok.output_text(finished)
            token_ids = request.output_token_ids[first:]
            state.num_sent = len(request.output_token_ids)
            logprobs = None
            if request.sampling_params.logprobs is not None:
                logprobs = [self._logprob_dict(entry) for entry in request.output_logprobs[first:]]
            stop_reason = detok.stop_str if detok.stop_str is not None else request.stop_reason
            completion = CompletionOutput(state.index, text, token_ids, request.finish_reason, stop_reason, logprobs)
            prompt_logprobs = None
            if request.prompt_logprobs is not None and not (state.kind == RequestOutputKind.DELTA
                                                            and state.prompt_logprobs_sent):
                prompt_logprobs = [None] + [None if e is None else self._logprob_dict(e)
                                            for e in request.prompt_logprobs[1:]]
                state.prompt_logprobs_sent = True
            if state.parent is None:
                outputs.append(RequestOutput(request.req_id, request.prompt, request.prompt_token_ids,
                                             [completion], finished, prompt_logprobs, request.kv_transfer_params))
            elif (out := self._parent_output(state.parent, completion, finished, state.kind,
                                             prompt_logprobs)) is not None:
                outputs.append(out)
        return outputs

    def _parent_output(self, parent: _Parent, completion: CompletionOutput, finished: bool,
                       kind: RequestOutputKind, prompt_logprobs: list | None) -> RequestOutput | None:
        """A child's completion as its parent's output; final only: once, with all n completions."""
        parent.num_finished += finished
        done = parent.num_finished == len(parent.child_ids)
        if done:
            del self._parents[parent.request.req_id]
        r = parent.request
        if kind != RequestOutputKind.FINAL_ONLY:
            return RequestOutput(r.req_id, r.prompt, r.prompt_token_ids, [completion], done, prompt_logprobs)
        parent.completions[completion.index] = completion
        if not done:
            return None
        return RequestOutput(r.req_id, r.prompt, r.prompt_token_ids,
                             [parent.completions[i] for i in sorted(parent.completions)], True, prompt_logprobs)
