"""Attention backends: metadata builders, KV layout preferences, graph-capture hooks."""

from mrv2.attention.backend import AttentionBackend, CommonAttentionMetadata

__all__ = ["AttentionBackend", "CommonAttentionMetadata", "get_attention_backend"]


def get_attention_backend(name: str | None = None) -> AttentionBackend:
    """The attention backend by name; the portable torch backend by default."""
    from mrv2.attention.torch_paged import TorchPagedAttention

    backends = {TorchPagedAttention.name: TorchPagedAttention}
    if name is None:
        return TorchPagedAttention()
    if name not in backends:
        raise ValueError(f"attention backend must be one of {sorted(backends)}, got {name!r}")
    return backends[name]()
