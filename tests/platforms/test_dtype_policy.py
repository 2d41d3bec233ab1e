"""dtype="auto" follows the CPU's flags: bf16 where it is native (AMX or AVX-512-BF16), fp32 elsewhere.

The flags are faked, so every branch runs on any machine.
"""

from __future__ import annotations

import pytest
import torch

from mrv2.platforms import CpuPlatform


@pytest.mark.parametrize("flags,expected", [
    ({"avx2", "fma"}, torch.float32),  # Zen 3: bf16 would be emulated
    ({"avx2", "avx512f", "avx512_bf16"}, torch.bfloat16),  # Zen 4, Cooper Lake
    ({"avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile"}, torch.bfloat16),  # Sapphire Rapids
    (set(), torch.float32),  # flags unreadable
])
@pytest.mark.parametrize("checkpoint", [torch.float32, torch.bfloat16, torch.float16, None])
def test_auto_dtype_follows_cpu_flags(flags, expected, checkpoint):
    dtype, why = CpuPlatform(frozenset(flags)).resolve_dtype("auto", checkpoint)
    assert dtype == expected  # even for an fp32 checkpoint, and never fp16 on a CPU
    assert "dtype='auto'" in why and ("native" in why)


@pytest.mark.parametrize("name,expected", [("float32", torch.float32), ("fp32", torch.float32),
                                           ("bfloat16", torch.bfloat16), ("float16", torch.float16)])
def test_named_dtype_is_kept_whatever_the_flags(name, expected):
    for flags in ({"avx2"}, {"avx512_bf16", "amx_bf16"}):
        dtype, why = CpuPlatform(frozenset(flags)).resolve_dtype(name, torch.float32)
        assert dtype == expected and name in why


def test_the_machine_flags_are_read_by_default():
    platform = CpuPlatform()
    assert platform.supports_native_bf16() == bool({"avx512_bf16", "amx_bf16"} & platform.flags)


ZEN3 = {"avx2", "fma", "f16c"}


@pytest.mark.parametrize("flags,dtype,exact,quantization,int4_rows,dense", [
    ({"avx2", "avx512f", "avx512_bf16", "amx_bf16"}, torch.bfloat16, False, "auto", 4, True),  # Sapphire Rapids
    ({"avx2", "avx512f", "avx512_bf16"}, torch.bfloat16, False, "auto", 4, True),  # Zen 4: a packed dense copy
    ({"avx2", "avx512f", "avx512_bf16"}, torch.bfloat16, False, "gguf", 4, False),  # no dense copy asked
    (ZEN3, torch.float32, False, "auto", 4, False),  # Zen 3's auto dtype: block GEMV, then the AVX2 block GEMM
    (ZEN3, torch.float32, True, "auto", 0, False),  # float32 by name: the exact reference mode
    ({"avx2", "fma"}, torch.float32, False, "auto", 0, False),  # no block GEMV; torch's int4 kernel is bf16-only
    ({"avx2", "fma"}, torch.bfloat16, False, "auto", 8, True),  # bf16 by name: torch's AVX2 int4 code
    (set(), torch.bfloat16, False, "auto", 0, False),  # no vector ISA known
    ({"avx2", "avx512f", "avx512_bf16"}, torch.float32, True, "auto", 0, False),  # the exact reference mode
    (ZEN3, torch.float32, True, "gguf", 4, False),  # ... unless the GGUF's weights are asked to stay quantized
    ({"avx2", "avx512f", "avx512_bf16"}, torch.bfloat16, False, None, 0, False),  # quantization=None
])
def test_quantized_kernels_follow_cpu_flags_and_dtype(flags, dtype, exact, quantization, int4_rows, dense):
    policy, why = CpuPlatform(frozenset(flags)).quant_policy(dtype, quantization, exact=exact)
    assert policy.uses_int4 == bool(int4_rows) and (policy.dense_budget > 0) == dense
    assert policy.int4_max_rows == int4_rows or not int4_rows
    assert why


VNNI = {"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni"}


