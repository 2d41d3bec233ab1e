"""GGUF blocks and tiny GGUF vocabularies for tests of the quantized path."""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import dequantize, quantize
from transformers.convert_slow_tokenizer import bytes_to_unicode

from mrv2.layers.quantization import QuantizedWeight
from mrv2.loader.gguf_quant import decode_blocks, stored_weight


def random_q4_k(n: int, k: int, rng: np.random.Generator, d: float = 0.01, dmin: float | None = None) -> np.ndarray:
    """Raw Q4_K blocks ([n, k / 256 * 144] uint8): random codes and 6-bit scales, positive d up to `d` and dmin
    up to `dmin` (2d where not given; 7.5d centres the weights on zero).

    `gguf` cannot quantize to Q4_K, but any bytes are valid blocks (finite halves aside).
    """
    blocks = rng.integers(0, 256, (n, k // 256, 144), dtype=np.uint8)
    blocks[..., 0:2] = rng.uniform(d / 10, d, (n, k // 256, 1)).astype(np.float16).view(np.uint8)
    dmin = 2 * d if dmin is None else dmin
    blocks[..., 2:4] = rng.uniform(dmin / 10, dmin, (n, k // 256, 1)).astype(np.float16).view(np.uint8)
    return blocks.reshape(n, -1)


def random_q6_k(n: int, k: int, rng: np.random.Generator, d: float = 0.001, sc: int = 128) -> np.ndarray:
    """Raw Q6_K blocks ([n, k / 256 * 210] uint8): random codes, int8 sub-block scales in [-sc, sc) (either sign)
    and positive d up to `d`. `gguf` cannot quantize to Q6_K either."""
    blocks = rng.integers(0, 256, (n, k // 256, 210), dtype=np.uint8)
    blocks[..., 192:208] = rng.integers(-sc, sc, (n, k // 256, 16)).astype(np.int8).view(np.uint8)
    blocks[..., 208:210] = rng.uniform(d / 10, d, (n, k // 256, 1)).astype(np.float16).view(np.uint8)
    return blocks.reshape(n, -1)


RANDOM_BLOCKS = {"Q4_K": random_q4_k, "Q6_K": random_q6_k}


def quantized(qtype: str, n: int, k: int, seed: int = 0) -> tuple[QuantizedWeight, np.ndarray]:
    """A random [n, k] weight quantized by `gguf` (K-quants: random blocks) and its reference dequantization.
    A K-quant of k features that are not whole 256-weight super-blocks is the first k of a wider one (whole
    32-weight blocks of it: what the kernels take)."""
    rng = np.random.default_rng(seed)
    if qtype in RANDOM_BLOCKS:
        wide = -(-k // 256) * 256
        raw = RANDOM_BLOCKS[qtype](n, wide, rng)
        ref = dequantize(raw, GGMLQuantizationType[qtype]).reshape(n, wide)[:, :k]
        parts = {p: torch.from_numpy(a) for p, a in decode_blocks(qtype, raw, n, wide).items()}
        return stored_weight(qtype, parts).narrow(1, 0, k), np.ascontiguousarray(ref)
    raw = quantize(rng.standard_normal((n, k)).astype(np.float32), GGMLQuantizationType[qtype])
    ref = dequantize(raw, GGMLQuantizationType[qtype]).reshape(n, k)
    parts = {p: torch.from_numpy(a) for p, a in decode_blocks(qtype, raw, n, k).items()}
    return stored_weight(qtype, parts), ref


def held_in_fp16(weight: QuantizedWeight) -> QuantizedWeight:
    """`weight` with its scales and mins rounded to fp16, as the block kernels hold them (a change for Q4_K's and
    Q6_K's only: GGUF stores the other types' as fp16)."""
    mins = None if weight.mins is None else weight.mins.half().float()
    return QuantizedWeight(weight.qtype, weight.codes, weight.scales.half().float(), mins)


def int8_blocks(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x's values as the integer GEMMs quantize them (int8 codes per 32-value block, scale max |x| / 127), and each
    block's scale. In their float32 steps, so that values near halfway between two codes round as theirs do:
    x times 127 / max |x| (a division: torch's `127 / t` multiplies by t's reciprocal, an ulp away at times),
    rounded half to even."""
    blocks = x.view(x.shape[0], -1, 32)
    amax = blocks.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, torch.full_like(amax, 127) / amax, 0)
    codes = torch.round(blocks * inv)
    scale = amax / 127
    return (codes * scale).view_as(x), scale.squeeze(-1)


def check_int8_product(weight: QuantizedWeight, x: torch.Tensor, got: torch.Tensor) -> None:
    """`got` (float32 sums) is the product of x quantized to int8 per block with the dequantized weight, as the
    integer GEMMs compute it (a Q4 block's min times x's exact sum), and within that quantization's bound of
    the exact product."""
    x = x.float()
    w = weight.dequantize(torch.float32).double()
    n, k = w.shape
    quantized_x, scale = int8_blocks(x)
    want = quantized_x.double() @ w.t()
    coded = w  # the part of each weight its code carries: d * q
    if weight.mins is not None or weight.qtype == "Q4_0":  # a Q4 block's min multiplies x's exact sum
        mins = -8 * weight.scales.double() if weight.qtype == "Q4_0" else weight.mins.double()
        sums = lambda t: t.double().view(t.shape[0], -1, 32).sum(-1)  # noqa: E731
        want += (sums(x) - sums(quantized_x)) @ mins.t()
        coded = w - mins.repeat_interleave(32, dim=1)
    # The kernel's arithmetic on those codes: integer sums, scaled once a block in fp32.
    assert (got.double() - want).abs().max() <= want.abs().max() * 2 ** -18
    # Against the exact product: at most half a step of x's codes a value, times what the codes carry.
    exact = x.double() @ w.t()
    bound = (scale.double() / 2) @ coded.abs().view(n, k // 32, 32).sum(-1).t()
    assert ((got.double() - exact).abs() <= bound * (1 + 2 ** -10) + exact.abs().max() * 2 ** -18).all()


TINY_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TINY_CHAT_TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"


def tiny_gguf_writer(path, arch: str, *, layers: int, hidden: int, ffn: int, heads: int,
                     kv_heads: int) -> GGUFWriter:
    """A `GGUFWriter` for a tiny model of `arch` with its shape in the metadata (256 tokens of context, RMS norm
    eps 1e-6, rotary base 10000)."""
    writer = GGUFWriter(path, arch)
    writer.add_block_count(layers)
    writer.add_context_length(256)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(10000.0)
    return writer


def add_tiny_vocabulary(writer: GGUFWriter) -> int:
    """A byte-level BPE vocabulary (the three specials, the 256 byte tokens, two merges) and a chat template in
    `writer`'s metadata; returns its size."""
    tokens = TINY_SPECIALS + list(bytes_to_unicode().values()) + ["Ġt", "he"]
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([3] * len(TINY_SPECIALS) + [1] * (len(tokens) - len(TINY_SPECIALS)))
    writer.add_token_merges(["Ġ t", "h e"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_pad_token_id(2)
    writer.add_add_bos_token(False)
    writer.add_chat_template(TINY_CHAT_TEMPLATE)
    return len(tokens)
