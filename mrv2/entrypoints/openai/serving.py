"""The OpenAI API's completions and chat completions over `AsyncLLM`: requests in, JSON or SSE out.

`OpenAIServing` validates a request into engine prompts and SamplingParams (nothing
starts unless every prompt is valid), runs one engine request per prompt (each with
`n` completions), and shapes the outputs as OpenAI's responses or stream chunks,
with `usage`, logprobs and vLLM's extra fields. Errors are `APIError`s in OpenAI's
JSON shape.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from mrv2.engine.async_llm import AsyncLLM, EngineDeadError
from mrv2.engine.outputs import RequestOutput
from mrv2.entrypoints.openai.logprobs_format import (chat_logprobs, completion_logprobs, join_logprobs,
                                                    prompt_completion_logprobs, prompt_logprobs_json)
from mrv2.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest, InvalidRequest
from mrv2.sampling_params import SamplingParams


@dataclass(frozen=True)
class ServerConfig:
    """What the HTTP layer needs besides the engine."""

    served_model_name: str
    api_key: str | None = None


class APIError(Exception):
    """An error with an HTTP status, returned in OpenAI's shape."""

    def __init__(self, status: int, message: str, type_: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param = status, message, type_, param

    def response(self) -> JSONResponse:
        return JSONResponse({"error": {"message": self.message, "type": self.type, "param": self.param,
                                       "code": self.status}}, status_code=self.status)


def bad_request(e: ValueError) -> APIError:
    """A ValueError from validation as a 400 naming the field it is about."""
    param = e.param if isinstance(e, InvalidRequest) else _field_of(str(e))
    return APIError(400, str(e), "BadRequestError", param)


def _field_of(message: str) -> str | None:
    """The request field an engine ValueError is about (its messages start with, or name, the field)."""
    first = message.split(" ", 1)[0]
    if first.isidentifier():
        return "prompt" if first.startswith("prompt") else first
    return None


def _sse(payload: dict[str, Any] | str) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


def _event_stream(events: AsyncIterator[str]) -> StreamingResponse:
    """A server-sent-event response: the events, an error event if the engine fails mid-stream, [DONE]."""
    async def body() -> AsyncIterator[str]:
        try:
            async for event in events:
                yield event
        except EngineDeadError as e:
            yield _sse({"error": {"message": str(e), "type": "ServiceUnavailable", "code": 503}})
        except RuntimeError as e:
            yield _sse({"error": {"message": str(e), "type": "InternalServerError", "code": 500}})
        yield _sse("[DONE]")

    return StreamingResponse(body(), media_type="text/event-stream")


class _Merged:
    """Outputs of several requests as one stream, tagged with each request's index."""

    def __init__(self, streams: list[AsyncIterator[RequestOutput]]) -> None:
        self.streams = streams

    async def __aiter__(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        if len(self.streams) == 1:
            async for out in self.streams[0]:
                yield 0, out
            return
        queue: asyncio.Queue = asyncio.Queue()
        done = object()

        async def pump(i: int, stream: AsyncIterator[RequestOutput]) -> None:
            try:
                async for out in stream:
                    await queue.put((i, out))
            except BaseException as e:  # noqa: BLE001 - handed to the consumer
                await queue.put((i, e))
            finally:
                await queue.put((i, done))

        tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(self.streams)]
        try:
            remaining = len(tasks)
            while remaining:
                i, item = await queue.get()
                if item is done:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield i, item
        finally:
            for task in tasks:
                task.cancel()


async def _choices(streams: list[AsyncIterator[RequestOutput]],
                   n: int) -> AsyncIterator[tuple[int, int, Any, RequestOutput]]:
    """(choice index, prompt index, completion, its request output) for each new completion of the requests'
    outputs: choice `p * n + k` is completion k of prompt p."""
    async for i, out in _Merged(streams):
        for c in out.outputs:
            yield i * n + c.index, i, c, out


class OpenAIServing:
    """The route handlers' logic over one AsyncLLM."""

    def __init__(self, llm: AsyncLLM, config: ServerConfig) -> None:
        self.llm = llm
        self.config = config
        engine = llm.engine
        self.max_model_len = engine.config.max_model_len

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.config.served_model_name:
            raise APIError(404, f"The model `{name}` does not exist.", "NotFoundError", "model")

    def _default_max_tokens(self, prompts: list[list[int]]) -> int:
        return max(1, self.max_model_len - max(len(p) for p in prompts))

    def _start(self, prompts: list[Any], params_for: Any,
               cache_salt: str | None) -> tuple[list[AsyncIterator[RequestOutput]], list[list[int]]]:
        """Validate every prompt, then start one request per prompt (nothing starts if any is bad)."""
        engine = self.llm.engine
        token_ids = []
        for p in prompts:
            _, ids = engine.tokenize(p)
            engine.scheduler.validate_prompt(ids)
            token_ids.append(ids)
        params: SamplingParams = params_for(self._default_max_tokens(token_ids))
        if params.structured_outputs is not None:  # a bad spec is a 400 before any stream starts
            engine.compile_structured_outputs(params.structured_outputs)
        if params.max_tokens is not None:
            too_long = [len(ids) for ids in token_ids if len(ids) + params.max_tokens > self.max_model_len]
            if too_long:
                raise InvalidRequest(
                    f"prompt ({too_long[0]} tokens) plus max_tokens ({params.max_tokens}) exceeds the model's "
                    f"maximum context length of {self.max_model_len} tokens", "max_tokens")
        base = f"{uuid.uuid4().hex}"
        streams = [self.llm.generate({"prompt_token_ids": ids, "cache_salt": cache_salt}, params,
                                     request_id=f"{base}-{i}")
                   for i, ids in enumerate(token_ids)]
        return streams, token_ids

    # -- completions --

    async def completions(self, body: CompletionRequest, raw: Request) -> Response:
        self.check_model(body.model)
        prompts = body.prompts()
        streams, prompts_ids = self._start(prompts, body.to_sampling_params, body.cache_salt)
        prompt_lens = [len(ids) for ids in prompts_ids]
        texts = [p.get("prompt") for p in prompts]
        request_id, created, model = f"cmpl-{uuid.uuid4().hex}", int(time.time()), self.config.served_model_name
        if body.echo:
            tok = self.llm.tokenizer
            texts = [t if t is not None else tok.decode(p["prompt_token_ids"]) for t, p in zip(texts, prompts)]

        def echo_logprobs(i: int, entries: list | None) -> dict[str, Any]:
            return prompt_completion_logprobs(self.llm.tokenizer, prompts_ids[i], entries or [None] * len(prompts_ids[i]))

        def chunk(index: int, text: str, finish: str | None, stop_reason: Any,
                  logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
            return {"id": request_id, "object": "text_completion", "created": created, "model": model,
                    "choices": [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish,
                                 "stop_reason": stop_reason}]}

        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)

            async def events() -> AsyncIterator[str]:
                num_choices = len(streams) * body.n
                completion_tokens = [0] * num_choices
                echoed = [not body.echo] * num_choices
                offsets = [0] * num_choices
                async for j, i, c, out in _choices(streams, body.n):
                    prompt_lps = out.prompt_logprobs
                    completion_tokens[j] += len(c.token_ids)
                    logprobs = None
                    if c.logprobs is not None:
                        logprobs = completion_logprobs(c.token_ids, c.logprobs, offsets[j])
                        if not echoed[j]:
                            logprobs = join_logprobs(echo_logprobs(i, prompt_lps), logprobs)
                    text = c.text if echoed[j] else texts[i] + c.text
                    echoed[j] = True
                    offsets[j] += len(text)
                    if text or c.token_ids or c.finish_reason is not None:
                        yield _sse(chunk(j, text, c.finish_reason, c.stop_reason, logprobs))
                if include_usage:
                    yield _sse(self._usage_chunk(request_id, "text_completion", created, prompt_lens,
                                                 completion_tokens))

            return _event_stream(events())

        finals, prompt_lps, kv_params = await self._collect(streams, body.n, raw)
        choices = []
        for j, (text, token_ids, finish, stop_reason, logprobs) in enumerate(finals):
            i = j // body.n
            if logprobs is not None:
                logprobs = completion_logprobs(token_ids, logprobs, 0)
                if body.echo:
                    logprobs = join_logprobs(echo_logprobs(i, prompt_lps[i]), logprobs)
            choice = {"index": j, "text": (texts[i] if body.echo else "") + text, "logprobs": logprobs,
                      "finish_reason": finish, "stop_reason": stop_reason}
            if body.prompt_logprobs is not None:
                choice["prompt_logprobs"] = prompt_logprobs_json(prompt_lps[i])
            choices.append(choice)
        return JSONResponse({"id": request_id, "object": "text_completion", "created": created, "model": model,
                             "choices": choices, "usage": self._usage(prompt_lens, [len(f[1]) for f in finals]),
                             "kv_transfer_params": kv_params})

    # -- chat --

    async def chat(self, body: ChatCompletionRequest, raw: Request) -> Response:
        self.check_model(body.model)
        messages = [m.as_template_input() for m in body.messages]
        try:
            ids = self.llm.engine.apply_chat_template(messages, body.add_generation_prompt, body.chat_template_kwargs)
        except ValueError as e:
            raise InvalidRequest(str(e), "messages") from None
        except Exception as e:  # a template that rejects the conversation (jinja2 raise_exception)
            raise InvalidRequest(f"the chat template rejected the messages: {e}", "messages") from None
        streams, prompts_ids = self._start([{"prompt_token_ids": ids}], body.to_sampling_params, body.cache_salt)
        prompt_lens = [len(ids)]
        request_id, created, model = f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), self.config.served_model_name

        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)

            def chunk(index: int, delta: dict[str, Any], finish: str | None = None, stop_reason: Any = None,
                      logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
                choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
                if finish is not None:
                    choice["stop_reason"] = stop_reason
                return {"id": request_id, "object": "chat.completion.chunk", "created": created, "model": model,
                        "choices": [choice]}

            async def events() -> AsyncIterator[str]:
                completion_tokens = 0
                for j in range(body.n):
                    yield _sse(chunk(j, {"role": "assistant", "content": ""}))
                async for j, _, c, _ in _choices(streams, body.n):
                    completion_tokens += len(c.token_ids)
                    if c.text or (c.logprobs and c.token_ids):
                        logprobs = None if c.logprobs is None else \
                            chat_logprobs(c.token_ids, c.logprobs, body.top_logprobs or 0)
                        yield _sse(chunk(j, {"content": c.text}, logprobs=logprobs))
                    if c.finish_reason is not None:
                        yield _sse(chunk(j, {}, c.finish_reason, c.stop_reason))
                if include_usage:
                    yield _sse(self._usage_chunk(request_id, "chat.completion.chunk", created, prompt_lens,
                                                 [completion_tokens]))

            return _event_stream(events())

        finals, prompt_lps, kv_params = await self._collect(streams, body.n, raw)
        choices = [{"index": j, "message": {"role": "assistant", "content": text},
                    "logprobs": None if logprobs is None else chat_logprobs(token_ids, logprobs, body.top_logprobs or 0),
                    "finish_reason": finish, "stop_reason": stop_reason}
                   for j, (text, token_ids, finish, stop_reason, logprobs) in enumerate(finals)]
        response = {"id": request_id, "object": "chat.completion", "created": created, "model": model,
                    "choices": choices, "usage": self._usage(prompt_lens, [len(f[1]) for f in finals]),
                    "kv_transfer_params": kv_params}
        if body.prompt_logprobs is not None:
            response["prompt_logprobs"] = prompt_logprobs_json(prompt_lps[0])
        return JSONResponse(response)

    # -- shared --

    async def _collect(self, streams: list[AsyncIterator[RequestOutput]], n: int,
                       raw: Request) -> tuple[list[tuple], list[list | None], dict | None]:
        """Run the requests to the end: one (text, token ids, finish reason, stop reason, logprobs) per choice,
        each prompt's logprobs (None unless asked), and the first prompt's `kv_transfer_params` (a prefill
        instance's handover, else None); a client that disconnects meanwhile aborts them."""
        num = len(streams) * n
        prompt_logprobs: list[list | None] = [None] * len(streams)
        texts, tokens = [""] * num, [[] for _ in range(num)]
        logprobs: list[list | None] = [None] * num
        finals: list[tuple] = [("", [], None, None, None)] * num
        kv_params = None
        choices = _choices(streams, n)
        try:
            async for j, i, c, out in choices:
                if out.prompt_logprobs is not None:
                    prompt_logprobs[i] = out.prompt_logprobs
                if i == 0 and out.kv_transfer_params is not None:
                    kv_params = out.kv_transfer_params
                texts[j] += c.text
                tokens[j] += c.token_ids
                if c.logprobs is not None:
                    logprobs[j] = (logprobs[j] or []) + c.logprobs
                finals[j] = (texts[j], tokens[j], c.finish_reason, c.stop_reason, logprobs[j])
                if await raw.is_disconnected():
                    raise asyncio.CancelledError
        finally:
            await choices.aclose()
        return finals, prompt_logprobs, kv_params

    @staticmethod
    def _usage(prompt_lens: list[int], completion_lens: list[int]) -> dict[str, int]:
        prompt, completion = sum(prompt_lens), sum(completion_lens)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def _usage_chunk(self, request_id: str, obj: str, created: int, prompt_lens: list[int],
                     completion_lens: list[int]) -> dict[str, Any]:
        return {"id": request_id, "object": obj, "created": created, "model": self.config.served_model_name,
                "choices": [], "usage": self._usage(prompt_lens, completion_lens)}
