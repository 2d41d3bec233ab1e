"""OpenAI API request bodies (plus vLLM's extra fields), and their mapping to SamplingParams.

Field names, types and defaults follow OpenAI's completions and chat completions
APIs; vLLM's extra sampling fields are accepted alongside. Unknown fields are
ignored, as OpenAI-compatible servers do. Fields mrv2 does not implement yet are
rejected with a 400 naming them when set to anything but their neutral value.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from mrv2.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams


class InvalidRequest(ValueError):
    """A request the server rejects with 400; `param` names the offending field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class StreamOptions(BaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _SamplingRequest(BaseModel):
    """The sampling fields both endpoints share."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None  # accepted and ignored
    # vLLM's extra fields
    top_k: int | None = None
    min_p: float | None = None
    min_tokens: int = 0
    repetition_penalty: float = 1.0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    prompt_logprobs: int | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    # Requests share cached prefix blocks only with requests of the same salt (vLLM's field).
    cache_salt: str | None = Field(default=None, min_length=1)
    # Prefill/decode disaggregation (vLLM's field): see SamplingParams.kv_transfer_params.
    kv_transfer_params: dict[str, Any] | None = None
    # Structured output: OpenAI's response_format, or vLLM's structured_outputs ({"json" | "regex" |
    # "choice" | "grammar" | "json_object": ...}).
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None

    def _unsupported(self) -> dict[str, Any]:
        """Fields set to a value mrv2 cannot honour yet (name -> neutral value)."""
        return {}

    def _max_tokens(self) -> int | None:
        return self.max_tokens

    def _structured(self) -> StructuredOutputsParams | None:
        fmt = self.response_format
        if fmt is not None and not isinstance(fmt.get("type"), str):
            raise InvalidRequest("response_format.type is required", "response_format")
        if fmt is not None and fmt["type"] == "text":
            fmt = None
        if fmt is not None and self.structured_outputs is not None:
            raise InvalidRequest("give response_format or structured_outputs, not both", "response_format")
        if self.structured_outputs is not None:
            known = set(StructuredOutputsParams.__dataclass_fields__)
            if unknown := sorted(set(self.structured_outputs) - known):
                raise InvalidRequest(f"structured_outputs has unknown keys {unknown}; known: {sorted(known)}",
                                     "structured_outputs")
            return StructuredOutputsParams(**self.structured_outputs)
        if fmt is None:
            return None
        if fmt["type"] == "json_object":
            return StructuredOutputsParams(json_object=True)
        if fmt["type"] == "json_schema":
            schema = (fmt.get("json_schema") or {}).get("schema")
            if not isinstance(schema, dict):
                raise InvalidRequest("response_format.json_schema.schema must be a JSON schema object",
                                     "response_format")
            return StructuredOutputsParams(json=schema)
        raise InvalidRequest(f"response_format.type must be text, json_object or json_schema, got {fmt['type']!r}",
                             "response_format")

    def _logprobs(self) -> int | None:
        return None

    def _prompt_logprobs(self) -> int | None:
        return self.prompt_logprobs

    def to_sampling_params(self, default_max_tokens: int) -> SamplingParams:
        """SamplingParams for this request (streamed outputs as deltas); InvalidRequest names a bad field."""
        for name, neutral in self._unsupported().items():
            value = getattr(self, name)
            if value is not None and value != neutral and value != {} and value != []:
                raise InvalidRequest(f"{name} is not supported yet", name)
        if self.stream_options is not None and not self.stream:
            raise InvalidRequest("stream_options is only allowed when stream is true", "stream_options")
        max_tokens = self._max_tokens()
        logit_bias = None
        if self.logit_bias:
            try:
                logit_bias = {int(t): b for t, b in self.logit_bias.items()}
            except ValueError:
                raise InvalidRequest("logit_bias keys must be token ids", "logit_bias") from None
        try:
            return SamplingParams(
                n=self.n, temperature=1.0 if self.temperature is None else self.temperature,
                top_p=1.0 if self.top_p is None else self.top_p, top_k=self.top_k or 0,
                min_p=self.min_p or 0.0, seed=self.seed, presence_penalty=self.presence_penalty,
                frequency_penalty=self.frequency_penalty, repetition_penalty=self.repetition_penalty,
                logit_bias=logit_bias, allowed_token_ids=self.allowed_token_ids, bad_words=self.bad_words,
                max_tokens=default_max_tokens if max_tokens is None else max_tokens, min_tokens=self.min_tokens,
                stop=self.stop, stop_token_ids=self.stop_token_ids or [],
                include_stop_str_in_output=self.include_stop_str_in_output, ignore_eos=self.ignore_eos,
                skip_special_tokens=self.skip_special_tokens,
                spaces_between_special_tokens=self.spaces_between_special_tokens,
                logprobs=self._logprobs(), prompt_logprobs=self._prompt_logprobs(),
                output_kind=RequestOutputKind.DELTA, kv_transfer_params=self.kv_transfer_params,
                structured_outputs=self._structured())
        except ValueError as e:
            raise InvalidRequest(str(e), str(e).split(" ", 1)[0]) from None


class CompletionRequest(_SamplingRequest):
    """POST /v1/completions."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16  # OpenAI's default for completions (chat: the room left in the context)
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None
    best_of: int | None = None

    def _unsupported(self) -> dict[str, Any]:
        return super()._unsupported() | {"suffix": None}

    def _logprobs(self) -> int | None:
        return self.logprobs

    def _prompt_logprobs(self) -> int | None:
        if self.echo and self.logprobs is not None:  # the echoed prompt comes with its logprobs
            return max(self.prompt_logprobs or 0, self.logprobs)
        return self.prompt_logprobs

    def prompts(self) -> list[dict[str, Any]]:
        """The prompts as engine inputs: text or token ids, one request each."""
        p = self.prompt
        if isinstance(p, str):
            return [{"prompt": p}]
        if not p:
            raise InvalidRequest("prompt must not be empty", "prompt")
        if all(isinstance(x, int) for x in p):
            return [{"prompt_token_ids": list(p)}]
        if all(isinstance(x, str) for x in p):
            return [{"prompt": x} for x in p]
        if all(isinstance(x, list) for x in p):
            return [{"prompt_token_ids": list(x)} for x in p]
        raise InvalidRequest("prompt must be a string, a list of strings, a list of token ids or a list of "
                             "lists of token ids", "prompt")


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[dict[str, Any]] | None = None

    def as_template_input(self) -> dict[str, Any]:
        content = self.content
        if content is None and self.role != "assistant":
            raise InvalidRequest(f"a {self.role!r} message needs content", "messages")
        if isinstance(content, list):  # OpenAI's content parts: only text parts are supported
            texts = []
            for part in content:
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise InvalidRequest(f"content parts of type {part.get('type')!r} are not supported; "
                                         "use text parts", "messages")
                texts.append(part["text"])
            content = "\n".join(texts)
        return {**(self.model_extra or {}), "role": self.role, "content": content or ""}


class ChatCompletionRequest(_SamplingRequest):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None

    def _unsupported(self) -> dict[str, Any]:
        return super()._unsupported() | {"tools": None}

    def _logprobs(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequest("top_logprobs needs logprobs to be true", "top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None

    def _max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class TokenizeRequest(BaseModel):
    """POST /tokenize: a prompt, or chat messages through the chat template."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(BaseModel):
    """POST /detokenize."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    tokens: list[int]

