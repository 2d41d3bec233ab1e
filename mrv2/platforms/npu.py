"""The Ascend NPU platform, through `torch_npu` when it imports.

No Ascend hardware is reachable from CI; this module is exercised through the
same interfaces as the other platforms, and only activates when `torch_npu`
imports and reports a device.
"""

from __future__ import annotations

import importlib.util

import torch

from mrv2.platforms.graphs import GraphBackend, NpuGraphBackend
from mrv2.platforms.interface import AcceleratorPlatform


class NpuPlatform(AcceleratorPlatform):
    """Huawei Ascend NPUs through torch_npu."""

    name = "npu"
    device_type = "npu"
    # The Ascend KV transfer engine registers 2 MiB-aligned buffers; other kernels want 512 B.
    kv_alignment = 512
    ray_resource = "NPU"
    dist_backend = "hccl"

    def is_available(self) -> bool:
        if importlib.util.find_spec("torch_npu") is None:
            return False
        import torch_npu  # noqa: F401  (registers torch.npu)

        return torch.npu.is_available()

    def supports_native_bf16(self) -> bool:
        return True

    def _graph_backend(self) -> GraphBackend:
        return NpuGraphBackend()
