"""The xgrammar backend: compile a `StructuredOutputsParams` once per distinct spec, make matchers."""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from typing import Any

from mrv2.sampling_params import StructuredOutputsParams

CACHE_SIZE = 256  # compiled grammars kept, least recently used dropped first


def _spec_key(params: StructuredOutputsParams) -> tuple[str, str]:
    kind = params.kind
    if kind == "json":
        value = params.json if isinstance(params.json, str) else json.dumps(params.json, sort_keys=True)
    elif kind == "choice":
        value = json.dumps(list(params.choice))
    elif kind == "json_object":
        value = ""
    else:
        value = getattr(params, kind)
    return kind, value


def _choice_grammar(choices: list[str]) -> str:
    """An EBNF grammar matching exactly one of `choices` (JSON string literals are valid EBNF literals)."""
    return "root ::= " + " | ".join(json.dumps(c) for c in choices)


class XgrammarBackend:
    """Grammars for one tokenizer's vocabulary (`vocab_size`: the model's, which may pad the tokenizer's)."""

    name = "xgrammar"

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> None:
        import xgrammar as xgr

        self._xgr = xgr
        self.vocab_size = vocab_size
        self.stop_token_ids = list(stop_token_ids)
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=self.stop_token_ids)
        self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self._cache: OrderedDict[tuple[str, str], Any] = OrderedDict()
        self._lock = threading.Lock()
        self.num_compiled = 0

    def compile(self, params: StructuredOutputsParams) -> Any:
        """The compiled grammar of `params` (cached per spec); ValueError naming the problem if it is invalid."""
        key = _spec_key(params)
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        kind, value = key
        try:
            if kind == "json":
                if isinstance(params.json, str):
                    json.loads(params.json)  # xgrammar's own message for malformed JSON is less clear
                compiled = self._compiler.compile_json_schema(value, any_whitespace=False)
            elif kind == "json_object":  # OpenAI's json_object: an object (the builtin grammar takes any value)
                compiled = self._compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
            elif kind == "regex":
                compiled = self._compiler.compile_regex(value)
            elif kind == "choice":
                compiled = self._compiler.compile_grammar(_choice_grammar(params.choice))
            else:
                compiled = self._compiler.compile_grammar(value)
        except (RuntimeError, ValueError) as e:
            reason = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
            reason = reason.split("] ", 1)[-1].split(": ", 1)[-1] if "/project/" in reason else reason
            raise ValueError(f"structured_outputs.{kind} is invalid: {reason}") from None
        with self._lock:
            self._cache[key] = compiled
            self.num_compiled += 1
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return compiled

    def matcher(self, compiled: Any) -> Any:
        """A matcher at the grammar's start (it can roll back any number of tokens)."""
        return self._xgr.GrammarMatcher(compiled, override_stop_tokens=self.stop_token_ids)

    def bitmask_words(self) -> int:
        return (self.vocab_size + 31) // 32
