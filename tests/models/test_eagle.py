"""Eagle-1 and Eagle-3 heads against references assembled from transformers' Llama blocks (fp32).

Each tiny checkpoint is the state dict of its reference module, so its tensor names are the
published ones (EAGLE's `cnets.py`: `fc`, `layers.{i}` / `midlayer`, `norm`, `lm_head`, `d2t`,
`t2d`, optional `embed_tokens`; no `model.` prefix).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn
from transformers import AutoConfig, LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import (
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaMLP,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
)

from mrv2.attention import get_attention_backend
from mrv2.attention.backend import CommonAttentionMetadata
from mrv2.loader.checkpoint_weights import iter_checkpoint_weights
from mrv2.models.architectures import EAGLE3_ARCHITECTURES, EAGLE_ARCHITECTURES
from mrv2.models.eagle import build_eagle3_head, build_eagle_head, eagle3_aux_layer_ids
from mrv2.models.registry import build_model
from mrv2.platforms import CpuPlatform
from mrv2.runner.kv_cache import allocate_kv_cache

VOCAB, H, T, MAX_LEN, TARGET_LAYERS = 512, 64, 20, 64, 4
ROPE = {"rope_type": "default", "rope_theta": 500000.0}
ATOL = 1e-5


def llama_config(arch: str, num_layers: int = 1, **extra) -> LlamaConfig:
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=H, intermediate_size=128, num_hidden_layers=num_layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048, rms_norm_eps=1e-5,
                      rope_parameters=dict(ROPE), tie_word_embeddings=False, architectures=[arch], **extra)
    cfg._attn_implementation = "eager"
    return cfg


def randomize_norms(module: nn.Module) -> None:
    with torch.no_grad():
        for name, p in module.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))


@pytest.fixture(scope="module")
def target():
    """A 4-layer tiny Llama target in mrv2 (random weights from transformers), with its backend."""
    cfg = llama_config("LlamaForCausalLM", TARGET_LAYERS)
    torch.manual_seed(7)
    hf = LlamaForCausalLM(cfg).eval()
    backend = get_attention_backend(CpuPlatform(), "gqa")
    model = build_model(cfg, backend, torch.float32, MAX_LEN)
    model.load_weights(hf.state_dict().items())
    return model, backend, cfg


def save_checkpoint(folder, cfg: LlamaConfig, state: dict[str, torch.Tensor], fmt: str = "safetensors"):
    """A published-format head folder: config.json and the weights as safetensors or pytorch_model.bin."""
    folder.mkdir(parents=True, exist_ok=True)
    cfg.save_pretrained(folder)
    state = {k: v.detach().clone().contiguous() for k, v in state.items()}
    if fmt == "safetensors":
        save_file(state, folder / "model.safetensors")
    else:
        torch.save(state, folder / "pytorch_model.bin")
    return AutoConfig.from_pretrained(folder)


def causal_inputs(cfg: LlamaConfig, x: torch.Tensor):
    pos = torch.arange(T)[None]
    mask = torch.full((T, T), float("-inf")).triu(1)[None, None]
    return pos, mask, LlamaRotaryEmbedding(cfg)(x, pos)


# --- Eagle-1 -----------------------------------------------------------------------------------


class RefEagle(nn.Module):
    """EAGLE-1 from transformers' blocks: fc, Llama layers (layer 0 without input norm), no final norm."""

    def __init__(self, cfg: LlamaConfig, own_embed: bool, fc_bias: bool, para_norm: bool) -> None:
        super().__init__()
        if own_embed:
            self.embed_tokens = nn.Embedding(VOCAB, H)
        self.fc = nn.Linear(2 * H, H, bias=fc_bias)
        self.layers = nn.ModuleList([LlamaDecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers)])
        self.layers[0].input_layernorm = nn.Identity()
        if para_norm:
            self.embedding_layernorm = LlamaRMSNorm(H, cfg.rms_norm_eps)
            self.hidden_states_layernorm = LlamaRMSNorm(H, cfg.rms_norm_eps)
        self.para_norm = para_norm
        self.cfg = cfg

    def forward(self, ids, features, embed_weight):
        e, h = F.embedding(ids, embed_weight)[None], features[None]
        if self.para_norm:
            e, h = self.embedding_layernorm(e), self.hidden_states_layernorm(h)
        x = self.fc(torch.cat([e, h], dim=-1))
        pos, mask, cos_sin = causal_inputs(self.cfg, x)
        for layer in self.layers:
            x = layer(x, attention_mask=mask, position_ids=pos, position_embeddings=cos_sin)
        return x[0]


