"""Attention backends: metadata builders, KV layout preferences, graph-capture hooks."""

from mrv2.attention.backend import AttentionBackend, CommonAttentionMetadata

__all__ = ["AttentionBackend", "CommonAttentionMetadata", "get_attention_backend"]


def get_attention_backend(kind: str = "gqa") -> AttentionBackend:
    """The portable torch backend for an attention kind: "gqa" (incl. MHA/MQA) or "mla"."""
    from mrv2.attention.torch_mla import TorchMLAAttention
    from mrv2.attention.torch_paged import TorchPagedAttention

    backends = {"gqa": TorchPagedAttention, "mla": TorchMLAAttention}
    if kind not in backends:
        raise ValueError(f"attention kind must be one of {sorted(backends)}, got {kind!r}")
    return backends[kind]()
