"""Fixtures for the loader tests: tiny synthetic GGUF files and the converted default model."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from quant_helpers import add_tiny_vocabulary, tiny_gguf_writer

HIDDEN, HEADS, KV_HEADS, FFN, LAYERS = 64, 4, 2, 128, 2
Q8_0 = GGMLQuantizationType.Q8_0


@pytest.fixture
def tmp_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    cache = tmp_path / "cache"
    monkeypatch.setenv("MRV2_CACHE_DIR", str(cache))
    return cache


def llamacpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf `LlamaModel.permute`: what the converter must undo."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


TinyGguf = Callable[..., dict[str, np.ndarray]]


@pytest.fixture
def tiny_gguf() -> TinyGguf:
    """Factory writing a tiny random GGUF; returns the HF-named tensors the conversion must produce."""

    def write(path: Path, arch: str = "llama", *, untied: bool = False, bias: bool = False, head_dim: int = 0):
        rng = np.random.default_rng(0)
        head_dim = head_dim or (32 if arch == "qwen3" else HIDDEN // HEADS)
        writer = tiny_gguf_writer(path, arch, layers=LAYERS, hidden=HIDDEN, ffn=FFN, heads=HEADS, kv_heads=KV_HEADS)
        if arch == "qwen3":
            writer.add_key_length(head_dim)
            writer.add_value_length(head_dim)
        vocab = add_tiny_vocabulary(writer)

        expected: dict[str, np.ndarray] = {}

        def add(gguf_name: str, hf_name: str, shape: tuple[int, ...], *, q8=False, heads=0, norm=False) -> None:
            w = (1 + 0.1 * rng.standard_normal(shape) if norm else rng.standard_normal(shape)).astype(np.float32)
            if q8:  # what the file holds after quantization is what the conversion must reproduce
                w = dequantize(quantize(w, Q8_0), Q8_0)
            expected[hf_name] = w
            stored = llamacpp_permute(w, heads) if arch == "llama" and heads else w
            if q8:
                writer.add_tensor(gguf_name, quantize(stored, Q8_0), raw_dtype=Q8_0)
            else:
                writer.add_tensor(gguf_name, stored)

        add("token_embd.weight", "model.embed_tokens.weight", (vocab, HIDDEN), q8=True)
        add("output_norm.weight", "model.norm.weight", (HIDDEN,), norm=True)
        if untied:
            add("output.weight", "lm_head.weight", (vocab, HIDDEN))
        q_rows, kv_rows = HEADS * head_dim, KV_HEADS * head_dim
        for i in range(LAYERS):
            g, h = f"blk.{i}.", f"model.layers.{i}."
            add(g + "attn_norm.weight", h + "input_layernorm.weight", (HIDDEN,), norm=True)
            add(g + "attn_q.weight", h + "self_attn.q_proj.weight", (q_rows, HIDDEN), q8=True, heads=HEADS)
            add(g + "attn_k.weight", h + "self_attn.k_proj.weight", (kv_rows, HIDDEN), heads=KV_HEADS)
            add(g + "attn_v.weight", h + "self_attn.v_proj.weight", (kv_rows, HIDDEN))
            if bias:
                add(g + "attn_q.bias", h + "self_attn.q_proj.bias", (q_rows,), heads=HEADS)
                add(g + "attn_k.bias", h + "self_attn.k_proj.bias", (kv_rows,), heads=KV_HEADS)
                add(g + "attn_v.bias", h + "self_attn.v_proj.bias", (kv_rows,))
            if arch == "qwen3":
                add(g + "attn_q_norm.weight", h + "self_attn.q_norm.weight", (head_dim,), norm=True)
                add(g + "attn_k_norm.weight", h + "self_attn.k_norm.weight", (head_dim,), norm=True)
            add(g + "attn_output.weight", h + "self_attn.o_proj.weight", (HIDDEN, q_rows))
            if bias and arch == "llama":  # HF llama's attention_bias covers o_proj too
                add(g + "attn_output.bias", h + "self_attn.o_proj.bias", (HIDDEN,))
            add(g + "ffn_norm.weight", h + "post_attention_layernorm.weight", (HIDDEN,), norm=True)
            add(g + "ffn_gate.weight", h + "mlp.gate_proj.weight", (FFN, HIDDEN), q8=True)
            add(g + "ffn_up.weight", h + "mlp.up_proj.weight", (FFN, HIDDEN))
            add(g + "ffn_down.weight", h + "mlp.down_proj.weight", (HIDDEN, FFN), q8=True)

        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        return expected

    return write