def make_eagle(tmp_path, *, num_layers=1, own_embed=True, fc_bias=False, para_norm=False, fmt="safetensors",
               seed=0, extra_state=None):
    extra = {"add_para_norm": True} if para_norm else {}
    cfg = llama_config("LlamaForCausalLMEagle", num_layers, **extra)
    torch.manual_seed(seed)
    ref = RefEagle(cfg, own_embed, fc_bias, para_norm).eval()
    randomize_norms(ref)
    state = dict(ref.state_dict(), **(extra_state or {}))
    folder = tmp_path / f"eagle-{seed}-{fmt}"
    return ref, save_checkpoint(folder, cfg, state, fmt), folder


def eagle_inputs(seed=1, width=H):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (T,), generator=g), torch.arange(T), torch.randn(T, width, generator=g)


@pytest.mark.parametrize("num_layers,own_embed,fc_bias,para_norm,fmt", [
    (1, True, False, False, "safetensors"),
    (2, False, True, True, "bin"),  # shared embedding, fc bias the config does not declare (EAGLE-1), HASS norms
], ids=["plain", "hass-shared-embed-bin"])
def test_eagle_matches_reference(tmp_path, target, num_layers, own_embed, fc_bias, para_norm, fmt):
    model, backend, target_cfg = target
    ref, cfg, folder = make_eagle(tmp_path, num_layers=num_layers, own_embed=own_embed, fc_bias=fc_bias,
                                  para_norm=para_norm, fmt=fmt)
    head = build_eagle_head(cfg, target_cfg, backend, torch.float32, MAX_LEN)
    head.load_weights(iter_checkpoint_weights(folder))
    head.bind_target(model)
    assert head.feature_size == H and head.aux_layer_ids == ()
    assert len(head.kv_cache_specs()) == num_layers == len(head.attention_layers())
    assert (head.embed_tokens is not None) == own_embed
    embed = ref.embed_tokens.weight if own_embed else model.embed_tokens.weight
    ids, pos, features = eagle_inputs()
    with torch.no_grad():
        hidden, next_features = head(ids, pos, features, None)
        expected = ref(ids, features, embed)
        torch.testing.assert_close(hidden, expected, atol=ATOL, rtol=0)
        assert next_features is hidden
        logits = head.compute_logits(hidden)
        assert logits.dtype == torch.float32 and logits.shape == (T, VOCAB)
        torch.testing.assert_close(logits, F.linear(expected, model.lm_head_weight), atol=ATOL, rtol=0)
        # A later pass takes the head's own output as its features.
        hidden2, _ = head(ids, pos, hidden, None)
        torch.testing.assert_close(hidden2, ref(ids, expected, embed), atol=ATOL, rtol=0)


def test_missing_embedding_is_shared_from_the_target(tmp_path, target):
    model, backend, target_cfg = target
    ref, cfg, folder = make_eagle(tmp_path, own_embed=False)
    head = build_eagle_head(cfg, target_cfg, backend, torch.float32, MAX_LEN)
    head.load_weights(iter_checkpoint_weights(folder))
    assert head.embed_tokens is None
    ids, pos, features = eagle_inputs()
    with pytest.raises(RuntimeError, match="bind_target"):
        head(ids, pos, features, None)
    head.bind_target(model)
    with torch.no_grad():
        out, _ = head(ids, pos, features, None)
        torch.testing.assert_close(out, ref(ids, features, model.embed_tokens.weight), atol=ATOL, rtol=0)

    # An own embedding equal to the target's (EAGLE's frozen copy) is dropped for the target's.
    copy = {"embed_tokens.weight": model.embed_tokens.weight}
    _, cfg, folder = make_eagle(tmp_path, own_embed=False, seed=3, extra_state=copy)
    head = build_eagle_head(cfg, target_cfg, backend, torch.float32, MAX_LEN)
    head.load_weights(iter_checkpoint_weights(folder))
    assert head.embed_tokens is not None
    head.bind_target(model)
    assert head.embed_tokens is None


