"""C++ kernels the CPU platform builds on first use, for this machine's compiler and torch.

`torch.utils.cpp_extension` compiles them once per machine (about 15 s, with ninja) into
torch's extension cache and loads them from there afterwards. Where there is no compiler
the platform keeps torch's own kernels.
"""

from __future__ import annotations

import logging
import time
from functools import lru_cache
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

_SOURCES = Path(__file__).parent


@lru_cache(maxsize=1)
def load_gguf_gemv() -> str | None:
    """Build (once per machine) and load the GGUF block GEMVs (`torch.ops.mrv2_gguf.q4_gemv`,
    `q8_gemv`); None when loaded, else why not."""
    start = time.perf_counter()
    try:
        from torch.utils.cpp_extension import load
        # -fopenmp: at::parallel_for splits rows over torch's OpenMP threads (its own libgomp,
        # already loaded, serves the calls).
        load(name="mrv2_gguf_gemv", sources=[str(_SOURCES / "gguf_gemv.cpp")], extra_cflags=["-O3", "-fopenmp"],
             extra_ldflags=["-fopenmp"], is_python_module=False)
    except Exception as e:  # no compiler, no ninja, a failed build: the caller falls back
        lines = str(e).strip().splitlines()
        return f"{type(e).__name__}: {lines[-1] if lines else ''}"
    _register_fakes()
    logger.info("GGUF block GEMV kernels loaded in %.1f s", time.perf_counter() - start)
    return None


def _register_fakes() -> None:
    """Output shapes for tracing (torch.compile): [rows, out_features] in x's dtype."""
    @torch.library.register_fake("mrv2_gguf::q4_gemv")
    def _q4(x, codes, scales, mins, isa):
        return x.new_empty(x.shape[0], codes.shape[0])

    @torch.library.register_fake("mrv2_gguf::q8_gemv")
    def _q8(x, codes, scales, isa):
        return x.new_empty(x.shape[0], codes.shape[0])
