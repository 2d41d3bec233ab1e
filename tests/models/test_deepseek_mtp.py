"""DeepSeek-V3's MTP layer as a draft head, against the layer assembled from transformers' blocks (fp32).

transformers' DeepseekV3ForCausalLM ignores MTP layers, so each tiny checkpoint gets its MTP
layer (index num_hidden_layers) written by hand into an extra safetensors file listed in
the index, named as DeepSeek-V3's checkpoints name it (experts one by one).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn
from transformers import AutoConfig, DeepseekV3Config, DeepseekV3ForCausalLM
from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
    DeepseekV3DecoderLayer, DeepseekV3RMSNorm, DeepseekV3RotaryEmbedding)

from mrv2.attention import CommonAttentionMetadata, get_attention_backend
from mrv2.loader.safetensors_weights import INDEX_FILE, iter_safetensors_weights
from mrv2.models.deepseek_mtp import build_mtp_head
from mrv2.models.registry import build_model
from mrv2.platforms import CpuPlatform
from mrv2.runner.kv_cache import allocate_kv_cache

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 32,
        "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.8, "rope_theta": 10000.0}
# The tiny DeepSeek-V3 of tests/conftest.py with two decoder layers; the MTP layer is layer 2.
BASE = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=4, max_position_embeddings=512, moe_intermediate_size=32, q_lora_rank=None,
            kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8,
            n_shared_experts=1, num_experts_per_tok=2, n_group=4, topk_group=2, first_k_dense_replace=1,
            routed_scaling_factor=1.5, norm_topk_prob=True, tie_word_embeddings=False, num_nextn_predict_layers=1,
            bos_token_id=1, eos_token_id=2, pad_token_id=2)
# moe: MoE MTP block, q_lora, YaRN, sharded checkpoint; dense: first_k_dense_replace past every layer.
CASES = {"moe": dict(q_lora_rank=16, rope_parameters=YARN, max_position_embeddings=256),
         "dense": dict(first_k_dense_replace=5)}
N = BASE["num_hidden_layers"]
PREFIX = f"model.layers.{N}."
SEQ = 20
MAX_LEN = 64


class RefMTP(nn.Module):
    """The MTP layer from transformers' building blocks: enorm/hnorm, eh_proj, decoder layer N, shared head."""

    def __init__(self, config: DeepseekV3Config) -> None:
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.embed_tokens = nn.Embedding(config.vocab_size, h)
        self.enorm = DeepseekV3RMSNorm(h, eps)
        self.hnorm = DeepseekV3RMSNorm(h, eps)
        self.eh_proj = nn.Linear(2 * h, h, bias=False)
        self.block = DeepseekV3DecoderLayer(config, layer_idx=config.num_hidden_layers)
        self.shared_head = nn.ModuleDict({"norm": DeepseekV3RMSNorm(h, eps),
                                          "head": nn.Linear(h, config.vocab_size, bias=False)})
        self.rotary = DeepseekV3RotaryEmbedding(config)

    @torch.no_grad()
    def forward(self, next_ids, features, embed=None, head=None):
        """[T] tokens at i + 1 and [T, H] features at i -> (hidden [T, H], logits [T, V]), causal over T."""
        t = next_ids.shape[0]
        e = self.enorm((embed or self.embed_tokens)(next_ids[None]))
        x = self.eh_proj(torch.cat([e, self.hnorm(features[None])], dim=-1))
        positions = torch.arange(t)[None]
        mask = torch.full((t, t), float("-inf")).triu(1)[None, None]
        out = self.block(x, attention_mask=mask, position_ids=positions,
                         position_embeddings=self.rotary(x, positions))[0]  # the one sequence
        return out, (head or self.shared_head["head"])(self.shared_head["norm"](out))