@pytest.mark.parametrize("flags,isa", [
    (VNNI | {"avx512_bf16", "amx_bf16"}, 2),  # Sapphire Rapids
    (VNNI | {"avx512_bf16"}, 2),  # Zen 4
    ({"avx2", "fma", "f16c"}, 1),  # Zen 3
    ({"avx2", "avx512f"}, 0),  # no FMA or F16C named: torch's int4 kernel
])
def test_block_gemv_follows_cpu_flags(flags, isa):
    platform = CpuPlatform(frozenset(flags))
    assert platform.gemv_isa() == isa
    policy, why = platform.quant_policy(torch.bfloat16, "auto")
    assert policy.uses_int4 and policy.gemv_isa == isa  # the kernels build on this machine (a compiler is here)
    assert why.startswith("mrv2's GGUF block GEMV" if isa else "torch's int4 kernel (mrv2's GGUF block GEMV: ")


SAPPHIRE_RAPIDS = VNNI | {"avx512_bf16", "amx_tile", "amx_bf16"}


@pytest.mark.parametrize("flags,dtype,quantization", [
    (SAPPHIRE_RAPIDS, torch.bfloat16, "auto"),
    (SAPPHIRE_RAPIDS, torch.bfloat16, "gguf"),
    (SAPPHIRE_RAPIDS, torch.float32, "gguf"),  # fp32 activations with native bf16: the GEMV's finer int16 codes
    (SAPPHIRE_RAPIDS - {"amx_bf16"}, torch.bfloat16, "auto"),  # no AMX: VNNI integer products
    (VNNI | {"avx512_bf16"}, torch.bfloat16, "auto"),  # Zen 4: VNNI integer products
    (VNNI - {"avx512_vnni"} | {"avx512_bf16"}, torch.bfloat16, "auto"),  # AVX512-BF16 without VNNI: dot products
    (VNNI | {"avx512_bf16"}, torch.float32, "auto"),
    (VNNI, torch.bfloat16, "auto"),  # AVX-512 without BF16: dense GEMMs on a copy
    (ZEN3, torch.bfloat16, "gguf"),  # bf16 by name without native bf16: neither GEMM
    (ZEN3, torch.float32, "auto"),
])
def test_block_gemm_follows_cpu_flags_and_dtype(flags, dtype, quantization):
    """Larger batches run on the block GEMM (no dense copy): bf16 activations on AMX where the flags name
    AMX-BF16 and the process may use AMX tiles (which only a CPU with AMX grants), else where the flags name
    AVX512-BF16 with AVX512-VNNI integer products, or without VNNI AVX512-BF16 dot products; float32
    activations without native bf16 with AVX2 integer products;
    as before elsewhere."""
    from mrv2.platforms.cpu_kernels import load_cpu_kernels

    platform = CpuPlatform(frozenset(flags))
    policy, why = platform.quant_policy(dtype, quantization)
    loaded = load_cpu_kernels() is None
    amx = platform.has_amx() and dtype == torch.bfloat16 and loaded and torch.ops.mrv2_gguf.amx_ready()
    bf16 = not amx and "avx512_bf16" in flags and dtype == torch.bfloat16 and loaded
    vnni, dot = bf16 and "avx512_vnni" in flags, bf16 and "avx512_vnni" not in flags
    assert platform.has_amx() == ("amx_bf16" in flags)
    avx2 = dtype == torch.float32 and not platform.supports_native_bf16() and loaded
    assert policy.gemm_isa == (2 if amx else 4 if vnni else 1 if dot else 3 if avx2 else 0) and policy.uses_int4
    assert ("block GEMM (AMX)" in why) == amx and ("block GEMM (AVX512-BF16)" in why) == dot
    assert ("block GEMM (AVX512-VNNI int8)" in why) == vnni and ("block GEMM (AVX2 int8)" in why) == avx2
    if amx or bf16 or avx2:  # the tiles serve every batch but the GEMV's few rows: no dense copy
        rows = {2: 1, 4: CpuPlatform.int4_max_rows_vnni_gemm, 1: 2,
                3: CpuPlatform.int4_max_rows_avx2_gemm}[policy.gemm_isa]
        assert policy.dense_budget == 0 and policy.int4_max_rows == rows


