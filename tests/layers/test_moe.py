"""FusedMoE equals transformers' DeepseekV2Moe / DeepseekV3MoE (fp32), for both checkpoint namings of the experts."""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2Moe
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

from mrv2.layers.moe import FusedMoE, MoEConfig

H, I, E = 32, 16, 8


def _hf_moe(version: str, seed: int = 0, **overrides):
    """A random HF MoE block: 8 experts in 4 groups of 2, top-3 from the best 2 groups."""
    kwargs = dict(hidden_size=H, moe_intermediate_size=I, n_routed_experts=E, num_experts_per_tok=3, n_group=4,
                  topk_group=2, routed_scaling_factor=2.5, experts_implementation="eager")
    kwargs.update(overrides)
    if version == "v2":
        cfg, module = transformers.DeepseekV2Config(**{"n_shared_experts": 2, **kwargs}), DeepseekV2Moe
    else:
        cfg, module = transformers.DeepseekV3Config(**{"n_shared_experts": 1, **kwargs}), DeepseekV3MoE
    g = torch.Generator().manual_seed(seed)
    ref = module(cfg).eval()
    with torch.no_grad():
        for p in list(ref.parameters()) + list(ref.buffers()):
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)  # incl. a nonzero e_score_correction_bias
    return cfg, ref


def _checkpoint(ref: torch.nn.Module, fused: bool) -> dict[str, torch.Tensor]:
    """The block's tensors named relative to `mlp.`: stacked (transformers 5 in memory) or per expert (on disk)."""
    sd = dict(ref.state_dict())
    if fused:
        return sd
    gate_up, down = sd.pop("experts.gate_up_proj"), sd.pop("experts.down_proj")
    for e in range(gate_up.shape[0]):
        sd[f"experts.{e}.gate_proj.weight"], sd[f"experts.{e}.up_proj.weight"] = gate_up[e].chunk(2)
        sd[f"experts.{e}.down_proj.weight"] = down[e]
    return sd


def _load(cfg, ref, fused: bool = True, dtype: torch.dtype = torch.float32) -> FusedMoE:
    moe = FusedMoE(MoEConfig.from_hf(cfg), dtype)
    for name, tensor in _checkpoint(ref, fused).items():
        assert moe.load_hf_weight(name, tensor), name
    assert moe.missing_weights() == []
    return moe


