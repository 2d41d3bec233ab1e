"""Platforms: the only package that names a device type."""

from __future__ import annotations

from mrv2.platforms.cpu import CpuPlatform
from mrv2.platforms.cuda import CudaPlatform
from mrv2.platforms.interface import Platform
from mrv2.platforms.npu import NpuPlatform

_PLATFORMS: dict[str, type[Platform]] = {"cpu": CpuPlatform, "cuda": CudaPlatform, "npu": NpuPlatform}


def get_platform(device: str | None = None) -> Platform:
    """The platform for `device` ("cpu", "cuda", "npu"), or the best available one."""
    if device is not None:
        if device not in _PLATFORMS:
            raise ValueError(f"device must be one of {sorted(_PLATFORMS)}, got {device!r}")
        platform = _PLATFORMS[device]()
        if not platform.is_available():
            raise ValueError(f"device {device!r} is not available on this machine")
        return platform
    for cls in (NpuPlatform, CudaPlatform):
        platform = cls()
        if platform.is_available():
            return platform
    return CpuPlatform()


__all__ = ["Platform", "get_platform", "CpuPlatform", "CudaPlatform", "NpuPlatform"]