@pytest.mark.parametrize("flags,dtype,gemm_isa,name", [
    (VNNI | {"avx512_bf16"}, torch.bfloat16, 1, "AVX512-BF16"),  # Zen 4: the dot products on bf16 activations
    (ZEN3, torch.float32, 0, None),  # Zen 3: no integer GEMM; the block GEMV, and a dense copy for large batches
])
def test_int8_activations_false_keeps_the_activations_dtype(flags, dtype, gemm_isa, name):
    from mrv2.platforms.cpu_kernels import load_cpu_kernels

    if load_cpu_kernels() is not None:
        pytest.skip("the block kernels did not build here")
    platform = CpuPlatform(frozenset(flags))
    assert platform.gemm_isa(dtype) in (3, 4)  # by default, int8 activations
    policy, why = platform.quant_policy(dtype, "auto", int8_activations=False)
    assert policy.gemm_isa == gemm_isa and policy.uses_int4 and "int8" not in why
    assert (f"block GEMM ({name})" in why) if name else (policy.dense_budget > 0 and "block GEMM" not in why)


INTEL, AMD = "GenuineIntel", "AuthenticAMD"


@pytest.mark.parametrize("flags,vendor,dtype,packs", [
    ({"avx2", "avx512f", "avx512_bf16", "amx_bf16"}, INTEL, torch.bfloat16, True),  # Sapphire Rapids
    ({"avx2", "avx512f", "avx512_bf16"}, AMD, torch.bfloat16, True),  # Zen 4
    ({"avx2", "avx512f", "avx512_bf16", "amx_bf16"}, INTEL, torch.float32, False),  # fp32 keeps MKL
    (VNNI | {"avx512_bf16"}, AMD, torch.float32, False),  # Zen 4: plain weights, mrv2's dense GEMV and oneDNN
    (ZEN3, AMD, torch.float32, False),  # Zen 3 too
    ({"avx2", "avx512f", "avx512_bf16"}, AMD, torch.float32, True),  # no FMA or F16C named: MKL's slow fp32 on AMD
    ({"avx2", "fma"}, AMD, torch.float32, True),  # the same on Zen 3
    ({"avx2", "fma"}, AMD, torch.bfloat16, False),  # Zen 3: no native bf16 kernels to pack for
])
def test_linear_packing_follows_cpu_flags_and_dtype(flags, vendor, dtype, packs):
    rows = CpuPlatform(frozenset(flags), vendor).linear_pack_rows(dtype)
    assert (rows is not None) == packs and (rows is None or rows > 0)


@pytest.mark.parametrize("flags,vendor,dtype,isa,rows", [
    (SAPPHIRE_RAPIDS, INTEL, torch.float32, 2, CpuPlatform.dense_gemv_max_rows),  # AVX-512, then MKL
    ({"avx2", "fma", "f16c"}, INTEL, torch.float32, 1, CpuPlatform.dense_gemv_max_rows),  # AVX2 only
    (SAPPHIRE_RAPIDS, INTEL, torch.bfloat16, 0, 0),  # bf16 weights: packed for oneDNN or plain torch
    (VNNI | {"avx512_bf16"}, AMD, torch.float32, 2, CpuPlatform.dense_gemv_max_rows_amd),  # Zen 4, then oneDNN
    (ZEN3, AMD, torch.float32, 1, CpuPlatform.dense_gemv_max_rows_amd),  # Zen 3, then oneDNN
    ({"avx2", "avx512f"}, INTEL, torch.float32, 0, 0),  # no FMA or F16C named
])
def test_dense_gemv_follows_cpu_flags_vendor_and_dtype(flags, vendor, dtype, isa, rows):
    platform = CpuPlatform(frozenset(flags), vendor)
    policy, why = platform.dense_gemv_policy(dtype)
    assert (policy.isa if policy else 0) == isa and why  # the kernels build on this machine (a compiler is here)
    assert not (policy and platform.linear_pack_rows(dtype))  # the GEMV reads plain weights: none are packed
    if policy:
        assert policy.max_rows == rows and policy.onednn_above == (vendor == AMD)
        assert policy.row_stream == (vendor == AMD)  # one row: each weight row front to back, where measured
        assert why.startswith(f"mrv2's dense GEMV ({'AVX-512' if isa == 2 else 'AVX2'})")
        assert ("oneDNN on the same plain weights" in why) == policy.onednn_above