def _assert_matches(moe, ref, x):
    with torch.no_grad():
        torch.testing.assert_close(moe(x), ref(x), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("fused", [False, True], ids=["per_expert", "stacked"])
@pytest.mark.parametrize("norm", [False, True], ids=["raw", "norm"])
@pytest.mark.parametrize("version,method", [("v2", "greedy"), ("v2", "group_limited_greedy"), ("v3", "noaux_tc")])
def test_matches_transformers(version, method, norm, fused):
    extra = {"topk_method": method} if version == "v2" else {}
    cfg, ref = _hf_moe(version, norm_topk_prob=norm, **extra)
    moe = _load(cfg, ref, fused)
    g = torch.Generator().manual_seed(1)
    for t in (1, 7, 64):
        _assert_matches(moe, ref, torch.randn(t, H, generator=g))


def test_v2_shared_expert_bias_and_single_group():
    cfg, ref = _hf_moe("v2", mlp_bias=True, n_group=1, topk_group=1, n_shared_experts=1, num_experts_per_tok=2)
    moe = _load(cfg, ref)
    _assert_matches(moe, ref, torch.randn(9, H, generator=torch.Generator().manual_seed(2)))


@pytest.mark.parametrize("top_k", [1, 3])
@pytest.mark.parametrize("version", ["v2", "v3"])
def test_skewed_routing(version, top_k):
    """Every token picks the same experts (0, then 1, 4): one expert gets all tokens, most get none."""
    extra = {"topk_method": "group_limited_greedy"} if version == "v2" else {}
    cfg, ref = _hf_moe(version, num_experts_per_tok=top_k, **extra)
    favourites = torch.tensor([0, 1, 4])
    with torch.no_grad():
        if version == "v3":  # the bias alone decides the choice; weights still come from the scores
            ref.gate.e_score_correction_bias[favourites] += torch.tensor([30.0, 20.0, 10.0])
        else:  # positive inputs and large positive router rows
            ref.gate.weight[favourites] = torch.tensor([3.0, 2.0, 1.0])[:, None]
    moe = _load(cfg, ref)
    x = torch.randn(64, H, generator=torch.Generator().manual_seed(3)).abs()
    _, ids = moe.gate(x)
    assert (ids.sort(-1).values == favourites[:top_k].sort().values).all()
    _assert_matches(moe, ref, x)


@pytest.mark.parametrize("version", ["v2", "v3"])
def test_no_tokens(version):
    cfg, ref = _hf_moe(version)
    out = _load(cfg, ref)(torch.empty(0, H))
    assert out.shape == (0, H)


def test_bf16_close_to_fp32():
    cfg, ref = _hf_moe("v3")
    moe32, moe16 = _load(cfg, ref), _load(cfg, ref, dtype=torch.bfloat16)
    assert moe16.gate.weight.dtype == torch.float32 and moe16.gate.e_score_correction_bias.dtype == torch.float32
    x = torch.randn(16, H, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        out16 = moe16(x.bfloat16())
        assert out16.dtype == torch.bfloat16
        torch.testing.assert_close(out16.float(), moe32(x), atol=5e-2, rtol=5e-2)


def test_load_accounting():
    cfg, ref = _hf_moe("v3")
    moe = FusedMoE(MoEConfig.from_hf(cfg), torch.float32)
    assert len(moe.missing_weights()) == 3 * E + 2 + 3
    ckpt = _checkpoint(ref, fused=False)
    for name, tensor in ckpt.items():
        if name != "experts.5.up_proj.weight":
            moe.load_hf_weight(name, tensor)
    assert moe.missing_weights() == ["experts.5.up_proj.weight"]
    moe.load_hf_weight("experts.gate_up_proj", ref.experts.gate_up_proj.detach())  # stacked form covers it
    assert moe.missing_weights() == []
    for unknown in ("experts.8.up_proj.weight", "experts.0.up_proj.bias", "shared_experts.up_proj.bias",
                    "gate.bias", "experts.gate_up_proj_bias", "weight"):
        assert not moe.load_hf_weight(unknown, torch.zeros(1)), unknown
    with pytest.raises(ValueError, match="shape"):
        moe.load_hf_weight("experts.0.down_proj.weight", torch.zeros(I, H))
    v2 = FusedMoE(MoEConfig.from_hf(_hf_moe("v2")[0]), torch.float32)
    assert not v2.load_hf_weight("gate.e_score_correction_bias", torch.zeros(E))


def test_config_follows_transformers():
    v2 = MoEConfig.from_hf(transformers.DeepseekV2Config(norm_topk_prob=True, topk_method="greedy"))
    assert (v2.scoring_func, v2.topk_method, v2.norm_topk_prob) == ("softmax", "greedy", False)
    v3 = MoEConfig.from_hf(transformers.DeepseekV3Config(norm_topk_prob=False))
    assert (v3.scoring_func, v3.topk_method, v3.norm_topk_prob) == ("sigmoid", "noaux_tc", False)
    with pytest.raises(ValueError, match="topk_method"):
        MoEConfig.from_hf(transformers.DeepseekV2Config(topk_method="noaux_tc"))


def test_save_pretrained_checkpoint(tmp_path):
    """What transformers writes to disk (per-expert names, fp32 router) loads into FusedMoE."""
    from safetensors.torch import load_file

    cfg = transformers.DeepseekV3Config(
        vocab_size=64, hidden_size=H, intermediate_size=64, moe_intermediate_size=I, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, n_routed_experts=E, n_shared_experts=1, num_experts_per_tok=3,
        n_group=4, topk_group=2, first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8,
        qk_nope_head_dim=8, v_head_dim=8, experts_implementation="eager")
    torch.manual_seed(0)
    model = transformers.DeepseekV3ForCausalLM(cfg).eval()
    ref = model.model.layers[1].mlp
    with torch.no_grad():
        ref.gate.e_score_correction_bias.normal_(std=0.3)
    model.save_pretrained(tmp_path)
    prefix = "model.layers.1.mlp."
    tensors = {k.removeprefix(prefix): v for k, v in load_file(tmp_path / "model.safetensors").items()
               if k.startswith(prefix)}
    assert "experts.3.up_proj.weight" in tensors and "experts.gate_up_proj" not in tensors
    moe = FusedMoE(MoEConfig.from_hf(cfg), torch.float32)
    for name, tensor in tensors.items():
        assert moe.load_hf_weight(name, tensor), name
    assert moe.missing_weights() == []
    _assert_matches(moe, ref, torch.randn(7, H))