def test_unknown_or_missing_weights_raise(tmp_path, target):
    _, backend, target_cfg = target
    _, cfg, folder = make_eagle(tmp_path)
    state = dict(iter_checkpoint_weights(folder))

    def load(tensors):
        head = build_eagle_head(cfg, target_cfg, backend, torch.float32, MAX_LEN)
        head.load_weights(tensors.items())

    load(state)
    for name in ("layers.0.input_layernorm.weight", "lm_head.weight", "norm.weight"):
        with pytest.raises(ValueError, match="no place"):
            load(dict(state, **{name: torch.ones(H)}))
    with pytest.raises(ValueError, match="missing.*fc.weight"):
        load({k: v for k, v in state.items() if k != "fc.weight"})
    with pytest.raises(ValueError, match="shape"):
        load(dict(state, **{"fc.weight": torch.zeros(H, H)}))


def test_checkpoint_weights_reads_bin_and_names_an_empty_folder(tmp_path):
    state = {"a.weight": torch.randn(3, 2), "b": torch.arange(4)}
    (tmp_path / "bin").mkdir()
    torch.save(state, tmp_path / "bin" / "pytorch_model.bin")
    got = dict(iter_checkpoint_weights(tmp_path / "bin"))
    assert got.keys() == state.keys() and all(torch.equal(got[k], state[k]) for k in state)
    (tmp_path / "st").mkdir()
    save_file(state, tmp_path / "st" / "model.safetensors")
    got = dict(iter_checkpoint_weights(tmp_path / "st"))
    assert got.keys() == state.keys() and all(torch.equal(got[k], state[k]) for k in state)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="empty"):
        list(iter_checkpoint_weights(tmp_path / "empty"))


# --- Eagle-3 -----------------------------------------------------------------------------------


