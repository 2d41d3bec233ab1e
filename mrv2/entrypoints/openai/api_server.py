"""`mrv2 serve`: an OpenAI-compatible HTTP server over `AsyncLLM` (FastAPI + uvicorn).

Routes: `POST /v1/completions` and `POST /v1/chat/completions` (streamed as
server-sent events, or not; see `serving.py`), `GET /v1/models`, `GET /health`,
`POST /tokenize`, `POST /detokenize`, `GET /metrics` (Prometheus). With an API key
every `/v1` route needs `Authorization: Bearer KEY`. Errors use OpenAI's JSON shape;
bad input is a 400 naming the field, never a 500, and the engine keeps serving
everyone else.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from mrv2.engine.arg_utils import engine_kwargs
from mrv2.engine.async_llm import AsyncLLM, EngineDeadError
from mrv2.entrypoints.openai.args import DEFAULT_SERVED_NAME
from mrv2.entrypoints.openai.metrics import PrometheusStatLogger
from mrv2.entrypoints.openai.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                              InvalidRequest, TokenizeRequest)
from mrv2.entrypoints.openai.serving import APIError, OpenAIServing, ServerConfig, bad_request

logger = logging.getLogger("mrv2")


def build_app(llm: AsyncLLM, config: ServerConfig, stat_logger: PrometheusStatLogger | None = None) -> FastAPI:
    """The FastAPI application over a running `llm`."""
    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        # uvicorn's shutdown (SIGINT/SIGTERM) ran its graceful period: abort what is left, stop the engine.
        await asyncio.to_thread(llm.shutdown)

    app = FastAPI(title="mrv2", docs_url=None, redoc_url=None, lifespan=lifespan)
    serving = OpenAIServing(llm, config)

    @app.exception_handler(APIError)
    async def api_error(_: Request, e: APIError) -> JSONResponse:
        return e.response()

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, e: RequestValidationError) -> JSONResponse:
        first = e.errors()[0] if e.errors() else {}
        if first.get("type") == "json_invalid":
            return APIError(400, f"the body is not valid JSON: {first.get('ctx', {}).get('error', '')}",
                            "BadRequestError").response()
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        message = f"{'.'.join(loc) or 'body'}: {first.get('msg', 'invalid request')}"
        return APIError(400, message, "BadRequestError", loc[0] if loc else None).response()

    @app.exception_handler(ValueError)
    async def value_error(_: Request, e: ValueError) -> JSONResponse:
        return bad_request(e).response()

    @app.exception_handler(EngineDeadError)
    async def engine_dead(_: Request, e: EngineDeadError) -> JSONResponse:
        return APIError(503, str(e), "ServiceUnavailable").response()

    @app.middleware("http")
    async def authenticate(request: Request, call_next):
        if config.api_key is not None and request.url.path.startswith("/v1"):
            given = request.headers.get("Authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {config.api_key}".encode()):
                return APIError(401, "invalid or missing API key (Authorization: Bearer KEY)",
                                "AuthenticationError").response()
        return await call_next(request)

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if llm.is_running else 503)

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        return JSONResponse({"object": "list", "data": [{
            "id": config.served_model_name, "object": "model", "created": int(time.time()), "owned_by": "mrv2",
            "root": str(llm.engine.model_path), "max_model_len": serving.max_model_len}]})

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, raw: Request) -> Response:
        return await serving.completions(body, raw)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, raw: Request) -> Response:
        return await serving.chat(body, raw)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> JSONResponse:
        serving.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise InvalidRequest("give exactly one of prompt and messages", "prompt")
        if body.messages is not None:
            ids = llm.engine.apply_chat_template([m.as_template_input() for m in body.messages],
                                                 body.add_generation_prompt)
        else:
            ids = llm.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        return JSONResponse({"tokens": ids, "count": len(ids), "max_model_len": serving.max_model_len})

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> JSONResponse:
        serving.check_model(body.model)
        vocab = len(llm.tokenizer)
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise InvalidRequest(f"tokens contains ids outside the vocabulary [0, {vocab}): {bad[:5]}", "tokens")
        return JSONResponse({"prompt": llm.tokenizer.decode(body.tokens)})

    @app.get("/metrics")
    async def metrics() -> Response:
        if stat_logger is None:
            return Response(status_code=404)
        return Response(generate_latest(stat_logger.registry), media_type=CONTENT_TYPE_LATEST)

    return app



class _Server(uvicorn.Server):
    """uvicorn's server; on SIGINT/SIGTERM the engine's requests are aborted first, so every stream
    ends with finish_reason "abort" and [DONE] and the connections close within the graceful period."""

    def __init__(self, llm: AsyncLLM, config: uvicorn.Config) -> None:
        super().__init__(config)
        self.llm = llm

    def handle_exit(self, sig: int, frame: Any) -> None:
        self.llm.abort_all()
        super().handle_exit(sig, frame)


def serve(args: Any) -> int:
    """Start the engine, then serve HTTP until SIGINT/SIGTERM: requests in flight end as aborted, the engine
    stops, and the process exits by that signal, as uvicorn does."""
    name = args.served_model_name or args.model or DEFAULT_SERVED_NAME
    stat_logger = PrometheusStatLogger(name)
    llm = AsyncLLM(**engine_kwargs(args), stat_loggers=[stat_logger])
    try:
        app = build_app(llm, ServerConfig(name, args.api_key), stat_logger)
        server = _Server(llm, uvicorn.Config(app, host=args.host, port=args.port, log_level=args.uvicorn_log_level,
                                             timeout_graceful_shutdown=5))
        logger.warning("Serving %s on http://%s:%d/v1", name, args.host, args.port)
        server.run()
    finally:
        llm.shutdown()
    return 0