def _randomize(module: nn.Module, g: torch.Generator) -> None:
    with torch.no_grad():
        for name, p in module.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            elif "embed" in name:
                p.copy_(torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
        for name, b in module.named_buffers():
            if "e_score_correction_bias" in name:
                b.copy_(0.1 * torch.randn(b.shape, generator=g))


def _mtp_tensors(ref: RefMTP) -> dict[str, torch.Tensor]:
    """The reference's weights under DeepSeek-V3's checkpoint names for layer N."""
    out = {}
    for name, t in ref.state_dict().items():
        if name.startswith("block."):
            name = name.removeprefix("block.")
            if name == "mlp.experts.gate_up_proj":
                for e, w in enumerate(t):
                    gate, up = w.chunk(2)
                    out[f"{PREFIX}mlp.experts.{e}.gate_proj.weight"] = gate
                    out[f"{PREFIX}mlp.experts.{e}.up_proj.weight"] = up
                continue
            if name == "mlp.experts.down_proj":
                for e, w in enumerate(t):
                    out[f"{PREFIX}mlp.experts.{e}.down_proj.weight"] = w
                continue
        out[PREFIX + name] = t
    return {k: v.clone().contiguous() for k, v in out.items()}


def _add_to_checkpoint(path: Path, tensors: dict[str, torch.Tensor], file: str = "mtp.safetensors") -> None:
    save_file(tensors, path / file, metadata={"format": "pt"})
    index = path / INDEX_FILE
    if index.is_file():
        data = json.loads(index.read_text())
    else:  # one model.safetensors: an index makes the loader read the extra file too
        with safe_open(path / "model.safetensors", framework="pt") as f:
            data = {"metadata": {}, "weight_map": {k: "model.safetensors" for k in f.keys()}}
    data["weight_map"].update({k: file for k in tensors})
    index.write_text(json.dumps(data))


def _backend():
    return get_attention_backend(CpuPlatform(), "mla")


@pytest.fixture(scope="module", params=list(CASES))
def checkpoint(request, tmp_path_factory):
    """(folder, HF target, reference MTP layer, token ids [SEQ + 1], target features [SEQ, H])."""
    g = torch.Generator().manual_seed(0)
    config = DeepseekV3Config(**{**BASE, **CASES[request.param]})
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    target = DeepseekV3ForCausalLM(config).eval()
    ref = RefMTP(config).eval()
    _randomize(ref, g)
    with torch.no_grad():
        for name, p in target.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn(p.shape, generator=g))
    path = tmp_path_factory.mktemp(f"deepseek-mtp-{request.param}")
    target.save_pretrained(path, **({"max_shard_size": "300KB"} if request.param == "moe" else {}))
    assert (path / INDEX_FILE).is_file() == (request.param == "moe")
    _add_to_checkpoint(path, _mtp_tensors(ref))
    ids = torch.randint(3, config.vocab_size, (SEQ + 1,), generator=g)
    with torch.no_grad():
        features = target.model(ids[None, :SEQ]).last_hidden_state[0]  # final, normed hidden states
    return path, target, ref, ids, features


def _head(path: Path, weights=None):
    config = AutoConfig.from_pretrained(path)
    head = build_mtp_head(config, config, _backend(), torch.float32, MAX_LEN)
    head.load_weights(iter_safetensors_weights(path) if weights is None else weights)
    return head


def test_matches_transformers_layer(checkpoint):
    path, _, ref, ids, features = checkpoint
    head = _head(path)
    assert head.feature_size == BASE["hidden_size"] and head.aux_layer_ids == ()
    with torch.no_grad():
        hidden, next_features = head(ids[1:], torch.arange(SEQ), features, attn_metadata=None)
        logits = head.compute_logits(hidden)
    want_hidden, want_logits = ref(ids[1:], features)
    assert torch.equal(hidden, next_features)
    torch.testing.assert_close(hidden, want_hidden, atol=1e-5, rtol=1e-5)
    assert logits.dtype == torch.float32 and logits.shape == (SEQ, BASE["vocab_size"])
    torch.testing.assert_close(logits, want_logits, atol=1e-5, rtol=1e-5)


def test_block_is_moe_or_dense_by_layer_index(checkpoint):
    path, target, _, _, _ = checkpoint
    head = _head(path)
    moe = target.config.first_k_dense_replace <= N
    assert type(head.mtp_block.mlp).__name__ == ("FusedMoE" if moe else "GatedMLP")


