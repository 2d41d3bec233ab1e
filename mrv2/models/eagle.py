"""Eagle-1 and Eagle-3 draft heads for Llama-family targets (`mrv2.models.draft_head.DraftHead`).

Both follow vLLM's `llama_eagle.py` / `llama_eagle3.py` and load the checkpoints the EAGLE
authors publish (e.g. yuhuili/EAGLE-LLaMA3-Instruct-8B, yuhuili/EAGLE3-LLaMA3.1-Instruct-8B):
tensor names without a `model.` prefix, q/k/v and gate/up unfused.

Eagle-1 (`EagleLlamaForCausalLM`; features: the target's final, normed hidden states [T, H]):

    x = fc(cat([embed(token), feature]))               fc: Linear(2H -> H), bias if the checkpoint has one
    x, residual = decoder layers(x)                    layers.{i}: Llama layers; layer 0 has no input_layernorm
    out = x + residual                                 no final norm; `out` is also the next pass's feature
    logits = the target's LM head (out)

HASS heads (config `add_para_norm`) RMS-normalize the embedding and the feature before `fc`
(`embedding_layernorm`, `hidden_states_layernorm`).

Eagle-3 (`Eagle3LlamaForCausalLM`; first-pass features: the inputs (hidden + residual) of three
target layers, concatenated [T, 3 * target H]; later passes: the head's own prenorm output [T, H]):

    h = fc(feature) if feature is wider than H else feature          fc: Linear(3 * target H -> H), no bias
    x = cat([input_layernorm(embed(token)), hidden_norm(h)])         [T, 2H]: the first layer's q/k/v take 2H
    x = attention(x) + h, then + mlp(post_attention_layernorm(.))    `midlayer.*` in the checkpoint
    (further layers, if any: plain Llama layers)
    normed, prenorm = norm(x + residual), x + residual               -> (hidden for the logits, next feature)
    logits = lm_head(normed) [draft vocab], scattered into -inf over the target's vocabulary at
             target id = draft id + d2t[draft id]

`norm_before_residual` configs take the normed h as the residual. A head whose `eagle_config` sets
`use_aux_hidden_state: false` has no `fc` and reads the target's final hidden states.

A checkpoint may leave out `embed_tokens` (and an Eagle-3 one `lm_head`, when its draft vocabulary
is the target's): the head then shares the target's (`bind_target`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from mrv2.attention.backend import AttentionBackend
from mrv2.kv_spec import KVCacheSpec
from mrv2.layers.embedding import VocabEmbedding
from mrv2.layers.linear import Linear, pack_linears
from mrv2.layers.mlp import GatedMLP
from mrv2.layers.norm import RMSNorm
from mrv2.layers.rotary import RotaryEmbedding
from mrv2.models.base import PreNormBlock
from mrv2.models.decoder import Attention, DecoderConfig
from mrv2.models.weights import copy_checked, load_hf_weights


def _llama_block(cfg: DecoderConfig, backend: AttentionBackend, rotary: RotaryEmbedding,
                 dtype: torch.dtype) -> PreNormBlock:
    return PreNormBlock(cfg.hidden_size, cfg.rms_norm_eps, Attention(cfg, backend, rotary, dtype),
                        GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias, dtype, cfg.hidden_act), dtype)


class _EagleHead(nn.Module):
    """What both heads share: the embedding (own or the target's), the target binding, KV specs, loading."""

    config: DecoderConfig
    feature_size: int
    aux_layer_ids: tuple[int, ...]
    layers: nn.ModuleList

    def __init__(self, cfg: DecoderConfig, dtype: torch.dtype, logit_scale: float) -> None:
        super().__init__()
        self.config = cfg
        self.dtype = dtype
        self.logit_scale = logit_scale
        # Dropped by load_weights when the checkpoint has none (the target's then serves).
        self.embed_tokens: VocabEmbedding | None = VocabEmbedding(cfg.vocab_size, cfg.hidden_size, dtype)
        self.lm_head: Linear | None = None  # Eagle-3's own LM head (Eagle-1 always shares the target's)
        # The target model, once bound; a tuple so that torch does not register it as a submodule.
        self._target: tuple[nn.Module, ...] = ()
        self._loaded = False

    # --- DraftHead ---------------------------------------------------------------------------

    def bind_target(self, target: nn.Module) -> None:
        """Share the target's token embedding (and LM head) where the checkpoint has none.

        May come before or after `load_weights`. An own embedding equal to the target's (EAGLE
        checkpoints carry a frozen copy) is dropped for the target's, as vLLM shares it.
        """
        self._target = (target,)
        self._share_with_target()

    @property
    def next_feature_size(self) -> int:
        return self.config.hidden_size

    def kv_cache_specs(self) -> list[KVCacheSpec]:
        c = self.config
        return [KVCacheSpec.gqa(c.num_kv_heads, c.head_dim, c.head_dim, self.dtype)] * len(self.layers)

    def pack_linear_weights(self, rows_hint: int) -> int:
        return pack_linears(self, rows_hint)  # the target's shared modules are not submodules: not repacked

    def attention_layers(self) -> list[nn.Module]:
        return [layer.self_attn for layer in self.layers]

    # --- loading -----------------------------------------------------------------------------

    def _rename(self, name: str) -> str:
        return name.removeprefix("model.")

    def _load(self, weights: Iterable[tuple[str, torch.Tensor]],
              held_names: Callable[[str], bool]) -> dict[str, torch.Tensor]:
        """Load every tensor but those `held_names` selects (returned, by name, for the caller to place).

        The shareable modules (embed_tokens, lm_head) are detached meanwhile, so that
        `load_hf_weights` neither expects them nor takes their tensors; they are restored
        and filled if the checkpoint had them, else left None (the target's serve).
        """
        held: dict[str, torch.Tensor] = {}
        shareable = {"embed_tokens": self.embed_tokens, "lm_head": self.lm_head}

        def rest() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                name = self._rename(name)
                attr = name.removesuffix(".weight")
                if (name.endswith(".weight") and shareable.get(attr) is not None) or held_names(name):
                    if name in held:
                        raise ValueError(f"checkpoint tensor {name!r} appears twice")
                    held[name] = tensor
                    continue
                if attr == "lm_head":
                    raise ValueError(f"checkpoint tensor {name!r} has no place in the head "
                                     "(it shares the target's LM head)")
                yield name, tensor

        self.embed_tokens, self.lm_head = None, None
        try:
            load_hf_weights(self, rest(), tied_lm_head=False)
        finally:
            for attr, module in shareable.items():
                setattr(self, attr, module)
        for attr, module in shareable.items():
            name = f"{attr}.weight"
            if module is None:
                continue
            if name in held:
                copy_checked(module.weight, name, held.pop(name), "the head")
            else:
                setattr(self, attr, None)
        self._loaded = True
        return held

    def _share_with_target(self) -> None:
        """Once loaded and bound: drop an own embedding equal to the target's, check what is shared."""
        if not (self._target and self._loaded):
            return
        h, vocab = self.config.hidden_size, self.config.vocab_size
        target_embed = self._target[0].embed_tokens
        if self.embed_tokens is not None:
            own, theirs = self.embed_tokens.weight, target_embed.weight
            if theirs is not None and own.shape == theirs.shape and own.dtype == theirs.dtype \
                    and own.device == theirs.device and torch.equal(own, theirs):
                self.embed_tokens = None
        if self.embed_tokens is None and (target_embed.num_embeddings, target_embed.embedding_dim) != (vocab, h):
            raise ValueError(f"the head's checkpoint has no embed_tokens and the target's embedding "
                             f"[{target_embed.num_embeddings}, {target_embed.embedding_dim}] does not fit "
                             f"the head's [{vocab}, {h}]")

    # --- helpers ------------------------------------------------------------------------------

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.embed_tokens is not None:
            return self.embed_tokens(input_ids)
        return self._bound_target("token embedding").embed_tokens(input_ids)

    def _bound_target(self, what: str) -> nn.Module:
        if not self._target:
            raise RuntimeError(f"the head has no {what} of its own: call bind_target(target) to share "
                               "the target model's")
        return self._target[0]

    def _scaled(self, logits: torch.Tensor) -> torch.Tensor:
        return logits if self.logit_scale == 1.0 else logits * self.logit_scale


class EagleHead(_EagleHead):
    """Eagle-1 (vLLM `EagleLlamaForCausalLM`); implements `DraftHead` (see the module docstring)."""

    aux_layer_ids: tuple[int, ...] = ()  # the features are the target's final, normed hidden states

    def __init__(self, cfg: DecoderConfig, backend: AttentionBackend, dtype: torch.dtype, *, fc_bias: bool = False,
                 para_norm: bool = False, logit_scale: float = 1.0) -> None:
        super().__init__(cfg, dtype, logit_scale)
        h = cfg.hidden_size
        self.feature_size = h
        self.fc = Linear(2 * h, [h], fc_bias, dtype)  # a checkpoint's `fc.bias` is taken even if not declared
        # HASS: RMSNorm on the embedding and the feature before fc (vLLM: config `add_para_norm`).
        self.embedding_layernorm = RMSNorm(h, cfg.rms_norm_eps, dtype) if para_norm else None
        self.hidden_states_layernorm = RMSNorm(h, cfg.rms_norm_eps, dtype) if para_norm else None
        rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position, cfg.rope, dtype)
        self.layers = nn.ModuleList([_llama_block(cfg, backend, rotary, dtype) for _ in range(cfg.num_layers)])
        # EAGLE's first layer has no input norm: fc's output enters attention as it is.
        self.layers[0].input_layernorm = nn.Identity()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load the published checkpoint names; raise on unknown names or parameters left unset.

        `embed_tokens.weight` may be absent (the target's is shared), and `fc.bias` present
        though the config does not declare it (EAGLE-1's fc has one unless `bias: false`).
        """
        extra_bias = self.fc.bias is None
        held = self._load(weights, lambda name: extra_bias and name == "fc.bias")
        if "fc.bias" in held:
            bias = held.pop("fc.bias")
            self.fc.bias = nn.Parameter(torch.zeros(self.config.hidden_size, dtype=self.dtype,
                                                    device=self.fc.weight.device), requires_grad=False)
            copy_checked(self.fc.bias, "fc.bias", bias, "the head")
        self._share_with_target()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, features: torch.Tensor,
                attn_metadata: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Tokens at i + 1, positions i, features [T, H] at i -> (out, out), [T, H] each.

        `attn_metadata` None: causal attention over the given tokens as one sequence, no cache.
        """
        e = self._embed(input_ids)
        h = features.to(e.dtype)
        if self.embedding_layernorm is not None:
            e, h = self.embedding_layernorm(e), self.hidden_states_layernorm(h)
        x, residual = self.fc(torch.cat([e, h], dim=-1)), None
        for layer in self.layers:
            inputs, residual = layer.start(positions, x, residual)
            x, residual = layer.finish(layer.self_attn.attend(inputs, attn_metadata), residual)
        out = x + residual
        return out, out

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits [rows, vocab] through the target's LM head (in whatever form it runs)."""
        return self._scaled(self._bound_target("LM head").compute_logits(hidden))


class Eagle3FirstLayer(PreNormBlock):
    """Eagle-3's `midlayer`: attention over cat(input_layernorm(embedding), hidden_norm(feature)) [T, 2H]."""

    def __init__(self, cfg: DecoderConfig, backend: AttentionBackend, rotary: RotaryEmbedding, dtype: torch.dtype,
                 norm_before_residual: bool) -> None:
        h = cfg.hidden_size
        attn = Attention(cfg, backend, rotary, dtype)
        q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        attn.qkv_proj = Linear(2 * h, [q_size, kv_size, kv_size], cfg.qkv_bias, dtype)  # vLLM overrides it too
        super().__init__(h, cfg.rms_norm_eps, attn, GatedMLP(h, cfg.intermediate_size, cfg.mlp_bias, dtype,
                                                             cfg.hidden_act), dtype)
        self.hidden_norm = RMSNorm(h, cfg.rms_norm_eps, dtype)
        self.norm_before_residual = norm_before_residual

    def start_eagle3(self, positions: torch.Tensor, embeds: torch.Tensor,
                     hidden: torch.Tensor) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
        """(attention inputs, residual); `finish` runs the rest."""
        embeds = self.input_layernorm(embeds)
        if self.norm_before_residual:
            hidden = residual = self.hidden_norm(hidden)
        else:
            residual, hidden = hidden, self.hidden_norm(hidden)
        return self.self_attn.project(positions, torch.cat([embeds, hidden], dim=-1)), residual


class Eagle3Head(_EagleHead):
    """Eagle-3 (vLLM `Eagle3LlamaForCausalLM`); implements `DraftHead` (see the module docstring)."""

    def __init__(self, cfg: DecoderConfig, backend: AttentionBackend, dtype: torch.dtype, *, draft_vocab_size: int,
                 aux_layer_ids: tuple[int, ...], target_hidden_size: int, norm_before_residual: bool = False,
                 logit_scale: float = 1.0) -> None:
        super().__init__(cfg, dtype, logit_scale)
        h = cfg.hidden_size
        self.aux_layer_ids = aux_layer_ids
        self.draft_vocab_size = draft_vocab_size
        # () aux layers: no fc, the features are the target's final hidden states.
        self.feature_size = len(aux_layer_ids) * target_hidden_size if aux_layer_ids else h
        self.fc = Linear(self.feature_size, [h], False, dtype) if aux_layer_ids else None
        rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position, cfg.rope, dtype)
        self.layers = nn.ModuleList([Eagle3FirstLayer(cfg, backend, rotary, dtype, norm_before_residual)]
                                    + [_llama_block(cfg, backend, rotary, dtype) for _ in range(cfg.num_layers - 1)])
        self.norm = RMSNorm(h, cfg.rms_norm_eps, dtype)
        # Dropped by load_weights when the checkpoint has none (then draft vocab = target vocab, shared).
        self.lm_head = Linear(h, [draft_vocab_size], False, dtype)
        self.register_buffer("d2t", torch.zeros(draft_vocab_size, dtype=torch.long))
        # Target id of each draft id (d2t + arange), None while the vocabularies are the same.
        self.register_buffer("target_ids", None, persistent=False)

    def _rename(self, name: str) -> str:
        name = super()._rename(name)
        return "layers.0." + name.removeprefix("midlayer.") if name.startswith("midlayer.") else name

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load the published checkpoint names (`midlayer.*` is layer 0); raise on unknown or missing ones.

        `embed_tokens.weight` may be absent (the target's is shared), `lm_head.weight` too where
        the draft vocabulary is the target's; `t2d` is ignored.
        """
        held = self._load(weights, lambda name: name in ("d2t", "t2d"))
        held.pop("t2d", None)
        vocab, draft_vocab = self.config.vocab_size, self.draft_vocab_size
        if self.lm_head is None and draft_vocab != vocab:
            raise ValueError(f"checkpoint is missing tensors: ['lm_head.weight'] (the target's LM head can "
                             f"only serve a draft vocabulary of the target's size, {vocab}, not {draft_vocab})")
        if "d2t" in held:
            copy_checked(self.d2t, "d2t", held.pop("d2t"), "the head")
            ids = torch.arange(draft_vocab, device=self.d2t.device) + self.d2t
            if draft_vocab and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
                raise ValueError(f"checkpoint tensor 'd2t' maps draft ids outside the target vocabulary [0, {vocab})")
            self.target_ids = ids
        elif draft_vocab != vocab:
            raise ValueError(f"checkpoint is missing tensors: ['d2t'] (needed to map a draft vocabulary of "
                             f"{draft_vocab} ids into the target's {vocab})")
        else:
            self.d2t.zero_()
            self.target_ids = None
        self._share_with_target()

    def _share_with_target(self) -> None:
        super()._share_with_target()
        if self._target and self._loaded and self.lm_head is None:
            theirs, ours = self._target[0].config, self.config
            if (theirs.vocab_size, theirs.hidden_size) != (ours.vocab_size, ours.hidden_size):
                raise ValueError("the head's checkpoint has no lm_head and the target's LM head does not fit it")

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, features: torch.Tensor,
                attn_metadata: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Tokens at i + 1, positions i, features at i -> (normed, prenorm), [T, H] each.

        Features wider than H (the target's concatenated aux hidden states) go through fc first;
        the head's own prenorm output (later passes) does not. `attn_metadata` None: causal
        attention over the given tokens as one sequence, no cache.
        """
        e = self._embed(input_ids)
        h = features.to(e.dtype)
        if h.shape[-1] != self.config.hidden_size:
            if self.fc is None:
                raise ValueError(f"features of width {h.shape[-1]}: this head (no fc) takes {self.config.hidden_size}")
            h = self.fc(h)
        first = self.layers[0]
        inputs, residual = first.start_eagle3(positions, e, h)
        x, residual = first.finish(first.self_attn.attend(inputs, attn_metadata), residual)
        for layer in self.layers[1:]:
            inputs, residual = layer.start(positions, x, residual)
            x, residual = layer.finish(layer.self_attn.attend(inputs, attn_metadata), residual)
        return self.norm(x, residual)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits [rows, target vocab]: the draft vocabulary's at their target ids, -inf elsewhere."""
        if self.lm_head is not None:
            logits = self._scaled(self.lm_head(hidden).float())
        else:
            logits = self._scaled(self._bound_target("LM head").compute_logits(hidden))
        if self.target_ids is None:
            return logits
        out = logits.new_full((logits.shape[0], self.config.vocab_size), float("-inf"))
        return out.index_copy_(1, self.target_ids, logits)


def _head_config(head_hf_config: Any, target_hf_config: Any, max_model_len: int) -> DecoderConfig:
    cfg = DecoderConfig.from_hf(head_hf_config)
    if cfg.vocab_size != target_hf_config.vocab_size:
        raise ValueError(f"the head's vocab_size ({cfg.vocab_size}) differs from the target's "
                         f"({target_hf_config.vocab_size})")
    return replace(cfg, max_position=max_model_len)


def build_eagle_head(head_hf_config: Any, target_hf_config: Any, backend: AttentionBackend, dtype: torch.dtype,
                     max_model_len: int) -> nn.Module:
    """An uninitialised Eagle-1 head (weights via `load_weights`); its rotary cache covers `max_model_len`."""
    cfg = _head_config(head_hf_config, target_hf_config, max_model_len)
    if cfg.hidden_size != target_hf_config.hidden_size:
        raise ValueError(f"an Eagle head reads the target's hidden states: its hidden_size ({cfg.hidden_size}) "
                         f"must be the target's ({target_hf_config.hidden_size})")
    return EagleHead(cfg, backend, dtype, fc_bias=bool(getattr(head_hf_config, "bias", False)),
                     para_norm=bool(getattr(head_hf_config, "add_para_norm", False)),
                     logit_scale=float(getattr(head_hf_config, "logit_scale", 1.0)))


def eagle3_aux_layer_ids(head_hf_config: Any, target_hf_config: Any) -> tuple[int, ...]:
    """The target layers whose inputs an Eagle-3 head reads, as vLLM chooses them.

    The head config's `eagle_aux_hidden_state_layer_ids` (top level, else in `eagle_config`),
    else (2, L // 2, L - 3) for a target of L layers; () if `eagle_config` turns
    `use_aux_hidden_state` off (the head then reads the target's final hidden states).
    """
    eagle_config = getattr(head_hf_config, "eagle_config", None)
    eagle_config = eagle_config if isinstance(eagle_config, dict) else {}
    if not eagle_config.get("use_aux_hidden_state", True):
        return ()
    ids = getattr(head_hf_config, "eagle_aux_hidden_state_layer_ids", None) or \
        eagle_config.get("eagle_aux_hidden_state_layer_ids")
    num_layers = target_hf_config.num_hidden_layers
    ids = tuple(int(i) for i in ids) if ids else (2, num_layers // 2, num_layers - 3)
    if any(not 0 <= i < num_layers for i in ids):
        raise ValueError(f"Eagle-3 aux hidden-state layers {ids} are not all layers of the {num_layers}-layer target")
    return ids


def build_eagle3_head(head_hf_config: Any, target_hf_config: Any, backend: AttentionBackend, dtype: torch.dtype,
                      max_model_len: int) -> nn.Module:
    """An uninitialised Eagle-3 head (weights via `load_weights`); its rotary cache covers `max_model_len`."""
    cfg = _head_config(head_hf_config, target_hf_config, max_model_len)
    aux = eagle3_aux_layer_ids(head_hf_config, target_hf_config)
    target_h = target_hf_config.hidden_size
    declared = getattr(head_hf_config, "target_hidden_size", None)
    if declared is not None and declared != target_h:
        raise ValueError(f"the head's target_hidden_size ({declared}) is not the target's hidden_size ({target_h})")
    if not aux and target_h != cfg.hidden_size:
        raise ValueError(f"without aux hidden states the head reads the target's final hidden states: its "
                         f"hidden_size ({cfg.hidden_size}) must be the target's ({target_h})")
    draft_vocab = getattr(head_hf_config, "draft_vocab_size", None) or cfg.vocab_size
    return Eagle3Head(cfg, backend, dtype, draft_vocab_size=int(draft_vocab), aux_layer_ids=aux,
                      target_hidden_size=target_h,
                      norm_before_residual=bool(getattr(head_hf_config, "norm_before_residual", False)),
                      logit_scale=float(getattr(head_hf_config, "logit_scale", 1.0)))
