"""Per-request sampling parameters, with vLLM's names and defaults."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, TypeVar

# The one greedy rule: temperatures below this are greedy, as in vLLM (dividing by them
# would overflow). Every greedy decision (request, batch flags, sampler rows) uses it.
GREEDY_EPS = 1e-5
# The most top alternatives a request may ask for per token (vLLM's default max_logprobs).
MAX_LOGPROBS = 20
# The most completions one request may ask for.
MAX_N = 128
# The most (token id, bias) pairs a request's logit_bias may hold.
MAX_LOGIT_BIAS = 1024

_T = TypeVar("_T")


def is_greedy(temperature: _T) -> _T:
    """True where `temperature` (a float, numpy array or tensor) means greedy decoding."""
    return temperature < GREEDY_EPS


class RequestOutputKind(enum.Enum):
    """What each RequestOutput of a request carries (vLLM's names)."""

    CUMULATIVE = 0  # the text and token ids so far, every step
    DELTA = 1  # only what is new since the previous output
    FINAL_ONLY = 2  # nothing until the request finishes


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Constrain a request's output to a format (vLLM's names); exactly one of: `json` (a JSON
    schema, as a dict or a JSON string), `regex`, `choice` (one of these strings), `grammar`
    (EBNF, as xgrammar and llama.cpp's GBNF read it) or `json_object=True` (any JSON object)."""

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False

    def __post_init__(self) -> None:
        given = [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise ValueError(f"structured_outputs needs exactly one of json, regex, choice, grammar or json_object; "
                             f"got {given or 'none'}")
        if self.choice is not None and (not isinstance(self.choice, (list, tuple)) or not self.choice
                                        or not all(isinstance(c, str) and c for c in self.choice)):
            raise ValueError("structured_outputs.choice must be a non-empty list of non-empty strings")
        for name in ("regex", "grammar"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), str):
                raise ValueError(f"structured_outputs.{name} must be a string")
        if self.json is not None and not isinstance(self.json, (dict, str)):
            raise ValueError("structured_outputs.json must be a JSON schema (a dict or a JSON string)")

    @property
    def kind(self) -> str:
        return next(n for n in ("json", "regex", "choice", "grammar") if getattr(self, n) is not None) \
            if not self.json_object else "json_object"


@dataclass
class SamplingParams:
    """How to sample one request's completion.

    temperature < GREEDY_EPS (e.g. 0) means greedy. top_k <= 0 (or -1) disables top-k; top_p == 1 and
    min_p == 0 disable those filters. A request with `seed` set draws the same
    tokens whatever else is in the batch. Generation stops at an EOS (unless
    `ignore_eos`), at any of `stop_token_ids`, or once the text contains one of the
    `stop` strings, which is cut from the text unless `include_stop_str_in_output`;
    neither applies before `min_tokens`. `logprobs` (0 to MAX_LOGPROBS) returns, per
    generated token, its logprob and rank and those of the `logprobs` most likely
    tokens, from the model's raw logits; `prompt_logprobs` does the same for each prompt
    token after the first. `n` completions are sampled for the prompt
    (completion i of a seeded request uses seed + i). Penalties follow vLLM (and OpenAI):
    presence and frequency penalties in [-2, 2] act on the output's tokens, a
    repetition penalty > 0 (1: off) on the prompt's and the output's; `logit_bias`
    adds to chosen ids' logits (at most MAX_LOGIT_BIAS, each in [-100, 100]);
    `allowed_token_ids` restricts sampling to those ids; `bad_words` are never
    generated (their last token is banned after the rest of them). `spaces_between_special_tokens` joins special
    tokens and the text around them with a space when they are not skipped.
    `num_speculative_tokens` caps this request's draft tokens per step where the engine
    speculates (0: none; None: the engine's `speculative_config`).
    `kv_transfer_params` drives prefill/decode disaggregation (vLLM's): `{"do_remote_decode":
    true}` on a prefill instance saves the prompt's KV for a decode instance; the params
    its output returns, given to the decode instance, load that KV instead of recomputing it.
    `structured_outputs` (`StructuredOutputsParams`) makes every output follow a JSON schema,
    a regex, a choice or a grammar (and EOS come only where the format is complete).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    num_speculative_tokens: int | None = None
    kv_transfer_params: dict[str, Any] | None = None
    structured_outputs: StructuredOutputsParams | None = None
    # The token sequences `bad_words` ban, set by the engine from its tokenizer (not an argument).
    bad_words_token_ids: list[list[int]] = field(default_factory=list, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        else:
            self.stop = list(self.stop)
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the first invalid field."""
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise ValueError("structured_outputs must be StructuredOutputsParams")
        if self.kv_transfer_params is not None and not isinstance(self.kv_transfer_params, dict):
            raise ValueError(f"kv_transfer_params must be a dict, got {type(self.kv_transfer_params).__name__}")
        if not isinstance(self.n, int) or isinstance(self.n, bool) or not 1 <= self.n <= MAX_N:
            raise ValueError(f"n must be an integer in [1, {MAX_N}], got {self.n!r}")
        if not isinstance(self.temperature, (int, float)) or self.temperature < 0.0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise ValueError(f"top_k must be -1, 0 (disabled) or a positive integer, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.min_tokens < 0 or (self.max_tokens is not None and self.min_tokens > self.max_tokens):
            raise ValueError(f"min_tokens must be in [0, max_tokens], got {self.min_tokens}")
        k = self.num_speculative_tokens
        if k is not None and (not isinstance(k, int) or isinstance(k, bool) or k < 0):
            raise ValueError(f"num_speculative_tokens must be a non-negative integer, got {k!r}")
        if self.seed is not None and not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be non-negative integers, got {self.stop_token_ids}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop must be non-empty strings, got {self.stop!r}")
        for name in ("include_stop_str_in_output", "ignore_eos", "skip_special_tokens",
                     "spaces_between_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a boolean, got {getattr(self, name)!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {value!r}")
        if not isinstance(self.repetition_penalty, (int, float)) or not 0.0 < self.repetition_penalty <= 10.0:
            raise ValueError(f"repetition_penalty must be in (0, 10], got {self.repetition_penalty!r}")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict) or len(self.logit_bias) > MAX_LOGIT_BIAS:
                raise ValueError(f"logit_bias must be a dict of at most {MAX_LOGIT_BIAS} token ids to biases")
            for t, b in self.logit_bias.items():
                if not isinstance(t, int) or t < 0 or not isinstance(b, (int, float)) or not -100 <= b <= 100:
                    raise ValueError(f"logit_bias maps token ids (>= 0) to biases in [-100, 100], got {t!r}: {b!r}")
        if self.allowed_token_ids is not None and (
                not isinstance(self.allowed_token_ids, list) or not self.allowed_token_ids
                or any(not isinstance(t, int) or t < 0 for t in self.allowed_token_ids)):
            raise ValueError(f"allowed_token_ids must be a non-empty list of token ids, got {self.allowed_token_ids!r}")
        if self.bad_words is not None and (not isinstance(self.bad_words, list)
                                           or any(not isinstance(w, str) or not w.strip() for w in self.bad_words)):
            raise ValueError(f"bad_words must be a list of non-empty strings, got {self.bad_words!r}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                                      or not 0 <= value <= MAX_LOGPROBS):
                raise ValueError(f"{name} must be an integer in [0, {MAX_LOGPROBS}], got {value!r}")
        if not isinstance(self.output_kind, RequestOutputKind):
            raise ValueError(f"output_kind must be a RequestOutputKind, got {self.output_kind!r}")

    @property
    def greedy(self) -> bool:
        return bool(is_greedy(self.temperature))
