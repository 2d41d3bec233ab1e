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
# Every file the kernels are built from: compiled graphs that call them depend on these too.
SOURCE_FILES = tuple(sorted(p for p in _SOURCES.iterdir() if p.suffix in (".cpp", ".inc")))


@lru_cache(maxsize=1)
def load_cpu_kernels() -> str | None:
    """Build (once per machine) and load the kernels: the GGUF block GEMVs (`torch.ops.mrv2_gguf.q4_gemv`,
    `q8_gemv`), the GGUF block GEMMs on AMX (`q4_gemm_amx`, `q8_gemm_amx`, which run where `amx_ready()`), on
    AVX512-BF16 (`q4_gemm_bf16`, `q8_gemm_bf16`), on AVX512-VNNI (`q4_gemm_vnni`, `q8_gemm_vnni`) and, for
    float32 activations, on AVX2 (`q4_gemm_avx2`, `q8_gemm_avx2`), and paged decode attention
    (`torch.ops.mrv2.paged_decode_attention`, and `paged_decode_attention_with_kv`, which first writes the
    step's keys and values), and the dense fp32 GEMV for a few rows (`torch.ops.mrv2.dense_gemv`); None when
    loaded, else why not. They need AVX2, FMA and F16C (the caller checks the CPU's flags)."""
    start = time.perf_counter()
    try:
        from torch.utils.cpp_extension import load
        # -fopenmp: at::parallel_for splits rows over torch's OpenMP threads (its own libgomp,
        # already loaded, serves the calls).
        files = ("gguf_gemv.cpp", "gguf_gemm.cpp", "gguf_gemm_vnni.cpp", "gguf_gemm_avx2.cpp", "paged_attention.cpp",
                 "dense_gemv.cpp")
        load(name="mrv2_cpu_kernels", sources=[str(_SOURCES / f) for f in files],
             extra_cflags=["-O3", "-fopenmp"],
             extra_ldflags=["-fopenmp"], is_python_module=False)
    except Exception as e:  # no compiler, no ninja, a failed build: the caller falls back
        lines = str(e).strip().splitlines()
        return f"{type(e).__name__}: {lines[-1] if lines else ''}"
    _register_fakes()
    logger.info("CPU kernels (GGUF block GEMV and GEMM, paged decode attention, dense GEMV) loaded in %.1f s", time.perf_counter() - start)
    return None


def _gemm_out(x: torch.Tensor, scales: torch.Tensor, out_dtype: torch.dtype | None, gated: bool) -> torch.Tensor:
    columns = scales.shape[0] * scales.shape[-1]  # a gated product's out: silu(first half) * second half
    return x.new_empty(x.shape[0], columns // 2 if gated else columns, dtype=out_dtype or x.dtype)


def _register_fakes() -> None:
    """Output shapes for tracing (torch.compile), in the input's dtype (the GEMVs': `out_dtype` where given)."""
    @torch.library.register_fake("mrv2_gguf::q4_gemv")
    def _q4(x, codes, scales, mins, isa, out_dtype=None):
        return x.new_empty(x.shape[0], codes.shape[0], dtype=out_dtype or x.dtype)

    @torch.library.register_fake("mrv2_gguf::q8_gemv")
    def _q8(x, codes, scales, isa, out_dtype=None, sub_blocks=1):
        return x.new_empty(x.shape[0], codes.shape[0], dtype=out_dtype or x.dtype)

    for engine in ("amx", "bf16", "vnni", "avx2"):
        @torch.library.register_fake(f"mrv2_gguf::q4_gemm_{engine}")
        def _q4_gemm(x, codes, scales, mins, out_dtype=None, gated=False):
            return _gemm_out(x, scales, out_dtype, gated)

        @torch.library.register_fake(f"mrv2_gguf::q8_gemm_{engine}")
        def _q8_gemm(x, codes, scales, out_dtype=None, gated=False):
            return _gemm_out(x, scales, out_dtype, gated)

    @torch.library.register_fake("mrv2::dense_gemv")
    def _dense_gemv(x, weight, bias, isa, row_stream=False):
        return x.new_empty(x.shape[0], weight.shape[0])

    @torch.library.register_fake("mrv2::paged_decode_attention")
    def _attention(query, k_cache, v_cache, block_table, seq_lens, scale, isa=1):
        return query.new_empty(query.shape[0], query.shape[1], v_cache.shape[-1])

    @torch.library.register_fake("mrv2::paged_decode_attention_with_kv")
    def _attention_with_kv(query, key, value, kv_cache, k_view, v_view, slot_mapping, block_table, seq_lens, scale,
                           isa=1):
        return query.new_empty(query.shape[0], query.shape[1], v_view[4])
