"""Turn what the user passed as `model` into a local HF checkpoint folder.

Only local paths are accepted: nothing is ever downloaded. GGUF files are
converted once and served from the cache afterwards.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from mrv2.loader.cache import converted_checkpoint
from mrv2.loader.default_model import default_gguf_path
from mrv2.loader.errors import ModelNotFoundError, UnsupportedArchitectureError

from mrv2.models.architectures import SUPPORTED_ARCHITECTURES

_HUB_ID = re.compile(r"[\w.-]+/[\w.-]+")


def resolve_model_path(model: str | os.PathLike | None) -> Path:
    """Local HF checkpoint folder for `model`.

    None is the embedded default model; a `.gguf` file, or a folder holding exactly one,
    is converted (cached); a folder with a config.json is used as it is.
    """
    if model is None:
        return converted_checkpoint(default_gguf_path())
    if not str(model):
        raise ModelNotFoundError("''", "empty model path")
    path = Path(model).expanduser()
    if path.is_file():
        if path.suffix.lower() == ".gguf":
            return converted_checkpoint(path)
        raise ModelNotFoundError(path, "a model file must be a .gguf; otherwise pass an HF checkpoint folder")
    if path.is_dir():
        if (path / "config.json").is_file():
            return path.resolve()
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return converted_checkpoint(ggufs[0])
        if ggufs:
            names = ", ".join(g.name for g in ggufs)
            raise ModelNotFoundError(path, f"folder holds several .gguf files ({names}); pass one of them")
        raise ModelNotFoundError(path, "folder has neither a config.json nor a .gguf file")
    if _HUB_ID.fullmatch(str(model)) and not str(model).startswith("."):
        raise ModelNotFoundError(model, "not a local path; only local paths are supported, nothing is downloaded")
    raise ModelNotFoundError(path)


def gguf_source(model: str | os.PathLike | None) -> Path | None:
    """The GGUF file `model` stands for (None: the embedded default), or None for an HF folder."""
    if model is None:
        return default_gguf_path()
    path = Path(model).expanduser()
    if path.is_file() and path.suffix.lower() == ".gguf":
        return path
    if path.is_dir() and not (path / "config.json").is_file():
        ggufs = sorted(path.glob("*.gguf"))
        return ggufs[0] if len(ggufs) == 1 else None
    return None


def check_architecture(hf_config: Any, supported: Iterable[str] | None = None) -> str:
    """The first supported architecture the config names; else UnsupportedArchitectureError.

    `hf_config` is a transformers config or a config.json dict; `supported` defaults to
    this module's SUPPORTED_ARCHITECTURES, looked up at call time so it can be overridden.
    """
    supported = tuple(SUPPORTED_ARCHITECTURES if supported is None else supported)
    if isinstance(hf_config, Mapping):
        architectures = hf_config.get("architectures")
    else:
        architectures = getattr(hf_config, "architectures", None)
    for architecture in architectures or ():
        if architecture in supported:
            return architecture
    raise UnsupportedArchitectureError(", ".join(architectures) if architectures else "<none named>", supported)
