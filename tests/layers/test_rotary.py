"""RotaryEmbedding / RopeConfig equal transformers' own rotary code (Llama, DeepSeek-V2, DeepSeek-V3)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.deepseek_v2 import modeling_deepseek_v2 as ds2
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as ds3
from transformers.models.llama import modeling_llama as llama

from mrv2.layers.rotary import RopeConfig, RotaryEmbedding, hf_rotary_style, yarn_softmax_scale

MAX_POS = 2560
# DeepSeek's checkpoints carry this legacy form (original 4096 shrunk to keep the cache small; factor 40 kept).
DS_YARN = {"type": "yarn", "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0, "original_max_position_embeddings": 64,
           "beta_fast": 32, "beta_slow": 1}
LLAMA_ROPES = {
    "default": None,
    "linear": {"rope_type": "linear", "factor": 2.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 640},
    "yarn_mscale": {"rope_type": "yarn", "factor": 40.0, "mscale": 0.707, "mscale_all_dim": 1.0,
                    "original_max_position_embeddings": 64, "beta_fast": 16, "beta_slow": 2},
    "yarn_attention_factor": {"rope_type": "yarn", "factor": 8.0, "attention_factor": 1.3,
                              "original_max_position_embeddings": 320},
    "yarn_no_truncate": {"rope_type": "yarn", "factor": 8.0, "truncate": False, "original_max_position_embeddings": 320},
}


def _positions(n: int = 48, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    fixed = torch.tensor([0, 1, 63, 64, 65, 639, 640, 641, MAX_POS - 1])  # around original_max_position_embeddings
    return torch.cat([fixed, torch.randint(0, MAX_POS, (n - len(fixed),), generator=g)])


def _qk(t: int, heads: int, dim: int, dtype=torch.float32, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(1, heads, t, dim, generator=g).to(dtype), torch.randn(1, 1, t, dim, generator=g).to(dtype))


def _mrv2(rope: RotaryEmbedding, pos: torch.Tensor, hf_layout: torch.Tensor) -> torch.Tensor:
    """Apply mrv2 rotary to an HF-layout [1, heads, tokens, dim] tensor; return it in HF layout."""
    return rope(pos, hf_layout[0].transpose(0, 1).contiguous()).transpose(0, 1).unsqueeze(0)


def _llama_config(rope_parameters, theta: float = 10000.0) -> transformers.LlamaConfig:
    params = {"rope_theta": theta, **(rope_parameters or {"rope_type": "default"})}
    return transformers.LlamaConfig(hidden_size=128, num_attention_heads=4, num_key_value_heads=1,
                                    max_position_embeddings=MAX_POS, rope_parameters=params)


def _ds_config(version: int, rope_scaling=None, **kw):
    cls = transformers.DeepseekV2Config if version == 2 else transformers.DeepseekV3Config
    extra = {"rope_scaling": dict(rope_scaling)} if rope_scaling else {}
    return cls(vocab_size=64, hidden_size=64, intermediate_size=64, moe_intermediate_size=32, num_hidden_layers=1,
               num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=None, qk_rope_head_dim=16,
               qk_nope_head_dim=32, v_head_dim=32, max_position_embeddings=MAX_POS, rope_theta=10000.0, **extra, **kw)


@pytest.mark.parametrize("name", list(LLAMA_ROPES))
def test_llama_rope_types_match_transformers(name):
    cfg = _llama_config(LLAMA_ROPES[name], theta=500000.0 if name == "llama3" else 10000.0)
    hf = llama.LlamaRotaryEmbedding(cfg)
    rope = RopeConfig.from_hf(cfg)
    assert rope.rope_type == cfg.rope_parameters["rope_type"]
    assert torch.equal(rope.inv_freq(32), hf.inv_freq)
    assert rope.attention_scaling() == hf.attention_scaling
    if name != "default":
        hf_fn_inv_freq, hf_fn_scaling = ROPE_INIT_FUNCTIONS[rope.rope_type](cfg)
        assert torch.equal(rope.inv_freq(32), hf_fn_inv_freq) and rope.attention_scaling() == hf_fn_scaling

    pos = _positions()
    q, k = _qk(len(pos), 4, 32)
    cos, sin = hf(q, pos[None])
    hq, hk = llama.apply_rotary_pos_emb(q, k, cos, sin)
    ours = RotaryEmbedding(32, MAX_POS, rope, torch.float32)
    torch.testing.assert_close(_mrv2(ours, pos, q), hq, atol=1e-5, rtol=0)
    torch.testing.assert_close(_mrv2(ours, pos, k), hk, atol=1e-5, rtol=0)


def test_yarn_attention_scaling_values():
    assert RopeConfig.from_hf(_llama_config(LLAMA_ROPES["yarn"])).attention_scaling() == pytest.approx(
        0.1 * torch.log(torch.tensor(4.0)).item() + 1.0)
    # mscale == mscale_all_dim: HF's ratio is exactly 1 (DeepSeek-V3 folds its mscale into the softmax scale instead)
    assert RopeConfig.from_hf(_ds_config(3, DS_YARN)).attention_scaling() == 1.0
    assert RopeConfig.from_hf(_llama_config(LLAMA_ROPES["yarn_attention_factor"])).attention_scaling() == 1.3


@pytest.mark.parametrize("rope_scaling", [None, DS_YARN], ids=["default", "yarn"])
def test_deepseek_v2_complex_rotation_matches_transformers(rope_scaling):
    cfg = _ds_config(2, rope_scaling)
    hf = ds2.DeepseekV2RotaryEmbedding(cfg)
    rope = RopeConfig.from_hf(cfg)
    assert torch.equal(rope.inv_freq(16), hf.inv_freq)
    assert rope.attention_scaling() == hf.attention_scaling
    assert hf_rotary_style(cfg) == "interleaved"

    pos = _positions()
    q, k = _qk(len(pos), 4, 16)
    hq, hk = ds2.apply_rotary_emb(q, k, hf(q, pos[None]))
    ours = RotaryEmbedding(16, MAX_POS, rope, torch.float32, style="interleaved")
    torch.testing.assert_close(_mrv2(ours, pos, q), hq, atol=1e-5, rtol=0)
    torch.testing.assert_close(_mrv2(ours, pos, k), hk, atol=1e-5, rtol=0)


@pytest.mark.parametrize("rope_interleave", [True, False])
@pytest.mark.parametrize("rope_scaling", [None, DS_YARN], ids=["default", "yarn"])
def test_deepseek_v3_rotation_matches_transformers(rope_scaling, rope_interleave):
    cfg = _ds_config(3, rope_scaling, rope_interleave=rope_interleave)
    hf = ds3.DeepseekV3RotaryEmbedding(cfg)
    rope = RopeConfig.from_hf(cfg)
    assert torch.equal(rope.inv_freq(16), hf.inv_freq)
    assert rope.attention_scaling() == hf.attention_scaling

    pos = _positions()
    q, k = _qk(len(pos), 4, 16)
    cos, sin = hf(q, pos[None])
    apply = ds3.apply_rotary_pos_emb_interleave if rope_interleave else ds3.apply_rotary_pos_emb
    hq, hk = apply(q, k, cos, sin)
    style = hf_rotary_style(cfg)
    assert style == ("interleaved_to_neox" if rope_interleave else "neox")
    ours = RotaryEmbedding(16, MAX_POS, rope, torch.float32, style=style)
    torch.testing.assert_close(_mrv2(ours, pos, q), hq, atol=1e-5, rtol=0)
    torch.testing.assert_close(_mrv2(ours, pos, k), hk, atol=1e-5, rtol=0)


def test_v2_and_v3_layouts_differ_only_by_permutation():
    """Same pairs and angles; V2 keeps them interleaved, V3 writes cat(even, odd)."""
    rope = RopeConfig.from_hf(_ds_config(3, DS_YARN))
    pos = _positions(16)
    x = torch.randn(16, 2, 16)
    v2 = RotaryEmbedding(16, MAX_POS, rope, torch.float32, style="interleaved")(pos, x)
    v3 = RotaryEmbedding(16, MAX_POS, rope, torch.float32, style="interleaved_to_neox")(pos, x)
    torch.testing.assert_close(torch.cat([v2[..., 0::2], v2[..., 1::2]], dim=-1), v3, atol=1e-6, rtol=0)
    assert not torch.allclose(v2, v3)


def test_bf16_follows_hf_precision():
    """V3 and Llama rotate in the model dtype (bit-identical); V2 rotates in fp32 and rounds once."""
    pos = _positions()
    cfg3 = _ds_config(3, DS_YARN)
    q, k = _qk(len(pos), 4, 16, torch.bfloat16)
    cos, sin = ds3.DeepseekV3RotaryEmbedding(cfg3)(q, pos[None])
    hq, _ = ds3.apply_rotary_pos_emb_interleave(q, k, cos, sin)
    ours = RotaryEmbedding(16, MAX_POS, RopeConfig.from_hf(cfg3), torch.bfloat16, style="interleaved_to_neox")
    assert torch.equal(_mrv2(ours, pos, q), hq)

    cfg2 = _ds_config(2, DS_YARN)
    hq, _ = ds2.apply_rotary_emb(q, k, ds2.DeepseekV2RotaryEmbedding(cfg2)(q, pos[None]))
    ours = RotaryEmbedding(16, MAX_POS, RopeConfig.from_hf(cfg2), torch.bfloat16, style="interleaved")
    assert ours.cos_sin_cache.dtype == torch.float32
    out = _mrv2(ours, pos, q)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), hq.float(), atol=0, rtol=2 ** -7)  # at most one bf16 ulp apart

    cfgl = _llama_config(LLAMA_ROPES["yarn_mscale"])
    q, k = _qk(len(pos), 4, 32, torch.bfloat16)
    cos, sin = llama.LlamaRotaryEmbedding(cfgl)(q, pos[None])
    hq, _ = llama.apply_rotary_pos_emb(q, k, cos, sin)
    assert torch.equal(_mrv2(RotaryEmbedding(32, MAX_POS, RopeConfig.from_hf(cfgl), torch.bfloat16), pos, q), hq)


@pytest.mark.parametrize("style", ["neox", "interleaved", "interleaved_to_neox"])
def test_partial_rotary_dim_passes_the_tail_through(style):
    rope = RotaryEmbedding(16, 128, RopeConfig(), torch.float32, style=style)
    x, pos = torch.randn(5, 3, 24), torch.tensor([0, 3, 7, 100, 127])
    out = rope(pos, x)
    assert torch.equal(out[..., 16:], x[..., 16:])
    torch.testing.assert_close(out[..., :16], rope(pos, x[..., :16].contiguous()))
    at_zero = rope(torch.zeros(5, dtype=torch.long), x)  # position 0 only applies the style's output layout
    expected = torch.cat([x[..., 0:16:2], x[..., 1:16:2], x[..., 16:]], -1) if style == "interleaved_to_neox" else x
    torch.testing.assert_close(at_zero, expected)


@pytest.mark.parametrize("version", [2, 3])
@pytest.mark.parametrize("rope_scaling", [None, DS_YARN, {**DS_YARN, "mscale_all_dim": 0.707, "mscale": 0.707},
                                          {k: v for k, v in DS_YARN.items() if k != "mscale_all_dim"}],
                         ids=["default", "yarn", "yarn_mscale_0.707", "yarn_no_mscale_all_dim"])
def test_softmax_scale_matches_hf_attention(version, rope_scaling):
    cfg = _ds_config(version, rope_scaling)
    attn = (ds2.DeepseekV2Attention if version == 2 else ds3.DeepseekV3Attention)(cfg, layer_idx=0)
    assert yarn_softmax_scale(RopeConfig.from_hf(cfg), cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) == attn.scaling


def test_from_hf_reads_legacy_and_transformers5_forms():
    new = RopeConfig.from_hf(_ds_config(3, DS_YARN))
    legacy = SimpleNamespace(rope_scaling=dict(DS_YARN), rope_theta=10000, max_position_embeddings=MAX_POS)
    auto = transformers.AutoConfig.for_model("deepseek_v3", rope_scaling=dict(DS_YARN), rope_theta=10000.0,
                                             max_position_embeddings=MAX_POS)
    assert RopeConfig.from_hf(legacy) == new == RopeConfig.from_hf(auto)
    assert (new.rope_type, new.factor, new.mscale, new.mscale_all_dim, new.original_max_position_embeddings,
            new.beta_fast, new.beta_slow, new.truncate) == ("yarn", 40.0, 1.0, 1.0, 64, 32.0, 1.0, True)
    # No original length given: HF falls back to max_position_embeddings.
    bare = SimpleNamespace(rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6},
                           max_position_embeddings=1024)
    assert RopeConfig.from_hf(bare).original_max_position_embeddings == 1024
    assert RopeConfig.from_hf(SimpleNamespace(rope_parameters=None, rope_theta=None)) == RopeConfig()
    with pytest.raises(ValueError, match="dynamic"):
        RopeConfig.from_hf(SimpleNamespace(rope_scaling={"type": "dynamic", "factor": 2.0}, rope_theta=1e4))
    with pytest.raises(ValueError, match="style"):
        RotaryEmbedding(16, 8, RopeConfig(), torch.float32, style="gptj")


def test_real_deepseek_v3_yarn_numbers():
    """The shipped config (original 4096, factor 40, rope dim 64): same inv_freq, cos/sin and softmax scales as HF."""
    cfg = transformers.DeepseekV3Config(rope_scaling={**DS_YARN, "original_max_position_embeddings": 4096},
                                        rope_theta=10000, max_position_embeddings=163840)
    rope = RopeConfig.from_hf(cfg)
    assert torch.equal(rope.inv_freq(64), ds3.DeepseekV3RotaryEmbedding(cfg).inv_freq)
    assert rope.attention_scaling() == 1.0
    assert yarn_softmax_scale(rope, 192) == ds3.DeepseekV3Attention(cfg, layer_idx=0).scaling