class RefMidLayer(nn.Module):
    """EAGLE-3's midlayer: transformers' LlamaAttention with q/k/v over [input_layernorm(e), hidden_norm(h)]."""

    def __init__(self, cfg: LlamaConfig, norm_before_residual: bool) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(cfg, 0)
        hd, bias = cfg.head_dim, cfg.attention_bias
        for name, heads in (("q_proj", cfg.num_attention_heads), ("k_proj", cfg.num_key_value_heads),
                            ("v_proj", cfg.num_key_value_heads)):
            setattr(self.self_attn, name, nn.Linear(2 * H, heads * hd, bias=bias))
        self.mlp = LlamaMLP(cfg)
        self.input_layernorm = LlamaRMSNorm(H, cfg.rms_norm_eps)
        self.hidden_norm = LlamaRMSNorm(H, cfg.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(H, cfg.rms_norm_eps)
        self.norm_before_residual = norm_before_residual

    def forward(self, e, h, mask, cos_sin):
        if self.norm_before_residual:
            h = residual = self.hidden_norm(h)
        else:
            residual, h = h, self.hidden_norm(h)
        x = torch.cat([self.input_layernorm(e), h], dim=-1)
        x = residual + self.self_attn(x, position_embeddings=cos_sin, attention_mask=mask)[0]
        return x + self.mlp(self.post_attention_layernorm(x))


class RefEagle3(nn.Module):
    def __init__(self, cfg: LlamaConfig, own_embed: bool, draft_vocab: int, norm_before_residual: bool,
                 fc: bool = True) -> None:
        super().__init__()
        if own_embed:
            self.embed_tokens = nn.Embedding(VOCAB, H)
        if fc:
            self.fc = nn.Linear(3 * H, H, bias=False)
        self.midlayer = RefMidLayer(cfg, norm_before_residual)
        self.layers = nn.ModuleDict({str(i): LlamaDecoderLayer(cfg, i) for i in range(1, cfg.num_hidden_layers)})
        self.norm = LlamaRMSNorm(H, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(H, draft_vocab, bias=False)
        self.cfg = cfg

    def forward(self, ids, features, embed_weight):
        """(normed, prenorm) [T, H]."""
        e, h = F.embedding(ids, embed_weight)[None], features[None]
        if h.shape[-1] != H:
            h = self.fc(h)
        pos, mask, cos_sin = causal_inputs(self.cfg, h)
        x = self.midlayer(e, h, mask, cos_sin)
        for layer in self.layers.values():
            x = layer(x, attention_mask=mask, position_ids=pos, position_embeddings=cos_sin)
        return self.norm(x)[0], x[0]


def d2t_t2d(draft_vocab: int, seed: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    """EAGLE-3's vocabulary maps: draft id j is target id j + d2t[j]; t2d marks the target ids drafted."""
    g = torch.Generator().manual_seed(seed)
    target_ids = torch.randperm(VOCAB, generator=g)[:draft_vocab].sort().values
    t2d = torch.zeros(VOCAB, dtype=torch.bool)
    t2d[target_ids] = True
    return target_ids - torch.arange(draft_vocab), t2d


def make_eagle3(tmp_path, *, num_layers=1, own_embed=False, draft_vocab=128, with_d2t=True,
                norm_before_residual=False, fmt="safetensors", seed=0, **extra):
    extra.update(draft_vocab_size=draft_vocab)
    if norm_before_residual:
        extra["norm_before_residual"] = True
    cfg = llama_config("LlamaForCausalLMEagle3", num_layers, **extra)
    torch.manual_seed(seed)
    ref = RefEagle3(cfg, own_embed, draft_vocab, norm_before_residual).eval()
    randomize_norms(ref)
    state = dict(ref.state_dict())
    if with_d2t:
        d2t, t2d = d2t_t2d(draft_vocab)
        state.update(d2t=d2t, t2d=t2d)
    folder = tmp_path / f"eagle3-{seed}"
    return ref, save_checkpoint(folder, cfg, state, fmt), folder, state


def ref_logits(ref: RefEagle3, state, normed: torch.Tensor) -> torch.Tensor:
    draft = ref.lm_head(normed)
    if "d2t" not in state:
        return draft
    out = torch.full((normed.shape[0], VOCAB), float("-inf"))
    out[:, torch.arange(draft.shape[1]) + state["d2t"]] = draft
    return out


@pytest.mark.parametrize("case", [
    dict(),  # the published layout: one midlayer, draft vocab + d2t, no embed_tokens (the target's)
    dict(num_layers=2, own_embed=True, draft_vocab=VOCAB, with_d2t=False, norm_before_residual=True,
         attention_bias=True, target_hidden_size=H,
         eagle_config={"eagle_aux_hidden_state_layer_ids": [0, 1, 3]}, fmt="bin"),
], ids=["published", "two-layers-full-vocab-bias-bin"])
def test_eagle3_matches_reference(tmp_path, target, case):
    model, backend, target_cfg = target
    ref, cfg, folder, state = make_eagle3(tmp_path, **case)
    head = build_eagle3_head(cfg, target_cfg, backend, torch.float32, MAX_LEN)
    head.load_weights(iter_checkpoint_weights(folder))
    head.bind_target(model)
    assert head.feature_size == 3 * H
    assert head.aux_layer_ids == ((0, 1, 3) if "eagle_config" in case else (2, TARGET_LAYERS // 2, TARGET_LAYERS - 3))
    assert len(head.kv_cache_specs()) == case.get("num_layers", 1) == len(head.attention_layers())
    embed = ref.embed_tokens.weight if case.get("own_embed") else model.embed_tokens.weight
    ids, pos, features = eagle_inputs(width=3 * H)
    with torch.no_grad():
        normed, prenorm = head(ids, pos, features, None)
        exp_normed, exp_prenorm = ref(ids, features, embed)
        torch.testing.assert_close(normed, exp_normed, atol=ATOL, rtol=0)
        torch.testing.assert_close(prenorm, exp_prenorm, atol=ATOL, rtol=0)
        logits = head.compute_logits(normed)
        assert logits.dtype == torch.float32 and logits.shape == (T, VOCAB)
        torch.testing.assert_close(logits, ref_logits(ref, state, exp_normed), atol=ATOL, rtol=0)
        # A later pass: the head's own prenorm output, H wide, skips fc.
        normed2, prenorm2 = head(ids, pos, prenorm, None)
        exp_normed2, exp_prenorm2 = ref(ids, exp_prenorm, embed)
        torch.testing.assert_close(normed2, exp_normed2, atol=ATOL, rtol=0)
        torch.testing.assert_close(prenorm2, exp_prenorm2, atol=ATOL, rtol=0)


def test_eagle3_d2t_places_logits_at_target_ids(tmp_path, target):
    model, backend, target_cfg = target
    ref, cfg, folder, state = make_eagle3(tmp_path, draft_vocab=96)
    head = build_eagle3_head(cfg, target_cfg, backend, torch.float32, MAX_LEN)
    head.load_weights(iter_checkpoint_weights(folder))
    head.bind_target(model)
    hidden = torch.randn(5, H)
    with torch.no_grad():
        logits, draft = head.compute_logits(hidden), ref.lm_head(hidden)
    d2t, t2d = state["d2t"], state["t2d"]
    for j in (0, 1, 50, 95):
        torch.testing.assert_close(logits[:, j + int(d2t[j])], draft[:, j], atol=ATOL, rtol=0)
    assert torch.isfinite(logits[:, t2d]).all() and int(t2d.sum()) == 96
    assert (logits[:, ~t2d] == float("-inf")).all()
    assert torch.equal(logits.argmax(-1), torch.arange(96)[draft.argmax(-1)] + d2t[draft.argmax(-1)])


def test_eagle3_loading_errors(tmp_path, target):
    _, backend, target_cfg = target
    _, cfg, folder, state = make_eagle3(tmp_path, draft_vocab=96)
    state = dict(iter_checkpoint_weights(folder))

    def load(tensors):
        head = build_eagle3_head(cfg, target_cfg, backend, torch.float32, MAX_LEN)
        head.load_weights(tensors.items())
        return head

    assert load(state).lm_head is not None
    with pytest.raises(ValueError, match="no place"):
        load(dict(state, **{"midlayer.extra.weight": torch.ones(H)}))
    with pytest.raises(ValueError, match="missing.*hidden_norm"):
        load({k: v for k, v in state.items() if k != "midlayer.hidden_norm.weight"})
    with pytest.raises(ValueError, match="d2t"):  # a smaller draft vocabulary needs its map
        load({k: v for k, v in state.items() if k != "d2t"})
    with pytest.raises(ValueError, match="lm_head"):  # and its own LM head
        load({k: v for k, v in state.items() if k != "lm_head.weight"})
    with pytest.raises(ValueError, match="outside"):
        load(dict(state, d2t=state["d2t"] + VOCAB))


def test_eagle3_without_lm_head_shares_the_targets(tmp_path, target):
    """A full-vocabulary head may leave out lm_head (and d2t): the target's LM head serves, unmapped."""
    model, backend, target_cfg = target
    _, cfg, folder, _ = make_eagle3(tmp_path, draft_vocab=VOCAB, with_d2t=False)
    state = {k: v for k, v in iter_checkpoint_weights(folder) if k != "lm_head.weight"}
    head = build_eagle3_head(cfg, target_cfg, backend, torch.float32, MAX_LEN)
    head.load_weights(state.items())
    assert head.lm_head is None and head.target_ids is None
    head.bind_target(model)
    hidden = torch.randn(3, H)
    with torch.no_grad():
        torch.testing.assert_close(head.compute_logits(hidden), model.compute_logits(hidden), atol=0, rtol=0)


def test_eagle3_aux_layer_ids_follow_vllm():
    target_cfg = llama_config("LlamaForCausalLM", 32)
    plain = llama_config("LlamaForCausalLMEagle3")
    assert eagle3_aux_layer_ids(plain, target_cfg) == (2, 16, 29)
    top = llama_config("LlamaForCausalLMEagle3", eagle_aux_hidden_state_layer_ids=[1, 5, 9])
    assert eagle3_aux_layer_ids(top, target_cfg) == (1, 5, 9)
    nested = llama_config("LlamaForCausalLMEagle3", eagle_config={"eagle_aux_hidden_state_layer_ids": [3, 4, 30]})
    assert eagle3_aux_layer_ids(nested, target_cfg) == (3, 4, 30)
    off = llama_config("LlamaForCausalLMEagle3", eagle_config={"use_aux_hidden_state": False})
    assert eagle3_aux_layer_ids(off, target_cfg) == ()
    head = build_eagle3_head(off, llama_config("LlamaForCausalLM", 4), get_attention_backend(CpuPlatform(), "gqa"),
                             torch.float32, MAX_LEN)
    assert head.fc is None and head.feature_size == H
    with pytest.raises(ValueError, match="layers"):
        eagle3_aux_layer_ids(llama_config("X", eagle_aux_hidden_state_layer_ids=[1, 2, 40]), target_cfg)
    assert "LlamaForCausalLMEagle3" in EAGLE3_ARCHITECTURES and "EagleLlamaForCausalLM" in EAGLE_ARCHITECTURES


def _paged_metadata(backend, start: int, n: int, block_size: int, blocks: list[int]):
    seq = start + n
    pos = np.arange(start, seq)
    slots = torch.tensor([blocks[p // block_size] * block_size + p % block_size for p in pos])
    common = CommonAttentionMetadata(
        num_reqs=1, num_tokens=n, num_decodes=int(n == 1), max_query_len=n, max_seq_len=seq,
        query_start_loc=torch.tensor([0, n], dtype=torch.int32), seq_lens=torch.tensor([seq], dtype=torch.int32),
        block_table=torch.tensor([blocks], dtype=torch.int32), slot_mapping=slots,
        query_start_loc_cpu=np.array([0, n]), seq_lens_cpu=np.array([seq]), block_size=block_size)
    return backend.build_metadata(common)


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_paged_kv_cache_matches_causal_attention(tmp_path, target, kind):
    """Chunks over a paged cache (12 tokens, 7, then 1) give the no-cache causal pass's outputs."""
    model, backend, target_cfg = target
    if kind == "eagle":
        _, cfg, folder = make_eagle(tmp_path, num_layers=2)
        head, width = build_eagle_head(cfg, target_cfg, backend, torch.float32, MAX_LEN), H
    else:
        _, cfg, folder, _ = make_eagle3(tmp_path, num_layers=2)
        head, width = build_eagle3_head(cfg, target_cfg, backend, torch.float32, MAX_LEN), 3 * H
    head.load_weights(iter_checkpoint_weights(folder))
    head.bind_target(model)
    bs, blocks = 4, [3, 1, 6, 2, 5]
    cache = allocate_kv_cache(head.kv_cache_specs(), "split", 8, bs, 64, torch.device("cpu"))
    for attn, layer in zip(head.attention_layers(), cache.layers):
        attn.kv_cache = layer
    ids, pos, features = eagle_inputs(width=width)
    with torch.no_grad():
        full = head(ids, pos, features, None)
        chunks = [head(ids[a:b], pos[a:b], features[a:b], _paged_metadata(backend, a, b - a, bs, blocks))
                  for a, b in ((0, 12), (12, 19), (19, 20))]
    for i in range(2):
        torch.testing.assert_close(torch.cat([c[i] for c in chunks]), full[i], atol=ATOL, rtol=0)
