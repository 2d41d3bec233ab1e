"""Errors raised while locating, converting or reading a checkpoint.

All derive from `ModelLoadError`, itself a `ValueError`, so callers can catch one
type for "this model cannot be loaded". They keep their constructor arguments so
they survive pickling across process boundaries.
"""

from __future__ import annotations

import os
from collections.abc import Iterable


class ModelLoadError(ValueError):
    """A model could not be located, converted or read."""

    def __reduce__(self):
        return type(self), getattr(self, "_init_args", self.args)


class ModelNotFoundError(ModelLoadError):
    """No usable checkpoint at the given path."""

    def __init__(self, path: str | os.PathLike, reason: str = "no such file or directory") -> None:
        self._init_args = (path, reason)
        self.path = str(path)
        super().__init__(f"model not found: {self.path} ({reason})")


class UnsupportedArchitectureError(ModelLoadError):
    """The checkpoint's architecture is not one this engine implements."""

    def __init__(self, architecture: str, supported: Iterable[str]) -> None:
        self.architecture = architecture
        self.supported = tuple(supported)
        self._init_args = (architecture, self.supported)
        super().__init__(
            f"unsupported architecture {architecture!r}; supported: {', '.join(self.supported)}"
        )


class CorruptCheckpointError(ModelLoadError):
    """A checkpoint file is truncated, corrupt or not in the format its name claims."""

    def __init__(self, path: str | os.PathLike, reason: str) -> None:
        self._init_args = (path, reason)
        self.path = str(path)
        super().__init__(f"corrupt or truncated checkpoint file {self.path}: {reason}")
