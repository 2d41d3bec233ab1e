"""`mrv2 serve`'s own options (kept free of the server's imports, so the CLI starts fast)."""

from __future__ import annotations

import argparse

DEFAULT_SERVED_NAME = "SmolLM2-135M-Instruct"


def add_server_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on every /v1 route")
    g.add_argument("--served-model-name", default=None,
                   help="the model name clients send (default: --model, or SmolLM2-135M-Instruct)")
    g.add_argument("--uvicorn-log-level", default="warning")
