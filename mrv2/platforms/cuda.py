"""The CUDA platform: caching allocator, pinned staging buffers, async copies."""

from __future__ import annotations

import torch

from mrv2.platforms.graphs import CudaGraphBackend, GraphBackend
from mrv2.platforms.interface import AcceleratorPlatform


class CudaPlatform(AcceleratorPlatform):
    """NVIDIA GPUs through torch.cuda."""

    name = "cuda"
    device_type = "cuda"
    kv_alignment = 256
    ray_resource = "GPU"
    dist_backend = "nccl"

    def is_available(self) -> bool:
        return torch.cuda.is_available()

    def supports_native_bf16(self) -> bool:
        return torch.cuda.is_bf16_supported()

    def _graph_backend(self) -> GraphBackend:
        return CudaGraphBackend()
