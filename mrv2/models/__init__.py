"""Model definitions and the architecture registry."""

from mrv2.models.registry import SUPPORTED_ARCHITECTURES, build_model

__all__ = ["SUPPORTED_ARCHITECTURES", "build_model"]
