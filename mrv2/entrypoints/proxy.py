"""`mrv2 proxy`: the front of a prefill/decode-disaggregated deployment.

Each completion or chat request goes first to a prefill instance (`mrv2 serve
--kv-transfer-config '{"kv_connector": "ShmConnector", "kv_role": "kv_producer"}'`) with
one output token and `kv_transfer_params={"do_remote_decode": true}`; the params its
response returns go with the original request to a decode instance (`kv_role:
kv_consumer`), whose answer (streamed or not) is the client's. Instances are taken in
turn when several are given.
"""

from __future__ import annotations

import argparse
import itertools
import logging
from typing import Any

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

logger = logging.getLogger("mrv2")
ROUTES = ("/v1/completions", "/v1/chat/completions")


def add_proxy_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prefill", action="append", required=True, help="a prefill instance's base URL (repeatable)")
    p.add_argument("--decode", action="append", required=True, help="a decode instance's base URL (repeatable)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for an instance's answer")


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": "proxy_error", "code": status}}, status_code=status)


def build_proxy(prefill: list[str], decode: list[str], timeout: float = 600.0) -> FastAPI:
    """The proxy app over these instances (base URLs, with or without a trailing /v1)."""
    prefill = [u.rstrip("/").removesuffix("/v1") for u in prefill]
    decode = [u.rstrip("/").removesuffix("/v1") for u in decode]
    next_prefill, next_decode = itertools.cycle(prefill), itertools.cycle(decode)
    client = httpx.AsyncClient(timeout=timeout)
    app = FastAPI(title="mrv2 proxy", docs_url=None, redoc_url=None)

    async def forward(path: str, request: Request) -> Response:
        try:
            body: dict[str, Any] = await request.json()
        except ValueError:
            return _error(400, "the request body is not valid JSON")
        if not isinstance(body, dict):
            return _error(400, "the request body must be a JSON object")
        headers = {k: v for k, v in request.headers.items() if k.lower() == "authorization"}
        first = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
        first.update(max_tokens=1, n=1, kv_transfer_params={"do_remote_decode": True})
        if "max_completion_tokens" in first:
            first["max_completion_tokens"] = 1
        target = next(next_prefill)
        try:
            done = await client.post(target + path, json=first, headers=headers)
        except httpx.HTTPError as e:
            return _error(502, f"prefill instance {target} failed: {e}")
        if done.status_code != 200:
            return Response(done.content, done.status_code, media_type="application/json")
        second = dict(body, kv_transfer_params=done.json().get("kv_transfer_params"))
        target = next(next_decode)
        try:
            if body.get("stream"):
                req = client.build_request("POST", target + path, json=second, headers=headers)
                upstream = await client.send(req, stream=True)
                if upstream.status_code != 200:
                    content = await upstream.aread()
                    await upstream.aclose()
                    return Response(content, upstream.status_code, media_type="application/json")
                return StreamingResponse(upstream.aiter_raw(), media_type="text/event-stream",
                                         background=_Close(upstream))
            answer = await client.post(target + path, json=second, headers=headers)
        except httpx.HTTPError as e:
            return _error(502, f"decode instance {target} failed: {e}")
        return Response(answer.content, answer.status_code, media_type="application/json")

    for path in ROUTES:
        app.add_api_route(path, _route(forward, path), methods=["POST"])

    @app.get("/v1/models")
    async def models() -> Response:
        answer = await client.get(decode[0] + "/v1/models")
        return Response(answer.content, answer.status_code, media_type="application/json")

    @app.get("/health")
    async def health() -> Response:
        for url in prefill + decode:
            try:
                if (await client.get(url + "/health")).status_code != 200:
                    return _error(503, f"{url} is not healthy")
            except httpx.HTTPError as e:
                return _error(503, f"{url} is unreachable: {e}")
        return Response(status_code=200)

    return app


def _route(forward, path: str):
    async def handler(request: Request) -> Response:
        return await forward(path, request)
    return handler


class _Close:
    """Closes a streamed upstream response once its body is sent."""

    def __init__(self, response: httpx.Response) -> None:
        self.response = response

    async def __call__(self) -> None:
        await self.response.aclose()


def run_proxy(args: argparse.Namespace) -> int:
    app = build_proxy(args.prefill, args.decode, args.timeout)
    logger.warning("Proxying http://%s:%d/v1 to prefill %s and decode %s", args.host, args.port,
                   ", ".join(args.prefill), ", ".join(args.decode))
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    return 0
