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
