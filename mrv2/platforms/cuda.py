"""The CUDA platform: caching allocator, pinned staging buffers, async copies."""

from __future__ import annotations

import torch

from mrv2.platforms.interface import Platform


class CudaPlatform(Platform):
    """NVIDIA GPUs through torch.cuda."""

    name = "cuda"
    device_type = "cuda"
    kv_alignment = 256

    def is_available(self) -> bool:
        return torch.cuda.is_available()

    def supports_native_bf16(self) -> bool:
        return torch.cuda.is_bf16_supported()

    def free_memory(self) -> int:
        free, _total = torch.cuda.mem_get_info()
        return free

    def reset_peak_memory(self) -> None:
        torch.cuda.reset_peak_memory_stats()

    def peak_memory(self) -> int:
        return torch.cuda.max_memory_allocated()

    def synchronize(self) -> None:
        torch.cuda.synchronize()

    def pin_memory(self) -> bool:
        return True