def _metadata(chunk: tuple[int, int], blocks: list[int], block_size: int) -> CommonAttentionMetadata:
    """One request computing tokens [start, start + n) over `blocks`."""
    start, n = chunk
    slots = [blocks[p // block_size] * block_size + p % block_size for p in range(start, start + n)]
    table = torch.zeros(1, len(blocks) + 2, dtype=torch.int32)
    table[0, :len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
    qsl, seq_lens = np.array([0, n]), np.array([start + n])
    return CommonAttentionMetadata(
        num_reqs=1, num_tokens=n, num_decodes=int(n == 1), max_query_len=n, max_seq_len=start + n,
        query_start_loc=torch.from_numpy(qsl).int(), seq_lens=torch.from_numpy(seq_lens).int(), block_table=table,
        slot_mapping=torch.tensor(slots, dtype=torch.int64), query_start_loc_cpu=qsl, seq_lens_cpu=seq_lens,
        block_size=block_size)


@pytest.mark.parametrize("layout", ["joint", "split"])
def test_paged_cache_agrees_with_causal(checkpoint, layout):
    """A prefill chunk, decodes and a cached-prefix chunk over the head's own paged cache layer."""
    path, _, _, ids, features = checkpoint
    head = _head(path)
    specs = head.kv_cache_specs()
    assert len(specs) == 1 and [p.name for p in specs[0].parts] == ["latent", "rope"]
    block_size, blocks = 4, [5, 2, 7, 1, 3]
    cache = allocate_kv_cache(specs, layout, 8, block_size, 64, torch.device("cpu"))
    (attn,) = head.attention_layers()
    attn.kv_cache = cache.layers[0]
    backend = attn.backend
    outs = []
    with torch.no_grad():
        want, _ = head(ids[1:], torch.arange(SEQ), features, None)
        for start, n in [(0, 9), (9, 1), (10, 1), (11, 9)]:
            meta = backend.build_metadata(_metadata((start, n), blocks, block_size))
            sl = slice(start, start + n)
            outs.append(head(ids[1:][sl], torch.arange(SEQ)[sl], features[sl], meta)[0])
    torch.testing.assert_close(torch.cat(outs), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("bind_first", [False, True])
def test_shares_target_embedding_and_head_when_the_layer_lacks_them(checkpoint, bind_first):
    path, hf_target, ref, ids, features = checkpoint
    config = AutoConfig.from_pretrained(path)
    target = build_model(config, _backend(), torch.float32, MAX_LEN)
    target.load_weights(iter_safetensors_weights(path))  # skips the MTP layer
    head = build_mtp_head(config, config, _backend(), torch.float32, MAX_LEN)
    if bind_first:
        head.bind_target(target)
    lacking = (PREFIX + "embed_tokens.weight", PREFIX + "shared_head.head.weight")
    head.load_weights((n, t) for n, t in iter_safetensors_weights(path) if n not in lacking)
    if not bind_first:
        with pytest.raises(RuntimeError, match="bind_target"):
            head(ids[1:], torch.arange(SEQ), features, None)
        head.bind_target(target)
    assert head.embed_tokens is None and head.shared_head.head is None
    target_params = {id(p) for p in target.parameters()}
    assert not any(id(p) in target_params for p in head.parameters())  # shared, not adopted
    with torch.no_grad():
        hidden, _ = head(ids[1:], torch.arange(SEQ), features, None)
        logits = head.compute_logits(hidden)
    want_hidden, want_logits = ref(ids[1:], features, embed=hf_target.model.embed_tokens, head=hf_target.lm_head)
    torch.testing.assert_close(hidden, want_hidden, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(logits, want_logits, atol=1e-5, rtol=1e-5)
    own, _ = _head(path)(ids[1:], torch.arange(SEQ), features, None)
    assert not torch.allclose(own, hidden)  # the layer's own embedding differs here: sharing mattered


def test_checkpoint_without_mtp_layer_is_a_value_error(checkpoint):
    path, _, _, _, _ = checkpoint
    without = ((n, t) for n, t in iter_safetensors_weights(path) if not n.startswith(PREFIX))
    with pytest.raises(ValueError, match=rf"no multi-token-prediction layer.*model\.layers\.{N}\."):
        _head(path, without)
    config = AutoConfig.from_pretrained(path)
    config.num_nextn_predict_layers = 0
    with pytest.raises(ValueError, match="num_nextn_predict_layers is 0"):
        build_mtp_head(config, config, _backend(), torch.float32, MAX_LEN)


def test_loads_only_the_first_mtp_layer_and_checks_it(checkpoint):
    path, _, _, _, _ = checkpoint
    weights = list(iter_safetensors_weights(path))
    # A second MTP layer (num_nextn_predict_layers 2) is ignored, like every decoder layer's tensor.
    second = [(n.replace(PREFIX, f"model.layers.{N + 1}."), t) for n, t in weights if n.startswith(PREFIX)]
    _head(path, weights + second)

    def drop(name):
        return [(n, t) for n, t in weights if n != name]

    with pytest.raises(ValueError, match="enorm.weight"):
        _head(path, drop(PREFIX + "enorm.weight"))
    with pytest.raises(ValueError, match="missing.*self_attn.kv_b_proj.weight"):
        _head(path, drop(PREFIX + "self_attn.kv_b_proj.weight"))
    with pytest.raises(ValueError, match="no place"):
        _head(path, weights + [(PREFIX + "shared_head.bogus.weight", torch.zeros(1))])
    with pytest.raises(ValueError, match="no place"):
        _head(path, weights + [(PREFIX + "self_attn.bogus.weight", torch.zeros(1))])
