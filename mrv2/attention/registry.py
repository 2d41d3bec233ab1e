"""Attention backends by name, and the platform's choice per attention kind.

Backends register themselves (`@register_backend`) under their `name`; a platform
lists, per attention kind ("gqa", "mla"), the backend names it prefers
(`Platform.attention_backend_names`), and `get_attention_backend` returns the first
registered one that is available. The runner asks here; it never names a backend.
"""

from __future__ import annotations

import importlib

from mrv2.attention.backend import AttentionBackend
from mrv2.platforms import Platform

# Modules whose import registers the built-in backends.
_BUILTIN_MODULES = ("mrv2.attention.torch_paged", "mrv2.attention.torch_mla", "mrv2.attention.batch_invariant",
                    "mrv2.attention.paged_decode", "mrv2.attention.cpp_paged")

_BACKENDS: dict[str, type[AttentionBackend]] = {}


def register_backend(cls: type[AttentionBackend]) -> type[AttentionBackend]:
    """Class decorator: make `cls` selectable by its `name`."""
    other = _BACKENDS.get(cls.name)
    if other is not None and other is not cls:
        raise ValueError(f"attention backend name {cls.name!r} is taken by {other.__qualname__}")
    _BACKENDS[cls.name] = cls
    return cls


def registered_backends() -> dict[str, type[AttentionBackend]]:
    """Every registered backend class by name (built-ins included)."""
    for module in _BUILTIN_MODULES:
        importlib.import_module(module)
    return dict(_BACKENDS)


def get_attention_backend(platform: Platform, kind: str, batch_invariant: bool = False,
                          name: str | None = None) -> AttentionBackend:
    """A new instance of the backend `platform` prefers for attention `kind`.

    `batch_invariant`: a backend whose outputs do not depend on the batch (`batch_invariant = True`),
    in registration order, whatever the platform prefers. `name`: that backend, which must
    serve `kind` and be available here.
    """
    names = platform.attention_backend_names(kind)  # raises for a kind the platform does not know
    backends = registered_backends()
    if name is not None:
        cls = backends.get(name)
        if cls is None:
            raise ValueError(f"attention_backend {name!r} is not registered (registered: {sorted(backends)})")
        if cls.kind != kind:
            raise ValueError(f"attention_backend {name!r} serves {cls.kind!r} attention, but this model needs "
                             f"{kind!r} (those: {sorted(n for n, c in backends.items() if c.kind == kind)})")
        if not cls.is_available():
            raise ValueError(f"attention_backend {name!r} is not available here")
        return cls.for_platform(platform)
    if batch_invariant:
        for cls in backends.values():
            if cls.batch_invariant and cls.kind == kind and cls.is_available():
                return cls.for_platform(platform)
        raise ValueError(f"batch_invariant=True: no batch-invariant {kind!r} attention backend is available")
    for name in names:
        cls = backends.get(name)
        if cls is not None and cls.kind == kind and cls.is_available():
            return cls.for_platform(platform)
    raise ValueError(f"no available {kind!r} attention backend on platform {platform.name!r}: it prefers "
                     f"{list(names)}; registered: {sorted(n for n, c in backends.items() if c.kind == kind)}")
