"""Locating checkpoints and reading their weights.

`resolve_model_path` turns a user's `model` argument into a local HF checkpoint
folder (converting GGUF files once, into the cache); `iter_safetensors_weights`
streams that folder's tensors. Importing this package stays cheap: the modules
that need torch, numpy or gguf load on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from mrv2.loader.cache import cache_root, content_hash, converted_checkpoint
from mrv2.loader.default_model import default_gguf_path
from mrv2.loader.errors import (
    CorruptCheckpointError,
    ModelLoadError,
    ModelNotFoundError,
    UnsupportedArchitectureError,
)
from mrv2.loader.resolve import SUPPORTED_ARCHITECTURES, check_architecture, resolve_model_path

if TYPE_CHECKING:
    from mrv2.loader.gguf_convert import convert_gguf_to_hf
    from mrv2.loader.safetensors_weights import iter_safetensors_weights, safetensors_files

_LAZY = {
    "convert_gguf_to_hf": "mrv2.loader.gguf_convert",
    "iter_safetensors_weights": "mrv2.loader.safetensors_weights",
    "safetensors_files": "mrv2.loader.safetensors_weights",
}

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "CorruptCheckpointError",
    "ModelLoadError",
    "ModelNotFoundError",
    "UnsupportedArchitectureError",
    "cache_root",
    "check_architecture",
    "content_hash",
    "convert_gguf_to_hf",
    "converted_checkpoint",
    "default_gguf_path",
    "iter_safetensors_weights",
    "resolve_model_path",
    "safetensors_files",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
