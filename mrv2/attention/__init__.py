"""Attention backends: metadata builders, KV shapes, graph-capture hooks, and the registry the platform chooses from."""

from mrv2.attention.backend import AttentionBackend, CommonAttentionMetadata
from mrv2.attention.registry import get_attention_backend, register_backend, registered_backends

__all__ = ["AttentionBackend", "CommonAttentionMetadata", "get_attention_backend", "register_backend",
           "registered_backends"]
